"""The dashboard's parts outside a notebook: the Stop button, the refresh from a growing run directory, ETA."""
from __future__ import annotations

from test_advisor import busy_devices, full_rollout, healthy_metrics
from workbench import live
from workbench.metrics import STOP_FILE, append_jsonl
from workbench.rundir import write_atomic


def _run_dir(tmp_path, rows):
    write_atomic(tmp_path / "recipe.yaml", "trainer:\n  max_steps: 200\n")
    for row in rows:
        append_jsonl(tmp_path / "metrics.jsonl", row)
    for row in busy_devices():
        append_jsonl(tmp_path / "devices.jsonl", row)
    for row in full_rollout():
        append_jsonl(tmp_path / "rollout.jsonl", row)
    return tmp_path


def test_stop_button_writes_the_flag_the_trainer_checks(tmp_path):
    dash = live.Dashboard(_run_dir(tmp_path, healthy_metrics(5)))
    dash._build()
    assert not (tmp_path / STOP_FILE).exists()
    dash.stop_button.click()
    assert (tmp_path / STOP_FILE).exists() and dash.stop_button.disabled


def test_refresh_follows_a_growing_run_with_progress_and_eta(tmp_path):
    rows = healthy_metrics(30)
    dash = live.Dashboard(_run_dir(tmp_path, rows[:10]))
    dash._build()
    dash._update()
    assert dash.progress.value == 50 and dash.progress.max == 200  # logging every 5 steps: step 50 of 200
    assert "ETA 2m" in dash.status.value  # 150 steps left at about 1 s each
    first = dash.curves.outputs
    assert first and "image/png" in first[0]["data"]
    for row in rows[10:]:
        append_jsonl(tmp_path / "metrics.jsonl", row)
    dash._update()
    assert dash.progress.value == 150
    assert "Advisor" in dash.advice.value


def test_summary_rows_name_the_step_time_phases(tmp_path):
    data = live.RunData(_run_dir(tmp_path, healthy_metrics(30)))
    data.refresh()
    rows = dict(live.summary_rows(data))
    assert rows["steps"] == "150 / 200"
    assert float(rows["step time (s)"]) > float(rows["  optimisation"]) > float(rows["  generation"])
    assert "→" in rows["reward (first → last fifth)"]
