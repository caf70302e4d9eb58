"""Shared fixtures: the default recipe and its tiny model (built once per machine, cached under data/), the
session's servers and recorded runs, and what each costs. How the suite itself runs (time limits, the leak audit,
orders, the heavy marker) is tests/harness.py; what each fixture provides and what a new test may reuse is
tests/README.md."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from workbench.rundir import RunDir

pytest_plugins = ("harness",)

REPO = Path(__file__).resolve().parent.parent

# The session's shared server takes an API key, as a server beyond loopback must: every test that talks to it (the
# attached smoke training, the evaluation, the notebooks, the clients) does so with the key, read from the variable
# the recipe names, the way a user's run would. Set here so that every subprocess inherits it.
SERVER_KEY_ENV = "WORKBENCH_TEST_SERVER_KEY"
os.environ.setdefault(SERVER_KEY_ENV, "wb-test-" + os.urandom(12).hex())
KEYED = [f"server.api_key_env={SERVER_KEY_ENV}"]  # the override an attaching recipe adds
FIXTURES = Path(__file__).resolve().parent / "fixtures"
VENV_BIN = Path(sys.executable).parent

# Seconds a test may spend on top of its own limit when it is the first to ask for one of these shared fixtures
# (building it happens in that test's set-up); measured on the 2-core CI box, about twice the time seen there.
FIXTURE_BUDGETS = {
    "tiny_model_dir": 300,     # one thread (tinymodel.PINNED_ENV): about 140 s here, the weaker build beside it
    "weaker_model_dir": 120,
    "tiny_server": 180,
    "smoke_run": 300,          # attached to tiny_server: its budget comes on top when it is not up yet
    "grouped_run": 300,
    "killed_run": 900,         # four server starts, a hang's timeout, 14 steps
    "two_model_eval": 300,
    "pipeline_run": 900,
    "bench_run": 900,          # tests/test_bench.py
    "two_rank_run": 600,       # tests/test_distributed.py
    "shared_owner": 180,       # tests/test_shared_server.py: restarts tiny_server
    "row_python": 900,         # tests/test_contract.py: instant once `make contract-env` made it
    "contract_servers": 600,   # tests/test_contract.py: vLLM 0.23.0 starts in about 2 minutes on 2 busy cores
    "lora_pair": 600,          # tests/test_lora.py: a LoRA server and two trainings at once
    "dynamic_run": 300,        # tests/test_dynamic.py: 4 async steps attached to tiny_server
    "tiny_rm_dir": 300,        # tests/test_learned_rewards.py: the tiny reward model's build, about 90 s here
    "learned_run": 900,        # tests/test_learned_rewards.py: policy + reward engine, its restart, 4 LoRA steps
    "outcomes": 120,           # tests/test_bad_input.py: every bad input through the CLI in one process, ~100 s here
}
# Fixtures that start a vLLM server or engine, or train: a test using one is `heavy` (make test-fast skips it).
HEAVY_FIXTURES = {"lora_pair", "dynamic_run", "tiny_rm_dir", "learned_run",
                  "tiny_server", "smoke_run", "grouped_run", "killed_run", "two_model_eval", "pipeline_run",
                  "bench_run", "two_rank_run", "shared_owner", "contract_servers", "row_python"}


# Under `make test` (`pytest -n 2 --dist loadgroup`) each worker builds the shared fixtures its tests ask for. The
# tests sharing one of these go to one worker together, so it is built once. Not among them: the tiny models (built
# once per checkout on disk: a second worker waits for the first one's build and reuses it), and the session's
# server and smoke run, which every worker may start (a start and 3 steps, about 90 s beside the other worker)
# rather than tie the 60-odd tests that read them, and the runs read with them, to one worker.
ONE_WORKER = set(FIXTURE_BUDGETS) - {"tiny_model_dir", "weaker_model_dir", "row_python",
                                     "tiny_server", "smoke_run", "grouped_run"}


@pytest.hookimpl(tryfirst=True)  # the groups are set before pytest-xdist reads them
def pytest_collection_modifyitems(session, config, items) -> None:
    from harness import add_time_limits, group_by_shared

    add_time_limits(items, FIXTURE_BUDGETS, HEAVY_FIXTURES, default=float(config.getini("timeout") or 120))
    group_by_shared(items, ONE_WORKER)


def chromium() -> str:
    """Debian's Chromium (what .ci/run installs): the report and JupyterLab tests need a real browser, and fail
    without one instead of skipping the only UI checks."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium on this machine: the browser tests need it (`apt-get install chromium`; .ci/run "
                "installs it)", pytrace=False)


