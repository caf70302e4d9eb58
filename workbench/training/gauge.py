"""How close a CPU training runs to what its cores could do: gauge/generation and gauge/optimisation per logged step.

    gauge = Gauge.for_recipe(rr, train_dir, model, in_flight)   # None where it cannot measure (see below)
    logs.update(gauge.metrics(breakdown))                # the trainer's step breakdown of that log line

When the trainer is built, the limits (platform/limits.py) are measured once on the trainer role's cores and, when
the server runs on this machine (managed, or attached on a loopback address), on the server's: copy bandwidth and
read bandwidth and float32 GEMM throughput, 128 MB buffers and 1024-cube products, five of each (1-3 s). On an
accelerator they are the card's datasheet peaks (platform/datasheets.yaml by the trainer's device name, or the
recipe's devices.peak_memory_gb_s / peak_tflops) times the role's cards, the server's cards taken to be the
trainer's kind. They are written to train/limits.json with the model's shape and what measuring them cost
(`cost`: seconds and the process's CPU seconds; the report sets them against the training time). Each logged step then gets
  gauge/generation  the generation's completion tokens/s ÷ the server's decode ceiling for the step's batch
  gauge/optimisation  the optimisation's FLOPs (6 per parameter per completion token) ÷ its seconds ÷ the
                      trainer's GEMM throughput (a lower bound: prompt tokens are not counted)
read by the dashboard's and the report's summary rows and by the advisor (`far_from_limits`).

Left out (None): a card with no datasheet row and no recipe figures (said once when the trainer starts), several
trainer ranks (each rank's share would need its own tokens), a remote server (its cores cannot be measured from
here; gauge/optimisation is still logged).
"""
from __future__ import annotations

import json
import time

from workbench.platform import limits
from workbench.recipe import Resolved
from workbench.rundir import TrainDir, write_atomic
from workbench.serving.launch import is_loopback


def training_cores(rr: Resolved) -> list[int]:
    """The CPU cores (or cards) a single trainer process trains on: the trainer role's, and on the CPU the server's
    too when there is no server process (server.mode off or colocate). An accelerator's trainer sees only its own
    cards (its visible-devices variable), colocated generation included."""
    cores = list(rr.trainer.devices)
    if rr.recipe.server.in_process and rr.platform == "cpu":
        cores = sorted(set(cores) | set(rr.server.devices))
    return cores


def decode_context(recipe) -> float:
    """The tokens of context a decode step attends to, at most: the longest prompt and half the completion."""
    return recipe.data.max_prompt_length + recipe.max_completion_length / 2


def role_limits(rr: Resolved, roles: dict[str, list[int]], log=print, megabytes: int = 128) -> dict | None:
    """Each role's limits: measured on its cores with `megabytes` buffers (CPU), or its cards' datasheet peaks (an
    accelerator; None, said once, for a card neither datasheets.yaml nor the recipe gives figures for)."""
    if rr.platform == "cpu":
        return limits.measure(roles, megabytes=megabytes)
    try:
        name = limits.device_name(rr.platform)
    except Exception as exc:  # a measuring aid must not stop a training
        log(f"gauge: the {rr.platform} device's name could not be read ({type(exc).__name__}: {exc}): no gauge/* "
            "metrics")
        return None
    d = rr.recipe.devices
    sheet = limits.datasheet(name, d.peak_memory_gb_s, d.peak_tflops)
    if sheet is None:
        log(f"gauge: no datasheet figures for {name!r} (platform/datasheets.yaml): no gauge/* metrics; give the "
            "card's devices.peak_memory_gb_s and devices.peak_tflops in the recipe")
        return None
    return {role: limits.from_datasheet(sheet, len(cards)) for role, cards in roles.items()}


class Gauge:
    def __init__(self, shape: limits.Shape, measured: dict) -> None:
        self.shape = shape
        self.measured = measured

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, model, in_flight: int) -> "Gauge | None":
        from urllib.parse import urlparse

        if rr.trainer_processes > 1 or rr.recipe.distributed.nodes > 1:
            return None
        roles = {"trainer": training_cores(rr)}
        if not rr.recipe.server.in_process and is_loopback(urlparse(rr.server_url).hostname or ""):
            roles["server"] = list(rr.server.devices)
        wall, cpu = time.perf_counter(), time.process_time()
        measured = role_limits(rr, roles)
        if measured is None:
            return None
        # what measuring cost, before the first step (the per-step shares are a few divisions): the report sets it
        # against the training's time
        cost = {"seconds": round(time.perf_counter() - wall, 3), "cpu_seconds": round(time.process_time() - cpu, 3)}
        shape = limits.Shape.from_config(model.config.to_dict(), sum(p.numel() for p in model.parameters()),
                                         next(model.parameters()).element_size(), in_flight, decode_context(rr.recipe))
        write_atomic(train_dir.limits, json.dumps({"shape": shape.__dict__, "limits": measured, "cost": cost},
                                                  indent=2))
        return cls(shape, measured)

    def metrics(self, breakdown: dict[str, float]) -> dict[str, float]:
        out = {}
        rate = breakdown.get("rollout/tokens_per_second")
        if rate and "server" in self.measured:
            out["gauge/generation"] = rate / limits.decode_ceiling(self.shape, self.measured["server"])["ceiling"]
        share = limits.optimisation_share(self.shape, breakdown.get("rollout/completion_tokens", 0.0),
                                          breakdown.get("time/optimisation", 0.0), self.measured["trainer"])
        if share is not None:
            out["gauge/optimisation"] = share
        return out
