"""The smoke run's explicit checks: a few GRPO steps of the real recipe, then proof that each part did its job.

    result = trainer.train(recipe.load("cpu-tiny", smoke.OVERRIDES), run_dir=...)
    checks = smoke.verify(result.run_dir, base_model)     # raises SmokeFailed naming every failed check

Checks: the loss is finite at every step; the server served the step's completions (its own request counter, not
the trainer's word); the weights were pushed to the server every step; the trained weights differ from the base
(the optimizer moved them); the final model was saved in Hugging Face format and the metrics file is complete.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from workbench import rollout
from workbench.errors import WorkbenchError
from workbench.metrics import read_jsonl

# A smoke run of any recipe: same model, server, data and rewards, three logged steps.
OVERRIDES = ["trainer.max_steps=3", "trainer.logging_steps=1", "trainer.save_steps=3", "trainer.log_completions=false"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class SmokeFailed(WorkbenchError):
    pass


def _max_weight_change(base: Path, trained: Path) -> float:
    from safetensors.torch import load_file

    a, b = load_file(str(base / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b)


def verify(run_dir: Path | str, base_model: str | Path) -> list[Check]:
    run_dir = Path(run_dir)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    summary = json.loads((run_dir / "train.json").read_text()) if (run_dir / "train.json").exists() else {}
    steps = summary.get("steps", 0)
    checks = [Check("training finished", bool(summary) and steps > 0,
                    f"{steps} steps in {summary.get('train_seconds', 0):.1f}s" if summary else "no train.json")]
    losses = [r["loss"] for r in rows]
    checks.append(Check("loss finite", bool(losses) and all(math.isfinite(x) for x in losses),
                        f"{len(losses)} logged losses: {[round(x, 5) for x in losses]}"))
    import yaml

    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text()) if (run_dir / "recipe.yaml").exists() else {}
    completions = steps * int(((resolved or {}).get("trainer") or {}).get("per_device_train_batch_size") or 1)
    served = 0.0
    prom = run_dir / "server_metrics.prom"
    if prom.exists():
        served = rollout.parse(prom.read_text()).get("requests_finished", 0.0)
    checks.append(Check("server served the rollouts", served >= completions and steps > 0,
                        f"vllm:request_success_total = {served:.0f} after {steps} steps"
                        f" (≥ {completions} completions expected)"))
    pushes = sum(int(r.get("sync/count", 0)) for r in rows)
    checks.append(Check("weights synced every step", pushes >= steps > 0,
                        f"{pushes} pushes to the server, {sum(r.get('sync/megabytes', 0) for r in rows):.1f} MB"))
    final = run_dir / "final"
    if (final / "model.safetensors").exists() and (Path(base_model) / "model.safetensors").exists():
        change = _max_weight_change(Path(base_model), final)
        checks.append(Check("weights changed", change > 0, f"largest parameter change {change:.3g}"))
    else:
        checks.append(Check("weights changed", False, f"no model.safetensors in {final} or {base_model}"))
    checks.append(Check("metrics complete", len(rows) == len({r['step'] for r in rows}) and bool(rows),
                        f"{len(rows)} step lines in metrics.jsonl"))
    return checks


def require(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        raise SmokeFailed("smoke checks failed: " + "; ".join(f"{c.name} ({c.detail})" for c in failed),
                          "read the run directory's train.log / vllm-server-*.log; fix before the full run")


def table(checks: list[Check]) -> str:
    lines = ["| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'pass' if c.ok else 'FAIL'} | {c.detail} |" for c in checks]
    return "\n".join(lines)
