"""Faults during training, for real: a SIGKILLed server, a hung one, a SIGKILLed trainer and its resume, a sync
that stops.

The first three are one run, conftest's `killed_run` (`workbench train` against a real vLLM server on the CPU with
the tiny model; the server and the trainer are killed with SIGKILL as a crash or the OOM killer would, a server is
SIGSTOPped as a hang); tests/test_monitor.py reads the killed run's records from the same run. The sync that stops
is a training in this process attached to the session's server.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import psutil
import pytest

from conftest import FAST, KEYED, steps_logged, sync_dirs_of, workbench_command
from workbench.records import read_jsonl
from workbench.rundir import RunDir

_cmd = workbench_command
_steps = steps_logged


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


def test_save_total_limit_keeps_only_the_newest_checkpoints_through_a_resume(killed_run):
    """conftest's `killed_run` saves every 4 steps of 14 with the recipe's trainer.save_total_limit (2, from
    cpu-tiny): transformers deletes the older ones, the resume included, so a long run does not fill the disk."""
    from workbench import recipe

    limit = recipe.load(str(killed_run.run.recipe)).trainer["save_total_limit"]
    kept = sorted(killed_run.run.train.complete_checkpoints())
    assert limit == 2 and len(kept) == limit, kept
    assert 4 not in kept and kept[-1] >= 12  # the newest survive, the first is gone
    assert len(list(killed_run.run.train.checkpoints.glob("checkpoint-*"))) == limit  # no half-deleted ones


def test_dead_then_hung_server_is_restarted_and_resynced(killed_run, tiny_model_dir):
    """conftest's `killed_run`: its server SIGKILLed at step 3 (a crash), the replacement SIGSTOPped at step 7 (a
    hang: it holds its connections and answers nothing, and the trainer's requests time out after 10 s): two
    restarts, every step, and the canary proves each re-sync."""
    train_dir = killed_run.run.train.path
    assert _steps(train_dir) == list(range(1, 15))  # every step, once (across the trainer's kill and resume too)
    events = read_jsonl(train_dir / "events.jsonl", normalised=False)
    faults = [e for e in events if e["kind"] == "server_fault"]
    assert len(faults) == 2 and [e["kind"] for e in events].count("server_restart") == 2, events
    assert "Timeout" in faults[1]["message"], faults[1]  # the hang: noticed by its request timeout
    assert faults[1]["time"] - faults[0]["time"] < 300  # one timeout, not TRL's five retries with back-off
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
    for pid in (killed_run.crashed, killed_run.hung):  # the crashed one and the hung one, killed by the restart
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_trainer_sigkilled_then_resumed_has_every_step_once(killed_run):
    """conftest's `killed_run`: the trainer SIGKILLed past its step-8 checkpoint, then `workbench train --resume`."""
    run, reached = killed_run.run, killed_run.reached
    train_dir = run.train.path
    assert 9 <= reached < 14
    assert _steps(train_dir) == list(range(1, 15))  # merged: each step exactly once, up to max_steps
    summary = json.loads((train_dir / "train.json").read_text())
    assert summary["steps"] == 14
    assert summary["resumed_from"] == killed_run.checkpoint in (8, 12)  # the newest checkpoint before the kill
    (resume,) = [e for e in read_jsonl(train_dir / "events.jsonl", normalised=False) if e["kind"] == "resume"]
    assert resume["step"] == summary["resumed_from"] and resume["reached"] == reached
    assert (train_dir / "final" / "model.safetensors").exists()
    assert killed_run.killed and not sync_dirs_of(killed_run.killed)  # the killed trainer's copy is gone too
    report = subprocess.run([*_cmd(), "report", str(run.path)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "resumed from checkpoint" in (run.path / "report.html").read_text()


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

    monkeypatch.setattr(sync, "make", lambda rr, **_: Stale())
    before = sync_dirs_of({os.getpid()})  # the training runs in this process
    r = recipe.load("smoke", ["server.mode=attach", f"server.url={restored_server.url}", *KEYED, f"monitor.runs_dir={tmp_path}",
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
    assert sync_dirs_of({os.getpid()}) <= before  # the crashed run's weights copy is gone
