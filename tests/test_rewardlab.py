"""The reward lab: candidate rewards scored on a real run's logged completions (conftest's `grouped_run`) and on a
fresh offline generation, with the hack warnings: a reward that pays for length is flagged, correctness is not;
a reward that rises while correctness stays flat, a constant one and one without spread are flagged on built
records."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from workbench.errors import WorkbenchError
from workbench.experiments import rewardlab


@pytest.fixture
def in_project(grouped_run, monkeypatch):
    monkeypatch.chdir(grouped_run.path.parent.parent)  # where lab_rewards.py lives: the user's project
    return grouped_run


def test_a_length_paying_reward_is_flagged_on_logged_completions(in_project):
    from workbench import recipe

    samples = rewardlab.from_run(in_project.train)
    assert len(samples) == 3 * 8 and samples["length"].gt(0).all()
    r = recipe.load(in_project.recipe)
    lab = rewardlab.score(samples, {"correctness": 1.0, "format": 0.2,
                                    "wordy": {"function": "lab_rewards:wordy", "args": {"per_char": 0.02}}}, r)
    table = lab.table()
    assert list(table.index) == ["correctness", "format", "wordy"]
    # gold answers came from the recipe's rows: the lab's correctness is the run's own
    record = pd.read_parquet(sorted(in_project.train.groups.glob("*.parquet"))[0])
    first = lab.scores[lab.scores["step"] == 1]["correctness"].tolist()
    assert first == pytest.approx(record["reward/correctness"].tolist())
    assert table.loc["wordy", "corr_length"] > 0.7
    assert any(w.startswith("wordy: follows completion length") for w in lab.warnings), lab.warnings
    assert not any(w.startswith("correctness:") for w in lab.warnings)
    assert lab.scores["wordy"].tolist() == pytest.approx([0.02 * len(c) for c in lab.scores["completion"]])
    fig = lab.figure(in_project.path / "lab.png")
    assert (in_project.path / "lab.png").stat().st_size > 1000 and len(fig.axes) == 3


def test_bad_specs_are_refused_before_scoring(in_project):
    samples = rewardlab.from_run(in_project.train)
    with pytest.raises(WorkbenchError, match="cannot import module 'nope'"):
        rewardlab.score(samples, {"nope:fn": 1.0})


def _record(steps: int = 9, size: int = 4) -> pd.DataFrame:
    rows = []
    for step in range(1, steps + 1):
        for g in range(2):
            for m in range(size):
                # the same answers (every other one right) all along; only the way they are written changes
                value = g + m + (m % 2)
                text = f"<answer>{value}</answer>" if step > steps // 2 else f"#### {value}"
                rows.append({"step": step, "group": g, "prompt": f"What is {g} + {m}?", "answer": str(g + m),
                             "completion": text, "length": 5 + m})
    return pd.DataFrame(rows)


def test_a_reward_learnt_instead_of_the_task_is_flagged():
    lab = rewardlab.score(_record(), {"correctness": 1.0, "format": 0.2})
    by_step = lab.by_step()
    assert by_step["format"].iloc[-1] == 1.0 and by_step["format"].iloc[0] == 0.0
    assert by_step["correct"].nunique() == 1  # correctness flat at 0.5
    assert any(w.startswith("format: rose by") for w in lab.warnings), lab.warnings


def test_constant_and_signal_free_rewards_are_flagged(tmp_path, monkeypatch):
    (tmp_path / "flat.py").write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    lab = rewardlab.score(_record(), {"correctness": 1.0, "flat:one": 1.0})
    assert any(w.startswith("one: the same score for every completion") for w in lab.warnings)
    assert lab.table().loc["one", "zero_spread_groups"] == 1.0
    assert math.isnan(lab.table().loc["one", "corr_length"])


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_fresh_offline_generation_is_scored(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    # in its own process: the in-process engine binds its process's threads to the server's cores
    out = tmp_path / "samples.parquet"
    code = ("from workbench import recipe; from workbench.experiments import rewardlab; "
            "rr = recipe.resolve(recipe.load('cpu-tiny')); "
            f"rewardlab.sample(rr, num_prompts=3, num_generations=4, log=lambda *_: None).to_parquet({str(out)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = pd.read_parquet(out)
    assert len(samples) == 12 and samples.groupby("group").size().eq(4).all()
    assert samples["completion"].nunique() > 3  # sampled at the training temperature, not greedy copies
    lab = rewardlab.score(samples, {"correctness": 1.0, "format": 0.2})
    assert lab.scores["correctness"].notna().all()  # the gold answers came with the samples
    assert set(lab.table().columns) >= {"mean", "zero_spread_groups", "corr_correct", "corr_length"}


def test_reward_lab_notebook_scores_a_runs_completions(in_project, tmp_path):
    """The tool notebook under papermill, in the user's project (its rewards module importable), on the run."""
    import json

    import papermill
    from test_notebooks import NOTEBOOK_DIR, kernel, outputs_of, text_of

    out = tmp_path / "08.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK_DIR / "08_reward_lab.ipynb"), str(out), kernel_name=kernel(), progress_bar=False,
        parameters={"recipe": str(in_project.recipe), "source": str(in_project.path), "run_dir": str(tmp_path / "lab"),
                    "rewards": {"correctness": 1.0, "lab_rewards:wordy": 0.1}},
        cwd=str(in_project.path.parent.parent))
    saved = json.loads((tmp_path / "lab" / "lab" / "lab.json").read_text())
    assert saved["rewards"] == ["correctness", "wordy"] and saved["completions"] == 24
    assert any(w.startswith("wordy: follows completion length") for w in saved["warnings"])
    markdown = text_of(outputs_of(out), "text/markdown")
    assert "| wordy |" in markdown and "**warning** wordy" in markdown
    assert "**wordy** against correctness" in markdown  # where each reward and the rule disagree most
