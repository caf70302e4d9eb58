"""The smoke run's explicit checks: a few GRPO steps of the real recipe, then proof that each part did its job.

    smoke_rr = rr.with_recipe(smoke.variant(rr.recipe, overrides))   # the run's recipe, three logged steps
    result = train.train(smoke_rr, run.smoke)
    checks = smoke.verify(run.smoke, base_model)          # -> SmokeChecks; .save(run.smoke), .require()

Checks: the loss is finite at every step; the server generated exactly the prompts and completions the steps asked
for (its own per-request histograms, which keep the canary's one-token probes apart: not the trainer's word); the
server samples from the trainer's weights (the weight-parity canary after the pushes, not a count of them); the
trained weights differ from the base (the optimizer moved them); the final model was saved in Hugging Face format
and the metrics file is complete.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.records import read_jsonl
from workbench.rundir import TrainDir, is_adapter, trained_weights, weights, write_atomic
from workbench.serving import scraper
from workbench.training.groups import zero_spread_key


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class SmokeFailed(WorkbenchError):
    pass


def _max_weight_change(base: Path, trained: Path) -> float:
    """The largest change of any parameter; for a LoRA run's adapter, of the product B·A each adapter adds (B starts
    at zero, so any trained adapter moved the model by its largest |B·A| entry)."""
    from safetensors.torch import load_file

    if is_adapter(trained):
        tensors = load_file(str(trained_weights(trained)))
        pairs = [(tensors[k], tensors[k.replace("lora_A", "lora_B")]) for k in tensors
                 if "lora_A" in k and k.replace("lora_A", "lora_B") in tensors]
        return max(((b.float() @ a.float()).abs().max().item() for a, b in pairs), default=0.0)
    a, b = load_file(str(weights(base))), load_file(str(weights(trained)))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)


@dataclass
class SmokeChecks:
    """The smoke stage's result: every check with its evidence; saves and loads itself."""
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def save(self, train_dir: TrainDir) -> Path:
        return write_atomic(train_dir.smoke_checks, json.dumps([asdict(c) for c in self.checks], indent=2))

    @classmethod
    def load(cls, train_dir: TrainDir) -> "SmokeChecks | None":
        try:
            return cls([Check(**c) for c in json.loads(train_dir.smoke_checks.read_text())])
        except (OSError, json.JSONDecodeError, TypeError):
            return None

    def require(self) -> None:
        failed = [c for c in self.checks if not c.ok]
        if failed:
            raise SmokeFailed("smoke checks failed: " + "; ".join(f"{c.name} ({c.detail})" for c in failed),
                              "read the run directory's train.log / vllm-server-*.log; fix before the full run")

    def table(self) -> str:
        lines = ["| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c.name} | {'pass' if c.ok else 'FAIL'} | {c.detail} |" for c in self.checks]
        return "\n".join(lines)


def variant(recipe, overrides: dict):
    """The smoke variant of a recipe: the same model, server, data and rewards, with the smoke overrides."""
    from workbench.recipe import load  # lazy: yaml

    return load(recipe, overrides)


def rollouts_asked(trainer: dict, processes: int, steps: int) -> tuple[int, int]:
    """(prompts, completions) TRL's loop asks the server for in `steps` optimizer steps, from the GRPOConfig keys
    (TRL's defaults where the recipe leaves them): one generation batch of per_device_train_batch_size × processes ×
    steps_per_generation completions every steps_per_generation × num_iterations micro-batches, num_generations
    completions a prompt."""
    per_device = int(trainer.get("per_device_train_batch_size") or 8)
    accumulation = int(trainer.get("gradient_accumulation_steps") or 1)
    if trainer.get("generation_batch_size"):
        per_generation = int(trainer["generation_batch_size"]) // (per_device * processes)
    else:
        per_generation = int(trainer.get("steps_per_generation") or accumulation)
    reuse = int(trainer.get("num_iterations") or 1)
    generations = math.ceil(steps * accumulation / (per_generation * reuse))
    completions = generations * per_device * processes * per_generation
    return completions // int(trainer.get("num_generations") or 8), completions


SERVED = ("generation_prompts", "generation_sequences", "probe_requests")


def served_during(train_dir: TrainDir, end: dict | None = None) -> dict[str, float]:
    """What the server generated and scored for this training: its counters at the end (`end`, default the
    training's server_metrics.prom) less the snapshot taken as the training began, when there is one (a shared
    server served other stages or trainings before)."""
    end = end if end is not None else scraper.parse(train_dir.server_metrics.read_text())
    start = scraper.parse(train_dir.server_metrics_start.read_text()) if train_dir.server_metrics_start.exists() else {}
    return {key: end.get(key, 0.0) - start.get(key, 0.0) for key in SERVED}


