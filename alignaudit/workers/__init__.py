"""Worker processes: the parent side that starts them, the one-shot capture worker and the long-lived rl session
worker.
"""
