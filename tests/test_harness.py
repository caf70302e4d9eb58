"""The suite's own machinery (tests/harness.py): how `make test` spreads the tests over its workers, and the leak
audit (what a test leaves behind fails it; beside other workers, /dev/shm fails the session)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import group_by_shared


class _Item:
    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = ["tmp_path", *fixtures]
        self.marks: list = []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)

    @property
    def group(self) -> str | None:
        (mark,) = self.marks or [None]
        return mark.args[0] if mark is not None else None


def test_tests_sharing_an_expensive_fixture_run_on_one_worker():
    """A chain of sharing (one test uses A and B, another B and C) makes one group, named after its most used
    fixture; a fixture shared with no other stays its own group; cheap fixtures group nothing."""
    items = [_Item("run_a", "run_b"), _Item("run_b", "run_c"), _Item("run_b"), _Item("run_d"), _Item("run_d"),
             _Item(), _Item("cheap")]
    group_by_shared(items, {"run_a", "run_b", "run_c", "run_d", "run_e"})
    assert [i.group for i in items] == ["run_b", "run_b", "run_b", "run_d", "run_d", None, None]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_group_names_do_not_follow_the_collection_order(order):
    """Every worker collects the same tests, but a group's name must not depend on which test came first."""
    pair = [_Item("run_c", "run_a"), _Item("run_b")]  # a tie: each fixture used by one test
    items = [pair[i] for i in order]
    group_by_shared(items, {"run_a", "run_b", "run_c"})
    assert pair[0].group == "run_a" and pair[1].group == "run_b"


_GROUPED = '''
import os, time, pytest
from pathlib import Path

pytest_plugins = ("harness",)


@pytest.fixture(scope="session")
def shared_run():
    return os.environ["PYTEST_XDIST_WORKER"]


@pytest.fixture(scope="session")
def other_run():
    return os.environ["PYTEST_XDIST_WORKER"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    from harness import group_by_shared
    group_by_shared(items, {"shared_run", "other_run"})
'''

_WHO = '''
import os, time
from pathlib import Path

def _record(name, value):
    (Path(os.environ["WHO_DIR"]) / name).write_text(value)
    time.sleep(0.3)  # long enough that the other worker asks for work meanwhile

{tests}
'''


def test_a_group_runs_on_one_worker_under_pytest_xdist(tmp_path):
    """pytest-xdist's own loadgroup scheduler, two workers, eight tests of one shared fixture and eight of another
    mixed with eight that share none: each group's tests all ran on one worker. (With pytest 9.2 and pytest-xdist
    3.8, whose worker writes the group into an attribute pytest no longer reads, every test was a group of its own
    and each worker built its own copy of every shared fixture.)"""
    tests = []
    for i in range(8):
        for fixture in ("shared_run", "other_run", None):
            name = f"{fixture or 'alone'}_{i}"
            tests.append(f"def test_{name}({fixture or ''}):\n"
                         f"    _record({name!r}, os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "conftest.py").write_text(_GROUPED)
    (tmp_path / "test_grouped.py").write_text(_WHO.format(tests="\n".join(tests)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "PYTEST_ADDOPTS": "", "WHO_DIR": str(tmp_path / "who")}
    (tmp_path / "who").mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", str(tmp_path / "pytest.ini"), "-q", "-n", "2", "--dist", "loadgroup",
                           str(tmp_path / "test_grouped.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    who = {p.name: p.read_text() for p in (tmp_path / "who").iterdir()}
    assert len(who) == 24, sorted(who)
    for fixture in ("shared_run", "other_run"):
        assert len({who[f"{fixture}_{i}"] for i in range(8)}) == 1, who
    assert set(who.values()) == {"gw0", "gw1"}, who  # the tests of no group still went to both workers


_LEAKY = '''
import os, subprocess, sys, pytest
from pathlib import Path

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

def test_leaves_a_semaphore_file():
    Path("{shm}/{name}").write_bytes(b"")

def test_clean():
    pass
'''


def _inner_pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """A pytest of its own on `_LEAKY`, with the suite's harness as its plugin (what `make test` loads)."""
    import uuid

    name = f"sem.workbench-audit-test-{uuid.uuid4().hex[:8]}"
    shm = tmp_path / "shm"  # the inner audit's /dev/shm: nothing of another worker's can appear there
    shm.mkdir()
    (tmp_path / "test_leaky.py").write_text(_LEAKY.format(shm=shm, name=name))
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("harness",)\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "WORKBENCH_LEAK_GRACE_S": "2", "WORKBENCH_LEAK_SHM": str(shm), "PYTEST_ADDOPTS": ""}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                               "-c", str(tmp_path / "pytest.ini"), *args, str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    finally:
        leaked = shm / name
        there = leaked.exists()
        leaked.unlink(missing_ok=True)
    done.stdout += f"\n[semaphore file still there after the run: {there}]"
    done.name = name
    return done


def test_the_audit_fails_a_test_that_leaves_a_process_or_a_file(tmp_path):
    """One process (no workers): each leak fails the test that made it, by name; the leaks are cleaned up."""
    done = _inner_pytest(tmp_path, "-q")
    out = done.stdout
    assert done.returncode == 1, out
    assert "ERROR" in out and "test_leaves_a_process - Failed: " in out and "left behind" in out, out
    assert "test_leaves_a_semaphore_file - Failed: " in out and done.name in out, out
    assert "3 passed, 2 errors" in out, out
    assert "[semaphore file still there after the run: False]" in out


def test_beside_other_workers_the_controller_fails_the_session_for_a_file(tmp_path):
    """Two xdist workers: a process is still its test's failure; a /dev/shm file, which cannot be traced to a
    worker, fails the whole session when the last worker has ended (and is removed)."""
    done = _inner_pytest(tmp_path, "-q", "-n", "2", f"--junitxml={tmp_path / 'suite.xml'}")
    out = done.stdout
    assert done.returncode == 1, out
    assert "test_leaves_a_process - Failed: " in out and "left behind" in out, out
    assert "test_leaves_a_semaphore_file - Failed" not in out, out
    assert "the session left behind" in out and done.name in out, out
    assert "[semaphore file still there after the run: False]" in out
    # the suite record reads how the run went from its JUnit XML: the workers and the exit status, the session's
    # failure for the file included
    from conftest import script

    figures = script("measure").suite_figures(tmp_path / "suite.xml")
    assert figures["workers"] == 2 and figures["exit_status"] == 1, figures


def test_the_vllm_watch_knows_a_server_from_a_word_in_an_argument():
    """What the watch that fails an unmarked test for starting vLLM counts: the workbench's own server command lines
    (launch.command, on the CPU and on a GPU), a process vLLM retitled, `python -m vllm...`; not a stand-in whose
    arguments merely name a vllm setting (tests/test_launchlines.py)."""
    from harness import is_vllm
    from workbench import recipe
    from workbench.serving import launch

    for platform in ("cpu", "cuda"):
        rr = recipe.resolve(recipe.load("cpu-tiny", []), platform=platform)
        assert is_vllm(launch.command(rr, "/models/tiny")), platform
    assert is_vllm(["VLLM::EngineCore"]) and is_vllm([sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
    assert is_vllm(["/opt/venv/bin/vllm", "serve", "m"])
    assert not is_vllm([sys.executable, "/tmp/venv/bin/workbench", "serve", "--for-training",
                        "trainer.vllm_group_port=51300", "server.url=http://192.0.2.11:8101"])
    assert not is_vllm(["bash", "-c", "exec \"$@\"", "_", "workbench", "train", "trainer.vllm_group_port=51300"])
