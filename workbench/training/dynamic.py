"""Dynamic sampling: a generation batch's groups without reward spread are replaced by groups of further prompts.

    rollout:
      dynamic_sampling: true   # drop zero-spread groups, refill the batch from further training prompts
      refill_cap: 2.0          # at most 2x the batch's prompts again per generation; what stays unfilled trains as is
    workbench train --recipe cpu-tiny rollout.dynamic_sampling=true

A GRPO group whose G completions all score the same has zero advantage: it adds nothing to the gradient, and its
generation was spent for nothing (DAPO's "dynamic sampling"; TRL 1.16 has none). After TRL generated a batch, the
trainer (workbench/training/trainer.py) hands it here before TRL scores it: the batch's rewards are computed once,
the groups without spread (training/groups.py: equal within a tolerance relative to the rewards' scale, one scale
for all of a step's batches) are marked, and further prompts, drawn from the training split with a seed fixed by
the training seed, the generation and the round, are generated in one request per round and scored; each of their
groups with spread takes a marked slot.
A round asks for as many prompts as the signal share seen so far says will fill the slots left, so one round
usually does. When the cap is spent the remaining slots keep their original groups, which train with zero
advantage as in plain GRPO. Refills are generated when the batch is judged, on the trainer's path (`time/refill`),
not inside async's early request.

The exchange happens between TRL's generation and its scoring, in place, on whole groups: everything TRL computes
afterwards (advantages, old and reference log-probs, the loss's token count, its logs) is computed on the batch that
trains, by TRL's own code; its rewards are the ones each group was judged by (kept, not computed again: a reward
that is not deterministic, or costly, gives the same number once). The trainer recomputes TRL's completion metrics
(lengths, clipped ratio) for the batch that trains; a reward function's `log_extra` columns are not kept (they were
logged for completions that may have been dropped) and its `log_metric` values average over every batch scored;
`num_tokens` counts every generated token. With several ranks every rank sees the gathered rewards and the same
draws, so all take the same decisions and call the same collectives; a refill request's completions are gathered, so
a group may move to a slot on another rank. In async mode the refill requests run beside the next step's early
batch, synchronously, at the current weights (training/overlap.py is left alone).

Metrics, per step: `dynamic/zero_spread_generated` (share of every generated group, refills included, without
spread), `dynamic/prompts_per_kept` (prompts generated per prompt of the batch), `dynamic/extra_tokens`
(completion tokens the refills generated, every rank's), `dynamic/extra_prompts` and `dynamic/unfilled` (share of
the batch's slots left without signal).
`signal/zero_spread` stays the share in the batch that trains.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from workbench.training.groups import flat_groups, reward_scales

ZERO_SPREAD_GENERATED = "dynamic/zero_spread_generated"
PROMPTS_PER_KEPT = "dynamic/prompts_per_kept"
EXTRA_TOKENS = "dynamic/extra_tokens"
EXTRA_PROMPTS = "dynamic/extra_prompts"
UNFILLED = "dynamic/unfilled"
MAX_ROUNDS = 4  # requests per step; the first round's size already follows the signal share
MIN_SHARE = 0.1  # the signal share a round's size assumes at worst


@dataclass
class Sample:
    """One completion of a generation batch, with what TRL needs to score and train it."""
    row: dict  # the dataset row (the reward functions read its columns)
    prompt: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    completion: Any
    logprobs: list | None
    rewards: list[float] | None = None  # per reward function, as scored when the batch was judged


def refill_size(missing: int, share: float, budget: int, generations: int, processes: int) -> int:
    """Prompts to ask for in one round: enough to fill `missing` slots at the signal share seen so far, within the
    budget, in a multiple that gives every rank the same number of completions (TRL's server client slices the
    gathered batch evenly): rounded up to it, but never past the budget (0 when the budget holds none)."""
    if missing <= 0 or budget <= 0:
        return 0
    unit = processes // math.gcd(generations, processes)
    want = math.ceil(math.ceil(missing / max(share, MIN_SHARE)) / unit) * unit
    return min(want, budget // unit * unit)


def draw(rows: Sequence[dict], count: int, seed: int, step: int, round_: int) -> list[dict]:
    """`count` training rows for a refill, the same on every rank: without repeats while the split allows."""
    rng = random.Random(seed * 1_000_003 + step * 1_009 + round_)
    n = len(rows)
    picks = rng.sample(range(n), count) if count <= n else [rng.randrange(n) for _ in range(count)]
    return [rows[i] for i in picks]


class DynamicSampler:
    """Refills a generation batch. `rows` is the training split (indexable rows), `cap` the extra prompts allowed
    per step as a multiple of the batch's."""

    def __init__(self, rows: Sequence[dict], cap: float, seed: int = 0) -> None:
        self.rows = rows
        self.cap = cap
        self.seed = seed

    def fill(self, samples: list[Sample], *, generations: int, processes: int, rank: int, step: int,
             generate: Callable[[list[dict]], list[Sample]], score: Callable[[list[Sample]], Any],
             gather: Callable[[list], list], weights: list[float], aggregation: str
             ) -> tuple[list[Sample], dict[str, float], list[Sample]]:
        """This rank's samples of the batch that trains, the metrics, and every rank's samples of that batch, each
        with its rewards as `score` gave them (TRL trains on the rewards the groups were judged by; the reward
        functions do not run twice). `step` numbers the generation (the draws' seed). `generate(rows)` generates
        this rank's part of a request (each row once per completion), `score(samples)` returns every rank's
        rewards (gathered), `gather` is accelerate's gather_object. Collective: every rank calls it with the same
        arguments but its own samples."""
        local = len(samples)
        batch = _scored(gather(samples), score(samples))
        rewards = [s.rewards for s in batch]
        scales = reward_scales(rewards, weights, aggregation)
        flat, _ = flat_groups(rewards, weights, generations, aggregation, scales)
        groups = len(flat)
        if groups == 0:
            return samples, {}, batch
        slots = [g for g in range(groups) if flat[g]]
        budget = math.ceil(self.cap * groups)
        generated, with_signal, extra_prompts, extra_tokens = groups, groups - len(slots), 0, 0
        for round_ in range(MAX_ROUNDS):
            size = refill_size(len(slots), with_signal / generated, budget - extra_prompts, generations, processes)
            if size == 0:
                break
            rows = [row for row in draw(self.rows, size, self.seed, step, round_) for _ in range(generations)]
            part = len(rows) // processes
            mine = generate(rows[rank * part:(rank + 1) * part])
            more = _scored(gather(mine), score(mine))
            rewards = [s.rewards for s in more]
            # one scale for the step: the largest seen (float residues of equal rewards stay under its tolerance)
            scales = [max(a, b) for a, b in zip(scales, reward_scales(rewards, weights, aggregation))]
            more_flat, _ = flat_groups(rewards, weights, generations, aggregation, scales)
            extra_prompts += size
            extra_tokens += sum(len(s.completion_ids) for s in more)
            generated += size
            for h in range(size):
                if more_flat[h]:
                    continue
                with_signal += 1
                if slots:
                    g = slots.pop(0)
                    batch[g * generations:(g + 1) * generations] = more[h * generations:(h + 1) * generations]
        metrics = {ZERO_SPREAD_GENERATED: 1.0 - with_signal / generated,
                   PROMPTS_PER_KEPT: (groups + extra_prompts) / groups,
                   EXTRA_TOKENS: float(extra_tokens), EXTRA_PROMPTS: float(extra_prompts),
                   UNFILLED: len(slots) / groups}
        return batch[rank * local:(rank + 1) * local], metrics, batch


def _scored(everyone: list[Sample], rewards) -> list[Sample]:
    """Every rank's samples, each with its row of the gathered rewards (a tensor or nested lists)."""
    rows = rewards.float().cpu().tolist() if hasattr(rewards, "cpu") else [list(r) for r in rewards]
    if len(rows) != len(everyone):
        raise RuntimeError(f"dynamic sampling: {len(rows)} rewards for {len(everyone)} completions")
    for sample, row in zip(everyone, rows):
        sample.rewards = row
    return everyone
