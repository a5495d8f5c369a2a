"""`alignaudit rl`: GRPO steps with the train/rollout alignment checked at every step (loop.py is the map)."""
