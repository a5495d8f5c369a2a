"""alignaudit inside the RL frameworks' own loops: one module per framework, each importing that framework
(docs/frameworks.md)."""
