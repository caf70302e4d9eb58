"""How the suite runs: every test bounded in time, nothing left behind, any order, and a fast subset.

    make test                                  # everything (what CI runs)
    make test-fast                             # -m "not heavy": no vLLM server or engine, no training
    pytest --order reverse --order-seed 7      # files in reverse order, tests shuffled inside each file
    pytest --order shuffle                     # files and tests shuffled (the seed is printed in the header)

Time (pytest-timeout): a test gets `timeout` from pyproject.toml, or its own `@pytest.mark.timeout(s)`, plus the
budget of every expensive shared fixture it asks for (FIXTURE_BUDGETS in conftest.py): whichever test first asks
for a shared server or run pays for building it, and in a shuffled order that can be any of them. A test that runs
past its limit fails with the stacks of every thread (pytest-timeout's signal method).

Leaks (an autouse audit): the /dev/shm files (workbench-sync-*, psm_*, sem.*), processes and listening ports that
appeared while a test ran and are still there after a grace period fail that test. What a longer-lived fixture made
(in its set-up, or later through `keep()`: a shared server that a test restarts) is that fixture's: checked when it
ends, and everything once more when the session ends. The pytest process is made a child subreaper, so a process
orphaned by its parent's death stays in the tree where the audit sees it instead of going to init.
Beside other workers (pytest-xdist, `make test` runs two), a /dev/shm name cannot be traced to a worker: a named
semaphore is held by name, no process maps it once its maker ended, and the other worker's resource tracker may
unlink it later. So a worker checks processes and ports per test and fixture and leaves /dev/shm to the
controller, which compares the directory before the first worker started with after the last one ended.

Heavy: a test that starts a vLLM server or engine, trains, or uses a fixture that does (HEAVY_FIXTURES in
conftest.py) is marked `heavy`; `make test-fast` leaves those out. A test not marked heavy that starts a vLLM
process fails, so the fast subset stays fast.
"""
from __future__ import annotations

import ctypes
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import pytest

# where the audit looks; the suite's own tests of the audit point their inner pytest at a directory of theirs, so
# that another worker's files cannot reach it (nor be removed by it)
SHM = Path(os.environ.get("WORKBENCH_LEAK_SHM", "/dev/shm"))
SHM_PREFIXES = ("workbench-sync-", "psm_", "sem.")
_BESIDE_OTHERS = False  # a pytest-xdist worker with siblings: /dev/shm is the controller's to check (see above)
# a server's group ends a few seconds after its SIGTERM; a test's own children as well (the suite's own tests of
# the audit set it shorter)
GRACE_S = float(os.environ.get("WORKBENCH_LEAK_GRACE_S", "15"))
# Long-lived helpers that a library starts once in the pytest process itself and that end with it: not a test's leak.
BENIGN = ("multiprocessing.resource_tracker", "torch._inductor.compile_worker")


def is_vllm(argv: list[str]) -> bool:
    """Whether a command line is a vLLM process: the `vllm` program, a vLLM module run with -m (ours on the CPU
    included), or a process vLLM has retitled (VLLM::EngineCore). Not a word in an argument: a stand-in given
    `trainer.vllm_group_port=...` is not a server."""
    return any("VLLM::" in token or os.path.basename(token) == "vllm" or token.startswith("vllm.")
               or token == "workbench.serving.vllm_cpu" for token in argv)


# ----------------------------------------------------------------------------------------------------------------
# What a test can leave behind

@dataclass(frozen=True)
class Proc:
    pid: int
    started: float
    command: str


