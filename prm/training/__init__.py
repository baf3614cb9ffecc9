"""What train.py saves: checkpoints, resume and model directories (checkpoint), the model card (card)."""
