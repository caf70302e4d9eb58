"""The advisor's rules on synthetic traces that show each problem, and on a healthy run that shows none."""
from __future__ import annotations

import random

import pytest

from workbench import plots
from workbench.observe import advisor, figures, rundata
from workbench.records import append_jsonl

RECIPE = {"trainer": {"per_device_train_batch_size": 32, "num_generations": 8, "max_completion_length": 48,
                      "beta": 0.04, "learning_rate": 3e-5, "max_steps": 100}}


def healthy_metrics(n: int = 30, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        progress = i / n
        rows.append({
            "step": (i + 1) * 5, "time": 1000.0 + i * 5, "loss": 0.01,
            "reward": 0.3 + 0.4 * progress + rng.uniform(-0.02, 0.02),
            "reward_std": 0.3 - 0.15 * progress, "rewards/correctness/mean": 0.2 + 0.4 * progress,
            "rewards/format/mean": 0.95, "frac_reward_zero_std": 0.1, "kl": 0.01 + 0.002 * progress,
            "entropy": 0.3, "completions/mean_length": 30 + rng.uniform(-1, 1), "completions/max_length": 40,
            "completions/clipped_ratio": 0.0,
            "time/step": 1.0 + rng.uniform(-0.05, 0.05), "time/generation": 0.35, "time/weight_sync": 0.03,
            "time/reward": 0.01, "time/scoring": 0.06, "time/optimisation": 0.55,
        })
    return rows


def busy_devices(n: int = 20, server: float = 70.0, trainer: float = 90.0) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"time": 1000.0 + i, "role": "server", "device": "cpu0", "util_pct": server,
                    "proc_util_pct": server, "mem_used_mb": 900, "mem_total_mb": 24000})
        out.append({"time": 1000.0 + i, "role": "trainer", "device": "cpu1", "util_pct": trainer,
                    "proc_util_pct": trainer, "mem_used_mb": 1500, "mem_total_mb": 24000})
    return out


def full_rollout(n: int = 20, running: float = 30.0) -> list[dict]:
    return [{"time": 1000.0 + i, "running": running, "waiting": 0.0, "generation_tokens_per_s": 1000.0}
            for i in range(n)]


def rules_fired(metrics=None, devices=None, rollout=None, recipe=RECIPE) -> set[str]:
    found = advisor.advise(metrics=metrics if metrics is not None else healthy_metrics(),
                           devices=devices if devices is not None else busy_devices(),
                           rollout=rollout if rollout is not None else full_rollout(), recipe=recipe)
    for f in found:
        assert f.evidence and f.suggestion and f.title
    return {f.rule for f in found}


def test_a_healthy_run_raises_nothing():
    assert rules_fired() == set()


def test_idle_inference_devices():
    assert rules_fired(devices=busy_devices(server=12.0)) == {"idle_server"}
    assert rules_fired(devices=busy_devices(server=12.0)[:4]) == set()  # too few samples to judge


def test_trainer_waiting_on_a_server_with_few_requests_in_flight():
    rows = healthy_metrics()
    for r in rows:
        r["time/generation"], r["time/optimisation"] = 0.7, 0.2
    assert rules_fired(metrics=rows, rollout=full_rollout(running=4.0)) == {"low_concurrency"}
    assert rules_fired(metrics=rows, rollout=full_rollout(running=30.0)) == set()  # generation-bound but full
    finding = advisor.low_concurrency(advisor.RunRecords(rows, [], full_rollout(running=4.0), RECIPE))
    assert "4.0 requests" in finding.evidence and "32 completions" in finding.evidence


def test_idle_server_advice_names_async_rollouts_only_where_they_are_off():
    sync_run = advisor.idle_server(advisor.RunRecords(healthy_metrics(), busy_devices(server=12.0), [], RECIPE))
    assert "rollout.mode: async" in sync_run.suggestion
    assert "the server generated during 35% of each step" in sync_run.evidence
    already = {**RECIPE, "rollout": {"mode": "async"}}
    async_run = advisor.idle_server(advisor.RunRecords(healthy_metrics(), busy_devices(server=12.0), [], already))
    assert "rollout.mode" not in async_run.suggestion


def test_an_async_run_that_barely_waits_for_its_rollouts_is_not_generation_bound():
    rows = healthy_metrics()
    for r in rows:  # the server generates most of the step, but behind the training
        r["time/generation"], r["time/rollout_wait"], r["time/optimisation"] = 0.7, 0.02, 0.6
    assert rules_fired(metrics=rows, rollout=full_rollout(running=4.0)) == set()
    for r in rows:
        r["time/rollout_wait"] = 0.6
    assert rules_fired(metrics=rows, rollout=full_rollout(running=4.0)) == {"low_concurrency"}


