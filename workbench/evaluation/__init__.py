"""Evaluation through the server: base vs trained, repeated and concurrent (evaluate.py); what changed problem
by problem (analysis.py); the serving sweep (sweep.py); settings chosen on validation, reported on test over
seeds (protocol.py)."""
