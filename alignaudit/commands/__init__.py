"""The commands: the typer CLI, its shared options, and the pipelines each command runs (capture, diff, compare,
bisect, ablate).
"""
