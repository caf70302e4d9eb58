"""Device probes: one module per source, one interface, samples tagged with each device's role.

    probe = probes.for_platform("cpu", {0: "server", 1: "trainer"}, server_pid=srv.process.pid)
    probe.sample()  # -> [{"role": "server", "device": "cpu0", "util_pct": 97.0, "mem_used_mb": 812.4, ...}, ...]

Sources: `cpu` (psutil: each role's cores and its process tree: the vLLM server's vs the trainer's), `nvidia`
(nvidia-ml-py), `ascend` (npu-smi, parsed by workbench.platform.npusmi). Every sample dict has `role`, `device`, `kind`,
`util_pct`, `mem_used_mb`, `mem_total_mb`; sources add what they know (`power_w`, `temp_c`, `proc_util_pct`).
A probe that cannot read its source raises WorkbenchError (or NpuSmiFormatError) naming it: never silent zeros.
Device ids are the recipe's, physical ones (nvidia-smi's GPU numbers, Ascend's logical chip ids), never indices into
the sampling process's own visible-devices list. `probe.warnings` lists what a working probe doubts (a device order
it cannot prove); the sampler records those as events, and a probe that raises as a warning, not a dead rank.
"""
from __future__ import annotations

from typing import Protocol

from workbench.platform.probes.ascend import AscendProbe
from workbench.platform.probes.nvidia import NvidiaProbe

# A probe knows devices and their roles, not recipes: the sampler that starts it (workbench/training/monitor.py)
# reads those from the recipe's device split.
Roles = dict[int, str]  # device id (CPU: core; NVIDIA also a GPU/MIG UUID) -> "server" | "trainer"


class Probe(Protocol):
    kind: str
    warnings: list[str]  # doubts about a probe that works (CpuProbe: none); may grow at the first sample

    def sample(self) -> list[dict]:
        """One reading of every device in the device split (the first call may prime counters)."""


def for_platform(platform: str, roles: Roles, server_pid: int | None = None, trainer_pid: int | None = None) -> Probe:
    if platform == "cpu":
        from workbench.platform.probes.cpu import CpuProbe  # lazy: psutil
        return CpuProbe(roles, server_pid=server_pid, trainer_pid=trainer_pid)
    if platform == "cuda":
        return NvidiaProbe(roles)
    if platform == "npu":
        return AscendProbe(roles)
    raise ValueError(f"no device probe for platform {platform!r}")
