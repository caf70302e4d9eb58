"""The group record: a real smoke training through the server writes every step's GRPO groups (G completions each,
with every reward function's score, the total, the advantage, the length and truncation) that agree with TRL's
logged metrics; it trains with a reward function from a file outside the package, named module:function with an
argument; the inspector and the report read the record. The run is conftest's `grouped_run`."""
from __future__ import annotations

import json
import math

import pytest

from conftest import GROUP_SIZE as G


def _metrics(run) -> dict[int, dict]:
    rows = [json.loads(line) for line in run.train.metrics.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_every_step_has_its_groups_of_g_completions(grouped_run):
    from workbench.observe import groups

    df = groups.load(grouped_run.train)
    assert sorted(df["step"].unique()) == [1, 2, 3]
    sizes = df.groupby(["step", "group"]).size()
    assert (sizes == G).all() and len(sizes) == 3 * 2  # 8 completions a step = 2 groups of 4, each step
    expected = {"step", "group", "member", "prompt", "completion", "reward/correctness", "reward/format",
                "reward/short", "reward", "advantage", "length", "truncated"}
    assert expected <= set(df.columns)
    assert (df.groupby(["step", "group"])["prompt"].nunique() == 1).all()  # one prompt per group


def test_rewards_and_advantages_match_trls_logged_metrics(grouped_run):
    from workbench.observe import groups

    df, metrics = groups.load(grouped_run.train), _metrics(grouped_run)
    for step, rows in df.groupby("step"):
        logged = metrics[step]
        for name in ("correctness", "format", "short"):
            assert rows[f"reward/{name}"].mean() == pytest.approx(logged[f"rewards/{name}/mean"], abs=1e-6)
        assert rows["reward"].mean() == pytest.approx(logged["reward"], abs=1e-6)  # weights 1.0, 0.2, 0.1
        # the workbench's own count over every group of the step (all recorded here) agrees with the record's
        assert groups.summary(rows)["zero_spread"].mean() == pytest.approx(logged["signal/zero_spread"])
        for _, group in rows.groupby("group"):
            # TRL's group advantage: reward minus the group mean (over the group's std): sums to 0, same order
            assert group["advantage"].sum() == pytest.approx(0.0, abs=1e-4)
            centred = group["reward"] - group["reward"].mean()
            assert ((centred > 1e-6) == (group["advantage"] > 1e-6)).all()
        assert rows["length"].mean() == pytest.approx(logged["completions/mean_length"], abs=1e-6)
        assert rows["truncated"].mean() == pytest.approx(logged["completions/clipped_ratio"], abs=1e-6)


def test_the_external_reward_ran_with_its_argument(grouped_run):
    from workbench.observe import groups

    df = groups.load(grouped_run.train)
    for _, row in df.iterrows():  # limit 60 from the recipe, not the function's default 10
        assert row["reward/short"] == pytest.approx(max(0.0, 1.0 - len(row["completion"]) / 60))
    assert not df["reward/short"].isna().any() and not math.isnan(df["reward"].sum())


def test_filters_illustrations_and_report(grouped_run):
    from workbench.observe import groups, report

    df = groups.load(grouped_run.train)
    table = groups.summary(df)
    zero, spread = groups.filtered(df, zero_spread=True), groups.filtered(df, zero_spread=False)
    assert len(zero) + len(spread) == len(table)
    assert (zero["reward_max"] - zero["reward_min"] <= 1e-9).all()
    low = float(table["reward_mean"].median())
    assert (groups.filtered(df, reward_range=(low, 10))["reward_mean"] >= low).all()
    picks = groups.illustrative(df)
    assert picks and all(len(rows) == G and (rows["step"] == 3).all() for _, rows in picks)
    page = report.build(grouped_run).read_text()
    assert "GRPO groups" in page and "zero reward spread" in page and "advantage" in page


def test_inspector_widget_renders_the_chosen_step(grouped_run):
    from workbench.observe import groups

    widget = groups.inspector(grouped_run.train)
    step_slider = widget.children[0].children[0]
    assert list(step_slider.options) == [1, 2, 3] and step_slider.value == 3
    step_slider.value = 1  # what a user's drag does: the output shows step 1's groups
    text = widget.children[2].value
    assert text.startswith("<p>step 1:") and "<table class='groups'>" in text
    spread = widget.children[0].children[1]
    spread.value = True  # only the groups without spread: each table shows one reward value throughout
    assert widget.children[2].value.startswith("<p>step 1:")


def test_groups_per_step_is_checked_at_load():
    from workbench import recipe

    assert recipe.load("smoke", ["monitor.groups_per_step=0"]).monitor.groups_per_step == 0  # 0: no record
    with pytest.raises(Exception, match="monitor.groups_per_step is -1"):
        recipe.load("smoke", ["monitor.groups_per_step=-1"])
