"""The shared-memory files a vLLM server leaves in /dev/shm when it is killed, found and removed.

    from workbench.serving import shm
    files = shm.files_of(shm.group_pids(pgid))     # while the server runs: its psm_* and sem.* files
    shm.remove(files)                              # once the group is gone

vLLM's processes talk through Python multiprocessing shared memory (`/dev/shm/psm_*`, sparse files of 160-250 MB
each) and named semaphores (`/dev/shm/sem.*`). A clean shutdown unlinks them; a SIGKILLed server (a crash, the OOM
killer, a stop that had to escalate) leaves them behind, one pair per server. The workbench notes the files a
server's processes map or hold open while it runs and removes what is left once the whole group has ended. Only
/proc is read: the CPU launcher (vllm_cpu.py) uses this in its parent watch, before vLLM is imported.

Not complete: semaphores that multiprocessing's resource tracker holds by name (mapped by no process) are not
found this way, and when the API process exits on its own SIGTERM before the parent watch acts, the engine's
segments can stay (seen in tests/test_faults.py's SIGKILL scenarios).
"""
from __future__ import annotations

import os
from pathlib import Path

PREFIXES = ("psm_", "sem.")  # multiprocessing's shared_memory and named-semaphore files; never the weight files


def group_pids(pgid: int) -> list[int]:
    """Processes whose process group is `pgid` (zombies included: they hold nothing, it does not matter)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the command name, which may hold spaces and parentheses
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            out.append(int(entry.name))
    return out


def files_of(pids: list[int]) -> set[str]:
    """The /dev/shm files of these processes' kind (PREFIXES) that they map or hold open."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(parts) == 6:
                    found.add(parts[5].removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    found.add(os.readlink(fd))
                except OSError:
                    continue
        except OSError:
            pass
    return {p for p in found if p.startswith("/dev/shm/") and Path(p).name.startswith(PREFIXES)}


def remove(paths: set[str]) -> list[str]:
    """Unlink those of `paths` that still exist; returns what was removed."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
        except OSError:
            continue
    return removed
