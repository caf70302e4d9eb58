"""The policy's drift from its starting weights, on a fixed probe set, whatever trainer.beta is.

    drift = Drift.for_recipe(rr, train_dir, tokenizer)   # None when monitor.drift_every is 0
    drift.start(model)                                   # before the first step: recorded, or read back on resume
    logs["drift/kl_start"] = drift.measure(model)        # at a log line: nats per answer token

TRL computes a KL only with beta > 0 (it keeps a reference model for it); the demo trains with beta 0, so its KL
panel stayed empty for the whole run and nothing said how far the policy had moved. Here the starting model's
next-token distributions at the answer positions of the canary's probes (the first training prompts, each followed
by its gold answer: training/canary.probe_sequences) are recorded once, before the first optimizer step, into
train/drift_reference.pt, and at a log line the current policy's distributions at the same positions are compared
with them: the exact KL(policy || start), summed over the vocabulary, averaged over the positions. A resumed run
reads the reference back, so its curve continues from the same start.

Cheap on purpose: the canary's handful of sequences, one forward pass, no request to the server; the reference
holds (answer positions x vocabulary) float32 values (a few MB for a 150k vocabulary).
"""
from __future__ import annotations

import os

from workbench.recipe import Resolved
from workbench.rundir import TrainDir
from workbench.training.canary import next_token_logprobs, probe_sequences

KEY = "drift/kl_start"


def answer_starts(rr: Resolved, tokenizer, sequences: list[list[int]]) -> list[int]:
    """Where each probe's answer begins: the length of its chat-templated prompt (the generation prompt included)."""
    from workbench.tasks import dataset

    starts = []
    for row, ids in zip(dataset.recipe_rows(rr.recipe, limit=len(sequences)), sequences):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        starts.append(min(n, len(ids) - 1))
    return starts


class Drift:
    """KL of the current policy from the starting one on the probes' answer positions."""

    def __init__(self, train_dir: TrainDir, sequences: list[list[int]], starts: list[int], every: int) -> None:
        self.train_dir = train_dir
        self.sequences = sequences
        self.starts = starts
        self.every = every
        self.reference = None  # [answer positions, vocabulary] log-probs of the starting model
        self.last_step: int | None = None

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, tokenizer) -> "Drift | None":
        every = rr.recipe.monitor.drift_every
        if not every:
            return None
        sequences = probe_sequences(rr, tokenizer)
        return cls(train_dir, sequences, answer_starts(rr, tokenizer, sequences), every)

    def due(self, step: int, last: bool = False) -> bool:
        """At the first log line (of a run or of its resume), every `every`-th step, and at the last step."""
        return self.last_step is None or last or step % self.every == 0

    def logprobs(self, model):
        """[answer positions, vocabulary] log-probs of `model` (every rank must call this when the parameters are
        sharded: the forward gathers them)."""
        import torch

        rows = next_token_logprobs(model, self.sequences)
        # row i - 1 is the distribution that predicts token i: an answer starting at token `start` has its rows from
        # start - 1 on
        return torch.cat([r[start - 1:].cpu() for r, start in zip(rows, self.starts)])

    def start(self, model, main: bool = True) -> None:
        """Record the starting distributions (a new run), or read them back (a resumed one)."""
        import torch

        path = self.train_dir.drift_reference
        if path.is_file():
            self.reference = torch.load(path)
            return
        self.reference = self.logprobs(model)
        if main:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            torch.save(self.reference, tmp)
            os.replace(tmp, path)  # whole or absent: a resume never reads half a reference

    def measure(self, model, step: int) -> float:
        """KL(policy || start) in nats per answer token."""
        self.last_step = step
        return kl(self.logprobs(model), self.reference)


def kl(current, reference) -> float:
    """Mean over positions of sum_v p(v) (log p(v) - log q(v)), from two [positions, vocabulary] log-prob tensors."""
    return float((current.exp() * (current - reference)).sum(-1).mean())
