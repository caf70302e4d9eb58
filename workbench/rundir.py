"""Run directories: one per run under monitor.runs_dir, holding the resolved recipe, logs, metrics and models.

    runs/20261130-031130-smoke-train/
        recipe.yaml  vllm-server-8000.log  metrics.jsonl  server_metrics.prom  checkpoints/  final/  train.json
"""
from __future__ import annotations

import time
from pathlib import Path

from workbench.recipe import Recipe


def new_run_dir(recipe: Recipe, kind: str = "train") -> Path:
    """A fresh directory named by time, recipe and kind, with the resolved recipe written in it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(recipe.monitor.runs_dir)
    run_dir = root / f"{stamp}-{recipe.name}-{kind}"
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stamp}-{recipe.name}-{kind}-{suffix}"
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    return run_dir
