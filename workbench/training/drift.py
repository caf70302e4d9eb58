"""The policy's drift from its starting weights, on a fixed probe set, whatever trainer.beta is.

    drift = Drift.for_recipe(rr, train_dir, tokenizer)   # None when monitor.drift_every is 0
    plan = drift.plan(step)                              # main rank, before the first step: record | read | off
    drift.record(model)                                  # when "record" (every rank of a sharded model joins)
    logs["drift/kl_start"] = drift.measure(model, step)  # at a due log line: nats per answer token

TRL computes a KL only with beta > 0 (it keeps a reference model for it); the demo trains with beta 0, so its KL
panel stayed empty for the whole run and nothing said how far the policy had moved. Here the starting model's
next-token distributions at the answer positions of the canary's probes (the first training prompts, each followed
by its gold answer: training/canary.probe_sequences) are recorded once, before the first optimizer step, into
train/drift_reference.pt, and at a log line the current policy's distributions at the same positions are compared
with them: the exact KL(policy || start), summed over the vocabulary, averaged over the positions. A resumed run
reads the reference back, so its curve continues from the same start.

Cheap on purpose: the canary's handful of sequences, one forward pass, no request to the server; the reference
holds (answer positions x vocabulary) float32 values (about 24 MB for 40 positions of a 150k vocabulary).
"""
from __future__ import annotations

import os

from workbench.recipe import Resolved
from workbench.rundir import TrainDir
from workbench.training.canary import next_token_logprobs, probe_sequences

KEY = "drift/kl_start"


def answer_starts(rr: Resolved, tokenizer, sequences: list[list[int]]) -> list[int]:
    """Where each probe's answer begins: the length of its chat-templated prompt (the generation prompt included)."""
    starts = []
    for row, ids in zip(rr.task.rows("train", limit=len(sequences)), sequences):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        starts.append(min(n, len(ids) - 1))
    return starts


class Drift:
    """KL of the current policy from the starting one on the probes' answer positions.

    Every rank that runs the probes' forward (all of them when the parameters are sharded, else the main rank) calls
    `start` and `measure` at the same steps; only the main rank holds the reference and computes the KL."""

    def __init__(self, train_dir: TrainDir, sequences: list[list[int]], starts: list[int], every: int) -> None:
        self.train_dir = train_dir
        self.sequences = sequences
        self.starts = starts
        self.every = every
        self.reference = None  # [answer positions, vocabulary] log-probs of the starting model (main rank)
        self.last_step: int | None = None
        self.failed = False  # the KL could not be computed once: no more points (the forwards still run)

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, tokenizer) -> "Drift | None":
        every = rr.recipe.monitor.drift_every
        if not every:
            return None
        sequences = probe_sequences(rr, tokenizer)
        return cls(train_dir, sequences, answer_starts(rr, tokenizer, sequences), every)

    @property
    def positions(self) -> int:
        return sum(len(ids) - start for ids, start in zip(self.sequences, self.starts))

    def plan(self, step: int) -> str:
        """What the main rank does at the start of training: "record" the starting distributions (a new run, also
        one started again into a directory that holds an older reference), "read" them back (a resume), or "off"
        (a resume of a run without a usable reference). The main rank decides; every rank follows (see the trainer)."""
        import torch

        path = self.train_dir.drift_reference
        if step == 0:
            return "record"
        if not path.is_file():
            return "off"
        reference = torch.load(path)
        if reference.shape[0] != self.positions:  # the probes changed since (another recipe, another tokenizer)
            return "off"
        self.reference = reference
        return "read"

    def due(self, step: int, last: bool = False) -> bool:
        """At the first log line (of a run or of its resume), at the first log line at or after each multiple of
        `every` (whatever trainer.logging_steps is), and at the last step."""
        if self.last_step is None or last:
            return True
        return step // self.every > self.last_step // self.every

    def logprobs(self, model):
        """[answer positions, vocabulary] log-probs of `model`, on the CPU (every rank must call this when the
        parameters are sharded: the forward gathers them)."""
        import torch

        # row i - 1 is the distribution that predicts token i: an answer starting at token `start` has its rows from
        # start - 1 on
        return torch.cat([logp[start - 1:].cpu()
                          for logp, start in zip(next_token_logprobs(model, self.sequences), self.starts)])

    def record(self, model, main: bool = True) -> None:
        """The starting distributions: every forward rank computes them, the main rank keeps and saves them."""
        import torch

        current = self.logprobs(model)
        if main:
            self.reference = current
            path = self.train_dir.drift_reference
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            torch.save(current, tmp)
            os.replace(tmp, path)  # whole or absent: a resume never reads half a reference

    def measure(self, model, step: int) -> float | None:
        """KL(policy || start) in nats per answer token on the main rank (None elsewhere, or after a failure)."""
        self.last_step = step
        current = self.logprobs(model)
        if self.reference is None or self.failed:
            return None
        try:
            return kl(current, self.reference)
        except Exception as exc:  # a measuring aid never ends a run: say so once, stop the points
            self.failed = True
            print(f"warning: the drift from the start stopped ({type(exc).__name__}: {exc})", flush=True)
            return None


def kl(current, reference) -> float:
    """Mean over positions of sum_v p(v) (log p(v) - log q(v)), from two [positions, vocabulary] log-prob tensors."""
    return float((current.exp() * (current - reference)).sum(-1).mean())
