"""Notebooks: committed without outputs, and executed for real with papermill on the project's kernel."""
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def kernel() -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    return "grpo-workbench" if "grpo-workbench" in KernelSpecManager().find_kernel_specs() else "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_and_with_a_typed_parameters_cell(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    lines = [line for line in "".join(params[0]["source"]).splitlines() if line.strip()]
    assert any(line.startswith("recipe: str = ") for line in lines)
    assert all(":" in line.split("=")[0] and "#" in line for line in lines)  # typed and commented
    assert nb["cells"][0]["cell_type"] == "markdown"


def test_env_check_notebook_runs_under_papermill(tmp_path):
    import papermill

    out = tmp_path / "00_env_check.ipynb"
    papermill.execute_notebook(str(REPO / "notebooks" / "00_env_check.ipynb"), str(out), kernel_name=kernel(),
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
    overrides = ["server.mode=attach", f"server.url={tiny_server.url}", "eval.num_samples=32", "eval.repeats=2"]
    papermill.execute_notebook(str(REPO / "notebooks" / "05_evaluation.ipynb"), str(out), kernel_name=kernel(),
                               parameters={"overrides": overrides, "run_dir": str(tmp_path / "run")},
                               cwd=str(tmp_path), progress_bar=False)
    nb = json.loads(out.read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    markdown = "".join("".join(o["data"]["text/markdown"]) for o in outputs if "text/markdown" in o.get("data", {}))
    assert "| tiny-policy | 32 × 2 |" in markdown
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert (tmp_path / "run" / "samples.jsonl").read_text().count("\n") == 64
