"""Ascend probe: `npu-smi info` each sample (AICore utilization, HBM, power, temperature of every chip).

The recipe's device ids are logical chip ids over the whole machine: the values that go into each role's
ASCEND_RT_VISIBLE_DEVICES (0..N-1 over all chips, as the `Chip Logic ID` of `npu-smi info -m` numbers them). The
probe never reads the sampling process's own ASCEND_RT_VISIBLE_DEVICES (the trainer's chips: a server chip is not in
it), and takes id i as the i-th chip of the `npu-smi info` table: no `npu-smi info -m` output has been recorded,
so the Logic ID mapping is not read. Where the table lists NPU ids 0..N-1 with one chip each (the recorded 910B
hosts) id i is NPU i; any other layout (non-contiguous NPU ids, two dies per board) is sampled in table order too,
and the probe says in `warnings` that this order is unproven. Where the table prints `-` for a chip's AICore,
`npu-smi info -t usages -i <npu>` is asked instead. Output the parser does not understand raises
npusmi.NpuSmiFormatError naming the line.
"""
from __future__ import annotations

import subprocess
import time
from typing import Callable

from workbench.errors import WorkbenchError
from workbench.platform import npusmi


def run_npu_smi(*args: str) -> str:
    try:
        done = subprocess.run(["npu-smi", "info", *args], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        raise WorkbenchError("npu-smi is not on PATH", "install the Ascend driver, or set devices.platform") from None
    if done.returncode != 0:
        raise WorkbenchError(f"npu-smi info {' '.join(args)} exited with {done.returncode}: {done.stderr.strip()[:200]}",
                             "check the driver with `npu-smi info` in a shell")
    return done.stdout


class AscendProbe:
    kind = "npu"

    def __init__(self, roles: dict[int, str], runner: Callable[..., str] = run_npu_smi):
        self.roles = dict(roles)
        self.runner = runner
        self.warnings: list[str] = []
        self._layout_checked = False

    def _check_layout(self, chips: list[npusmi.NpuChip]) -> None:
        """A warning when table order is not provably the logical order (see the module's docstring)."""
        self._layout_checked = True
        if [(c.npu, c.chip) for c in chips] != [(i, 0) for i in range(len(chips))]:
            listed = ", ".join(f"{c.npu}/{c.chip}" for c in chips)
            self.warnings.append(
                f"npu-smi lists NPU/chip {listed}: device samples take recipe id i as the i-th chip of that table, "
                "which is the logical id (ASCEND_RT_VISIBLE_DEVICES) only if the driver numbers chips in table "
                "order; compare with the Chip Logic ID of `npu-smi info -m`")

    def sample(self) -> list[dict]:
        now = time.time()
        chips = npusmi.parse_info(self.runner())
        if not self._layout_checked:
            self._check_layout(chips)
        missing = [d for d in self.roles if d >= len(chips)]
        if missing:
            raise WorkbenchError(f"devices lists NPUs {missing}, but npu-smi shows {len(chips)} chips",
                                 f"use device ids 0..{len(chips) - 1} in devices.server and devices.trainer")
        usages: dict[int, list[dict]] = {}
        out = []
        for device, role in sorted(self.roles.items()):
            chip = chips[device]
            util = chip.aicore_pct
            if util is None:
                if chip.npu not in usages:
                    usages[chip.npu] = npusmi.parse_usages(self.runner("-t", "usages", "-i", str(chip.npu)))
                block = next((b for b in usages[chip.npu] if b.get("chip_id") == chip.chip), {})
                util = block.get("aicore_pct", block.get("npu_util_pct"))
            out.append({"time": now, "role": role, "device": f"npu:{device}", "kind": self.kind,
                        "npu": chip.npu, "chip": chip.chip, "name": chip.name, "health": chip.health,
                        "util_pct": util, "mem_used_mb": chip.hbm_used_mb, "mem_total_mb": chip.hbm_total_mb,
                        "power_w": chip.power_w, "temp_c": chip.temp_c})
        return out
