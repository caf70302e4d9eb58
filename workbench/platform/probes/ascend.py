"""Ascend probe: `npu-smi info` each sample (AICore utilization, HBM, power, temperature of every chip).

The recipe's device ids are logical NPU ids (ASCEND_RT_VISIBLE_DEVICES order); the table lists chips in the same
order, one per device on 910B (two dies per board on some models, each its own device). Where the table prints `-`
for a chip's AICore, `npu-smi info -t usages -i <npu>` is asked instead. Output the parser does not understand
raises npusmi.NpuSmiFormatError naming the line.
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

    def sample(self) -> list[dict]:
        now = time.time()
        chips = npusmi.parse_info(self.runner())
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
