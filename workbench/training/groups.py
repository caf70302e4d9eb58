"""Every GRPO group of every training step, recorded for inspection: the prompt, its G completions, each reward
function's score, the weighted total, the advantage, the length and whether the completion was cut off.

    train/groups/step_000012.parquet      one file per step, rows = completions (step, group, member, prompt,
                                          completion, reward/<fn>..., reward, advantage, length, truncated)

`monitor.groups_per_step` bounds what is kept (0 turns the recording off): a step with more groups keeps that many,
drawn at random with a seed fixed by the run's data seed and the step, so the record is unbiased (a first-N rule
would always keep the same dataset order's groups) and reproducible. The trainer (workbench/training/trainer.py)
calls `record` after TRL scored a generation batch, on every rank (lengths are gathered); the main rank writes.
Readers, the inspector widget and the report's examples are in workbench/observe/groups.py.

`group_signal` measures, from every group of every step (not the recorded sample), the share of groups whose
completions all scored the same: GRPO's advantage is zero for them, their generation taught nothing. The trainer logs
it as `signal/zero_spread`; the dashboard, report, advisor and smoke checks read it instead of TRL's
`frac_reward_zero_std`, which compares the group's float32 std with 0 at an absolute 1e-8 and so misses equal rewards
that are not powers of two (eight rewards of 0.2 average to 0.2000000149 in float32: std 1.6e-8, "not zero").
"""
from __future__ import annotations

import io
import math
import random
import warnings

from workbench.rundir import TrainDir, write_atomic
from workbench.tasks.rewards import completion_text  # also a chat prompt's last message


# rewards closer than this fraction of the batch's reward scale are equal: float32 sums and means leave residues of
# about 1e-7 of the value, and a reward function's own arithmetic (0.1 + 0.2) about 1e-16
SPREAD_RTOL = 1e-5


ZERO_SPREAD, ZERO_SPREAD_TOP = "signal/zero_spread", "signal/zero_spread_top"
TRL_ZERO_STD = "frac_reward_zero_std"  # TRL's own count: runs from before the workbench logged ZERO_SPREAD


def zero_spread_key(rows: list[dict]) -> str:
    """The metric to read for the share of groups without signal: the workbench's own where the run logged it."""
    return ZERO_SPREAD if any(ZERO_SPREAD in r for r in rows) else TRL_ZERO_STD


def spread_tolerance(scale: float) -> float:
    """The largest max-min difference of a group's rewards that still counts as no spread, for rewards of this size."""
    return SPREAD_RTOL * abs(scale)


def _columns(rewards_per_func, weights, aggregation: str):
    """The weighted total per completion, and the columns whose spread within a group is the signal."""
    import numpy as np

    r = np.asarray(rewards_per_func, dtype=np.float64).reshape(-1, len(weights))
    w = np.asarray(weights, dtype=np.float64)
    unscored = np.isnan(r).all(axis=1)
    total = np.where(unscored, np.nan, np.nansum(r * w, axis=1))
    if aggregation == "normalize_then_sum":
        return total, [r[:, i] for i in range(r.shape[1]) if w[i] != 0]
    return total, [total]


def reward_scales(rewards_per_func, weights, aggregation: str = "sum_then_normalize") -> list[float]:
    """The scale of each column `flat_groups` judges (its largest magnitude): what its tolerance is relative to."""
    import numpy as np

    _, columns = _columns(rewards_per_func, weights, aggregation)
    return [float(np.abs(c[~np.isnan(c)]).max()) if (~np.isnan(c)).any() else 0.0 for c in columns]


def flat_groups(rewards_per_func, weights, size: int, aggregation: str = "sum_then_normalize",
                scales: list[float] | None = None):
    """Per group of one generation batch, whether it carries no signal, from TRL's gathered rewards (completions x
    functions, NaN where a function did not score; consecutive `size` rows are one prompt's group). With TRL's
    default aggregation (`sum_then_normalize`) a group has no signal when its weighted totals are equal; with
    `normalize_then_sum` each weighted function is normalised within the group, so it has none only when every such
    function is flat. Equal means within SPREAD_RTOL of the column's scale: this batch's (`reward_scales`) unless
    `scales` are given (dynamic sampling judges a step's batches on one scale). Returns (flat: bool per group,
    total: the weighted reward per completion)."""
    import numpy as np

    total, columns = _columns(rewards_per_func, weights, aggregation)
    groups = total.shape[0] // size
    scales = scales if scales is not None else reward_scales(rewards_per_func, weights, aggregation)
    flat = np.ones(groups, dtype=bool)
    with warnings.catch_warnings():  # a group nobody scored: all-NaN slices, no spread and no signal
        warnings.simplefilter("ignore", RuntimeWarning)
        for values, scale in zip(columns, scales):
            grouped = values[: groups * size].reshape(groups, size)
            flat &= ~(np.nanmax(grouped, axis=1) - np.nanmin(grouped, axis=1) > spread_tolerance(scale))
    return flat, total


