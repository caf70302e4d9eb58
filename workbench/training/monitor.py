"""The background sampler: devices to `devices.jsonl`, the server's /metrics to `rollout.jsonl`, once a second.

    with monitor.Monitor(rr, train_dir, server_pid=srv.process.pid, server_url=srv.url):
        trainer.train()

One daemon thread in the training process (rank 0 only). The first sample is taken before training starts, so a
probe that cannot read its device fails the run at once with its cause; later failures are written as error
lines and counted, never allowed to stop the training. The thread's own CPU time is measured
(`overhead()`), which is how the README's overhead figure is obtained.
"""
from __future__ import annotations

import threading
import time

from workbench.platform import probes
from workbench.recipe import Recipe, Resolved
from workbench.records import append_jsonl
from workbench.rundir import TrainDir
from workbench.serving.scraper import Scraper


def device_roles(recipe: Recipe) -> probes.Roles:
    """Device id -> role, from the recipe's device split."""
    out = {d: "trainer" for d in recipe.devices.trainer}
    out.update({d: "server" for d in recipe.devices.server})  # a colocated device counts as the server's
    return out


class Monitor:
    def __init__(self, rr: Resolved, train_dir: TrainDir, server_pid: int | None = None,
                 server_url: str | None = None, trainer_pid: int | None = None, probe: probes.Probe | None = None,
                 enabled: bool = True):
        self.interval = rr.recipe.monitor.sample_interval_s
        self.devices_path = train_dir.devices
        self.rollout_path = train_dir.rollout
        self.enabled = enabled and self.interval > 0
        self.probe = probe or (probes.for_platform(rr.platform, device_roles(rr.recipe), server_pid=server_pid,
                                                     trainer_pid=trainer_pid)
                               if self.enabled else None)
        self.scraper = Scraper(server_url, rr.headers) if (server_url and self.enabled) else None
        self.samples = 0
        self.errors = 0
        self.cpu_seconds = 0.0
        self.wall_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _tick(self) -> None:
        for source, path, read in (("devices", self.devices_path, self.probe and self.probe.sample),
                                   ("rollout", self.rollout_path, self.scraper and self.scraper.scrape)):
            if not read:
                continue
            try:
                result = read()
            except Exception as exc:
                self.errors += 1
                append_jsonl(path, {"time": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}, fsync=False)
                continue
            for record in result if isinstance(result, list) else [result]:
                append_jsonl(path, record, fsync=False)
        self.samples += 1

    def _loop(self) -> None:
        started_wall, started_cpu = time.perf_counter(), time.thread_time()
        while not self._stop.wait(self.interval):
            self._tick()
            self.cpu_seconds = time.thread_time() - started_cpu
            self.wall_seconds = time.perf_counter() - started_wall

    def start(self) -> "Monitor":
        if not self.enabled:
            return self
        self.probe.sample()  # raises here, before training, when the device cannot be read
        if self.scraper:
            self.scraper.scrape()
        self._thread = threading.Thread(target=self._loop, name="workbench-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
            self._tick()  # a last sample: even a run shorter than one interval leaves one per device

    def overhead(self) -> dict:
        """The sampler's own CPU time against the wall time it ran: the share of one core it took."""
        share = self.cpu_seconds / self.wall_seconds if self.wall_seconds else 0.0
        return {"samples": self.samples, "errors": self.errors, "cpu_seconds": round(self.cpu_seconds, 3),
                "wall_seconds": round(self.wall_seconds, 1), "core_share": round(share, 5)}

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
