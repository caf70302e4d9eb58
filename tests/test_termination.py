"""SIGTERM ends workbench processes through their cleanup, and a protocol's concurrent trainings end with it.

Found by hand: `kill` of a `workbench protocol --concurrent 3` ended the protocol and (by PR_SET_PDEATHSIG) its
server, but left its three trainings running against a dead server, and the trainings, killed in turn, left their
adapter directories on /dev/shm. Real processes here, each a Python with the workbench's own entry code: the
protocol's runner of concurrent commands (`protocol.concurrently` + `protocol._call`) in a process that got
`exit_on_sigterm()` like the CLI, and children that record whether their `finally` ran."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from workbench.errors import TERMINATED

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from workbench.errors import exit_on_sigterm
    exit_on_sigterm()
    here = Path(sys.argv[1])
    (here / f"started-{sys.argv[2]}").write_text(str(os.getpid()))
    try:
        time.sleep(120)
    finally:
        (here / f"cleaned-{sys.argv[2]}").write_text("")
""")

PARENT = textwrap.dedent("""
    import functools, sys
    from workbench.errors import exit_on_sigterm
    exit_on_sigterm()
    from workbench.experiments.protocol import _call, concurrently
    here, child = sys.argv[1], sys.argv[2]
    calls = [functools.partial(_call, [sys.executable, "-c", child, here, str(i)], None) for i in range(3)]
    concurrently(calls, 2, print)
""")


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of an ended parent is reaped by init; count it as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_sigterm_runs_the_cleanup_and_exits_143(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "x"])
    assert _wait_for(lambda: (tmp_path / "started-x").exists(), 30)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=20) == TERMINATED == 143
    assert (tmp_path / "cleaned-x").exists()


def test_a_terminated_protocol_ends_its_running_trainings_and_starts_no_queued_one(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), CHILD])
    try:
        assert _wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 2, 60)
        pids = [int(p.read_text()) for p in tmp_path.glob("started-*")]
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == TERMINATED
        assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 10)
        assert sorted(p.name for p in tmp_path.glob("cleaned-*")) == ["cleaned-0", "cleaned-1"]  # their finally ran
        assert not (tmp_path / "started-2").exists()  # the queued one never started
    finally:
        parent.kill()
        for p in tmp_path.glob("started-*"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
