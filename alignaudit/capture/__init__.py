"""The capture format: the run and capture directories, what they hold, and the canonical ops. The only thing both
the engine side and the comparison side import.
"""
