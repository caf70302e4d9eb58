"""Training: TRL GRPOTrainer with the workbench weight sync (trainer.py), its arguments (config.py), callbacks, the training entry (train.py), the separate-process launch and the smoke checks."""
