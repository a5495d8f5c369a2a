"""The trainer an engine becomes inside an ``alignaudit rl`` worker (alignaudit.workers.rl_session): scoring, the GRPO
loss, the optimizer and the weight transfer to the rollout engine. Below the workers, above the engines."""
