"""The background sampler: devices to `devices.jsonl`, the server's /metrics to `rollout.jsonl`, once a second.

    with monitor.Monitor(rr, train_dir, server_pid=srv.process.pid, server_url=srv.url):
        trainer.train()

One daemon thread in the training process (rank 0 only). The first sample is taken before training starts. A probe
that cannot start (NVML or npu-smi missing or failing, an id beyond the device count: its construction or first sample
raises) is a warning, never a dead rank: one error line in devices.jsonl, a `probe_warning` event in events.jsonl
(the dashboard's and the report's events table shows its text) and a line on stderr, and the training goes on without
device samples while the /metrics scraper keeps sampling. The doubts of a probe that works (`probe.warnings`: a device
order it cannot prove) become `probe_warning` events too. Later failures are written as error lines and counted,
never allowed to stop the training. The thread's own CPU time is measured (`overhead()`), which is how the sampler's
overhead is reported (train.json).
"""
from __future__ import annotations

import sys
import threading
import time

from workbench.platform import probes
from workbench.recipe import Recipe, Resolved
from workbench.records import append_event, append_jsonl
from workbench.rundir import TrainDir
from workbench.serving.scraper import Scraper


def device_roles(recipe: Recipe) -> probes.Roles:
    """Device id -> role, from the recipe's device split."""
    out = {d: "trainer" for d in recipe.devices.trainer}
    if recipe.server.mode == "off":  # TRL generates in the trainer: devices.server runs nothing
        return out
    out.update({d: "server" for d in recipe.devices.server})  # a colocated device counts as the server's
    return out


class Monitor:
    def __init__(self, rr: Resolved, train_dir: TrainDir, server_pid: int | None = None,
                 server_url: str | None = None, trainer_pid: int | None = None, probe: probes.Probe | None = None,
                 enabled: bool = True):
        self.interval = rr.recipe.monitor.sample_interval_s
        self.devices_path = train_dir.devices
        self.rollout_path = train_dir.rollout
        self.events_path = train_dir.events
        self.platform = rr.platform
        self.enabled = enabled and self.interval > 0
        self.probe: probes.Probe | None = None
        self._probe_failure: str | None = None  # why the probe could not start (recorded by start())
        if self.enabled:
            try:
                self.probe = probe or probes.for_platform(rr.platform, device_roles(rr.recipe), server_pid=server_pid,
                                                          trainer_pid=trainer_pid)
            except Exception as exc:
                self._probe_failure = _describe(exc)
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
                append_jsonl(path, {"time": time.time(), "error": _describe(exc)[:300]}, fsync=False)
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
        if self.probe is not None:
            try:
                self.probe.sample()  # before training: an unreadable device shows now (the call primes counters)
            except Exception as exc:
                self.probe, self._probe_failure = None, _describe(exc)
        self._record_probe_state()
        if self.scraper:
            self.scraper.scrape()
        self._thread = threading.Thread(target=self._loop, name="workbench-monitor", daemon=True)
        self._thread.start()
        return self

    def _warn(self, message: str) -> None:
        append_event(self.events_path, "probe_warning", message, source="devices", platform=self.platform)
        print(f"workbench: warning: {message}", file=sys.stderr, flush=True)

    def _record_probe_state(self) -> None:
        if self._probe_failure is not None:
            self.errors += 1
            append_jsonl(self.devices_path, {"time": time.time(), "error": self._probe_failure[:300]}, fsync=False)
            self._warn(f"the {self.platform} device probe could not start ({self._probe_failure[:300]}): training "
                       "continues without device samples")
        for doubt in getattr(self.probe, "warnings", None) or ():
            self._warn(f"device samples: {doubt}")

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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