@dataclass
class Resources:
    shm: set[str] = field(default_factory=set)
    procs: set[Proc] = field(default_factory=set)
    ports: set[tuple[int, int]] = field(default_factory=set)  # (port, pid listening)

    def __sub__(self, other: "Resources") -> "Resources":
        return Resources(self.shm - other.shm, self.procs - other.procs, self.ports - other.ports)

    def __or__(self, other: "Resources") -> "Resources":
        return Resources(self.shm | other.shm, self.procs | other.procs, self.ports | other.ports)

    def __bool__(self) -> bool:
        return bool(self.shm or self.procs or self.ports)

    def without(self, kept: "Resources", pids: set[int]) -> "Resources":
        """What is left once a fixture's resources (and anything its live processes hold) are taken out."""
        kept_pids = pids | {p.pid for p in kept.procs}
        return Resources(self.shm - kept.shm - _shm_of(kept_pids),
                         {p for p in self.procs if p not in kept.procs and p.pid not in kept_pids},
                         {(port, pid) for port, pid in self.ports if (port, pid) not in kept.ports and pid not in kept_pids})

    def describe(self) -> str:
        lines = [f"process {p.pid}: {p.command[:200]}" for p in sorted(self.procs, key=lambda p: p.pid)]
        lines += [f"/dev/shm/{name}" for name in sorted(self.shm)]
        lines += [f"port {port} listening (pid {pid})" for port, pid in sorted(self.ports)]
        return "\n  ".join(lines)


def _shm_of(pids: set[int]) -> set[str]:
    from workbench.serving import shm

    return {Path(p).name for p in shm.files_of(sorted(pids))} if pids else set()


def _others_files(names: set[str]) -> set[str]:
    """Those of these /dev/shm names that belong to a live process outside this session's tree (another pytest,
    a run in another terminal): a weights directory named by its owner's pid, a segment that process maps."""
    from workbench.serving import shm

    ours = {os.getpid()} | {p.pid for p in _descendants()}
    others = [p.pid for p in psutil.process_iter() if p.pid not in ours]
    held = {Path(p).name for p in shm.files_of(others)}
    for name in names:
        pid = name.removeprefix("workbench-sync-").split("-", 1)[0]
        if name.startswith("workbench-sync-") and pid.isdigit() and int(pid) not in ours and psutil.pid_exists(int(pid)):
            held.add(name)
    return names & held


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _reap_orphans(zombies: list[psutil.Process]) -> None:
    """Reap the exited processes this subreaper adopted (a server's engine core whose API process ended first): no
    one else will. Children this process started itself (a live Popen or multiprocessing object holds them) are
    left to their owners, whose wait() needs the exit status."""
    import gc
    import multiprocessing
    import subprocess

    owned = {o.pid for o in gc.get_objects() if isinstance(o, subprocess.Popen)}
    owned |= {p.pid for p in multiprocessing.active_children()}
    for p in zombies:
        if p.pid not in owned:
            try:
                os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def snapshot() -> Resources:
    shm = _shm_names() if not _BESIDE_OTHERS else set()
    procs, pids = set(), {os.getpid()}
    zombies = []
    for p in _descendants():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                if p.ppid() == os.getpid():
                    zombies.append(p)
                continue
            command = " ".join(p.cmdline()) or p.name()
            if any(b in command for b in BENIGN):
                continue
            procs.add(Proc(p.pid, p.create_time(), command))
            pids.add(p.pid)
        except psutil.Error:
            continue
    if zombies:
        _reap_orphans(zombies)
    ports = set()
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr:
                ports.add((conn.laddr.port, conn.pid))
    except psutil.Error:
        pass
    return Resources(shm, procs, ports)


class Audit:
    """Resources by owner: each longer-lived fixture's, each test's. One per session."""

    def __init__(self) -> None:
        self.start = snapshot()
        self.owned: dict[str, Resources] = {}  # fixture name -> what its set-up made
        self.keepers: dict[str, Callable[[], set[int]]] = {}  # fixture name -> its live processes, now

    def kept(self) -> tuple[Resources, set[int]]:
        resources = Resources()
        for owned in self.owned.values():
            resources = resources | owned
        pids: set[int] = set()
        for live in self.keepers.values():
            try:
                pids |= set(live())
            except Exception:  # a keeper whose object is half torn down keeps nothing
                pass
        return resources, pids

    def left_since(self, before: Resources, grace: float = GRACE_S) -> Resources:
        """What appeared since `before`, is not a live fixture's, and is still there after the grace period."""
        deadline = time.time() + grace
        while True:
            kept, pids = self.kept()
            left = (snapshot() - before).without(kept, pids)
            if left.shm:
                left.shm -= _others_files(left.shm)
            restarted = pids - {p.pid for p in before.procs}  # a keeper's server that is new since `before`
            if left.shm and not left.procs and restarted and self._hand_over(left.shm, restarted):
                left.shm = set()
            if not left or time.time() >= deadline:
                return left
            time.sleep(0.5)

    def _hand_over(self, names: set[str], restarted: set[int]) -> bool:
        """Files no process maps (multiprocessing's named semaphores are held by name until its resource tracker
        unlinks them) cannot be traced to their server: when a keeper's server was restarted during the test (its
        processes are new), they are counted as that keeper fixture's, and checked when it ends."""
        def new_processes(argname: str) -> bool:
            try:
                return bool(set(self.keepers[argname]()) & restarted)
            except Exception:
                return False

        owner = next((key for key in self.owned if key.split(":")[1] in self.keepers
                      and new_processes(key.split(":")[1])), None)
        if owner is None:
            return False
        self.owned[owner].shm |= names
        return True


