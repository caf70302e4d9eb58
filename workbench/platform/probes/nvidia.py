"""NVIDIA probe (nvidia-ml-py): utilization, memory, power and temperature of each GPU in the device split.

The recipe's device ids are physical GPU ids, the numbers `nvidia-smi` shows: the resolved recipe writes them into
each role's CUDA_VISIBLE_DEVICES together with CUDA_DEVICE_ORDER=PCI_BUS_ID (workbench/recipe/resolve.py), so CUDA
numbers the cards as NVML does (PCI bus order; CUDA's own default is fastest first). NVML enumerates every GPU of the
machine whatever CUDA_VISIBLE_DEVICES says, so the probe looks each id up with nvmlDeviceGetHandleByIndex and never
reads the sampling process's own visible list (the trainer's cards: a server card is not in it). The probe also
takes a GPU or MIG UUID (`GPU-…`, `MIG-…`, as `nvidia-smi -L` prints them; looked up with nvmlDeviceGetHandleByUUID)
for callers that have one; recipes hold numbers only (devices.* are lists of ints).
Samples are labelled `gpu:<id>` and carry the card's `uuid`; a MIG instance reports memory but no utilization
(`util_pct` None). Where the sampling process's CUDA_DEVICE_ORDER is not PCI_BUS_ID, CUDA may have given the ids to
other cards than NVML's on a machine with mixed GPU models: the probe says so in `warnings`, which the sampler
records as an event.
"""
from __future__ import annotations

import os
import time

from workbench.errors import WorkbenchError


def _order(device) -> tuple:
    return (0, device, "") if isinstance(device, int) else (1, 0, str(device))


def _handle(nvml, device, count: int):
    """NVML's handle for a recipe id: a physical index, or a GPU/MIG UUID."""
    text = str(device).strip()
    if isinstance(device, int) or text.isdigit():
        index = int(text)
        if not 0 <= index < count:
            raise WorkbenchError(f"devices lists GPU {index}, but NVML sees {count} GPU(s) on this machine",
                                 f"use the GPU numbers nvidia-smi shows (0..{count - 1}) in devices.server and "
                                 "devices.trainer")
        return nvml.nvmlDeviceGetHandleByIndex(index)
    if text.startswith(("GPU-", "MIG-")):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(text)
        except Exception as exc:
            raise WorkbenchError(f"NVML knows no device {text} ({exc})",
                                 "check the UUID with `nvidia-smi -L`") from None
    raise WorkbenchError(f"device id {device!r} is neither a GPU number nor a GPU/MIG UUID",
                         "use the GPU numbers nvidia-smi shows in devices.server and devices.trainer")


class NvidiaProbe:
    kind = "gpu"

    def __init__(self, roles: dict, nvml=None):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise WorkbenchError("nvidia-ml-py is not installed",
                                     "pip install -e '.[cuda]' (it brings nvidia-ml-py)") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            raise WorkbenchError(f"NVML did not initialise ({exc})",
                                 "check the NVIDIA driver (nvidia-smi must work)") from None
        self.warnings: list[str] = []
        order = os.environ.get("CUDA_DEVICE_ORDER")
        if order != "PCI_BUS_ID":
            self.warnings.append(
                f"CUDA_DEVICE_ORDER is {order or 'unset (CUDA: FASTEST_FIRST)'}, not PCI_BUS_ID: the processes' CUDA "
                "ids may name other GPUs than nvidia-smi's numbers the device samples use, on a machine with mixed "
                "GPU models; drop CUDA_DEVICE_ORDER from the recipe's env (the workbench sets PCI_BUS_ID)")
        self.handles = {}
        for device, role in sorted(roles.items(), key=lambda item: _order(item[0])):
            handle = _handle(nvml, device, count)
            try:
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except Exception:  # a label only
                uuid = None
            self.handles[device] = (role, handle, uuid)

    def sample(self) -> list[dict]:
        now, nvml, out = time.time(), self.nvml, []
        for device, (role, handle, uuid) in self.handles.items():
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                if not str(device).startswith("MIG-"):
                    raise
                util = None  # NVML reports no utilization for a MIG instance: unknown, not zero
            record = {"time": now, "role": role, "device": f"gpu:{device}", "kind": self.kind, "uuid": uuid,
                      "util_pct": util,
                      "mem_used_mb": round(memory.used / 2**20, 1), "mem_total_mb": round(memory.total / 2**20, 1)}
            try:
                record["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                record["temp_c"] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except Exception:  # not every board reports these (nor a MIG instance); utilization and memory matter
                pass
            out.append(record)
        return out
