"""Every bad input in tests/bad_inputs.py, through the real CLI: exit status 2, one message naming the cause and the
fix, no traceback, and nothing expensive done — no model built, no server started, no run directory half-written.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bad_inputs import CASES, expand, write_files
from conftest import REPO, VENV_BIN, free_port


def _cmd() -> list[str]:
    script = VENV_BIN / "workbench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "workbench"]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run every case once (two at a time: each is a short process) in an empty data and runs directory."""
    tmp = tmp_path_factory.mktemp("bad")
    write_files(tmp)
    data, runs = tmp / "data", tmp / "runs"
    env = {**os.environ, "WORKBENCH_DATA": str(data)}
    port = free_port()

    def one(case):
        args, _ = case
        args = expand(args, tmp, port)
        # every command writes its runs under `runs` (an override where the command takes one)
        if args[0] in ("train", "eval", "run", "protocol") and "--resume" not in args:
            args = args + [f"monitor.runs_dir={runs}"]
        out = subprocess.run([*_cmd(), *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
        return args, out

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, CASES))
    return results, data, runs


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(a[1:] if a[0] == "train" else a)[:60] for a, _ in CASES])
def test_one_clear_message_exit_2(outcomes, index):
    results, _, _ = outcomes
    args, out = results[index]
    expected = CASES[index][1]
    assert out.returncode == 2, (args, out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr  # one message (several problems are listed under it)
    assert expected in out.stderr, (expected, out.stderr)
    assert "fix:" in out.stderr  # every message says what to do


def test_no_model_built_and_no_server_started(outcomes):
    _, data, runs = outcomes
    # the tiny model would be built under WORKBENCH_DATA; a server writes its log before it starts
    assert not data.exists() or not any(data.rglob("config.json"))
    assert not list(runs.rglob("vllm-server-*.log")) if runs.exists() else True
    assert not list(runs.rglob("metrics.jsonl")) if runs.exists() else True


def test_readme_lists_every_case():
    readme = (REPO / "README.md").read_text()
    for args, message in CASES:
        shown = " ".join(args[3:] if args[:3] == ["train", "--recipe", "smoke"] else args)
        assert f"`{shown}`" in readme, f"README's bad-input table lacks {shown!r}"
