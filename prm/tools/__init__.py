"""Developer tools: the training benchmark and the GPU check."""
