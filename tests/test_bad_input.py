"""Every bad input in tests/bad_inputs.py, through the CLI's entry point: exit status 2, one message naming the
cause and the fix, no traceback, and nothing expensive done — no model built, no server started, no run directory
half-written. The cases run one after the other in one process of their own (bad_inputs.run_all); the console
script itself is tested in tests/test_cli.py.
"""
from __future__ import annotations

import pytest

from bad_inputs import CASES, run_all
from conftest import REPO, free_port


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case once, in an empty data and runs directory."""
    tmp = tmp_path_factory.mktemp("bad")
    results = run_all(CASES, tmp, free_port())
    return results, tmp / "data", tmp / "runs"


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(a[1:] if a[0] == "train" else a)[:60] for a, _ in CASES])
def test_one_clear_message_exit_2(outcomes, index):
    results, _, _ = outcomes
    out = results[index]
    expected = CASES[index][1]
    assert out["code"] == 2, (out["args"], out["code"], out["stderr"][-2000:])
    assert "Traceback" not in out["stderr"] and "Traceback" not in out["stdout"], out["stderr"][-2000:]
    errors = [line for line in out["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out["stderr"]  # one message (several problems are listed under it)
    assert expected in out["stderr"], (expected, out["stderr"])
    assert "fix:" in out["stderr"]  # every message says what to do


def test_no_model_built_and_no_server_started(outcomes):
    _, data, runs = outcomes
    # the tiny model would be built under WORKBENCH_DATA; a server writes its log before it starts
    assert not data.exists() or not any(data.rglob("config.json"))
    assert not list(runs.rglob("vllm-server-*.log")) if runs.exists() else True
    assert not list(runs.rglob("metrics.jsonl")) if runs.exists() else True
    # refused before the run directory is written: a bad recipe leaves no half-made run behind
    left = sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) if runs.exists() else []
    assert not left, left


def test_reliability_page_lists_every_case():
    page = (REPO / "docs" / "reliability.md").read_text()
    for args, message in CASES:
        shown = " ".join(args[3:] if args[:3] == ["train", "--recipe", "smoke"] else args)
        assert f"`{shown}`" in page, f"docs/reliability.md's bad-input table lacks {shown!r}"
