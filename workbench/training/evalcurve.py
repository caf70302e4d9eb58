"""The learning curve: the serving weights scored on a held-out split while the run trains.

    eval:
      every_steps: 25          # 0: off
      during_split: validation
      during_samples: 100
      keep_best: true          # train/best: the model (or adapter) of the best-scoring step

Right after a push (trainer.py `sync_weights`, beside the canary) the server holds exactly the trainer's weights of
that optimizer step, and nothing else is asked of it: in async mode the push waits for the batch in flight and the
next batch is asked for after this. So each point is tagged with the step whose weights it scored, and keeping the
best step saves the trainer's model as it is at that moment. The first push (step 0) scores the starting model;
one more push after the last step (trainer.py `_score_final`) scores the model the run ends with, whatever
every_steps, so train/best is never an earlier step that scored below the final model.
Greedy requests (eval.temperature, eval.max_tokens, ...) through the chat endpoint, graded like `workbench eval`
(tasks/grading.py); requests on the main rank only, in parallel (eval.concurrency).

    train/eval_curve.jsonl    one line per point: step, split, n, accuracy, format_rate, seconds,
                              generated_tokens (completion tokens sampled for training so far), time
    train/best/               eval.keep_best: the best step's weights and tokenizer, replaced whole when beaten

Its cost (time/eval_curve in metrics.jsonl) blocks the trainer: the dashboard and the report show it beside the
training time.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.records import append_jsonl
from workbench.rundir import TrainDir
from workbench.tasks import grading, rewards


class EvalCurve:
    def __init__(self, rr: Resolved, train_dir: TrainDir, rows: list[dict], tokens: Callable[[], int] = lambda: 0,
                 save: Callable[[Path], None] | None = None):
        self.rr, self.train_dir, self.rows = rr, train_dir, rows
        self.every = rr.recipe.eval.every_steps
        self.tokens, self.save = tokens, save
        self.last: int | None = None
        self.best: float | None = None
        self._seconds = 0.0

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, tokens: Callable[[], int],
                   save: Callable[[Path], None] | None) -> "EvalCurve | None":
        e = rr.recipe.eval
        if e.every_steps <= 0:
            return None
        rows = rr.task.rows(e.during_split, limit=e.during_samples)
        if not rows:
            raise WorkbenchError(f"eval.every_steps: the {e.during_split} split has no rows to score",
                                 "set data.validation_size above 0, or eval.every_steps=0")
        curve = cls(rr, train_dir, rows, tokens, save if e.keep_best else None)
        if train_dir.eval_curve.exists():  # a resumed run: its curve goes on, its best stays the one to beat
            points = [json.loads(line) for line in train_dir.eval_curve.read_text().splitlines() if line.strip()]
            if points:
                curve.last = points[-1]["step"]
                if (train_dir.best / "best_step.json").exists():  # else the next point is kept, whatever it scores
                    curve.best = max(p["accuracy"] for p in points)
        return curve

    def due(self, step: int) -> bool:
        return self.last is None or step - self.last >= self.every

    def drain_seconds(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def score(self, step: int, url: str, served_as: str) -> dict:
        """Score what the server holds now (the trainer's weights of `step`) and record the point."""
        started = time.perf_counter()
        e = self.rr.recipe.eval
        body = {"model": served_as, "max_tokens": e.max_tokens, "temperature": e.temperature, "top_p": e.top_p,
                "seed": e.seed, **({"stop": e.stop} if e.stop else {})}

        def one(row: dict) -> str:
            import requests  # lazy: only a run with a curve asks

            for attempt in range(e.retries + 1):
                try:
                    r = requests.post(f"{url}/v1/chat/completions", json={**body, "messages": row["prompt"]},
                                      headers=self.rr.headers, timeout=self.rr.recipe.server.request_timeout_s)
                    if r.status_code == 200:
                        return r.json()["choices"][0]["message"]["content"] or ""
                except requests.RequestException:
                    pass
                time.sleep(min(4.0, 0.5 * 2 ** attempt))
            return ""  # unanswered: scored wrong, counted in `unanswered`

        with ThreadPoolExecutor(max_workers=e.concurrency) as pool:
            responses = list(pool.map(one, self.rows))
        graded = grading.grade([r["answer"] for r in self.rows], responses)
        seconds = time.perf_counter() - started
        point = {"step": step, "split": e.during_split, "n": len(self.rows),
                 "accuracy": sum(bool(c) for _, c in graded) / len(self.rows),
                 "format_rate": sum(rewards.score("format", responses)) / len(self.rows),
                 "unanswered": sum(not r for r in responses), "seconds": round(seconds, 3),
                 "generated_tokens": int(self.tokens()), "time": time.time()}
        if self.save is not None and (self.best is None or point["accuracy"] > self.best):
            self._keep(step)
            point["best"] = True
        self.best = point["accuracy"] if self.best is None else max(self.best, point["accuracy"])
        append_jsonl(self.train_dir.eval_curve, point)
        self.last = step
        self._seconds += time.perf_counter() - started
        return point

    def _keep(self, step: int) -> None:
        """The trainer's model of this step into train/best, whole: written beside it, then renamed over it."""
        best = self.train_dir.best
        tmp = best.with_name(f".best.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.save(tmp)
            (tmp / "best_step.json").write_text(json.dumps({"step": step}))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = best.with_name(f".best.old-{os.getpid()}")
        if best.exists():
            os.replace(best, old)
        os.replace(tmp, best)
        shutil.rmtree(old, ignore_errors=True)
