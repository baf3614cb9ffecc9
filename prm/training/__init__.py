"""Training: the configured model and tokenizer (build), the loop (trainer), checkpoints and resume (checkpoint),
the run directory, logging and trackers, DDP/FSDP2 wrapping (sharding) and the model card."""