def group_signal(rewards_per_func, weights, size: int, aggregation: str = "sum_then_normalize") -> dict[str, float]:
    """The learning signal of one generation batch (arguments as `flat_groups`): `signal/zero_spread`, the share of
    groups without spread, and, of those, `signal/zero_spread_top`, the share at the batch's highest reward (all
    solved) — the rest sit lower (typically all failed)."""
    import numpy as np

    flat, total = flat_groups(rewards_per_func, weights, size, aggregation)
    groups = len(flat)
    if groups == 0:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        means = np.nanmean(total[: groups * size].reshape(groups, size), axis=1)
    out = {ZERO_SPREAD: float(flat.mean())}
    if flat.any() and np.isfinite(total).any():
        top = np.nanmax(total)
        out[ZERO_SPREAD_TOP] = float((flat & (np.abs(means - top) <= spread_tolerance(top))).sum() / flat.sum())
    return out


def total_reward(scores: dict[str, float], weights: dict[str, float]) -> float:
    """TRL's combination: the weighted sum over the functions that scored the completion (NaN = did not), NaN when
    none did."""
    scored = [weights[name] * value for name, value in scores.items() if not math.isnan(value)]
    return sum(scored) if scored else math.nan


class GroupRecorder:
    """Writes one parquet file per training step into `train_dir.groups`."""

    def __init__(self, train_dir: TrainDir, groups_per_step: int, seed: int = 0):
        self.train_dir = train_dir
        self.groups_per_step = groups_per_step
        self.seed = seed

    def record(self, trainer, completion_ids: list[list[int]]) -> None:
        """After TRL's `_generate_and_score_completions`: this rank's completion token ids (for the lengths and the
        truncation, as TRL computes them); prompts, completions, rewards and advantages of the whole batch are in
        TRL's own `_logs` (already gathered across ranks), whose newest entries are this batch."""
        from accelerate.utils import gather_object

        stop_ids = {*trainer.eos_token_ids, trainer.processing_class.pad_token_id}
        lengths = gather_object([len(ids) for ids in completion_ids])
        truncated = gather_object([bool(ids) and ids[-1] not in stop_ids for ids in completion_ids])
        if not trainer.accelerator.is_main_process:
            return
        n = len(lengths)
        logs = trainer._logs
        newest = lambda values: list(values)[-n:]  # noqa: E731 - the deques hold at most one generation batch
        prompts, completions, advantages = newest(logs["prompt"]), newest(logs["completion"]), newest(logs["advantages"])
        scores = {name: newest(logs["rewards"][name]) for name in trainer.reward_func_names}
        if len(prompts) != n or len(advantages) != n:
            return  # not this batch (TRL changed how it logs): record nothing rather than mismatched rows
        weights = dict(zip(trainer.reward_func_names, trainer.reward_weights.tolist()))
        size = trainer.num_generations
        step = trainer.state.global_step + 1  # the step this batch trains: metrics.jsonl's step for it
        groups = list(range(n // size))
        if 0 < self.groups_per_step < len(groups):
            groups = sorted(random.Random(self.seed * 1_000_003 + step).sample(groups, self.groups_per_step))
        rows = []
        for g in groups:
            for member in range(size):
                i = g * size + member
                own = {name: float(values[i]) for name, values in scores.items()}
                rows.append({"step": step, "group": g, "member": member, "prompt": completion_text(prompts[i]),
                             "completion": completion_text(completions[i]),
                             **{f"reward/{name}": value for name, value in own.items()},
                             "reward": total_reward(own, weights), "advantage": float(advantages[i]),
                             "length": int(lengths[i]), "truncated": bool(truncated[i])})
        self._write(step, rows)

    def _write(self, step: int, rows: list[dict]) -> None:
        import pandas as pd

        self.train_dir.groups.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        pd.DataFrame(rows).to_parquet(buffer, index=False)
        write_atomic(self.train_dir.group_file(step), buffer.getvalue())
