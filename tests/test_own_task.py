"""A researcher's own work: the example of docs/recipes.md run as the page shows it (own model directory, data file
with an extra column, a reward that reads it), and a hub dataset named by id trained on from a local datasets cache,
its extra column reaching the reward."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, free_port

ROWS = [{"problem": f"What is {a} + {b}?", "solution": str(a + b), "tolerance": 5 + a % 3}
        for a, b in ((12, 30), (41, 17), (25, 25), (63, 14), (50, 38), (19, 22), (34, 45), (27, 61), (70, 11),
                     (16, 53), (44, 44), (38, 29))]


def _page_block() -> str:
    page = (REPO / "docs" / "recipes.md").read_text()
    found = re.search(r"<!-- own-task:begin -->\n```bash\n(.*?)```\n<!-- own-task:end -->", page, re.S)
    assert found, "docs/recipes.md lost its own-task block"
    return found.group(1)


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("WORKBENCH_PLATFORM", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


@pytest.mark.heavy
@pytest.mark.timeout(420)
def test_the_own_task_page_runs_as_it_stands(tmp_path, tiny_model_dir):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    port = free_port()
    # the page's lines, with one change: the servers take a port of the suite's, so that a test beside this one
    # that serves on the default port cannot answer in their place
    lines = [line + (f" server.port={port}" if line.startswith(("workbench train", "workbench eval")) else "")
             for line in _page_block().splitlines()]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    shown = [line for line in out.stdout.splitlines() if line.startswith("# data")]
    assert shown[0].startswith("# data.train: train part of file") and "own-task/train.jsonl" in shown[0]
    assert "validation part of file" in shown[1] and shown[2].endswith("own-task/test.jsonl"), shown
    run = tmp_path / "runs" / "own-task"
    metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    near = [m["rewards/near_miss/mean"] for m in metrics if "rewards/near_miss/mean" in m]
    assert len(near) == 3 and all(0.0 <= v <= 1.0 for v in near)  # the reward read `tolerance` at every step
    assert (run / "train" / "final" / "config.json").is_file()
    # the evaluation scored both models on the whole test file, and nothing of the training split
    summary = json.loads(next(tmp_path.glob("runs/*/eval/summary.json")).read_text())
    scored = {s["model"]: s["n"] for s in summary}
    assert scored == {"base": 12, "trained": 12}, scored


def _hub_cache(root: Path) -> Path:
    """A datasets cache holding `lab/units` as `datasets.load_dataset` leaves one on a machine that reached the hub
    (namespace___name/config/version/revision/, arrow files written by datasets' own builder): what one copies onto
    a node without internet."""
    from datasets.packaged_modules.json.json import Json

    src = root / "src"
    src.mkdir(parents=True)
    for split, rows in (("train", ROWS[:8]), ("test", ROWS[8:])):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = root / "datasets"
    builder = Json(data_files={s: str(src / f"{s}.jsonl") for s in ("train", "test")}, dataset_name="units",
                   config_name="default", cache_dir=str(cache))
    builder.download_and_prepare()
    target = cache / "lab___units" / "default" / "0.0.0" / ("0" * 40)
    target.mkdir(parents=True)
    for f in Path(builder.cache_dir).iterdir():
        if f.suffix in (".arrow", ".json"):
            shutil.move(str(f), target / f.name)
    shutil.rmtree(cache / "units")
    return cache


SEEN = '''
import json, os

def seen(prompts, completions, tolerance, **kwargs):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps(list(tolerance)) + "\\n")
    return [0.0 for _ in completions]
'''


@pytest.mark.heavy  # a training (TRL's own generate, no server): ~90 s on two cores
@pytest.mark.timeout(360)
def test_a_hub_dataset_by_id_trains_from_the_local_cache(tmp_path, workbench_cmd, tiny_model_dir):
    cache = _hub_cache(tmp_path / "hf")
    (tmp_path / "seen_reward.py").write_text(SEEN)
    seen = tmp_path / "seen.jsonl"
    out = subprocess.run(
        [*workbench_cmd, "train", "--recipe", "smoke", "--run-dir", str(tmp_path / "run"), "data.name=file",
         "data.train={hub: lab/units, split: train}", "data.test={hub: lab/units, split: test}",
         "data.fields={question: problem, answer: solution}", "data.validation_size=2", "data.train_size=null",
         "server.mode=off", "trainer.max_steps=2", "eval.num_samples=4",
         f"rewards={{correctness: 1.0, seen: {{function: {tmp_path}/seen_reward.py:seen, weight: 0.1}}}}"],
        cwd=tmp_path, env=_env(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(cache), HF_HOME=str(tmp_path / "hf"),
                               SEEN_FILE=str(seen)),
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    # the preflight's probe and both steps handed the reward the cached dataset's own column, row by row
    assert len(calls) >= 3 and all(v in {r["tolerance"] for r in ROWS[:8]} for call in calls for v in call)
    assert (tmp_path / "run" / "train" / "final" / "config.json").is_file()
