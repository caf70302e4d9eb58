"""Run directories: one per run under monitor.runs_dir, holding the resolved recipe, logs, metrics and models.

    runs/20261130-031130-smoke-train/
        recipe.yaml  vllm-server-8000.log  metrics.jsonl  server_metrics.prom  checkpoints/  final/  train.json
"""
from __future__ import annotations

import os
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
    write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
    return run_dir


def write_atomic(path: Path, text: str | bytes) -> Path:
    """Write through a temporary file and rename: a reader (or a crash) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
