"""Experiments: workflows that train, serve and read several times over to answer one question, on top of every
other room: which rollout path is fastest (bench.py, `workbench bench`), which settings win on validation and by
how much on test over seeds (protocol.py, `workbench protocol`), how reward functions score a run's completions
(rewardlab.py, notebook 08)."""
