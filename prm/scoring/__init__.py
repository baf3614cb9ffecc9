"""Using a PRM: published PRMs read as their authors read them (scorers), rewards for RL (reward) and the reward
server (serve)."""
