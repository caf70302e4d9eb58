"""The trainer's callbacks: every log line to metrics.jsonl, and a clean stop when the run's STOP file appears.

    trainer.add_callback(JsonlMetrics(train_dir.metrics))
    trainer.add_callback(StopFlag(train_dir))

A run stops cleanly between steps when STOP appears in its training directory (`workbench stop RUN`, or the Stop
button of the live dashboard): it saves a checkpoint first, then ends like a finished run.
"""
from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from workbench.records import append_jsonl, normalise
from workbench.rundir import TrainDir


class JsonlMetrics(TrainerCallback):
    """Every log of the main process appended to metrics.jsonl (normalised names, flushed and fsynced per line)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        append_jsonl(self.path, {"step": state.global_step, "time": time.time(), **normalise(logs)})


class StopFlag(TrainerCallback):
    """Ends training between steps when `run_dir/STOP` exists, saving a checkpoint first.

    The check is a stat() per step on every rank, so all ranks stop at the same step without a collective."""

    def __init__(self, train_dir: TrainDir, log=print):
        self.flag = train_dir.stop_flag
        self.log = log
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.flag.exists() and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                self.log(f"stop requested ({self.flag}): checkpointing at step {state.global_step}, then ending")
        return control
