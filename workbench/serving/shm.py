"""The shared-memory files a vLLM server leaves in /dev/shm when it is killed, found and removed.

    from workbench.serving import shm
    files = shm.files_of(shm.group_pids(pgid))     # while the server runs: its psm_* and sem.* files
    shm.remove(files)                              # once the group is gone
    shm.remove(shm.orphaned())                     # what no live process holds any more: dead servers' leftovers

vLLM's processes talk through Python multiprocessing shared memory (`/dev/shm/psm_*`, sparse files of 160-250 MB
each) and named semaphores (`/dev/shm/sem.*`, which the spawn start method keeps by name until multiprocessing's
resource tracker unlinks them). A clean shutdown unlinks them; a SIGKILLed server (a crash, the OOM killer, a stop
that had to escalate, a trainer killed so that its server follows it) leaves them behind, its resource tracker
killed with it. The workbench notes the files a server's processes map or hold open while it runs and removes what
is left once the whole group has ended; and since a group killed from outside (or one whose API process exited on
its own SIGTERM before anything could look) leaves files nobody noted, every server stop and start also removes the
orphans: files of these kinds that this user owns, that no live process maps or holds, and that are older than a
few seconds (a file being created is not yet mapped). Only /proc is read: the CPU launcher (vllm_cpu.py) uses this
in its parent watch, before vLLM is imported.
"""
from __future__ import annotations

import os
import time
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


def orphaned(min_age_s: float = 10.0) -> set[str]:
    """This user's psm_* and sem.* files in /dev/shm that no live process maps or holds (all of /proc read), older
    than `min_age_s`: left by a server that is gone, whoever started it."""
    base = Path("/dev/shm")
    if not base.is_dir():
        return set()
    now, uid = time.time(), os.getuid()
    candidates = set()
    for entry in base.iterdir():
        if not entry.name.startswith(PREFIXES):
            continue
        try:
            st = entry.stat()
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_ctime > min_age_s:
            candidates.add(str(entry))
    if not candidates:
        return set()
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return candidates - files_of(pids)


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
