"""Run comparison (workbench/observe/compare.py, `workbench compare`, `workbench tag`, notebook 07_compare).

The acceptance test: two real short trainings (`workbench train --recipe smoke`: the session's `smoke_run`, with a
reward of the user's own and the user's tracker, attached to the session's server, and its `killed_run`, 14 steps at
a higher learning rate on a server of its own, through a server crash, a hang, a kill and a resume), compared: the differing recipe keys are exactly the ones their command lines changed, both runs'
curves are there, the CLI writes its files, tags label the runs, and the notebook runs through papermill. The first
tests use small hand-made run directories and need no training.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import CURVE_SAMPLES, REPO, SERVER_KEY_ENV, workbench_command
from workbench.errors import WorkbenchError
from workbench.observe import compare, figures
from workbench.rundir import RunDir

PNG = b"\x89PNG\r\n\x1a\n"
# what the two real runs' command lines set differently (conftest's SMOKE_RUN and killed_run), as compare flattens it
CHANGED = {"trainer.report_to": ("tensorboard", "none"), "trainer.learning_rate": (5e-5, 3e-3),
           "trainer.max_steps": (3, 14), "trainer.save_steps": (3, 4), "monitor.canary_every": (10, 1),
           "server.request_timeout_s": (600.0, 10.0),
           "monitor.groups_per_step": (8, 16), "monitor.sample_interval_s": (1.0, 0.25),
           "rewards.short.function": ("lab_rewards:brevity", compare.ABSENT), "rewards.short.weight": (0.1, compare.ABSENT),
           "rewards.short.args.limit": (60, compare.ABSENT), "server.mode": ("attach", "managed"),
           "server.url": ("the session server's URL", None),
           # the smoke run trains against the keyed session server, its trainer in a child process (devices.env)
           "server.api_key_env": (SERVER_KEY_ENV, None), "devices.env.WORKBENCH_TEST_ROLE": ("trainer", compare.ABSENT),
           "devices.env": (compare.ABSENT, {}),  # the other run's empty section is a value of its own when flattened
           # the smoke run draws the learning curve at every push (tests/test_evalcurve.py)
           "eval.every_steps": (1, 0), "eval.during_samples": (CURVE_SAMPLES, 100), "eval.keep_best": (True, False)}


# ----------------------------------------------------------------------------------------------------------------
# Hand-made runs: the analysis without a training

def fake_run(path, recipe: dict, rewards: list[float], stage: str = "train"):
    """A run directory with a recipe and a metrics.jsonl of len(rewards) steps (what compare reads)."""
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (path / stage).mkdir()
    lines = [{"step": i + 1, "time": 1000.0 + i, "loss": 0.1, "reward": r, "time/step": 1.0 + i,
              "time/generation": 0.5, "time/optimisation": 0.4} for i, r in enumerate(rewards)]
    lines.append({"step": len(rewards), "time": 2000.0, "train_runtime": 5.0})  # the end-of-training line: no loss
    (path / stage / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def recipe(lr: float, port: int, runs_dir: str, **extra) -> dict:
    return {"name": "r", "description": f"lr {lr}", "server": {"port": port, "env": {}},
            "trainer": {"learning_rate": lr, "beta": 0.0, **extra}, "monitor": {"runs_dir": runs_dir},
            "eval": {"stop": []}}


def test_differing_keys_leave_out_ports_and_paths_and_show_absent_keys(tmp_path):
    a = fake_run(tmp_path / "a", recipe(5e-5, 8000, "runs"), [0.1, 0.2, 0.3])
    b = fake_run(tmp_path / "b", recipe(1e-4, 8123, "/elsewhere", warmup_steps=15), [0.2, 0.4])
    runs = compare.load_runs([a, b])
    keys = compare.differing_keys(runs)
    assert list(keys.index) == ["trainer.learning_rate", "trainer.warmup_steps"]
    assert list(keys.columns) == ["a", "b"]
    assert keys.loc["trainer.learning_rate"].tolist() == [5e-5, 1e-4]
    assert keys.loc["trainer.warmup_steps"].tolist() == [compare.ABSENT, 15]  # a recipe from before the key
    everything = compare.differing_keys(runs, ignore=())
    assert set(everything.index) == {"trainer.learning_rate", "trainer.warmup_steps", "server.port",
                                     "monitor.runs_dir", "description"}
    # empty sections and lists are values, equal in both runs: not differing
    assert runs.recipes.loc["server.env", "a"] == {} and runs.recipes.loc["eval.stop", "b"] == []


def test_frames_outcomes_and_labels_from_hand_made_runs(tmp_path):
    a = fake_run(tmp_path / "a", recipe(5e-5, 8000, "runs"), [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    b = fake_run(tmp_path / "b", recipe(5e-5, 8000, "runs"), [0.5], stage="smoke")  # a run with only a smoke stage
    compare.write_tag(b, "  only   smoke ", note="the smoke stage alone")
    runs = compare.load_runs([a, b, a])
    assert runs.labels == ["a", "only smoke", "a (2)"]  # tag (whitespace collapsed), directory name, made unique
    assert runs.metrics.groupby("run").size().to_dict() == {"a": 10, "only smoke": 1, "a (2)": 10}
    assert list(runs.metrics.columns[:3]) == ["run", "step", "time"]
    out = compare.outcomes(runs)
    assert out.loc["a", "reward_first"] == pytest.approx(0.05) and out.loc["a", "reward_last"] == pytest.approx(0.85)
    assert out.loc["a", "steps"] == 10 and out.loc["a", "step_seconds"] == pytest.approx(5.5)
    # runs from before the rollout wait was split from the generation: the generation is the wait
    assert runs.step_times.loc["a", "time/rollout_wait"] == pytest.approx(0.5)
    assert compare.differing_keys(runs).empty
    assert "The recipes are the same" in compare.markdown(runs)
    with pytest.raises(WorkbenchError, match="the tag name is empty"):
        compare.write_tag(a, " \n ")
    with pytest.raises(WorkbenchError, match="65 characters"):
        compare.write_tag(a, "x" * 65)
    (a / "eval").mkdir()
    with pytest.raises(WorkbenchError, match="is the 'eval' stage of the run"):
        compare.load_runs([a / "eval"])
    with pytest.raises(WorkbenchError, match="is the 'train' stage of the run"):
        compare.write_tag(a / "train", "x")  # the tag belongs to the run
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkbenchError, match="is not a run directory"):
        compare.load_runs([tmp_path / "empty"])
    with pytest.raises(WorkbenchError, match="no run directory"):
        compare.load_runs([tmp_path / "missing"])


def test_choosing_runs_newest_glob_and_missing(tmp_path):
    for i, name in enumerate(["20260101-000000-r-train", "20260102-000000-r-train", "20260103-000000-r-train"]):
        fake_run(tmp_path / name, recipe(5e-5, 8000, "runs"), [0.1])
        os.utime(tmp_path / name / "recipe.yaml", (1000 + i, 1000 + i))
    (tmp_path / "20260104-000000-r-compare").mkdir()  # a comparison's own directory: no training, never chosen
    (tmp_path / "20260104-000000-r-compare" / "recipe.yaml").write_text("name: r\n")
    assert [p.name for p in compare.select([], tmp_path, newest=2)] == ["20260102-000000-r-train",
                                                                       "20260103-000000-r-train"]
    assert len(compare.select([str(tmp_path / "2026010[12]*")], tmp_path)) == 2
    assert len(compare.select(f"{tmp_path}/20260101-000000-r-train {tmp_path}/20260103-000000-r-train", tmp_path)) == 2
    assert len(compare.select(f'["{tmp_path}/20260101-000000-r-train", "{tmp_path}/2026010[23]*"]', tmp_path)) == 3
    with pytest.raises(WorkbenchError, match="no run directory matches"):
        compare.select([str(tmp_path / "1999*")], tmp_path)
    with pytest.raises(WorkbenchError, match="no trained run under"):
        compare.select([], tmp_path / "20260104-000000-r-compare")


def test_evaluation_frame_and_the_gain(tmp_path):
    from workbench.evaluation.evaluate import Evaluation, Summary

    a = fake_run(tmp_path / "a", recipe(5e-5, 8000, "runs"), [0.1, 0.2])
    Evaluation([Summary("base", "", 300, 1, [0.5], 0.5), Summary("trained", "", 300, 1, [0.6], 0.6)]).save(
        RunDir(a).eval)
    b = fake_run(tmp_path / "b", recipe(1e-4, 8000, "runs"), [0.1, 0.3])
    runs = compare.load_runs([a, b])
    ev = runs.evaluation
    assert ev[["run", "model"]].values.tolist() == [["a", "base"], ["a", "trained"]]
    assert ev["gain"].isna().tolist() == [True, False] and ev["gain"].iloc[1] == pytest.approx(0.1)
    out = compare.outcomes(runs)
    assert out.loc["a", ["accuracy_before", "accuracy_after"]].tolist() == [0.5, 0.6]
    assert out.loc["a", "gain"] == pytest.approx(0.1) and out["gain"].isna().tolist() == [False, True]
    text = compare.markdown(runs)
    assert "+10.0 pts" in text and "60.0%" in text


# ----------------------------------------------------------------------------------------------------------------
# Two real short trainings

@pytest.fixture(scope="module")
def pair(smoke_run, killed_run, tmp_path_factory):
    """Copies of the two runs without their model weights (tags written by the tests stay off the originals)."""
    root = tmp_path_factory.mktemp("pair")
    skip = shutil.ignore_patterns("final", "checkpoints*")
    return tuple(shutil.copytree(run.path, root / run.path.name, ignore=skip) for run in (smoke_run[0], killed_run.run))


def test_two_real_runs_differ_in_exactly_the_changed_keys(pair, smoke_run):
    runs = compare.load_runs(pair)
    keys = compare.differing_keys(runs)
    assert set(keys.index) == set(CHANGED)
    assert list(keys.columns) == [p.name for p in pair] == runs.labels
    for key, values in {**CHANGED, "server.url": (smoke_run[1], None)}.items():
        assert tuple(keys.loc[key]) == values, key
    # what was left out really differs: the two trainings ran on different ports, into different runs directories
    assert {"server.port", "monitor.runs_dir"} <= set(compare.differing_keys(runs, ignore=()).index)


def test_two_real_runs_curves_and_outcomes(pair, tmp_path):
    runs = compare.load_runs(pair)
    a, b = runs.labels
    metrics = runs.metrics
    assert {label: sorted(metrics.loc[metrics["run"] == label, "step"]) for label in runs.labels} == \
        {a: [1, 2, 3], b: list(range(1, 15))}
    assert metrics[["reward", "kl", "loss", "completions/mean_length", "time/step"]].notna().all().all()

    fig = compare.curves_figure(runs, "reward,kl,length,step_time", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == [compare.TITLES[k] for k in
                                                 ("reward", "kl", "completions/mean_length", "time/step")]
    for ax, key in zip(panels, ("reward", "kl", "completions/mean_length", "time/step")):
        assert [line.get_label() for line in ax.lines] == [a, b]  # one line per run in every panel
        for line, label in zip(ax.lines, (a, b)):
            assert list(line.get_ydata()) == metrics.loc[metrics["run"] == label, key].tolist()

    out = compare.outcomes(runs)
    assert list(out.index) == [a, b] and out["steps"].tolist() == [3, 14]
    assert (out["train_seconds"] > 0).all() and (out["step_seconds"] > 0).all()
    assert out["reward_last"].notna().all()
    assert out["accuracy_before"].isna().all()  # `workbench train` alone does not evaluate
    steps = runs.step_times
    assert list(steps.columns) == ["time/step"] + [key for key, _ in figures.PHASES]
    assert (steps["time/step"] > 0).all() and (steps["time/rollout_wait"] > 0).all()

    # a training directory itself is a run too
    direct = compare.load_runs([pair[0] / "train", pair[1]])
    assert direct.labels == [f"{pair[0].name}/train", pair[1].name]
    assert set(compare.differing_keys(direct).index) == set(CHANGED)
    with pytest.raises(WorkbenchError, match="which no compared run logged"):
        compare.curves_figure(runs, "rewrd")


def test_cli_tag_and_compare_write_their_files(pair, tmp_path):
    a, b = (shutil.copytree(p, tmp_path / p.name) for p in pair)
    cmd = workbench_command()
    tagged = subprocess.run([*cmd, "tag", str(b), "lr-high", "--note", "learning rate 3e-3, 14 steps"],
                            capture_output=True, text=True, timeout=120)
    assert tagged.returncode == 0, tagged.stderr
    assert json.loads(RunDir(b).tag.read_text())["name"] == "lr-high"

    out = subprocess.run([*cmd, "compare", str(a), str(b), "--out", str(tmp_path / "cmp")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for text in ("lr-high", a.name, "learning rate 3e-3, 14 steps", "| trainer.learning_rate |",
                 "| trainer.max_steps | 3 | 14 |", "→ steps", "→ step_seconds"):
        assert text in out.stdout, (text, out.stdout)
    assert "server.port |" not in out.stdout and "monitor.runs_dir |" not in out.stdout
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["label"] for r in saved["runs"]] == [a.name, "lr-high"]
    assert set(saved["differing_keys"]) == set(CHANGED)
    assert saved["differing_keys"]["trainer.max_steps"] == {a.name: 3, "lr-high": 14}
    assert [o["steps"] for o in saved["outcomes"]] == [3, 14]
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:8] == PNG
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "**lr-high**" in table and "| trainer.learning_rate |" in table and "![curves](compare.png)" in table


def test_compare_without_out_is_light_and_writes_beside_the_runs(pair, tmp_path):
    """No --out: a new <stamp>-compare/ beside the first run; and the command imports no torch, TRL or vLLM."""
    a, b = (shutil.copytree(p, tmp_path / p.name) for p in pair)
    probe = ("import sys\nfrom workbench.cli import main\ncode = main(sys.argv[1:])\n"
             "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers', 'vllm', 'trl') if m in sys.modules))\n"
             "sys.exit(code)\n")
    out = subprocess.run([sys.executable, "-c", probe, "compare", str(a), str(b)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stdout
    (made,) = [p for p in tmp_path.iterdir() if p.name.endswith("-compare")]
    assert sorted(p.name for p in made.iterdir()) == ["compare.json", "compare.md", "compare.png"]


def test_notebook_compares_the_newest_runs(pair, tmp_path):
    """notebooks/07_compare.ipynb under papermill, with no runs named: the two newest trained runs of the recipe's
    runs directory; its own output directory (made there) is not taken for a run."""
    import papermill

    from workbench import paths
    from workbench.notebook import kernel_name

    root = tmp_path / "runs"
    root.mkdir()
    for p in pair:
        shutil.copytree(p, root / p.name)
    out = tmp_path / "07_compare.ipynb"
    papermill.execute_notebook(str(paths.notebooks_dir() / "07_compare.ipynb"), str(out), kernel_name=kernel_name(),
                               parameters={"recipe": "smoke", "overrides": [f"monitor.runs_dir={root}"],
                                           "metrics": "reward,kl"},
                               cwd=str(tmp_path), progress_bar=False)
    (made,) = [p for p in root.iterdir() if p.name.endswith("-compare")]
    saved = json.loads((made / "compare.json").read_text())
    assert [r["label"] for r in saved["runs"]] == [p.name for p in pair]
    assert set(saved["differing_keys"]) == set(CHANGED) and saved["metrics"] == ["reward", "kl"]
    nb = json.loads(out.read_text())
    shown = json.dumps([o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])])
    assert "trainer.learning_rate" in shown and "image/png" in shown and "logged steps" in shown
