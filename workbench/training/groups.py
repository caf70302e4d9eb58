"""Every GRPO group of every training step, recorded for inspection: the prompt, its G completions, each reward
function's score, the weighted total, the advantage, the length and whether the completion was cut off.

    train/groups/step_000012.parquet      one file per step, rows = completions (step, group, member, prompt,
                                          completion, reward/<fn>..., reward, advantage, length, truncated)

`monitor.groups_per_step` bounds what is kept (0 turns the recording off): a step with more groups keeps that many,
drawn at random with a seed fixed by the run's data seed and the step, so the record is unbiased (a first-N rule
would always keep the same dataset order's groups) and reproducible. The trainer (workbench/training/trainer.py)
calls `record` after TRL scored a generation batch, on every rank (lengths are gathered); the main rank writes.
Readers, the inspector widget and the report's examples are in workbench/observe/groups.py.
"""
from __future__ import annotations

import io
import math
import random

from workbench.rundir import TrainDir, write_atomic
from workbench.tasks.rewards import completion_text  # also a chat prompt's last message


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
