"""Making step labels: Monte-Carlo rollouts of a policy (`python -m prm.label`)."""