def _served_check(train_dir: TrainDir, summary: dict, steps: int) -> Check:
    """The server's own count of what it generated during this training (the snapshot at its start taken away: a
    shared server served other stages before), against what the steps asked for."""
    name = "server served the rollouts"
    if not train_dir.server_metrics.exists():
        return Check(name, False, f"no {train_dir.server_metrics.name}: the server's counters were not read")
    served = served_during(train_dir)
    # the learning curve's greedy requests (eval.every_steps): one prompt and one completion per problem scored
    curve = sum(int(p.get("n", 0)) for p in read_jsonl(train_dir.eval_curve)) if train_dir.eval_curve.exists() else 0
    prompts, sequences = served["generation_prompts"] - curve, served["generation_sequences"] - curve
    import yaml

    trainer = (yaml.safe_load(train_dir.recipe.read_text()) or {}).get("trainer") or {} if train_dir.recipe.exists() else {}
    generated_steps = steps - int(summary.get("resumed_from") or 0)
    want_prompts, want_sequences = rollouts_asked(trainer, int(summary.get("processes") or 1), generated_steps)
    refills = int(summary.get("refill_prompts") or 0)  # dynamic sampling's extra prompts, G completions each
    want_prompts += refills
    want_sequences += refills * int(trainer.get("num_generations") or 8)
    counted = (f"{prompts:.0f} prompts, {sequences:.0f} completions generated (and "
               f"{served['probe_requests']:.0f} one-token probes{f', {curve} learning-curve requests' if curve else ''}) for "
               f"{generated_steps} steps that asked for {want_prompts} and {want_sequences}")
    if summary.get("restarts"):  # a restarted server counts from zero again: only the last server's share is here
        return Check(name, 0 < sequences <= want_sequences,
                     f"{counted}; the server restarted {summary['restarts']} time(s), so only the last one's count")
    return Check(name, steps > 0 and (prompts, sequences) == (want_prompts, want_sequences), counted)


def verify(train_dir: TrainDir, base_model: str | Path) -> SmokeChecks:
    rows = [r for r in read_jsonl(train_dir.metrics) if "loss" in r]
    summary = json.loads(train_dir.summary.read_text()) if train_dir.summary.exists() else {}
    steps = summary.get("steps", 0)
    checks = [Check("training finished", bool(summary) and steps > 0,
                    f"{steps} steps in {summary.get('train_seconds', 0):.1f}s" if summary else "no train.json")]
    losses = [r["loss"] for r in rows]
    checks.append(Check("loss finite", bool(losses) and all(math.isfinite(x) for x in losses),
                        f"{len(losses)} logged losses: {[round(x, 5) for x in losses]}"))
    checks.append(_served_check(train_dir, summary, steps))
    # not the number of pushes but their effect: the weight-parity canary scored a probe set on the server and in the
    # trainer after the pushes (the smoke variant checks every step) and found the same log-probs
    pushes = sum(int(r.get("sync/count", 0)) for r in rows)
    canary = read_jsonl(train_dir.canary, normalised=False)
    checked = sorted({int(c["step"]) for c in canary})
    worst = max((c["gap_mean"] for c in canary), default=float("nan"))
    in_sync = bool(canary) and all(c["level"] == "ok" for c in canary) and steps > 0 and \
        len(checked) >= min(steps, 2)
    checks.append(Check("server holds the trainer's weights", in_sync,
                        (f"canary after the pushes of steps {checked}: largest gap {worst:.2g} nats/token; "
                         f"{pushes} pushes" if canary else
                         "no canary check recorded (monitor.canary_every is 0, or server.weight_sync is none)")))
    final = train_dir.final
    if trained_weights(final).exists() and weights(base_model).exists():
        change = _max_weight_change(Path(base_model), final)
        detail = f"largest parameter change {change:.3g}"
        if change == 0 and rows and all(r.get(zero_spread_key(rows)) == 1.0 for r in rows):
            # not a sync or optimizer fault: every group scored all its completions alike, so every advantage was 0
            detail += ("; every group of every step had zero reward spread (no learning signal: loss 0) — give the "
                       "smoke run more prompts or generations per step, or check the rewards")
        checks.append(Check("weights changed", change > 0, detail))
    else:
        checks.append(Check("weights changed", False, f"no trained weights in {final} (or none in {base_model})"))
    checks.append(Check("metrics complete", len(rows) == len({r['step'] for r in rows}) and bool(rows),
                        f"{len(rows)} step lines in metrics.jsonl"))
    return SmokeChecks(checks)
