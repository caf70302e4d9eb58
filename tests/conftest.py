"""Shared fixtures: the default recipe and its tiny model (built once per machine, cached under data/)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def cpu_recipe():
    from workbench import recipe

    return recipe.load("cpu-tiny")


@pytest.fixture(scope="session")
def cpu_rr(cpu_recipe):
    """cpu-tiny, resolved (platform, model path, weight sync, URL, roles)."""
    from workbench import recipe

    return recipe.resolve(cpu_recipe)


@pytest.fixture(scope="session")
def tiny_model_dir(cpu_recipe) -> Path:
    """The cpu-tiny model, built for real (about 40 s on 2 cores the first time, reused after)."""
    from workbench.tasks import tinymodel

    return tinymodel.ensure(cpu_recipe, log=lambda *_: None)


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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_recipe(tmp_path_factory):
    """cpu-tiny on a free port, runs under a temporary directory."""
    from workbench import recipe

    runs = tmp_path_factory.mktemp("runs")
    return recipe.load("cpu-tiny", [f"server.port={free_port()}", f"monitor.runs_dir={runs}"])


@pytest.fixture(scope="session")
def server_rr(server_recipe):
    from workbench import recipe

    return recipe.resolve(server_recipe)


@pytest.fixture(scope="session")
def tiny_server(server_rr, tiny_model_dir, tmp_path_factory):
    """One real vLLM server (CPU build, tiny model) shared by the tests that only talk to it."""
    from workbench.serving.server import VLLMServer

    # for_training: tests/test_sync.py pushes weights into it and resets its prefix cache (dev endpoints)
    srv = VLLMServer(server_rr, str(tiny_model_dir), tmp_path_factory.mktemp("server"), quiet=True, for_training=True)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_model_dir):
    """`workbench train --recipe smoke` for real, once: (RunDir, server port); its training is run.train."""
    import subprocess

    from workbench.rundir import RunDir

    runs = tmp_path_factory.mktemp("smoke-runs")
    port = free_port()
    cmd = workbench_command()
    # report_to: the user's tracker runs alongside the workbench's own metrics.jsonl
    out = subprocess.run([*cmd, "train", "--recipe", "smoke", f"server.port={port}", f"monitor.runs_dir={runs}",
                          "trainer.report_to=tensorboard"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.name.endswith("-smoke-train")]
    return RunDir(run_dir), port


GROUP_SIZE = 4
# the user's reward module: a reward trained with, and a deliberately hackable one for the reward lab
LAB_REWARDS = """
def brevity(prompts, completions, limit=10, **kwargs):
    return [max(0.0, 1.0 - len(c[-1]["content"]) / limit) for c in completions]

def wordy(prompts, completions, per_char=0.01, **kwargs):
    return [per_char * len(c[-1]["content"]) for c in completions]
"""


@pytest.fixture(scope="session")
def grouped_run(tmp_path_factory):
    """`workbench train --recipe smoke` for real with 2 groups of 4 a step, the group record on, and a reward from
    a file in the user's project (outside the package, the working directory), named module:function with an
    argument (tests/test_groups.py, tests/test_rewardlab.py)."""
    import subprocess

    from workbench.rundir import RunDir

    project = tmp_path_factory.mktemp("project")  # the user's project: its own rewards module, the working dir
    (project / "lab_rewards.py").write_text(LAB_REWARDS)
    runs = project / "runs"
    cmd = workbench_command() + [
        "train", "--recipe", "smoke", f"server.port={free_port()}", f"monitor.runs_dir={runs}",
        "trainer.per_device_train_batch_size=8", f"trainer.num_generations={GROUP_SIZE}", "trainer.max_steps=3",
        "rewards.short={function: lab_rewards:brevity, weight: 0.1, args: {limit: 60}}",
        "monitor.groups_per_step=8", "monitor.canary_every=0"]
    out = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = runs.glob("*-train")
    return RunDir.open(path)