_AUDIT: Audit | None = None
_SHM_BEFORE: set[str] | None = None  # the xdist controller's: /dev/shm before any worker started


def _shm_names() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(SHM_PREFIXES)} if SHM.is_dir() else set()


def keep(name: str, live: Callable[[], set[int] | list[int]]) -> None:
    """A longer-lived fixture names the processes it owns now (called at check time: a server it restarts keeps
    counting as its own). Unregistered when the fixture ends (see the fixture hooks below)."""
    if _AUDIT is not None:
        _AUDIT.keepers[name] = lambda: set(live())


def _subreaper() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------------------------
# Hooks

def pytest_addoption(parser) -> None:
    group = parser.getgroup("workbench suite")
    group.addoption("--order", choices=("as-written", "reverse", "shuffle"), default="as-written",
                    help="reverse: files in reverse order, tests shuffled inside each file; shuffle: files and tests")
    group.addoption("--order-seed", type=int, default=None, help="seed of the shuffles (default: random, printed)")
    group.addoption("--no-leak-audit", action="store_true", help="skip the per-test leak audit")


def pytest_configure(config) -> None:
    global _AUDIT, _BESIDE_OTHERS, _SHM_BEFORE
    config.addinivalue_line("markers", "heavy: starts a vLLM server or engine, or trains (left out by make test-fast)")
    worker = getattr(config, "workerinput", None)  # a pytest-xdist worker: its controller chose the seed
    if worker is not None and "order_seed" in worker:
        config.option.order_seed = worker["order_seed"]
    elif config.getoption("--order-seed") is None:
        config.option.order_seed = random.randrange(1 << 16)
    controller = worker is None and getattr(config.option, "numprocesses", None)  # runs no test itself
    if config.getoption("--no-leak-audit"):
        return
    if controller:
        _SHM_BEFORE = _shm_names()
        return
    _BESIDE_OTHERS = worker is not None and int(worker.get("workercount", 1)) > 1
    _subreaper()
    _AUDIT = Audit()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: every worker collects the same order, so it gets the seed
def pytest_configure_node(node) -> None:
    node.workerinput["order_seed"] = node.config.option.order_seed


def pytest_report_header(config) -> str:
    order = config.getoption("--order")
    return f"workbench suite: order {order}" + (f" (seed {config.option.order_seed})" if order != "as-written" else "")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.getoption("--order") != "as-written":  # also under -q, which hides the header: a failing order repeats
        terminalreporter.write_line(pytest_report_header(config) + f": rerun with --order-seed {config.option.order_seed}")


def reorder(items: list, how: str, seed: int) -> list:
    """Files (modules) and the tests inside each, in the order asked for."""
    if how == "as-written":
        return items
    rng = random.Random(seed)
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(str(item.path), []).append(item)
    files = list(by_file)
    if how == "reverse":
        files.reverse()
    else:
        rng.shuffle(files)
    out = []
    for name in files:
        tests = by_file[name]
        rng.shuffle(tests)
        out += tests
    return out


