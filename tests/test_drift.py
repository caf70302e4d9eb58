"""The policy's KL from its starting weights (monitor.drift_every, training/drift.py), logged whatever beta is: for
real in conftest's smoke run and across the killed run's resume; read by the figure, the
dashboard's summary and the advisor."""
from __future__ import annotations

import json

import pytest

from workbench import recipe
from workbench.errors import WorkbenchError


def _drift_points(train_dir) -> dict[int, float]:
    from workbench.training.drift import KEY

    rows = [json.loads(line) for line in train_dir.metrics.read_text().splitlines()]
    return {r["step"]: r[KEY] for r in rows if KEY in r}


def test_kl_from_the_start_is_logged_and_is_the_final_models(smoke_run, tiny_model_dir):
    """Recomputed here: the reference is the starting model's, and the last point is KL(final model || start)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.training.drift import Drift, kl

    run, _ = smoke_run
    points = _drift_points(run.train)
    assert sorted(points) == [1, 3]  # the first log line and the last step (drift_every 10 > max_steps 3)
    assert points[1] >= 0 and points[3] > 0, points  # step 1 ran at the warm-up's learning rate of 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    drift = Drift.for_recipe(recipe.resolve(recipe.load("smoke")), run.train, tokenizer)
    reference = torch.load(run.train.drift_reference)
    start = drift.logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert reference.shape == start.shape and reference.shape[0] >= 4  # one row per answer token of the probes
    assert torch.allclose(reference, start, atol=1e-5)  # recorded before the first update, not after it
    final = drift.logprobs(AutoModelForCausalLM.from_pretrained(run.train.final))
    assert kl(final, reference) == pytest.approx(points[3], rel=1e-3)
    assert kl(start, reference) < 1e-6 < points[3]


def test_a_resumed_run_measures_from_the_same_start(killed_run):
    """The killed run resumed from its checkpoint reads the reference back instead of recording the checkpoint's."""
    before = killed_run.as_killed.train.drift_reference.read_bytes()
    assert killed_run.run.train.drift_reference.read_bytes() == before
    points = _drift_points(killed_run.run.train)
    assert {1, 10, 14} <= set(points), points  # first line, every 10 steps, the last; 10 and 14 after the resume
    assert points[14] > 0


def test_the_kl_curve_is_on_the_figure_and_the_summary(smoke_run):
    from workbench.observe import figures, rundata, views

    run, _ = smoke_run
    data = rundata.load(run.train)
    points = _drift_points(run.train)
    rows = dict(views.summary_rows(data))
    assert rows["KL from the start (probes)"] == f"{points[3]:.3g} at step 3 (max {max(points.values()):.3g})"
    fig = figures.training_figure(data)
    kl_axes = [ax for ax in fig.axes if ax.get_title() == "KL (nats/token)"]
    assert len(kl_axes) == 1
    (line,) = [ln for ln in kl_axes[0].get_lines() if ln.get_label() == "from the start (probes)"]
    assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == [points[1], points[3]]


def _metrics(rewards: list[float], drift: list[float]) -> list[dict]:
    from workbench.training.drift import KEY

    rows = [{"step": i + 1, "loss": 0.0, "reward": r} for i, r in enumerate(rewards)]
    for i, value in enumerate(drift):
        rows[i * (len(rows) // len(drift))][KEY] = value
    return rows


@pytest.mark.parametrize("rewards, drift, rule", [
    ([0.3] * 12, [0.1, 0.4, 0.8], "policy_drift"),        # far from the start, reward flat
    ([0.3] * 12, [1e-5, 2e-5, 4e-5], "policy_still"),     # not moving, reward flat
    ([0.3] * 12, [0.01, 0.02, 0.05], None),               # moving a little: no finding either way
    ([0.1] * 6 + [0.5] * 6, [0.1, 0.4, 0.8], None),       # far, but the reward rose: learning
])
def test_the_advisor_reads_the_drift_against_the_reward(rewards, drift, rule):
    from workbench.observe import advisor

    found = [f.rule for f in advisor.advise(metrics=_metrics(rewards, drift), devices=[], rollout=[])]
    assert ([r for r in found if r.startswith("policy_")] or [None]) == [rule]


def test_a_negative_drift_period_is_refused_at_load():
    with pytest.raises(WorkbenchError, match="monitor.drift_every is -1"):
        recipe.load("smoke", ["monitor.drift_every=-1"])


def test_a_point_at_the_first_log_line_past_each_multiple_whatever_the_logging_period(tmp_path):
    """logging_steps 4, drift_every 10: the points fall at the first log line at or after 10, 20, 30, ..."""
    from workbench.rundir import TrainDir
    from workbench.training.drift import Drift

    drift = Drift(TrainDir(tmp_path), [[1, 2, 3]], [1], every=10)
    points = []
    for step in range(4, 45, 4):
        if drift.due(step, last=step == 44):
            points.append(step)
            drift.last_step = step
    assert points == [4, 12, 20, 32, 40, 44]
    import torch

    assert drift.plan(0) == "record" and drift.plan(8) == "off"  # a resume without a reference: no curve
    torch.save(torch.zeros(5, 7), drift.train_dir.drift_reference)  # another recipe's probes
    assert drift.plan(8) == "off" and drift.reference is None
    torch.save(torch.zeros(2, 7), drift.train_dir.drift_reference)  # these probes' two answer rows
    assert drift.plan(8) == "read" and drift.reference.shape == (2, 7)
    assert drift.plan(0) == "record"  # a new run into a directory holding an older reference records its own
