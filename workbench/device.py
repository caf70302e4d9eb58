"""Which accelerator this process can use: 'npu' (Ascend, torch_npu), 'cuda' (NVIDIA) or 'cpu'.

    python -m workbench.device
"""
from __future__ import annotations

import importlib.util
import os


def detect_platform() -> str:
    """The platform torch can run on here; WORKBENCH_PLATFORM forces one (tests, dry runs)."""
    forced = os.environ.get("WORKBENCH_PLATFORM")
    if forced:
        return forced
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():
                return "npu"
        except Exception:  # a broken CANN shows up in `workbench env`, not here
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    return "cpu"


def visible_devices_variable(platform: str) -> str | None:
    """The environment variable that picks devices for a process on this platform."""
    return {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(platform)


if __name__ == "__main__":
    print(detect_platform())
