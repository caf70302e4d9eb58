"""Which accelerator this machine offers: 'npu' (Ascend, torch_npu), 'cuda' (NVIDIA) or 'cpu'.

    python -m workbench.platform.detect

Only the recipe resolver calls this (workbench.recipe.resolve): every other module gets the platform from the
resolved recipe. Light where it can be: a machine with no Ascend or NVIDIA device node is the CPU without importing
torch (seconds saved on every light command); where a device node exists, torch decides.
"""
from __future__ import annotations

import glob
import importlib.util
import os


def _has_nodes(pattern: str) -> bool:
    return bool(glob.glob(pattern))


def detect_platform() -> str:
    """The platform torch can run on here; WORKBENCH_PLATFORM forces one (tests, dry runs)."""
    forced = os.environ.get("WORKBENCH_PLATFORM")
    if forced:
        return forced
    if importlib.util.find_spec("torch_npu") is not None and _has_nodes("/dev/davinci[0-9]*"):
        try:
            import torch
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():
                return "npu"
        except Exception:  # a broken CANN shows up in `workbench env`, not here
            pass
    if _has_nodes("/dev/nvidia[0-9]*"):
        try:
            import torch

            if torch.cuda.is_available():
                return "cuda"
        except ImportError:
            pass
    return "cpu"


if __name__ == "__main__":
    print(detect_platform())
