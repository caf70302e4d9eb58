"""The dashboard's parts outside a notebook: the Stop button, the refresh from a growing run directory, ETA."""
from __future__ import annotations

from test_advisor import busy_devices, full_rollout, healthy_metrics

from workbench.observe.dashboard import Dashboard
from workbench.observe.rundata import RunData
from workbench.observe.views import summary_rows
from workbench.records import append_jsonl
from workbench.rundir import RunDir, TrainDir, write_atomic


def _run_dir(tmp_path, rows) -> TrainDir:
    """A `workbench train` run: recipe.yaml at the run's root, the training's records in RUN/train/."""
    run = RunDir(tmp_path)
    write_atomic(run.recipe, "trainer:\n  max_steps: 200\n")
    train = run.train.make()
    for row in rows:
        append_jsonl(train.metrics, row)
    for row in busy_devices():
        append_jsonl(train.devices, row)
    for row in full_rollout():
        append_jsonl(train.rollout, row)
    return train


def test_stop_button_writes_the_flag_the_trainer_checks(tmp_path):
    train = _run_dir(tmp_path, healthy_metrics(5))
    dash = Dashboard(train)
    dash._build()
    assert not train.stop_flag.exists()
    dash.stop_button.click()
    assert train.stop_flag.exists() and dash.stop_button.disabled


def test_refresh_follows_a_growing_run_with_progress_and_eta(tmp_path):
    rows = healthy_metrics(30)
    train = _run_dir(tmp_path, rows[:10])
    dash = Dashboard(train)
    dash._build()
    dash._update()
    assert dash.progress.value == 50 and dash.progress.max == 200  # logging every 5 steps: step 50 of 200
    assert "ETA 2m" in dash.status.value  # 150 steps left at about 1 s each
    first = dash.curves.outputs
    assert first and "image/png" in first[0]["data"]
    for row in rows[10:]:
        append_jsonl(train.metrics, row)
    dash._update()
    assert dash.progress.value == 150
    assert "Advisor" in dash.advice.value


def test_summary_rows_name_the_step_time_phases(tmp_path):
    data = RunData(_run_dir(tmp_path, healthy_metrics(30)))
    data.refresh()
    rows = dict(summary_rows(data))
    assert rows["steps"] == "150 / 200"
    assert float(rows["step time (s)"]) > float(rows["  optimisation"]) > float(rows["  waiting for rollouts"])
    assert "→" in rows["reward (first → last fifth)"]