def test_rollouts_waiting_on_a_server_far_below_its_ceiling():
    """gauge/generation (training/gauge.py): the trainer waits for rollouts while the server decodes at a tenth of
    what its cores could for that batch; not a finding when the server is near its ceiling or nobody waits."""
    rows = healthy_metrics()
    for r in rows:
        r["time/generation"] = r["time/rollout_wait"] = 0.6
        r["gauge/generation"], r["gauge/optimisation"] = 0.1, 0.4
    assert rules_fired(metrics=rows) == {"far_from_limits"}
    finding = advisor.far_from_limits(advisor.RunRecords(rows, [], [], RECIPE))
    assert "at 10% of the server cores' decode ceiling (median over 30 steps)" in finding.evidence
    assert "60% of each step" in finding.evidence and "the optimisation at 40% of the trainer cores' GEMM" in finding.evidence
    near = [{**r, "gauge/generation": 0.5} for r in rows]
    assert rules_fired(metrics=near) == set()
    not_waiting = [{**r, "time/rollout_wait": 0.05} for r in rows]
    assert rules_fired(metrics=not_waiting) == set()
    assert advisor.far_from_limits(advisor.RunRecords(rows[:2], [], [], RECIPE)) is None  # too few steps


def test_long_tail_completions():
    rows = healthy_metrics()
    for r in rows:
        r["completions/max_length"] = 48
        r["completions/mean_length"] = 18
        r["completions/clipped_ratio"] = 0.12
    finding = advisor.long_tail(advisor.RunRecords(rows, [], [], RECIPE))
    assert finding is not None and "2.7x" in finding.evidence and "12%" in finding.evidence
    assert "now 48" in finding.suggestion
    assert rules_fired(metrics=rows) == {"long_tail"}


def test_kl_spikes():
    rows = healthy_metrics()
    rows[20]["kl"] = 0.4
    assert rules_fired(metrics=rows) == {"kl_spikes"}
    rows[20]["kl"] = 0.03  # three times the median, under the spike factor
    assert rules_fired(metrics=rows) == set()


def test_groups_without_signal():
    rows = healthy_metrics()
    for r in rows[20:]:
        r["frac_reward_zero_std"] = 0.8
    assert rules_fired(metrics=rows) == {"no_signal"}


def test_groups_without_signal_suggest_dynamic_sampling_or_read_its_generated_share():
    rows = healthy_metrics()
    for r in rows[20:]:
        r["signal/zero_spread"] = 0.8
    (finding,) = advisor.advise(metrics=rows, devices=busy_devices(), rollout=full_rollout(), recipe=RECIPE)
    assert "rollout.dynamic_sampling: true" in finding.suggestion
    # under dynamic sampling the trained batch is refilled (0 without signal): the generated share tells
    for r in rows:
        r["signal/zero_spread"], r["dynamic/unfilled"] = 0.0, 0.25
        r["dynamic/zero_spread_generated"], r["dynamic/prompts_per_kept"] = 0.2, 1.2
    assert rules_fired(metrics=rows) == set()
    for r in rows[20:]:
        r["dynamic/zero_spread_generated"], r["dynamic/prompts_per_kept"] = 0.85, 3.0
    (finding,) = advisor.advise(metrics=rows, devices=busy_devices(), rollout=full_rollout(), recipe=RECIPE)
    assert finding.rule == "no_signal" and "85% of the generated groups" in finding.evidence
    assert "3 prompts per prompt trained" in finding.evidence and "25% of the batch's groups" in finding.evidence
    assert "rollout.refill_cap" in finding.suggestion and "dynamic_sampling: true" not in finding.suggestion


