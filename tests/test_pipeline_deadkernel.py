"""A stage whose kernel dies (issue 14, nothing lost, nothing leaked): an out-of-memory kill reaches papermill as
nbclient's DeadKernelError, not as a cell error. The stage must still be a failed stage with its log, and the run
must still get its report. A real kernel (a few seconds), no server.
"""
from __future__ import annotations

import json

import nbformat
import pytest

from workbench import paths, pipeline, recipe
from workbench.errors import WorkbenchError


def _notebook(path, source: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    parameters = nbformat.v4.new_code_cell("recipe = ''\noverrides = []\nrun_dir = ''")
    parameters.metadata["tags"] = ["parameters"]  # papermill injects the run's parameters after it
    nb.cells = [parameters, nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, str(path))


def test_a_dead_kernel_fails_its_stage_and_the_report_is_written(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    # what the OOM killer does to a kernel: SIGKILL, no traceback, no reply
    _notebook(notebooks / f"{pipeline.STAGES['env']}.ipynb",
              "import os, signal, time\nprint('last words before the kill', flush=True)\n"
                  "time.sleep(2)  # the output reaches papermill before the kernel goes\nos.kill(os.getpid(), signal.SIGKILL)")
    monkeypatch.setattr(paths, "notebooks_dir", lambda: notebooks)
    runs = tmp_path / "runs"
    rr = recipe.resolve(recipe.load("cpu-tiny", [f"monitor.runs_dir={runs}"]), platform="cpu")
    lines: list[str] = []

    with pytest.raises(WorkbenchError, match=r"stage 'env' failed: DeadKernelError: the kernel died.*out-of-memory"):
        pipeline.run(rr, ["env"], log=lines.append)

    (run_dir,) = runs.iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["failed_stage"] == "env" and record["results"]["env"]["status"] == "failed"
    assert record["error"].startswith("DeadKernelError: the kernel died") and "seconds" in record
    log = (run_dir / record["results"]["env"]["log"]).read_text()
    assert "last words before the kill" in log and "DeadKernelError" in log
    assert (run_dir / record["results"]["env"]["notebook"]).exists()  # as far as it got
    report = (run_dir / "report.html").read_text()
    assert "failed" in report and "DeadKernelError" in report
    assert any("env: failed" in line for line in lines)
