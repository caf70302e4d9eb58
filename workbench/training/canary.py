"""The weight-parity canary: proof, every N steps, that the server samples from the trainer's weights.

    canary = Canary.for_recipe(rr, train_dir, tokenizer)      # None when monitor.canary_every is 0
    canary.compare(step, canary.trainer_logprobs(model), server)  # right after a push; logged, may raise

A fixed probe set (the first training prompts, each followed by its gold answer in the answer format) is scored
by the server (prompt log-probs, teacher forcing, temperature 1) and by the trainer's model in the same state
that was just pushed. The gap is the mean |log p_server - log p_trainer| per token: at the exact-sync level it is
numerical noise (about 1e-6 nats/token in float32 on the CPU), while a server left on older weights drifts to
1e-2 .. 1e-1 within a few steps (measured in tests/test_faults.py). Each check is a line of canary.jsonl; a gap
over the warning level is an event, over the stop level the run stops (CanaryAlarm) with what happened.

Cheap on purpose: a handful of short sequences, one forward pass and one request.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.records import append_event, append_jsonl
from workbench.rundir import TrainDir

# (warn, stop) in nats per token when the recipe leaves them unset: float32 agrees to rounding; 16-bit kernels of the
# server and the trainer differ by a few hundredths even when the weights are identical.
DEFAULT_GAPS = {"float32": (2e-3, 2e-2), "16bit": (5e-2, 0.5)}
PROBES = 4


class CanaryAlarm(WorkbenchError):
    """The server's log-probs are far from the trainer's: it is not sampling from the weights being trained."""


@dataclass
class Check:
    step: int
    gap_mean: float
    gap_max: float
    tokens: int
    seconds: float
    reason: str = "scheduled"
    level: str = "ok"  # ok | warn | stop


def thresholds(rr: Resolved) -> tuple[float, float]:
    """The warning and stop gaps: the recipe's, or the defaults for the trainer's precision."""
    m = rr.recipe.monitor
    sixteen = rr.platform != "cpu" and (rr.recipe.trainer.get("bf16") or rr.recipe.trainer.get("fp16")
                                        or rr.recipe.model.dtype in ("bfloat16", "float16"))
    warn, stop = DEFAULT_GAPS["16bit" if sixteen else "float32"]
    return (m.canary_warn_gap or warn, m.canary_stop_gap or stop)


def probe_sequences(rr: Resolved, tokenizer, count: int = PROBES) -> list[list[int]]:
    """Token ids of the probe set: chat-templated prompt + the gold answer as the tasks format it."""
    rows = rr.task.rows("train", limit=count)
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text + f"<answer>{row['answer']}</answer>", add_special_tokens=False))
    return out


def next_token_logprobs(model, sequences: list[list[int]]):
    """Each sequence's next-token log-probs, [length - 1, vocabulary] in float32 (row i predicts token i + 1), one
    forward pass at a time with the model in eval mode, yielded on the model's device (a caller keeps what it needs
    before the next: a whole vocabulary per position is large); every rank must consume it all when the parameters
    are sharded (the forward gathers them). The canary reads the probes' own tokens, the drift whole distributions."""
    import torch

    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for ids in sequences:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids], device=device)).logits.float()[0, :-1]
                logp = torch.log_softmax(logits, dim=-1)
            yield logp
    finally:
        model.train(was_training)


class Canary:
    """Scores the probe set on both sides after a push, keeps canary.jsonl, raises CanaryAlarm on gross drift."""

    def __init__(self, train_dir: TrainDir, sequences: list[list[int]], every: int, warn: float, stop: float,
                 log=print) -> None:
        self.train_dir = train_dir
        self.sequences = sequences
        self.every = every
        self.warn = warn
        self.stop = stop
        self.log = log
        self.checks: list[Check] = []
        self.spent = 0.0  # seconds since the trainer last logged (it is inside the generation phase)

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, tokenizer, log=print) -> "Canary | None":
        every = rr.recipe.monitor.canary_every
        if not every or rr.weight_sync == "none":  # without a sync the gap is known to grow: nothing to prove
            return None
        warn, stop = thresholds(rr)
        return cls(train_dir, probe_sequences(rr, tokenizer), every, warn, stop, log)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def trainer_logprobs(self, model) -> list[list[float]]:
        """The model's log-probability of each probe token after the first; every rank must call this when the
        parameters are sharded (the forward gathers them)."""
        import torch

        out = []
        for ids, logp in zip(self.sequences, next_token_logprobs(model, self.sequences)):
            taken = torch.tensor(ids[1:], device=logp.device)[:, None]
            out.append(logp.gather(1, taken)[:, 0].cpu().tolist())
        return out

    def compare(self, step: int, trainer: list[list[float]], server: list[list[float]], seconds: float,
                reason: str = "scheduled") -> Check:
        """Record one check; raise CanaryAlarm above the stop level."""
        gaps = [abs(a - b) for ts, ss in zip(trainer, server) for a, b in zip(ts, ss)]
        check = Check(step=step, gap_mean=sum(gaps) / max(1, len(gaps)), gap_max=max(gaps, default=0.0),
                      tokens=len(gaps), seconds=round(seconds, 4), reason=reason)
        self.spent += seconds
        check.level = "stop" if check.gap_mean > self.stop else "warn" if check.gap_mean > self.warn else "ok"
        self.checks.append(check)
        append_jsonl(self.train_dir.canary, check.__dict__)
        if check.level != "ok":
            message = (f"weight-parity canary at step {step} ({reason}): server and trainer log-probs differ by "
                       f"{check.gap_mean:.3g} nats/token (max {check.gap_max:.3g}); warn above {self.warn:g}, "
                       f"stop above {self.stop:g}")
            append_event(self.train_dir.events, f"canary_{check.level}", message, step=step, gap=check.gap_mean)
            self.log(("error: " if check.level == "stop" else "warning: ") + message)
            if check.level == "stop":
                raise CanaryAlarm(message + ": the server is not sampling from the weights being trained",
                                  "check the weight sync (server.weight_sync) and the server log; resume from the "
                                  "last checkpoint once it is fixed (workbench train --resume RUN)")
        return check

    def drain_seconds(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent
