"""Comparison, pure: bit views and ULPs, per-token and per-op differences, integrity of what is compared, and the
gate's verdict. Imports no engine.
"""
