"""prm: a minimal PyTorch trainer for process reward models."""
