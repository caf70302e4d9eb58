"""NVIDIA probe (nvidia-ml-py): utilization, memory, power and temperature of each GPU in the device split.

Device ids in the recipe are CUDA indices as the processes see them; when CUDA_VISIBLE_DEVICES renumbers them,
the probe maps them back to the physical GPU NVML reports.
"""
from __future__ import annotations

import os
import time

from workbench.errors import WorkbenchError


def physical_index(logical: int, visible: str | None) -> int:
    if not visible:
        return logical
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if logical >= len(ids) or not ids[logical].isdigit():
        raise WorkbenchError(f"device {logical} is not a numbered entry of CUDA_VISIBLE_DEVICES={visible!r}",
                             "use numeric CUDA_VISIBLE_DEVICES, or device ids within it")
    return int(ids[logical])


class NvidiaProbe:
    kind = "gpu"

    def __init__(self, roles: dict[int, str], nvml=None):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise WorkbenchError("nvidia-ml-py is not installed",
                                     "pip install -e '.[cuda]' (it brings nvidia-ml-py)") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise WorkbenchError(f"NVML did not initialise ({exc})",
                                 "check the NVIDIA driver (nvidia-smi must work)") from None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = nvml.nvmlDeviceGetCount()
        self.handles = {}
        for logical, role in sorted(roles.items()):
            index = physical_index(logical, visible)
            if index >= count:
                raise WorkbenchError(f"devices lists GPU {logical}, but NVML sees {count}",
                                     f"use GPU ids 0..{count - 1} in devices.server and devices.trainer")
            self.handles[logical] = (role, nvml.nvmlDeviceGetHandleByIndex(index))

    def sample(self) -> list[dict]:
        now, nvml, out = time.time(), self.nvml, []
        for logical, (role, handle) in self.handles.items():
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            record = {"time": now, "role": role, "device": f"cuda:{logical}", "kind": self.kind,
                      "util_pct": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                      "mem_used_mb": round(memory.used / 2**20, 1), "mem_total_mb": round(memory.total / 2**20, 1)}
            try:
                record["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                record["temp_c"] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except Exception:  # not every board reports these; utilization and memory are what matter
                pass
            out.append(record)
        return out
