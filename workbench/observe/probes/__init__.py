"""Device probes: one module per source, one interface, samples tagged with the recipe's device roles.

    probe = probes.for_recipe(rr, server_pid=srv.process.pid)      # rr: the resolved recipe
    probe.sample()  # -> [{"role": "server", "device": "cpu0", "util_pct": 97.0, "mem_used_mb": 812.4, ...}, ...]

Sources: `cpu` (psutil: each role's cores and its process tree: the vLLM server's vs the trainer's), `nvidia`
(nvidia-ml-py), `ascend` (npu-smi, parsed by workbench.platform.npusmi). Every sample dict has `role`, `device`, `kind`,
`util_pct`, `mem_used_mb`, `mem_total_mb`; sources add what they know (`power_w`, `temp_c`, `proc_util_pct`).
A probe that cannot read its source raises WorkbenchError (or NpuSmiFormatError) naming it: never silent zeros.
"""
from __future__ import annotations

from typing import Protocol

from workbench.recipe import Recipe, Resolved


class Probe(Protocol):
    kind: str

    def sample(self) -> list[dict]:
        """One reading of every device in the device split (the first call may prime counters)."""


def roles(recipe: Recipe) -> dict[int, str]:
    """Device id -> role, from the recipe's device split."""
    out = {d: "trainer" for d in recipe.devices.trainer}
    out.update({d: "server" for d in recipe.devices.server})  # a colocated device counts as the server's
    return out


def for_recipe(rr: Resolved, server_pid: int | None = None, trainer_pid: int | None = None) -> Probe:
    recipe, platform = rr.recipe, rr.platform
    if platform == "cpu":
        from workbench.observe.probes.cpu import CpuProbe
        return CpuProbe(recipe, server_pid=server_pid, trainer_pid=trainer_pid)
    if platform == "cuda":
        from workbench.observe.probes.nvidia import NvidiaProbe
        return NvidiaProbe(recipe)
    if platform == "npu":
        from workbench.observe.probes.ascend import AscendProbe
        return AscendProbe(recipe)
    raise ValueError(f"no device probe for platform {platform!r}")
