"""How a workbench process fails or ends: the one exception type it raises for bad input, and SIGTERM as a
clean exit.

Every message is a single line that names the cause and the fix, so that a notebook cell or the
CLI can show it without a stack trace. Raise it before expensive work starts.

    raise WorkbenchError("server.max_model_len is 256", "set it to at least 560 (prompt 512 + completion 48)")
"""
from __future__ import annotations

import signal
import threading


class WorkbenchError(Exception):
    """Bad input or a broken environment, described as 'cause; fix'."""

    def __init__(self, cause: str, fix: str | None = None):
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}; fix: {fix}" if fix else cause)


# SIGTERM ends a workbench process the way Ctrl-C does, through its cleanup. `kill PID`, a scheduler's stop (Slurm and
# Kubernetes send SIGTERM before SIGKILL) and a parent's death (the children's PR_SET_PDEATHSIG,
# die_with_parent) all send it, and its default action ends Python at once: no `finally`, so a training's
# RAM-disk adapter or weight files, its trainer processes, a protocol's trainings and the server a command owns
# would be left behind. Every entry point (the CLI, each trainer rank) calls exit_on_sigterm().
TERMINATED = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM


def _exit(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one cleanup: a second SIGTERM must not cut it short (SIGKILL can)
    raise SystemExit(TERMINATED)


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises SystemExit(143) in the main thread, which passes `except Exception` untouched and
    runs every cleanup (a no-op off the main thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def die_with_parent() -> None:
    """In a child, before exec (a Popen preexec_fn): SIGTERM when the parent dies (PR_SET_PDEATHSIG; Linux only,
    a no-op elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