@pytest.fixture(scope="session")
def cpu_recipe():
    from workbench import recipe

    return recipe.load("cpu-tiny")


@pytest.fixture(scope="session")
def cpu_rr(cpu_recipe):
    """cpu-tiny, resolved (platform, model path, weight sync, URL, roles)."""
    from workbench import recipe

    return recipe.resolve(cpu_recipe)


WEAKER = ["model.tiny.pretrain_steps=200", "model.tiny.eval_size=0"]  # weaker_model_dir's settings


@pytest.fixture(scope="session")
def tiny_model_dir(cpu_recipe, request):
    """The cpu-tiny model, built for real (about 140 s the first time, reused after). A build runs on one thread
    (tinymodel.PINNED_ENV): the weaker model (weaker_model_dir) is built at the same time in a second process when
    a test of the session will ask for it, so on two cores the pair costs one build's time."""
    import subprocess

    from workbench import recipe, tinymodel

    weaker = None
    wanted = any("weaker_model_dir" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if wanted and not (tinymodel.model_dir(recipe.load("cpu-tiny", WEAKER)) / tinymodel.INFO_FILE).is_file():
        weaker = subprocess.Popen([sys.executable, "-m", "workbench.tinymodel", "--recipe", "cpu-tiny", *WEAKER],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _WEAKER_BUILD.append(weaker)
    try:
        yield tinymodel.ensure(cpu_recipe, log=lambda *_: None)
    finally:
        if weaker is not None and weaker.poll() is None:  # a session that never got to the weaker model
            weaker.terminate()  # SIGTERM: the build removes its temporary directory and ends its child
            try:
                weaker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                weaker.kill()
                weaker.wait()


_WEAKER_BUILD: list = []  # the background build tiny_model_dir started (None: cached), for weaker_model_dir


def script(name: str):
    """One of scripts/*.py, imported as a module (they are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def workbench_command() -> list[str]:
    """The installed console script when there is one, else `python -m workbench`."""
    script = VENV_BIN / "workbench"
    return [str(script)] if script.exists() else [sys.executable, "-m", "workbench"]


@pytest.fixture
def workbench_cmd() -> list[str]:
    return workbench_command()


@pytest.fixture
def clean_env() -> dict:
    env = dict(os.environ)
    env.pop("WORKBENCH_PLATFORM", None)
    return env


# free_port's blocks: below Linux's ephemeral range (32768-60999 by default), where bind(("", 0)) picks the ports of
# vLLM's, torch.distributed's and HTTP clients' own sockets, so a port handed to a test cannot be taken by one of
# those before the test's server binds it; one block per pytest-xdist worker (and one for a run without workers), so
# two workers are never handed the same port. Every second port only: the workbench may take a server's port + 1
# (evaluation lanes), which must not be the next test's. A process starts at its own offset in its block, so two
# sessions side by side (another checkout's `make test`) do not walk the same ports in step.
_PORT_START, _PORT_BLOCK, _PORT_BLOCKS = 16000, 1500, 11
_ports_handed = 0


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody listens on, from this test process's own block: the kernel's port 0 could hand the
    same port to another worker, or to a client socket, between this check and the server's bind."""
    import socket

    global _ports_handed
    if _PORT_START + _PORT_BLOCKS * _PORT_BLOCK > _ephemeral_start():  # a host that widened its ephemeral range
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % (_PORT_BLOCKS - 1) if worker[2:].isdigit() else _PORT_BLOCKS - 1
    first, slots = _PORT_START + index * _PORT_BLOCK, _PORT_BLOCK // 2
    offset = os.getpid() % slots
    for _ in range(slots):
        port = first + 2 * ((offset + _ports_handed) % slots)
        _ports_handed += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT: the next one
                continue
            return port
    raise RuntimeError(f"free_port: no free loopback port in {first}-{first + _PORT_BLOCK - 1}")


@pytest.fixture(scope="session")
def server_recipe(tmp_path_factory):
    """cpu-tiny on a free port, runs under a temporary directory."""
    from workbench import recipe

    runs = tmp_path_factory.mktemp("runs")
    return recipe.load("cpu-tiny", [f"server.port={free_port()}", f"monitor.runs_dir={runs}", *KEYED])


@pytest.fixture(scope="session")
def server_rr(server_recipe):
    from workbench import recipe

    return recipe.resolve(server_recipe)


@pytest.fixture(scope="session")
def tiny_server(server_rr, tiny_model_dir, tmp_path_factory):
    """One real vLLM server (CPU build, tiny model) shared by the tests that only talk to it."""
    # for_training: tests/test_sync.py pushes weights into it and resets its prefix cache (dev endpoints)
    import harness
    from workbench.serving.server import VLLMServer, group_members

    srv = VLLMServer(server_rr, str(tiny_model_dir), tmp_path_factory.mktemp("server"), quiet=True, for_training=True)
    srv.start()
    harness.keep("tiny_server", lambda: group_members(srv.pgid) if srv.pgid else [])  # its restarts stay its own
    yield srv
    srv.stop()


EXACT = 1e-4  # nats a token: float32 weights moved exactly; what is left is kernel rounding (about 1e-6 here)


def mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def model_logprobs(model, ids) -> list[float]:
    """A Hugging Face model's log-probability of each token of `ids` after the first (teacher forcing)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def push_base_weights(url: str, model_dir, headers: dict | None = None) -> object:
    """Push the base model's weights into the server at `url`, as a fresh trainer's first sync would (with the
    server's key, `headers`); returns the model."""
    from transformers import AutoModelForCausalLM

    from workbench.serving import sync

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    client = sync.SyncingVLLMClient(base_url=url, weight_sync=sync.ReloadSync(aliases=sync.tied_aliases(model)),
                                    headers=headers)
    client.init_communicator()
    try:
        client.update_named_params([], iter(model.named_parameters()))
        client.reset_prefix_cache()
    finally:
        client.close_communicator()
    return model


@pytest.fixture
def restored_server(tiny_server, server_rr, tiny_model_dir):
    """The session's server for a test that trains on it (pushes trained weights into it): the base weights go back
    afterwards, checked by the server's log-probs of a fixed sequence against the base model's, so the tests that
    only read tiny_server see the model it started with, in any order."""
    yield tiny_server
    restore_base_weights(tiny_server, server_rr, tiny_model_dir)


def restore_base_weights(tiny_server, server_rr, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from workbench.serving.client import sequence_logprobs

    model = push_base_weights(tiny_server.url, tiny_model_dir, server_rr.headers)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 47 + 35?"}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt + "47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    gap = mean_abs(sequence_logprobs(server_rr, ids, url=tiny_server.url), model_logprobs(model, ids))
    assert gap < EXACT, f"the session's server did not get the base weights back ({gap:.2e} nats/token off)"


# enough completions per step for the rewards to differ inside a group (so the weights really move) and a learning
# rate high enough that a server left on old weights is visibly off after a few steps; the canary after every push
FAST = ["trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.learning_rate=3e-3",
        "trainer.logging_steps=1", "trainer.log_completions=false", "monitor.canary_every=1"]


def wait_for(predicate, timeout: float, proc=None, what: str = "", log: Path | None = None) -> None:
    """Poll `predicate` until it holds; fail with the run's log tail when `proc` ends first or time runs out."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise AssertionError(f"the run ended (status {proc.returncode}) before {what}: {tail}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def served_during(train_dir, end: dict | None = None) -> dict[str, float]:
    """The server's counters for one training, less what it had served before (smoke.served_during). An attached
    training shares its server with other tests, so the snapshot taken as it began must be there."""
    from workbench.training import smoke

    assert train_dir.server_metrics_start.exists(), "the training took no snapshot of the server's counters"
    return smoke.served_during(train_dir, end)


def steps_logged(train_dir) -> list[int]:
    from workbench.records import read_jsonl

    return [r["step"] for r in read_jsonl(Path(train_dir) / "metrics.jsonl") if "loss" in r]


@dataclass
class KilledRun:
    """What `killed_run` went through: the run as the trainer's kill left it (a copy), the run after its resume."""
    as_killed: RunDir
    run: RunDir
    crashed: int  # the pid of the first server, SIGKILLed with its whole group at step 3 (a crash)
    hung: int  # the pid of its replacement, SIGSTOPped at step 7 (a hang)
    reached: int  # the last step logged before the trainer's SIGKILL
    checkpoint: int  # the newest complete checkpoint then: where the resume continues
    killed: set[int]  # the SIGKILLed `workbench train` and every process under it then


def tree(pid: int | None = None) -> set[int]:
    """A process and every process under it (this one's by default)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return {root.pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.Error:
        return set()


def sync_dirs_of(pids: set[int]) -> set[str]:
    """The RAM-disk weight directories (workbench-sync-<pid>-*) that these processes made: a test's own, not
    another test worker's running or killed run's."""
    from workbench.serving.sync import SYNC_PREFIX

    shm = Path("/dev/shm")
    names = {p.name for p in shm.glob(f"{SYNC_PREFIX}*")} if shm.is_dir() else set()
    return {n for n in names if n[len(SYNC_PREFIX):].split("-", 1)[0] in {str(p) for p in pids}}


def _server_of(pid: int):
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        if "workbench.serving.vllm_cpu" in " ".join(child.cmdline()):
            return child
    raise AssertionError("no vLLM server among the run's processes")


@pytest.fixture(scope="session")
def killed_run(tmp_path_factory, tiny_model_dir) -> KilledRun:
    """A long run's faults, in one `workbench train --recipe smoke` of 14 steps, for real: its server SIGKILLed
    (group and all) at step 3, a crash; the replacement SIGSTOPped at step 7, a hang (alive, listening, silent: the
    trainer's requests time out after server.request_timeout_s=10); then, past the checkpoint at step 8, the trainer
    itself SIGKILLed, as the OOM killer would (no clean-up of its own; its server must follow it); and `workbench
    train --resume` to the end. tests/test_faults.py reads the restarts and the resume, tests/test_monitor.py the
    run as the kill left it, tests/test_compare.py the finished run."""
    import json
    import signal
    import subprocess

    from workbench.serving.server import group_members

    root = tmp_path_factory.mktemp("killed")
    runs, log = root / "runs", root / "train.log"
    args = ["train", "--recipe", "smoke", f"server.port={free_port()}", f"monitor.runs_dir={runs}",
            "trainer.max_steps=14", "trainer.save_steps=4", "server.request_timeout_s=10",
            "monitor.sample_interval_s=0.25", *FAST]

    def train_dir() -> Path | None:
        found = list(runs.glob("*/train")) if runs.exists() else []
        return found[0] if found else None

    def at_step(n: int) -> bool:
        return train_dir() is not None and max(steps_logged(train_dir()), default=0) >= n

    with open(log, "w") as out:  # a file: a pipe nobody reads would block the trainer in a progress-bar write
        proc = subprocess.Popen([*workbench_command(), *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: at_step(3), 400, proc, "step 3", log)
        crashed = _server_of(proc.pid).pid
        os.killpg(os.getpgid(crashed), signal.SIGKILL)  # the whole server: API process, engine core, worker
        wait_for(lambda: at_step(7) and _server_of(proc.pid).pid != crashed, 400, proc, "step 7", log)
        hung = _server_of(proc.pid).pid
        os.killpg(os.getpgid(hung), signal.SIGSTOP)
        wait_for(lambda: at_step(9) and (train_dir() / "checkpoints" / "checkpoint-8" / "trainer_state.json").exists(),
                 400, proc, "step 9 past the checkpoint at step 8", log)
        server = _server_of(proc.pid)
        pgid = os.getpgid(server.pid)  # the third server's group: started with setsid, its processes share it
        killed = tree(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text(errors="replace")[-3000:]
    # the server's whole group follows its parent (PR_SET_PDEATHSIG, the launcher's parent watch): a notebook kernel
    # or a `workbench train` killed by the OOM killer leaves no server behind
    wait_for(lambda: group_members(pgid) == [], 60, what="the killed trainer's server to end")
    run_dir = train_dir().parent
    reached = max(steps_logged(run_dir / "train"))
    checkpoint = max(int(p.parent.name.rsplit("-", 1)[1])
                     for p in (run_dir / "train" / "checkpoints").glob("checkpoint-*/trainer_state.json"))
    as_killed = Path(shutil.copytree(run_dir, root / "as-killed" / run_dir.name,
                                     ignore=shutil.ignore_patterns("checkpoints", "final")))
    out = subprocess.run([*workbench_command(), "train", "--resume", str(run_dir)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "train" / "train.json").read_text())["steps"] == 14
    return KilledRun(RunDir(as_killed), RunDir(run_dir), crashed, hung, reached, checkpoint, killed)


@pytest.fixture(scope="session")
def weaker_model_dir(tiny_model_dir):
    """The tiny model pre-trained for 200 steps instead of 250 (a lower held-out accuracy), built once (beside
    tiny_model_dir's build) and cached. A genuinely different model: a smoke run's final model, three steps from
    the base, answers exactly as the base does, which would leave nothing fixed or broken between the two."""
    from workbench import recipe, tinymodel

    weaker = _WEAKER_BUILD[-1] if _WEAKER_BUILD else None
    if weaker is not None:
        _, err = weaker.communicate(timeout=600)
        assert weaker.returncode == 0, err[-3000:]
    return tinymodel.ensure(recipe.load("cpu-tiny", WEAKER), log=lambda *_: None)


@pytest.fixture(scope="session")
def two_model_eval(server_recipe, tiny_model_dir, weaker_model_dir, tmp_path_factory):
    """`evaluate.evaluate` of two models for real: the weaker model as "base" on a server started with it, the tiny
    model as "trained" loaded into that server; 48 problems, two repeats, sampled at temperature 1 (so a problem's
    repeats can disagree).
    Returns (its run directory, the recipe it ran with). tests/test_evaluate.py reads its outputs,
    tests/test_eval_analysis.py its per-problem analysis."""
    from workbench import recipe
    from workbench.evaluation import evaluate

    r = recipe.load(server_recipe, {"eval.num_samples": 48, "eval.repeats": 2, "eval.temperature": 1.0,
                                    "server.port": free_port()})
    run = RunDir.at(tmp_path_factory.mktemp("two-models") / "run", r)
    evaluate.evaluate(recipe.resolve(r), {"base": str(weaker_model_dir), "trained": "tiny"}, stage=run.eval,
                      quiet=True, log=lambda *_: None)
    return run, r


GROUP_SIZE = 4
# what the session's smoke run sets beyond the smoke recipe (the compare tests read these as the keys it changed)
CURVE_SAMPLES = 24
SMOKE_RUN = ["trainer.report_to=tensorboard", "trainer.per_device_train_batch_size=8",
             f"trainer.num_generations={GROUP_SIZE}", "trainer.max_steps=3",
             # the learning curve at every push, the best step kept (tests/test_evalcurve.py)
             "eval.every_steps=1", f"eval.during_samples={CURVE_SAMPLES}", "eval.keep_best=true",
             "rewards.short={function: lab_rewards:brevity, weight: 0.1, args: {limit: 60}}", "monitor.groups_per_step=8",
             # a variable for the trainer role: `workbench train` starts the trainer as a child process that has it
             "devices.env.WORKBENCH_TEST_ROLE=trainer"]
# the user's reward module: a reward trained with, and a deliberately hackable one for the reward lab
LAB_REWARDS = """
def brevity(prompts, completions, limit=10, **kwargs):
    return [max(0.0, 1.0 - len(c[-1]["content"]) / limit) for c in completions]

def wordy(prompts, completions, per_char=0.01, **kwargs):
    return [per_char * len(c[-1]["content"]) for c in completions]
"""


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_server, server_rr, tiny_model_dir):
    """`workbench train --recipe smoke` for real, once, as a user's project runs it: 2 groups of 4 completions a
    step, the group record on, a reward from a file in the project (outside the package, the working directory)
    named module:function with an argument, and the user's tracker (TensorBoard) beside the workbench's own
    metrics; attached to the session's server (server.mode=attach, as a trainer beside a running `workbench serve`),
    whose base weights go back afterwards; with the server's key (server.api_key_env) and a devices.env variable,
    so the trainer runs as a child process with the trainer role's environment. Returns (RunDir, the server's URL). The readers of a finished training
    share it: the sync, monitor, architecture, evaluation, groups, reward-lab and comparison tests."""
    import subprocess

    project = tmp_path_factory.mktemp("project")  # the user's project: its own rewards module, the working dir
    (project / "lab_rewards.py").write_text(LAB_REWARDS)
    runs = project / "runs"
    cmd = workbench_command() + ["train", "--recipe", "smoke", "server.mode=attach", f"server.url={tiny_server.url}",
                                 f"monitor.runs_dir={runs}", *KEYED, *SMOKE_RUN]
    try:
        out = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=900)
    finally:
        restore_base_weights(tiny_server, server_rr, tiny_model_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = runs.glob("*-smoke-train")
    return RunDir.open(path), tiny_server.url


@pytest.fixture(scope="session")
def grouped_run(smoke_run):
    """The smoke run, read for its group record (tests/test_groups.py, tests/test_rewardlab.py)."""
    return smoke_run[0]
