"""Faults during training, for real: a SIGKILLed server, a SIGKILLed trainer and its resume, a sync that stops.

Each test runs `workbench train` (or train() in this process) against a real vLLM server on the CPU with the tiny
model; the server and trainer are killed with SIGKILL as a crash or the OOM killer would. The SIGKILLed trainer and
its resume are conftest's `killed_run` (tests/test_monitor.py reads the killed run's records from the same run).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from conftest import FAST, free_port, steps_logged, wait_for, workbench_command
from workbench.observe.records import read_jsonl
from workbench.rundir import RunDir

_cmd = workbench_command
_steps = steps_logged


def _train_dir(runs: Path) -> Path:
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return run / "train"


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """`workbench ARGS` with its output in a file: a pipe that nobody reads while the run goes on fills up and
    blocks the trainer in a progress-bar write."""
    with open(log, "w") as out:
        return subprocess.Popen([*_cmd(), *args], stdout=out, stderr=subprocess.STDOUT, text=True)


def _server_of(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "workbench.serving.vllm_cpu" in " ".join(child.cmdline()):
            return child
    raise AssertionError("no vLLM server among the run's processes")


def _sync_dirs() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("workbench-sync-*")} if Path("/dev/shm").is_dir() else set()


def _no_sync_gap(train_dir: Path, base: Path) -> float:
    """What the canary would read from a server that kept the initial weights: trainer's final vs the base model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench import recipe
    from workbench.training.canary import Canary, probe_sequences

    rr = recipe.resolve(recipe.load(str(train_dir.parent / "recipe.yaml")))
    sequences = probe_sequences(rr, AutoTokenizer.from_pretrained(str(base)))
    canary = Canary(None, sequences, 1, 1.0, 2.0)
    a = canary.trainer_logprobs(AutoModelForCausalLM.from_pretrained(str(base)))
    b = canary.trainer_logprobs(AutoModelForCausalLM.from_pretrained(str(train_dir / "final")))
    gaps = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(gaps) / len(gaps)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_dead_then_hung_server_is_restarted_and_resynced(tmp_path, tiny_model_dir):
    """SIGKILL of the whole server at step 3 (a crash), SIGSTOP of the new one at step 8 (a hang: it holds its
    connections and answers nothing, and the trainer's requests time out after 10 s): two restarts, every step, and
    the canary proves each re-sync."""
    before = _sync_dirs()
    runs = tmp_path / "runs"
    log = tmp_path / "train.log"
    proc = _start(["train", "--recipe", "smoke", f"server.port={free_port()}", f"monitor.runs_dir={runs}",
                   "trainer.max_steps=14", "trainer.save_steps=100", "server.request_timeout_s=10", *FAST], log)
    try:
        wait_for(lambda: runs.exists() and any(runs.iterdir()) and len(_steps(_train_dir(runs))) >= 3, 400, proc,
                  "step 3", log)
        server = _server_of(proc.pid)
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # the whole server: API process and engine core
        wait_for(lambda: len(_steps(_train_dir(runs))) >= 8, 400, proc, "step 8", log)
        second = _server_of(proc.pid)
        assert second.pid != server.pid
        os.killpg(os.getpgid(second.pid), signal.SIGSTOP)  # hung: alive, listening, silent
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    train_dir = _train_dir(runs)
    assert _steps(train_dir) == list(range(1, 15))  # every step, once
    events = read_jsonl(train_dir / "events.jsonl", normalised=False)
    kinds = [e["kind"] for e in events]
    assert kinds.count("server_fault") == 2 and kinds.count("server_restart") == 2, kinds
    hang = [e for e in events if e["kind"] == "server_fault"][1]
    assert "Timeout" in hang["message"], hang
    summary = json.loads((train_dir / "train.json").read_text())
    assert summary["restarts"] == 2 and summary["steps"] == 14
    canary = read_jsonl(train_dir / "canary.jsonl", normalised=False)
    after = [c for c in canary if c["reason"] == "after restart"]
    assert len(after) == 2 and all(c["level"] == "ok" for c in after)
    no_sync = _no_sync_gap(train_dir, tiny_model_dir)
    print(f"canary after the restarts: {[c['gap_mean'] for c in after]}; a server on the base weights: {no_sync:.3g}")
    # re-synced: the gap right after each restart is at the exact-sync level, far below a server on the base weights
    assert max(c["gap_mean"] for c in after) < 1e-4 < no_sync / 10, (after, no_sync)
    assert all(c["level"] == "ok" for c in canary)
    for n in (1, 2):  # each dead server's log is kept
        assert list(train_dir.glob(f"vllm-server-*.before-restart-{n}.log"))
    assert not psutil.pid_exists(second.pid) or second.status() == psutil.STATUS_ZOMBIE  # the hung one was killed
    assert _sync_dirs() <= before


