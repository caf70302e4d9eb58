"""Training: TRL's GRPOTrainer with the workbench's weight sync (trainer.py), its arguments (config.py), callbacks
(callbacks.py), the weight-parity canary (canary.py), server recovery (recovery.py), async rollouts (overlap.py),
the device and /metrics sampler (monitor.py), GRPO groups (groups.py), the training entry (train.py), the
`accelerate launch` of several ranks (launch.py, rank.py) and the smoke checks (smoke.py)."""
