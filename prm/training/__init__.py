"""What train.py saves (checkpoint) and reports (report)."""