def test_groups_without_signal_are_counted_by_the_workbench_not_trls_float32_check(tmp_path):
    """Groups whose completions all scored 0.2 (format only) or 1.2 (right and formatted): TRL's own computation
    (its nanstd on the float32 weighted sum, then isclose to 0 at 1e-8) calls neither flat, so its
    frac_reward_zero_std logs 0 while no group carries a gradient. The workbench's count (signal/zero_spread)
    sees both, and the advisor, the dashboard's summary and the figure read it."""
    import numpy as np
    import torch
    from trl.trainer.utils import nanstd

    from workbench.observe import views
    from workbench.training.groups import group_signal

    weights = [1.0, 0.2, 0.1]  # correctness, format, short: the demo's weights
    rewards = np.zeros((16, 3), dtype=np.float32)
    rewards[:, 1] = 1.0        # every completion well formatted: 0.2
    rewards[8:, 0] = 1.0       # the second prompt's completions all right: 1.2
    totals = (torch.tensor(rewards) * torch.tensor(weights)).nansum(dim=1)
    std = nanstd(totals.view(-1, 8), dim=1)
    assert not torch.isclose(std, torch.zeros_like(std)).any()  # TRL's check: "spread" in both groups
    signal = group_signal(rewards, weights, 8)
    assert signal == {"signal/zero_spread": 1.0, "signal/zero_spread_top": 0.5}
    rewards[3, 0] = 1.0        # one right answer in the first group: that group has signal
    assert group_signal(rewards, weights, 8)["signal/zero_spread"] == 0.5
    assert group_signal(rewards, weights, 8, "normalize_then_sum")["signal/zero_spread"] == 0.5

    rows = healthy_metrics()
    for r in rows[20:]:        # what such a run logs: TRL's count at 0, the workbench's at 0.9
        r["frac_reward_zero_std"], r["signal/zero_spread"], r["signal/zero_spread_top"] = 0.0, 0.9, 0.2
    for r in rows[:20]:
        r["signal/zero_spread"] = 0.1
    assert rules_fired(metrics=rows) == {"no_signal"}
    finding = next(f for f in advisor.advise(metrics=rows, devices=busy_devices(), rollout=full_rollout(),
                                             recipe=RECIPE))
    assert "90%" in finding.evidence and "signal/zero_spread" in finding.evidence
    assert "80% of them are all below the batch's best reward" in finding.suggestion
    from workbench.rundir import TrainDir

    train = TrainDir(tmp_path / "train").make()
    for r in rows:
        append_jsonl(train.metrics, r)
    summary = dict(views.summary_rows(rundata.load(train)))
    assert summary["groups with no signal (first → last fifth)"] == "0.1 → 0.9"


def test_reward_collapse_and_flat_reward():
    rows = healthy_metrics()
    for i, r in enumerate(rows):
        r["reward"] = 0.6 - 0.5 * (i / len(rows)) ** 2 if i > 5 else 0.6  # peaks early, then falls
    assert rules_fired(metrics=rows) == {"reward_drop"}
    flat = healthy_metrics()
    for r in flat:
        r["reward"], r["reward_std"] = 0.3, 0.3
    assert rules_fired(metrics=flat) == {"reward_flat"}


def test_weight_sync_share():
    rows = healthy_metrics()
    for r in rows:
        r["time/weight_sync"], r["time/optimisation"] = 0.3, 0.28
    assert rules_fired(metrics=rows) == {"sync_share"}


def test_rules_say_nothing_without_their_data():
    assert advisor.advise(metrics=[], devices=[], rollout=[]) == []


def test_training_figure_from_a_run_directory(tmp_path):
    for row in healthy_metrics():
        append_jsonl(tmp_path / "metrics.jsonl", row)
    for row in busy_devices():
        append_jsonl(tmp_path / "devices.jsonl", row)
    for row in full_rollout():
        append_jsonl(tmp_path / "rollout.jsonl", row)
    data = rundata.load(tmp_path)
    fig = figures.training_figure(data)
    drawn = [ax for ax in fig.axes if ax.lines or ax.collections]
    assert len(drawn) >= 9  # every panel has a curve (plus twin axes)
    titles = {ax.get_title() for ax in fig.axes}
    assert {"reward (mean per completion)", "step time breakdown (s/step)", "device utilization per role (%)",
            "server requests in flight"} <= titles
    png = plots.png_bytes(fig)
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


@pytest.mark.parametrize("missing", ["metrics", "devices", "rollout"])
def test_figure_survives_missing_records(tmp_path, missing):
    for name, rows in (("metrics", healthy_metrics()), ("devices", busy_devices()), ("rollout", full_rollout())):
        if name != missing:
            for row in rows:
                append_jsonl(tmp_path / f"{name}.jsonl", row)
    assert plots.png_bytes(figures.training_figure(rundata.load(tmp_path))).startswith(b"\x89PNG")


def _canary(gaps, level="ok"):
    return [{"step": i, "gap_mean": g, "gap_max": g, "level": level if g > 1e-3 else "ok", "reason": "scheduled"}
            for i, g in enumerate(gaps)]


def test_weight_drift_alarms_and_rising_gap():
    assert advisor.weight_drift(advisor.RunRecords([], [], [], RECIPE, canary=_canary([2e-6] * 9))) is None
    alarm = advisor.weight_drift(advisor.RunRecords([], [], [], RECIPE, canary=_canary([2e-6, 2e-6, 0.05], "stop")))
    assert alarm.severity == "warning" and "step 2" in alarm.evidence
    rising = advisor.weight_drift(advisor.RunRecords([], [], [], RECIPE, canary=_canary([1e-6] * 3 + [5e-5] * 3)))
    assert rising.severity == "info" and "rising" in rising.title


