"""Notebooks: committed without outputs, and executed for real with papermill on the project's kernel."""
import json
from pathlib import Path

import pytest

from conftest import KEYED
from workbench import paths

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = paths.notebooks_dir()  # package data: workbench/notebooks (the top-level notebooks/ links to it)
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def kernel() -> str:
    from workbench.notebook import kernel_name

    return kernel_name()


def outputs_of(path: Path) -> list[dict]:
    nb = json.loads(Path(path).read_text())
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def text_of(outputs: list[dict], mime: str) -> str:
    out = []
    for o in outputs:
        data = o.get("data", {}).get(mime)
        if data is not None:
            out.append("".join(data) if isinstance(data, list) else data)
        if mime == "text/plain" and o.get("output_type") == "stream":
            out.append("".join(o["text"]) if isinstance(o["text"], list) else o["text"])
    return "\n".join(out)


def test_six_staged_notebooks_and_the_tools():
    from workbench.pipeline import STAGES, TOOLS

    assert [p.stem for p in NOTEBOOKS] == list(STAGES.values()) + list(TOOLS.values())
    # the checkout's notebooks/ is the same files (a link), so `jupyter lab notebooks/` opens what `workbench run` runs
    assert sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")) == [p.name for p in NOTEBOOKS]
    assert (REPO / "notebooks").resolve() == NOTEBOOK_DIR.resolve()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_papermill_sees_every_parameter_with_its_type_and_help(path):
    import papermill

    nb = json.loads(path.read_text())
    (cell,) = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    names = [line.split(":")[0] for line in "".join(cell["source"]).splitlines() if line.strip()]
    inferred = papermill.inspect_notebook(str(path))
    assert list(inferred) == names  # a line papermill cannot parse would be missing here
    assert all(p["inferred_type_name"] not in ("None", "") and p["help"] for p in inferred.values())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_and_with_a_typed_parameters_cell(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    lines = [line for line in "".join(params[0]["source"]).splitlines() if line.strip()]
    assert any(line.startswith("recipe: str = ") for line in lines)
    assert any(line.startswith("overrides: list = ") for line in lines)
    assert any(line.startswith('run_dir: str = ""') for line in lines)  # the run ROOT; empty: a new run
    assert all(":" in line.split("=")[0] and "#" in line for line in lines)  # typed and commented
    assert nb["cells"][0]["cell_type"] == "markdown"
    # one setup call: recipe loaded and resolved, run directory opened, as every entry point does
    source = "".join("".join(c["source"]) for c in code if c is not params[0])
    assert "notebook.setup(recipe, overrides, run_dir" in source


def test_env_check_notebook_runs_under_papermill(tmp_path):
    import papermill

    out = tmp_path / "00_env_check.ipynb"
    papermill.execute_notebook(str(NOTEBOOK_DIR / "00_env_check.ipynb"), str(out), kernel_name=kernel(),
                               parameters={"run_dir": str(tmp_path / "run")}, cwd=str(tmp_path), progress_bar=False)
    nb = json.loads(out.read_text())
    html = [o["data"]["text/html"] for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
            if "text/html" in o.get("data", {})]
    table = "".join("".join(h) if isinstance(h, list) else h for h in html)
    assert "<table>" in table and "gloo all-reduce" in table and "FAILED" not in table
    saved = json.loads((tmp_path / "run" / "env.json").read_text())
    assert saved["ok"] and any(c["name"] == "gloo all-reduce" and c["status"] == "pass" for c in saved["checks"])


def test_evaluation_notebook_runs_under_papermill(tmp_path, tiny_server):
    import papermill

    out = tmp_path / "05_evaluation.ipynb"
    overrides = ["server.mode=attach", f"server.url={tiny_server.url}", *KEYED, "eval.num_samples=32", "eval.repeats=2"]
    papermill.execute_notebook(str(NOTEBOOK_DIR / "05_evaluation.ipynb"), str(out), kernel_name=kernel(),
                               parameters={"overrides": overrides, "run_dir": str(tmp_path / "run")},
                               cwd=str(tmp_path), progress_bar=False)
    nb = json.loads(out.read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    markdown = "".join("".join(o["data"]["text/markdown"]) for o in outputs if "text/markdown" in o.get("data", {}))
    assert "| tiny-policy | 32 × 2 |" in markdown
    assert any("image/png" in o.get("data", {}) for o in outputs)
    run = tmp_path / "run"
    assert (run / "eval" / "samples.jsonl").read_text().count("\n") == 64
    (summary,) = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["n"] == 32 and summary["errors"] == 0
    assert (run / "eval" / "comparison.png").stat().st_size > 0
    assert "| tiny-policy |" in (run / "eval" / "comparison.md").read_text()
    assert (run / "recipe.yaml").exists()  # a run root, with the recipe written once


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_offline_generation_notebook_saves_its_answers_then_fails_loudly(tmp_path, tiny_model_dir):
    """One engine, both outcomes: the answers are shown and saved, then the format check (asked for more than every
    answer can give) fails the notebook, as a model that does not follow the format would."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    out = tmp_path / "01.ipynb"
    with pytest.raises(PapermillExecutionError, match="follow the answer format"):
        papermill.execute_notebook(str(NOTEBOOK_DIR / "01_offline_generation.ipynb"), str(out), kernel_name=kernel(),
                                   parameters={"num_prompts": 6, "min_format_rate": 1.01,
                                               "run_dir": str(tmp_path / "run")},
                                   cwd=str(tmp_path), progress_bar=False)
    outputs = outputs_of(out)
    assert "| question | completion | gold | correct |" in text_of(outputs, "text/markdown")
    saved = json.loads((tmp_path / "run" / "offline" / "offline.json").read_text())
    assert len(saved["rows"]) == 6 and saved["format_rate"] >= 0.5 and saved["tokens_per_second"] > 0
    from workbench.rundir import RunDir
    from workbench.serving.offline import OfflineResult

    again = OfflineResult.load(RunDir(tmp_path / "run").offline)  # the report reads it back the same way
    assert len(again.rows) == 6 and again.format_rate == saved["format_rate"] and again.completion_tokens > 0
    assert all("<answer>" in r["completion"] for r in saved["rows"] if r["format"] > 0)


def test_serving_notebook_attached_to_a_running_server(tmp_path, tiny_server):
    import papermill

    out = tmp_path / "02.ipynb"
    overrides = ["server.mode=attach", f"server.url={tiny_server.url}", *KEYED]
    papermill.execute_notebook(str(NOTEBOOK_DIR / "02_serving.ipynb"), str(out), kernel_name=kernel(),
                               parameters={"overrides": overrides, "concurrencies": [1, 8], "num_requests": 16,
                                           "run_dir": str(tmp_path / "run")}, cwd=str(tmp_path), progress_bar=False)
    outputs = outputs_of(out)
    assert "one chat completion: '" in text_of(outputs, "text/plain")
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert "| requests in flight | requests/s |" in text_of(outputs, "text/markdown")
    sweep = json.loads((tmp_path / "run" / "serving" / "serving.json").read_text())
    assert (tmp_path / "run" / "serving" / "serving.png").stat().st_size > 0
    assert set(sweep["by_concurrency"]) == {"1", "8"} and sweep["n"] == 16
    assert sweep["by_concurrency"]["8"]["requests_per_second"] > sweep["by_concurrency"]["1"]["requests_per_second"]


@pytest.mark.parametrize("flag, value, execute", [
    ("-p", "trainer.max_steps=7 eval.max_tokens=32", True),     # docs/notebooks.md's first form: one string
    ("-p", '["trainer.max_steps=7", "eval.max_tokens=32"]', False),  # a list, typed as text (-p passes a string)
    ("-y", "overrides: [trainer.max_steps=7, eval.max_tokens=32]", False),  # a real list, as YAML
], ids=["p-words", "p-list-text", "y-list"])
def test_papermill_cli_takes_overrides_the_obvious_ways(tmp_path, flag, value, execute):
    """Exactly as a user types it: the papermill command line, on the cheapest notebook; the run's recipe.yaml
    shows both overrides arrived. The first form runs the notebook on its kernel; the other two forms stop after
    papermill wrote its parameters cell (--prepare-only), which then runs with the notebook's own setup call here,
    as the kernel would run them."""
    import subprocess

    import yaml

    from conftest import VENV_BIN

    papermill = VENV_BIN / "papermill"
    run, out = tmp_path / "run", tmp_path / "out.ipynb"
    args = [flag, "overrides", value] if flag == "-p" else [flag, value]
    done = subprocess.run([str(papermill), str(NOTEBOOK_DIR / "00_env_check.ipynb"), str(out), "-k", kernel(),
                           *args, "-p", "run_dir", str(run), *([] if execute else ["--prepare-only"])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    if not execute:
        from workbench import notebook

        nb = json.loads(out.read_text())
        (cell,) = [c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
        parameters: dict = {}
        exec("".join(cell["source"]), parameters)
        notebook.setup("cpu-tiny", parameters["overrides"], parameters["run_dir"])
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 7 and saved["eval"]["max_tokens"] == 32


# --- the staged notebooks walked by hand: one run directory -----------------------------------------------------

def test_notebooks_opened_by_hand_share_the_newest_walk_of_their_recipe(tmp_path):
    """00 starts a walk; 01-05 take the newest walk of their recipe; a run_dir given wins; the tools and another
    recipe make runs of their own."""
    from workbench import notebook

    runs = [f"monitor.runs_dir={tmp_path / 'runs'}"]
    said: list[str] = []
    _, first = notebook.setup("cpu-tiny", runs, "", kind="env", log=said.append)
    assert first.path.name.endswith("-cpu-tiny-notebooks") and "a new notebook walk" in said[-1]
    for kind in ("offline", "serving", "smoke", "train", "eval"):
        _, run = notebook.setup("cpu-tiny", runs, "", kind=kind, log=said.append)
        assert run.path == first.path and "the newest notebook walk of this recipe and these overrides" in said[-1], kind
    _, again = notebook.setup("cpu-tiny", runs, "", kind="env", log=said.append)  # 00 once more: a new walk
    assert again.path != first.path and notebook.setup("cpu-tiny", runs, "", kind="eval")[1].path == again.path
    assert notebook.setup("smoke", runs, "", kind="train", log=said.append)[1].path.name.endswith("-smoke-notebooks")
    # a recipe whose name holds another's is not that one's walk, either way round
    async_walk = notebook.setup("cpu-tiny-async", runs, "", kind="env")[1]
    assert notebook.setup("cpu-tiny", runs, "", kind="eval")[1].path == again.path
    assert notebook.setup("cpu-tiny-async", runs, "", kind="eval")[1].path == async_walk.path
    assert notebook.setup("cpu-tiny", runs, "", kind="bench")[1].path.name.endswith("-cpu-tiny-bench")
    # other overrides are another walk: 04 trains from the walk's recipe.yaml, which would not be what it says
    _, other = notebook.setup("cpu-tiny", [*runs, "trainer.max_steps=5"], "", kind="train", log=said.append)
    assert other.path != again.path and "no walk of this recipe with these overrides" in said[-1]
    assert notebook.setup("cpu-tiny", runs, "", kind="eval")[1].path == again.path
    chosen = tmp_path / "mine"
    assert notebook.setup("cpu-tiny", runs, str(chosen), kind="eval")[1].path == chosen


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_six_notebooks_walked_in_order_without_a_run_directory_share_one(tmp_path):
    """papermill runs 00-05 as a user walks them in JupyterLab: the same recipe and overrides, no run_dir. 05
    then evaluates the model 04 trained, beside the base."""
    import papermill

    from conftest import free_port

    runs = tmp_path / "runs"
    overrides = [f"monitor.runs_dir={runs}", f"server.port={free_port()}", "trainer.max_steps=2",
                 "eval.num_samples=8"]
    own = {"00_env_check": {"collective": False}, "01_offline_generation": {"num_prompts": 4},
           "02_serving": {"concurrencies": [1, 4], "num_requests": 8}}
    for path in NOTEBOOKS[:6]:
        papermill.execute_notebook(str(path), str(tmp_path / path.name), kernel_name=kernel(), cwd=str(tmp_path),
                                   parameters={"overrides": overrides, **own.get(path.stem, {})},
                                   progress_bar=False)
    (run,) = runs.iterdir()
    assert run.name.endswith("-cpu-tiny-notebooks")
    for stage in ("env.json", "offline", "serving", "smoke", "train/final", "eval/summary.json"):
        assert (run / stage).exists(), stage
    table = text_of(outputs_of(tmp_path / "05_evaluation.ipynb"), "text/markdown")
    labels = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:]
    assert "base" in labels and "trained" in labels, table
    summaries = json.loads((run / "eval" / "summary.json").read_text())
    assert str(run / "train" / "final") in json.dumps(summaries)
