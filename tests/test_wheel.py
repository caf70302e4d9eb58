"""A wheel built from the repository, installed in a fresh virtual environment outside the checkout, runs the env
stage through papermill: the notebooks, recipes and version matrix ship with the package, and nothing it needs is
found through the checkout.

The fresh environment gets the wheel itself (no editable install anywhere on its path) and borrows the project
venv's third-party packages through a path entry: installing torch and vLLM a second time would take minutes and
prove nothing about the package. The project's editable finder is not on that path (a plain path entry in a .pth
file does not process the .pth files of the directory it adds).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-1500:]}\n{out.stderr[-3000:]}"
    return out


def test_wheel_install_runs_the_env_stage_outside_the_checkout(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
         timeout=300)
    (wheel,) = dist.glob("grpo_workbench-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("workbench/notebooks/00_env_check.ipynb", "workbench/notebooks/05_evaluation.ipynb",
                    "workbench/recipe/recipes/cpu-tiny.yaml", "workbench/platform/compat.yaml"):
        assert shipped in names, f"{shipped} missing from the wheel"

    venv = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    fresh_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (fresh_site / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], timeout=300)
    _run([str(py), "-m", "ipykernel", "install", "--sys-prefix", "--name", "grpo-workbench"], timeout=120)
    # nbconvert's templates are data files its install puts under the environment's share/ (not on sys.path)
    (venv / "share" / "jupyter" / "nbconvert").symlink_to(Path(sys.prefix) / "share" / "jupyter" / "nbconvert")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "JUPYTER"))}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", WORKBENCH_DATA=str(tmp_path / "data"))
    where = _run([str(py), "-c", "import workbench; print(workbench.__file__)"], cwd=work, env=env).stdout.strip()
    assert where.startswith(str(venv)), f"imported {where}, not the wheel"
    out = _run([str(venv / "bin" / "workbench"), "run", "--recipe", "cpu-tiny", "--stages", "env",
                f"monitor.runs_dir={work / 'runs'}"], cwd=work, env=env, timeout=600)
    (run,) = (work / "runs").iterdir()
    record = json.loads((run / "run.json").read_text())
    assert record["results"]["env"]["status"] == "passed", out.stdout[-2000:]
    assert record["kernel"] == "grpo-workbench"
    assert json.loads((run / "env.json").read_text())["ok"] is True
    assert (run / "notebooks" / "00_env_check.html").exists() and (run / "report.html").exists()
    # the kernel ran the wheel's code too, not the checkout's
    executed = (run / "notebooks" / "00_env_check.ipynb").read_text()
    assert str(REPO / "workbench") not in executed