def test_trainer_sigkilled_then_resumed_has_every_step_once(killed_run):
    """conftest's `killed_run`: the trainer SIGKILLed after its step-4 checkpoint, then `workbench train --resume`."""
    _, run, reached = killed_run
    train_dir = run.train.path
    assert 6 <= reached < 12
    assert _steps(train_dir) == list(range(1, 13))  # merged: each step exactly once, up to max_steps
    summary = json.loads((train_dir / "train.json").read_text())
    assert summary["steps"] == 12
    assert summary["resumed_from"] == (8 if reached >= 8 else 4)  # the newest checkpoint before the kill
    (resume,) = [e for e in read_jsonl(train_dir / "events.jsonl", normalised=False) if e["kind"] == "resume"]
    assert resume["step"] == summary["resumed_from"] and resume["reached"] == reached
    assert (train_dir / "final" / "model.safetensors").exists()
    assert not [p for p in _sync_dirs() if not _alive_owner(p)]  # the killed run's copy is gone too
    report = subprocess.run([*_cmd(), "report", str(run.path)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "resumed from checkpoint" in (run.path / "report.html").read_text()


def _alive_owner(name: str) -> bool:
    pid = name.removeprefix("workbench-sync-").split("-", 1)[0]
    return pid.isdigit() and psutil.pid_exists(int(pid))


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_canary_stops_a_run_whose_sync_stops(tmp_path, restored_server, monkeypatch):
    """A training attached to the session's server (server.mode=attach), in this process, whose sync goes quiet."""
    from workbench import recipe
    from workbench.serving import sync
    from workbench.training import train as training
    from workbench.training.canary import CanaryAlarm

    class Stale(sync.ReloadSync):
        """Stops after two pushes without a word: the server keeps old weights, as a broken sync would."""
        sent = 0

        def send(self, client, metadata, named_params):
            self.sent += 1
            if self.sent > 2:
                for _ in named_params:
                    pass
                return 0
            return super().send(client, metadata, named_params)

    monkeypatch.setattr(sync, "make", lambda rr: Stale())
    before = _sync_dirs()
    r = recipe.load("smoke", ["server.mode=attach", f"server.url={restored_server.url}", f"monitor.runs_dir={tmp_path}",
                              "trainer.max_steps=20", "trainer.save_steps=100", *FAST])
    run = RunDir.create(r, "train")
    with pytest.raises(CanaryAlarm) as alarm:
        training.train(recipe.resolve(r), run.train, log=lambda *_: None)
    assert "not sampling from the weights being trained" in str(alarm.value)
    canary = read_jsonl(run.train.canary, normalised=False)
    assert canary[0]["level"] == "ok" and canary[-1]["level"] == "stop"
    stopped_at = canary[-1]["step"]
    assert 2 <= stopped_at < 20
    kinds = [e["kind"] for e in read_jsonl(run.train.events, normalised=False)]
    assert "canary_stop" in kinds and "failure" in kinds
    assert (run.train.checkpoints / f"checkpoint-{stopped_at}" / "trainer_state.json").exists()  # resumable
    assert _sync_dirs() <= before  # the crashed run's weights copy is gone
