"""How close a CPU training runs to what its cores could do: gauge/generation and gauge/optimisation per logged step.

    gauge = Gauge.for_recipe(rr, train_dir, model)      # None where it cannot measure (see below)
    logs.update(gauge.metrics(breakdown))                # the trainer's step breakdown of that log line

When the trainer is built, the limits (platform/limits.py) are measured once on the trainer role's cores and, when
the server runs on this machine (managed, or attached on a loopback address), on the server's: copy bandwidth and
read bandwidth and float32 GEMM throughput, 128 MB buffers and 1024-cube products, five of each (about a second). They are written to
train/limits.json with the model's shape. Each logged step then gets
  gauge/generation  the generation's completion tokens/s ÷ the server cores' decode ceiling for the step's batch
  gauge/optimisation  the optimisation's FLOPs (6 per parameter per completion token) ÷ its seconds ÷ the
                      trainer cores' GEMM throughput (a lower bound: prompt tokens are not counted)
read by the dashboard's and the report's summary rows and by the advisor (`far_from_limits`).

Left out (None): accelerators (their limits are not measured yet), several trainer ranks (each rank's share would
need its own tokens), a remote server (its cores cannot be measured from here; gauge/optimisation is still
logged).
"""
from __future__ import annotations

import json

from workbench.platform import limits
from workbench.recipe import Resolved
from workbench.rundir import TrainDir, write_atomic
from workbench.serving.launch import is_loopback


class Gauge:
    def __init__(self, shape: limits.Shape, measured: dict) -> None:
        self.shape = shape
        self.measured = measured

    @classmethod
    def for_recipe(cls, rr: Resolved, train_dir: TrainDir, model, in_flight: int) -> "Gauge | None":
        from urllib.parse import urlparse

        if rr.platform != "cpu" or rr.trainer_processes > 1 or rr.recipe.distributed.nodes > 1:
            return None
        trainer = list(rr.trainer.devices)
        if rr.recipe.server.in_process:  # no server: the trainer gets the server's cores too (training/train.py)
            trainer = sorted(set(trainer) | set(rr.server.devices))
        roles = {"trainer": trainer}
        if not rr.recipe.server.in_process and is_loopback(urlparse(rr.server_url).hostname or ""):
            roles["server"] = list(rr.server.devices)
        measured = limits.measure(roles, megabytes=128)
        config = model.config
        heads = config.num_attention_heads
        parameters = sum(p.numel() for p in model.parameters())
        bytes_per = next(model.parameters()).element_size()
        context = rr.recipe.data.max_prompt_length + rr.recipe.max_completion_length / 2
        shape = limits.Shape(parameters=parameters, bytes_per_parameter=bytes_per,
                             layers=config.num_hidden_layers, kv_heads=getattr(config, "num_key_value_heads", heads),
                             head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                             in_flight=in_flight, context=context)
        write_atomic(train_dir.limits, json.dumps({"shape": shape.__dict__, "limits": measured}, indent=2))
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
