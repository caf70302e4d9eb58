"""A training read back: metrics, device samples, rollout health, recipe, sample completions, summary.

    data = rundata.RunData(run.train)          # a TrainDir (workbench.rundir)
    data.refresh()           # reads only what was appended since the last call: cheap to call every few seconds
    data.metrics[-1]["reward"], data.progress(), data.latest_completions(4)

Used by the live dashboard (following a run that another process writes) and by the report (after the fact, also
for a run that crashed: whatever lines were written are read; a torn last line is skipped).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from workbench.records import Tail
from workbench.rundir import TrainDir


class RunData:
    def __init__(self, train_dir: TrainDir | Path | str):
        self.dir = train_dir if isinstance(train_dir, TrainDir) else TrainDir(train_dir)
        self.run_dir = self.dir.path
        self._tails = {"metrics": Tail(self.dir.metrics), "devices": Tail(self.dir.devices),
                       "rollout": Tail(self.dir.rollout), "events": Tail(self.dir.events, normalised=False),
                       "canary": Tail(self.dir.canary, normalised=False),
                       "eval_curve": Tail(self.dir.eval_curve, normalised=False)}
        self.recipe: dict | None = None

    @property
    def metrics(self) -> list[dict]:
        return self._tails["metrics"].rows

    @property
    def train_metrics(self) -> list[dict]:
        """The per-step log lines (the end-of-training summary line has no loss)."""
        return [r for r in self.metrics if "loss" in r]

    @property
    def devices(self) -> list[dict]:
        return self._tails["devices"].rows

    @property
    def rollout(self) -> list[dict]:
        return self._tails["rollout"].rows

    @property
    def events(self) -> list[dict]:
        """Server faults and restarts, resumes, canary alarms, failures (events.jsonl)."""
        return self._tails["events"].rows

    @property
    def canary(self) -> list[dict]:
        """The weight-parity checks (canary.jsonl): step, gap_mean, gap_max, level, reason."""
        return self._tails["canary"].rows

    @property
    def eval_curve(self) -> list[dict]:
        """The learning curve (eval_curve.jsonl): step, split, n, accuracy, seconds, generated_tokens, best."""
        return self._tails["eval_curve"].rows

    def refresh(self) -> int:
        """Read what was appended; returns the number of new records."""
        if self.recipe is None and self.dir.recipe.exists():
            self.recipe = yaml.safe_load(self.dir.recipe.read_text())
        return sum(len(tail.read()) for tail in self._tails.values())

    @staticmethod
    def _json(path: Path) -> dict | None:
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except json.JSONDecodeError:
            return None

    @property
    def train_summary(self) -> dict | None:
        return self._json(self.dir.summary)

    @property
    def limits(self) -> dict:
        """The roles' limits the gauge compares against (limits.json, training/gauge.py): role -> its figures, a
        datasheet's carrying their `source`; empty when the run had no gauge."""
        return (self._json(self.dir.limits) or {}).get("limits") or {}

    @property
    def gauge_cost(self) -> dict | None:
        """What measuring the limits cost when training began: seconds and cpu_seconds (None: no gauge, or a run
        from before it was recorded)."""
        return (self._json(self.dir.limits) or {}).get("cost")

    def ranks(self) -> list[dict]:
        """Each trainer rank's process and device (ranks.json, written by the main rank at start)."""
        try:
            ranks = json.loads(self.dir.ranks.read_text()) if self.dir.ranks.exists() else []
        except json.JSONDecodeError:
            return []
        return ranks if isinstance(ranks, list) else []

    @property
    def finished(self) -> bool:
        return self.dir.summary.exists()

    @property
    def stop_requested(self) -> bool:
        return self.dir.stop_flag.exists()

    def max_steps(self) -> int | None:
        value = ((self.recipe or {}).get("trainer") or {}).get("max_steps")
        return int(value) if isinstance(value, (int, float)) and value > 0 else None

    def progress(self) -> dict:
        """Step reached, steps planned, seconds per step lately, and the estimated time left."""
        rows = self.train_metrics
        step = int(rows[-1]["step"]) if rows else 0
        total = self.max_steps()
        recent = [r["time/step"] for r in rows[-3:] if isinstance(r.get("time/step"), (int, float))]
        per_step = sum(recent) / len(recent) if recent else None
        eta = (total - step) * per_step if (total and per_step is not None) else None
        return {"step": step, "max_steps": total, "seconds_per_step": per_step, "eta_seconds": eta,
                "finished": self.finished, "updated": rows[-1]["time"] if rows else None}

    def latest_completions(self, n: int = 4) -> list[dict]:
        """The newest logged completions (TRL's log_completions parquet files) with their rewards."""
        files = list(self.dir.completion_logs().values())
        if not files or n <= 0:
            return []
        import pandas as pd

        try:
            frame = pd.read_parquet(files[-1])
        except Exception:  # being written right now: the next refresh reads it
            return []
        out = []
        for row in frame.head(n).to_dict("records"):
            prompt, completion = row.pop("prompt"), row.pop("completion")
            out.append({"step": int(row.pop("step")), "prompt": _text(prompt), "completion": _text(completion),
                        **{k: (None if v != v else float(v)) for k, v in row.items() if isinstance(v, (int, float))}})
        return out


def _text(messages) -> str:
    """The last message's content of a chat list (TRL stores conversations), or the string itself."""
    if isinstance(messages, str):
        return messages
    try:
        items = list(messages)
        return str(items[-1]["content"]) if items else ""
    except (TypeError, KeyError, IndexError):
        return str(messages)


def load(train_dir: TrainDir | Path | str) -> RunData:
    data = RunData(train_dir)
    data.refresh()
    return data
