"""Which accelerator this machine offers: 'npu' (Ascend, torch_npu), 'cuda' (NVIDIA) or 'cpu'.

    python -m workbench.platform.detect

Only the recipe resolver calls this (workbench.recipe.resolve): every other module gets the platform from the
resolved recipe. Light where it can be: a machine with no Ascend or NVIDIA device node is the CPU without importing
torch (seconds saved on every light command); where a device node exists, torch decides. Device nodes that torch
cannot use (a driver older than torch's CUDA build, a CPU-only torch, torch_npu missing or failing to load CANN) are
still the CPU, so light commands (`workbench plan`, `workbench recipe show`) keep working, but not in silence: one
line on stderr, once per process, names the cause and the fix (devices.platform=cpu or WORKBENCH_PLATFORM=cpu says
the CPU is meant).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import warnings

_warned: set[str] = set()


def _has_nodes(pattern: str) -> bool:
    return bool(glob.glob(pattern))


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:200] if lines else ""


def _npu_problem() -> str | None:
    """Why torch cannot use the Ascend device nodes here (None: it can)."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (see the Ascend install in docs/ascend.md)"
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return None
        return "torch.npu.is_available() is False"
    except Exception as exc:
        return f"importing torch_npu failed ({type(exc).__name__}: {_first_line(exc)})"


def _cuda_problem() -> str | None:
    """Why torch cannot use the NVIDIA device nodes here (None: it can)."""
    try:
        import torch
    except Exception as exc:
        return f"torch does not import ({type(exc).__name__}: {_first_line(exc)})"
    try:
        with warnings.catch_warnings(record=True) as caught:  # torch explains a failed CUDA init in a warning
            warnings.simplefilter("always")
            if torch.cuda.is_available():
                return None
    except Exception as exc:
        return f"torch.cuda.is_available() raised {type(exc).__name__}: {_first_line(exc)}"
    build = getattr(getattr(torch, "version", None), "cuda", None)
    if build is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    said = next((_first_line(w.message) for w in caught if str(w.message).strip()), "")
    return (f"torch {torch.__version__} (built for CUDA {build}) cannot use the GPUs"
            + (f": {said}" if said else "") + f" (check that the driver `nvidia-smi` reports supports CUDA {build})")


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"workbench: warning: {message}", file=sys.stderr, flush=True)


def detect_platform() -> str:
    """The platform torch can run on here; WORKBENCH_PLATFORM forces one (tests, dry runs)."""
    forced = os.environ.get("WORKBENCH_PLATFORM")
    if forced:
        return forced
    problems = []
    if _has_nodes("/dev/davinci[0-9]*"):
        problem = _npu_problem()
        if problem is None:
            return "npu"
        problems.append(f"/dev/davinci* exists but {problem}; check `npu-smi info`, `source "
                        "/usr/local/Ascend/ascend-toolkit/set_env.sh` and that torch_npu matches torch and CANN "
                        "(`workbench env`)")
    if _has_nodes("/dev/nvidia[0-9]*"):
        problem = _cuda_problem()
        if problem is None:
            return "cuda"
        problems.append(f"/dev/nvidia* exists but {problem}")
    for problem in problems:
        _warn(f"{problem}; using the CPU (set devices.platform=cpu or WORKBENCH_PLATFORM=cpu to silence this)")
    return "cpu"


if __name__ == "__main__":
    print(detect_platform())