@pytest.hookimpl(tryfirst=True)  # before pytest groups the items of parametrized higher-scoped fixtures again
def pytest_collection_modifyitems(session, config, items) -> None:
    items[:] = reorder(items, config.getoption("--order"), config.option.order_seed)


def add_time_limits(items, budgets: dict[str, float], heavy: set[str], default: float) -> None:
    """Each item's limit: its own (or the default) plus the budgets of the shared fixtures it asks for; `heavy`
    for the items that use a heavy fixture."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        own = item.get_closest_marker("timeout")
        base = float(own.args[0]) if own and own.args else float(own.kwargs.get("timeout", default)) if own else default
        extra = sum(budget for name, budget in budgets.items() if name in names)
        if extra:
            item.add_marker(pytest.mark.timeout(base + extra), append=False)
        if names & heavy:
            item.add_marker(pytest.mark.heavy)


def _module_scoped(item) -> set[str]:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    return {name for name, d in defs.items() if d and d[-1].scope == "module"}


def group_by_shared(items, shared: set[str]) -> None:
    """Mark the tests that share an expensive fixture (one of `shared`, or any module-scoped one), directly or
    through a chain of tests (one uses A and B, another B and C), with one `xdist_group`: pytest-xdist's loadgroup
    runs a group on one worker, so a shared server or run is built once. Tests that share none are spread over the
    workers one by one."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    def keys(item) -> list[str]:
        names = set(getattr(item, "fixturenames", ()))
        # a module-scoped fixture is one per file: two files' fixtures of one name are two different fixtures
        local = {f"{name}@{item.path.name}" for name in _module_scoped(item) & names}
        return sorted((shared & names) | local)

    uses = [keys(item) for item in items]
    for names in uses:
        for other in names:
            parent[root(other)] = root(names[0])
    users: dict[str, int] = {}
    for names in uses:
        for name in names:
            users[name] = users.get(name, 0) + 1
    label: dict[str, str] = {}  # a group's name: its most used fixture (ties: the first by name), stable
    for name in sorted(parent, key=lambda n: (-users.get(n, 0), n)):
        label.setdefault(root(name), name)
    for item, names in zip(items, uses):
        if names:
            item.add_marker(pytest.mark.xdist_group(label[root(names[0])]))


def _group_of(item) -> str | None:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "_".join(names) or None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker sends the collected ids to the controller
def pytest_collection_finish(session) -> None:
    """pytest-xdist's loadgroup sends the tests of one `xdist_group` to one worker by reading the group from the
    test's id, a suffix its worker adds by assigning `item._nodeid`; from pytest 9.2 an id lives in `item._id` and
    that assignment is lost, so every test became a group of its own: each worker built its own copy of every
    shared server and run (tests/README.md "Where the time goes"). Here the suffix is checked, and put where the
    running pytest keeps the id when it is missing."""
    if not getattr(session.config.option, "loadgroup", False):  # set in a worker of `--dist loadgroup`
        return
    for item in session.items:
        group = _group_of(item)
        if group is None or item.nodeid.endswith(f"@{group}"):
            continue
        ident = getattr(item, "_id", None)
        if ident is None or not hasattr(type(ident), "parse"):
            raise pytest.UsageError(f"cannot put {item.nodeid} in its xdist group {group!r}: this pytest keeps a "
                                    "test's id where tests/harness.py does not know; pin the pytest that "
                                    "pyproject.toml's test extra names")
        item._id = type(ident).parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if _AUDIT is None or fixturedef.scope == "function":
        return (yield)
    name = f"{fixturedef.scope}:{fixturedef.argname}:{id(fixturedef)}"
    made: dict = {}

    def ended() -> None:
        # registered before the fixture's own clean-up, so it runs after it (finalizers run last in, first out):
        # what the fixture made must be gone now
        _AUDIT.owned.pop(name, None)
        _AUDIT.keepers.pop(fixturedef.argname, None)
        left = _still_there(made["resources"]) if "resources" in made else Resources()
        if left:  # what it made inside another live fixture's processes (a port in a server) ends with that one
            kept, pids = _AUDIT.kept()
            left = left.without(kept, pids)
        if left:
            _clean(left)
            raise AssertionError(f"fixture {fixturedef.argname!r} left behind:\n  {left.describe()}")

    fixturedef.addfinalizer(ended)
    before = snapshot()
    result = yield
    made["resources"] = _AUDIT.owned[name] = snapshot() - before
    return result


