"""The smoke checks on recorded runs: a run whose weights did not move says why when the cause is a run without
learning signal (every group's rewards alike), and not otherwise."""
from __future__ import annotations

import json

import pytest


def _run(tmp_path, zero_spread: float, moved: bool):
    import torch
    from safetensors.torch import save_file

    from workbench.observe.records import append_jsonl
    from workbench.rundir import TrainDir, write_atomic

    train = TrainDir(tmp_path / "smoke").make()
    for step in (1, 2, 3):
        append_jsonl(train.metrics, {"step": step, "loss": 0.0, "frac_reward_zero_std": zero_spread})
    write_atomic(train.summary, json.dumps({"steps": 3, "train_seconds": 1.0}))
    base, final = tmp_path / "base", train.final
    base.mkdir()
    final.mkdir()
    weight = torch.zeros(4, 4)
    save_file({"w": weight}, str(base / "model.safetensors"))
    save_file({"w": weight + (0.1 if moved else 0.0)}, str(final / "model.safetensors"))
    return train, base


@pytest.mark.parametrize("zero_spread, says_why", [(1.0, True), (0.5, False)])
def test_unmoved_weights_name_a_missing_learning_signal(tmp_path, zero_spread, says_why):
    from workbench.training import smoke

    train, base = _run(tmp_path, zero_spread, moved=False)
    (check,) = [c for c in smoke.verify(train, base).checks if c.name == "weights changed"]
    assert not check.ok
    assert ("zero reward spread" in check.detail) is says_why


def test_moved_weights_pass(tmp_path):
    from workbench.training import smoke

    train, base = _run(tmp_path, 1.0, moved=True)
    (check,) = [c for c in smoke.verify(train, base).checks if c.name == "weights changed"]
    assert check.ok and "zero reward spread" not in check.detail
