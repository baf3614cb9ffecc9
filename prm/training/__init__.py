"""What train.py saves and reports: checkpoints, resume and model directories (checkpoint), the
model card and trackers (report)."""