def _still_there(made: Resources, grace: float = GRACE_S) -> Resources:
    deadline = time.time() + grace
    while True:
        now = snapshot()
        left = Resources(made.shm & now.shm, made.procs & now.procs, made.ports & now.ports)
        if left.shm:
            left.shm -= _others_files(left.shm)
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.5)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._audit_before = snapshot() if _AUDIT is not None else None
    return (yield)


class _VllmWatch:
    """Notes every vLLM process that appears under this process while a test that is not marked heavy runs (the
    servers of longer-lived fixtures, already running, do not count)."""

    def __init__(self) -> None:
        import threading

        self.before = {p.pid for p in _descendants()}
        self.seen: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vllm-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            for p in _descendants():
                if p.pid in self.before:
                    continue
                try:
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                    argv = p.cmdline() or [p.name()]
                except psutil.Error:
                    continue
                command = " ".join(argv)
                if is_vllm(argv) and command not in self.seen:
                    self.seen.append(command)

    def stop(self) -> list[str]:
        self.done.set()
        self.thread.join()
        return self.seen


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    watch = _VllmWatch() if _AUDIT is not None and item.get_closest_marker("heavy") is None else None
    try:
        result = yield
    finally:
        seen = watch.stop() if watch else []
    if seen:
        pytest.fail(f"{item.nodeid} started vLLM ({seen[0][:120]}) but is not marked heavy: mark it "
                    "@pytest.mark.heavy (make test-fast leaves heavy tests out)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    before = getattr(item, "_audit_before", None)
    try:
        result = yield
    except BaseException:
        if _AUDIT is not None and before is not None:
            _clean(_AUDIT.left_since(before))  # the teardown's own error is the one to report
        raise
    if _AUDIT is None or before is None:
        return result
    left = _AUDIT.left_since(before)
    if left:
        _clean(left)  # so that the next test starts clean; the failure is this test's teardown error
        pytest.fail(f"{item.nodeid} left behind:\n  {left.describe()}", pytrace=False)
    return result


def _shm_left_since(before: set[str], grace: float = GRACE_S) -> Resources:
    deadline = time.time() + grace
    while True:
        left = _shm_names() - before
        left -= _others_files(left)  # a run in another terminal
        if not left or time.time() >= deadline:
            return Resources(shm=left)
        time.sleep(0.5)


def _clean(left: Resources) -> None:
    for proc in left.procs:
        try:
            psutil.Process(proc.pid).kill()
        except psutil.Error:
            pass
    for name in left.shm:
        try:
            path = SHM / name
            if path.is_dir():
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        except OSError:
            pass


@pytest.hookimpl(tryfirst=True)  # before junitxml's own sessionfinish writes the file
def pytest_sessionfinish(session, exitstatus) -> None:
    _session_leaks(session)
    _record_run(session)


def _record_run(session) -> None:
    """The controller's JUnit XML (`--junitxml`) gets how the suite ran: its worker count and exit status, read by
    scripts/measure.py --suite (not assumed there)."""
    from _pytest.junitxml import xml_key

    xml = session.config.stash.get(xml_key, None)
    if xml is None or getattr(session.config, "workerinput", None) is not None:
        return
    workers = session.config.getoption("numprocesses", None) or 0
    xml.add_global_property("workers", str(workers))
    xml.add_global_property("exit_status", str(int(session.exitstatus)))


def _session_leaks(session) -> None:
    if _SHM_BEFORE is not None:  # the controller, every worker ended: what they left in /dev/shm
        left = _shm_left_since(_SHM_BEFORE)
    elif _AUDIT is not None:
        left = _AUDIT.left_since(_AUDIT.start)
    else:
        return
    if left:
        _clean(left)
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        when = "every worker" if _SHM_BEFORE is not None else "every fixture"
        message = f"the session left behind (after {when} ended):\n  {left.describe()}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
