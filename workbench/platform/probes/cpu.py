"""CPU probe (psutil): per core of each role, the core's load and the role's processes.

On the CPU the recipe's device ids are cores: the vLLM server is pinned to devices.server, the trainer to
devices.trainer. Each sample gives a core's utilization (`util_pct`, anything running on it) and what the role's own
process tree uses, spread over the role's cores (`proc_util_pct`, 100 = all its cores busy) with its resident memory
(`mem_used_mb`): the same "server devices vs trainer devices" picture an 8-card run shows.
"""
from __future__ import annotations

import os
import time

import psutil

from workbench.errors import WorkbenchError


class CpuProbe:
    kind = "cpu"

    def __init__(self, roles: dict[int, str], server_pid: int | None = None, trainer_pid: int | None = None):
        self.roles = dict(roles)
        self.warnings: list[str] = []
        self.root_pids = {"server": server_pid, "trainer": trainer_pid or os.getpid()}
        self._procs: dict[int, psutil.Process] = {}
        self._trees: dict[int, tuple[float, list[psutil.Process]]] = {}
        self.total_mb = psutil.virtual_memory().total / 2**20
        ncores = psutil.cpu_count() or 1
        missing = [d for d in self.roles if d >= ncores]
        if missing:
            raise WorkbenchError(f"devices lists cores {missing}, but this machine has {ncores}",
                                 f"use core ids 0..{ncores - 1} in devices.server and devices.trainer")
        psutil.cpu_percent(percpu=True)  # prime: the next call measures from here

    def _tree(self, pid: int | None) -> list[psutil.Process]:
        if pid is None:
            return []
        cached = self._trees.get(pid)
        if cached and time.time() - cached[0] < 10:  # walking /proc for children costs more than the sample
            return cached[1]
        try:
            root = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
            members = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        # keep the same Process objects between samples: cpu_percent() measures since that object's last call
        tree = [self._procs.setdefault(p.pid, p) for p in members]
        self._trees[pid] = (time.time(), tree)
        return tree

    def _members(self, role: str) -> list[psutil.Process]:
        """The role's process tree; the trainer's without the server's (a single training process is the server's
        parent, and counting the server twice would make both roles' numbers wrong)."""
        tree = self._tree(self.root_pids.get(role))
        if role == "trainer" and self.root_pids.get("server"):
            server = {p.pid for p in self._tree(self.root_pids["server"])}
            tree = [p for p in tree if p.pid not in server]
        return tree

    def _usage(self, role: str) -> tuple[float, float]:
        cpu = rss = 0.0
        for proc in self._members(role):
            try:
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(proc.pid, None)
        return cpu, rss / 2**20

    def sample(self) -> list[dict]:
        now = time.time()
        per_core = psutil.cpu_percent(percpu=True)
        usage = {role: self._usage(role) for role in set(self.roles.values())}
        counts = {role: sum(1 for r in self.roles.values() if r == role) for role in usage}
        out = []
        for core, role in sorted(self.roles.items()):
            cpu, rss = usage[role]
            out.append({"time": now, "role": role, "device": f"cpu{core}", "kind": self.kind,
                        "util_pct": per_core[core], "proc_util_pct": min(100.0, cpu / counts[role]),
                        "mem_used_mb": round(rss, 1), "mem_total_mb": round(self.total_mb, 1)})
        return out
