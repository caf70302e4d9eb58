"""A run directory read back: metrics, device samples, rollout health, recipe, sample completions, results.

    data = rundata.RunData("runs/<id>")
    data.refresh()           # reads only what was appended since the last call: cheap to call every few seconds
    data.metrics[-1]["reward"], data.progress(), data.latest_completions(4)

Used by the live dashboard (following a run that another process writes) and by the report (after the fact, also
for a run that crashed: whatever lines were written are read; a torn last line is skipped).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from workbench.metrics import STOP_FILE, Tail


class RunData:
    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self._tails = {name: Tail(self.run_dir / f"{name}.jsonl") for name in ("metrics", "devices", "rollout")}
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

    def refresh(self) -> int:
        """Read what was appended; returns the number of new records."""
        if self.recipe is None and (self.run_dir / "recipe.yaml").exists():
            self.recipe = yaml.safe_load((self.run_dir / "recipe.yaml").read_text())
        return sum(len(tail.read()) for tail in self._tails.values())

    def _json(self, name: str) -> dict | None:
        path = self.run_dir / name
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except json.JSONDecodeError:
            return None

    @property
    def train_summary(self) -> dict | None:
        return self._json("train.json")

    @property
    def finished(self) -> bool:
        return (self.run_dir / "train.json").exists()

    @property
    def stop_requested(self) -> bool:
        return (self.run_dir / STOP_FILE).exists()

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
        files = sorted((self.run_dir / "checkpoints" / "completions").glob("completions_*.parquet"))
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


def load(run_dir: Path | str) -> RunData:
    data = RunData(run_dir)
    data.refresh()
    return data
