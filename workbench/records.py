"""JSON-lines records that are never lost, under metric names that do not depend on the TRL version.

Every log line of the trainer is appended to `runs/<id>/metrics.jsonl`, flushed and fsynced as it comes, so a run
killed at any moment keeps everything it logged. Names are normalised on the way in (and again on the way out, for
files written by older versions): TRL has renamed its metrics between releases (`completion_length` became
`completions/mean_length`, `rewards/<fn>` became `rewards/<fn>/mean`), and trackers prefix them with `train/`.

    from workbench import records
    rows = records.read_jsonl(run.train.metrics)             # complete lines only, names normalised
    tail = records.Tail(path); tail.read()                   # only the lines added since the last call

The step-time breakdown the workbench adds (see workbench/training/trainer.py) uses these names, seconds per optimizer step:
`time/step`, `time/generation`, `time/weight_sync`, `time/reward`, `time/scoring` (old/reference log-probs and the
rest of the rollout bookkeeping), `time/optimisation`, plus `rollout/tokens_per_second`.
Nothing here imports TRL or transformers: the report, the advisor and the dashboard read these files in light
processes. The trainer's callbacks that write them are in workbench/training/callbacks.py.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

# Older or tracker-prefixed name -> the name the workbench uses (TRL 1.16's).
ALIASES = {
    "completion_length": "completions/mean_length",
    "completion_length/mean": "completions/mean_length",
    "completions/mean_length": "completions/mean_length",
    "completion_length/max": "completions/max_length",
    "completion_length/min": "completions/min_length",
    "completions/clipped_frac": "completions/clipped_ratio",
    "clipped_ratio": "completions/clipped_ratio",
    "rewards/mean": "reward",
    "reward_mean": "reward",
    "rewards/std": "reward_std",
    "kl_divergence": "kl",
    "objective/kl": "kl",
    "objective/entropy": "entropy",
    "clip_ratio": "clip_ratio/region_mean",
    "train_step_time": "step_time",
}
_PREFIXES = ("train/", "train_")
_PER_REWARD = re.compile(r"^rewards/(?P<fn>[^/]+)$")


def normalise_name(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix) and name[len(prefix):] not in ("runtime", "loss", "samples_per_second",
                                                                  "steps_per_second"):
            name = name[len(prefix):]
            break
    name = ALIASES.get(name, name)
    match = _PER_REWARD.match(name)
    if match and match["fn"] not in ("mean", "std"):
        return f"rewards/{match['fn']}/mean"  # older TRL logged each reward function's mean without the suffix
    return name


def normalise(record: dict) -> dict:
    """The same record under the workbench's names; where two names collide the newer spelling wins."""
    out: dict = {}
    for key, value in record.items():
        new = normalise_name(key)
        if new in out and new != key and new in record:
            continue
        out[new] = value
    return out


def append_jsonl(path: Path, record: dict, fsync: bool = True) -> None:
    """One JSON line, written in one call and flushed: a reader never sees half a record of a live run."""
    line = json.dumps(record, default=float) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_jsonl(path: Path | str, normalised: bool = True) -> list[dict]:
    """Every complete line of a JSONL file; a torn last line (a run killed mid-write) is left out, not an error."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append(normalise(row) if normalised else row)
    return rows


class Tail:
    """Reads a growing JSONL file incrementally: each `read()` returns the complete lines added since the last."""

    def __init__(self, path: Path | str, normalised: bool = True):
        self.path = Path(path)
        self.normalised = normalised
        self.offset = 0
        self.rows: list[dict] = []

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # leave a torn last line for the next call
        self.offset += end
        new = []
        for line in chunk[:end].decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            new.append(normalise(row) if self.normalised else row)
        self.rows.extend(new)
        return new


def append_event(path: Path, kind: str, message: str, **fields) -> dict:
    """One line of a run's events log (events.jsonl): restarts, resumes, canary alarms, failures.

    kinds: server_fault, server_restart, server_lost, resume, canary_warn, canary_stop, reward_failure, failure,
    reward_engine_restart (a learned reward's engine, serving/rewards.py)."""
    record = {"time": time.time(), "kind": kind, "message": message, **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(path, record)
    return record


def truncate_after(path: Path, step: int) -> int:
    """Keep only the complete lines whose `step` is at most `step` (a resumed run continues from its checkpoint:
    what the killed run logged after it is logged again). Rewritten atomically; returns the lines dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                dropped += 1  # a torn last line of the killed process
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(row.get("step"), (int, float)) and row["step"] > step:
                dropped += 1
                continue
            kept.append(line)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
    return dropped
