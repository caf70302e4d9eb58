"""Evaluation through the server: base vs trained, repeated and concurrent (evaluate.py)."""
