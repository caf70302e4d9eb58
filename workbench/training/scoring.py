"""What the trainer does with a learned reward's step after TRL gathered it: the groups holding a completion no
learned reward could score are dropped (NaN rows: TRL 1.16 gives them no advantage and leaves them out of its
baselines and means), a `normalize: batch` reward is standardised over the whole gathered batch (every rank's
completions of that scoring, not one rank's share), the failures are counted over every rank, and the counts
survive a resume (written beside each checkpoint).

    groups, failed = drop_unscored(rewards, scorers, rank=0, processes=1, size=8, gather=gather_object)
    trainer.add_callback(FailureLedger(scorers))          # totals into each checkpoint, back on resume

Every rank calls `drop_unscored` with the same gathered tensor and gets the same answer, so the failure policy
(serving/rewards.Scorer.account) stops all ranks together. Tested with two ranks' inputs in tests/test_learned_rewards.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from transformers import TrainerCallback

from workbench.rundir import LEARNED_REWARDS, checkpoint_path, write_atomic
from workbench.serving.rewards import Scorer


def unscored_groups(ranks: list[tuple[int, list[int], list[int]]], size: int) -> list[int]:
    """The groups (of `size` completions, in the gathered batch's order) holding a completion some learned reward
    could not score; `ranks`: each rank's (offset of its rows in the gathered batch, its failed row indices, ...)."""
    return sorted({(offset + i) // size for offset, failed, _ in ranks for i in failed})


def standardise_column(rewards, column: int) -> None:
    """Column `column` of the gathered rewards standardised in place over its finite entries (a dropped group's
    NaN rows stay NaN and do not move the mean)."""
    values = rewards[:, column]
    ok = values.isfinite()
    if int(ok.sum()) < 2:
        return
    present = values[ok]
    values[ok] = (present - present.mean()) / (present.std(unbiased=False) + 1e-6)


def drop_unscored(rewards, scorers: list[tuple[int, Scorer]], *, rank: int, processes: int, size: int,
                  gather: Callable[[list], list]) -> tuple[list[int], list[int]]:
    """`rewards`: TRL's gathered rewards per function (rows: every rank's completions in rank order; changed in
    place); `scorers`: (column, Scorer) of each learned reward, whose `failed_now` holds this rank's failed rows
    of the call. Returns (the groups dropped, each scorer's failed completions over every rank)."""
    local = rewards.shape[0] // processes
    mine = (rank * local, sorted({i for _, s in scorers for i in s.failed_now}), [len(s.failed_now) for _, s in scorers])
    for _, scorer in scorers:
        scorer.failed_now = []
    everyone = gather([mine]) if processes > 1 else [mine]
    groups = unscored_groups(everyone, size)
    for g in groups:
        rewards[g * size:(g + 1) * size] = math.nan
    for column, scorer in scorers:
        if scorer.batch_normalised:
            standardise_column(rewards, column)
    failed = [sum(counts[k] for _, _, counts in everyone) for k in range(len(scorers))]
    return groups, failed


class FailureLedger(TrainerCallback):
    """Each learned reward's totals (requests, failed, restarts, seconds) written into every checkpoint the main
    rank saves, and read back when a run resumes from one: `max_failures` counts the whole run, not the part since
    the last resume. A checkpoint without the file (one from before learned rewards, or cut short after
    transformers' own files) starts the counts at zero."""

    def __init__(self, scorers: list[Scorer]) -> None:
        self.scorers = scorers

    @staticmethod
    def _path(args, step: int) -> Path:  # transformers' own checkpoint folder under output_dir
        return checkpoint_path(args.output_dir, step) / LEARNED_REWARDS

    def on_save(self, args, state, control, **kwargs):
        folder = self._path(args, state.global_step).parent
        if state.is_world_process_zero and folder.is_dir():
            write_atomic(folder / LEARNED_REWARDS, json.dumps({s.spec.name: s.totals() for s in self.scorers},
                                                              indent=2))

    def on_train_begin(self, args, state, control, **kwargs):
        path = self._path(args, state.global_step)
        if state.global_step <= 0 or not path.is_file():
            return
        saved = json.loads(path.read_text())
        for scorer in self.scorers:
            if scorer.spec.name in saved:
                scorer.restore(saved[scorer.spec.name])
