"""Evaluation through the server: base vs trained, repeated and concurrent, checkpoints of one model on one server
(evaluate.py); what changed problem by problem (analysis.py); the server's throughput against requests in flight
(sweep.py)."""
