"""Searching with a PRM: best-of-N, weighted vote, beam search, DVTS (`python -m prm.search`)."""
