"""alignaudit: numerical alignment auditor for LLM reinforcement learning."""

__version__ = "0.1.0"