def test_a_sampler_that_drifts_without_the_canary():
    """TRL's own sampler-trainer gap rising through a run, or pushes that moved no bytes, are findings even with
    no canary record (canary off, or a run from before it); a steady gap at the exact-sync level is not."""
    rows = healthy_metrics()
    for i, r in enumerate(rows):
        r["sampling/sampling_logp_difference/mean"] = 2e-4
        r["sync/count"], r["sync/megabytes"] = 5.0, 0.52
    assert advisor.sampler_drift(advisor.RunRecords(rows, [], [], RECIPE)) is None
    for i, r in enumerate(rows):
        r["sampling/sampling_logp_difference/mean"] = 2e-4 if i < 10 else 2e-4 * 2 ** (i - 9)
    rising = advisor.sampler_drift(advisor.RunRecords(rows, [], [], RECIPE))
    assert rising.severity == "warning" and "sampler − trainer gap 0.0002 →" in rising.evidence
    assert rules_fired(metrics=rows) == {"sampler_drift"}
    for r in rows:
        r["sampling/sampling_logp_difference/mean"] = 2e-4
    rows[12]["sync/megabytes"] = 0.0
    empty = advisor.sampler_drift(advisor.RunRecords(rows, [], [], RECIPE))
    assert "moved no bytes" in empty.title and f"steps [{rows[12]['step']}]" in empty.evidence
    unsynced = {**RECIPE, "server": {"weight_sync": "none"}}
    assert advisor.sampler_drift(advisor.RunRecords(rows, [], [], unsynced)) is None


def test_server_faults_are_a_finding():
    events = [{"kind": "server_fault", "message": "generation failed at step 3: ConnectionError"},
              {"kind": "server_restart", "message": "server restarted"}]
    finding = advisor.server_faults(advisor.RunRecords([], [], [], RECIPE, events=events))
    assert "1 fault(s), 1 restart(s)" in finding.evidence
    assert advisor.server_faults(advisor.RunRecords([], [], [], RECIPE)) is None


def test_memory_growth_per_role():
    def samples(role, start, growth):
        return [{"time": 1000.0 + 60 * i, "role": role, "kind": "cpu", "device": "cpu0",
                 "mem_used_mb": start + growth * i / 99} for i in range(100)]
    flat = samples("server", 3000, 20) + samples("trainer", 800, 5)
    assert advisor.memory_growth(advisor.RunRecords([], flat, [], RECIPE)) is None
    grows = samples("server", 3000, 20) + samples("trainer", 800, 900)
    finding = advisor.memory_growth(advisor.RunRecords([], grows, [], RECIPE))
    assert finding is not None and finding.evidence.startswith("trainer 8") and "server" not in finding.evidence
    trend = advisor.memory_trend(grows)["trainer"]
    assert trend["slope_mb_per_hour"] == pytest.approx(900 / (99 / 60), rel=0.01)


LEARNED_RECIPE = {**RECIPE, "rewards": {"correctness": 0.0, "format": 0.2,
                                        "preference": {"kind": "model", "model": "tiny-rm", "score": "logit"}}}


def _learned_metrics(verified_rises: bool, with_verified: bool = True) -> list[dict]:
    rows = healthy_metrics()
    for i, row in enumerate(rows):
        row["rewards/preference/mean"] = 0.2 + 0.02 * i  # the learned reward climbs all run
        if not with_verified:
            del row["rewards/correctness/mean"]
        elif not verified_rises:
            row["rewards/correctness/mean"] = 0.40 + (0.01 if i % 2 else -0.01)  # flat around 0.4
    return rows


def test_a_learned_reward_rising_while_the_verified_accuracy_stays_flat_is_reward_hacking():
    found = {f.rule: f for f in advisor.advise(metrics=_learned_metrics(False), recipe=LEARNED_RECIPE)}
    hack = found["reward_hacking"]
    assert hack.severity == "warning" and "preference rises, the verified accuracy does not" in hack.title
    assert "rewards/correctness/mean 0.4 -> 0.4" in hack.evidence
    # the same learned reward while the verified accuracy rises with it: no finding
    rules = {f.rule for f in advisor.advise(metrics=_learned_metrics(True), recipe=LEARNED_RECIPE)}
    assert "reward_hacking" not in rules and "reward_unverified" not in rules
    # a rule-only run never gets it, whatever its rewards do
    assert "reward_hacking" not in {f.rule for f in advisor.advise(metrics=_learned_metrics(False), recipe=RECIPE)}


def test_a_learned_reward_without_a_verified_one_beside_it_is_named():
    found = {f.rule: f for f in advisor.advise(metrics=_learned_metrics(False, with_verified=False),
                                               recipe=LEARNED_RECIPE)}
    assert "correctness: 0.0" in found["reward_unverified"].suggestion
