"""Developer tools: the training benchmark and the GPU check (`python -m prm.bench`)."""
