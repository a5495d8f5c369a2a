"""The typer-free library the commands run: requests built and checked before any engine starts (requests.py), the
compare / rescore / bisect / diff runs (runs.py) and ablate's runs (ablate.py). The CLI (alignaudit.commands), the
Python API (alignaudit.api) and rl (alignaudit.rl) build on it; it imports none of them."""
