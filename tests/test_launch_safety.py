"""What a managed server exposes (issue 14, nothing lost, nothing leaked): vLLM's development and weight-update
endpoints only on a server a trainer uses, extra_args that cannot replace what the workbench sets and checks, and a
network address that takes weight pushes only by explicit opt-in, with a key. No server starts here.
"""
from __future__ import annotations

import pytest

from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.serving import launch
from workbench.serving.server import VLLMServer


def _rr(*overrides: str):
    return recipe.resolve(recipe.load("cpu-tiny", list(overrides)), platform="cpu")


def test_dev_mode_only_for_a_server_a_trainer_uses(monkeypatch):
    rr = _rr()
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert launch.environment(rr, for_training=True)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in launch.environment(rr)
    # inherited from the shell (a notebook started from a training session): not on by accident
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert "VLLM_SERVER_DEV_MODE" not in launch.environment(rr, for_training=False)
    # also with server.weight_sync=none: TRL still reads /server_info and resets the prefix cache
    assert launch.environment(_rr("server.weight_sync=none"), for_training=True)["VLLM_SERVER_DEV_MODE"] == "1"


def test_server_remembers_whether_a_trainer_uses_it():
    rr = _rr()
    assert VLLMServer(rr, "/m").for_training is False
    assert VLLMServer(rr, "/m", for_training=True).for_training is True


def test_redacted_recipe_values_do_not_reach_the_server(monkeypatch):
    """A run's copied recipe has secret values replaced by the placeholder: the variable inherited wins."""
    monkeypatch.setenv("MY_API_TOKEN", "from-the-shell-123")
    env = launch.environment(_rr("server.env.MY_API_TOKEN=<redacted>", "server.env.OTHER=kept"))
    assert env["MY_API_TOKEN"] == "from-the-shell-123" and env["OTHER"] == "kept"


@pytest.mark.parametrize("args", [
    ["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--port", "9"], ["--port=9"], ["--api-key", "k"], ["--api_key=k"],
    ["--served-model-name", "x"], ["--served_model_name=x"], ["--max-model-len", "99"], ["--max-model-len=99"],
    ["--uds", "/tmp/s"], ["--uds=/tmp/s"], ["--weight-transfer-config", "{}"],
    ["--weight-transfer-config.backend", "nccl"], ["--weight_transfer_config={}"],
    ["--enforce-eager", "--hos", "0.0.0.0"],  # argparse's unambiguous prefix of --host
])
def test_extra_args_cannot_override_what_the_workbench_sets(args):
    rr = _rr(f"server.extra_args={args!r}".replace("'", '"'))
    assert list(rr.recipe.server.extra_args) == args
    with pytest.raises(WorkbenchError, match=r"server.extra_args contains .*set server\.\w+.* instead"):
        launch.check_extra_args(rr)


@pytest.mark.heavy  # vLLM's parser: a process that imports vLLM
def test_other_extra_args_pass_and_a_knobs_flag_in_any_spelling_does_not():
    """As vLLM's own parser reads them (a process of its own, about 10 s each): flags the workbench neither sets nor
    checks pass; one it reads from the recipe, in a prefix and `=` spelling, names its knob."""
    launch.check_extra_args(_rr('server.extra_args=["--seed", "3", "--hf-overrides", "{}"]'))
    with pytest.raises(WorkbenchError, match=r"set --max-num-seqs to 8 as vLLM reads them.*set server.max_num_seqs"):
        launch.check_extra_args(_rr('server.extra_args=["--seed", "3", "--max-num-seq=8"]'))


def test_extra_args_are_checked_before_a_server_starts(tmp_path):
    rr = _rr('server.extra_args=["--port", "9"]', f"monitor.runs_dir={tmp_path}")
    with pytest.raises(WorkbenchError, match="set server.port instead"):
        VLLMServer(rr, "/m", tmp_path).start()
    assert not list(tmp_path.iterdir())  # refused before any log or process


def test_loopback_needs_nothing():
    launch.check_exposure(_rr(), for_training=True)
    launch.check_exposure(_rr())


def test_network_server_without_weight_updates_needs_a_key(monkeypatch):
    with pytest.raises(WorkbenchError, match=r"server.host=0.0.0.0 exposes .*no API key.*api_key_env"):
        launch.check_exposure(_rr("server.host=0.0.0.0"))
    monkeypatch.setenv("WB_TEST_KEY", "s3cret-key")
    launch.check_exposure(_rr("server.host=0.0.0.0", "server.api_key_env=WB_TEST_KEY"))


def test_network_training_server_needs_opt_in_and_a_key(monkeypatch, capsys):
    monkeypatch.setenv("WB_TEST_KEY", "s3cret-key")
    keyed = ["server.host=0.0.0.0", "server.api_key_env=WB_TEST_KEY"]
    # a key alone is not enough: vLLM's key does not guard the weight-update endpoints
    with pytest.raises(WorkbenchError, match=r"weight-update endpoints.*allow_remote_weight_updates=true"):
        launch.check_exposure(_rr(*keyed), for_training=True)
    with pytest.raises(WorkbenchError, match=r"no API key.*api_key_env"):
        launch.check_exposure(_rr("server.host=0.0.0.0", "server.allow_remote_weight_updates=true"),
                              for_training=True)
    launch.check_exposure(_rr(*keyed, "server.allow_remote_weight_updates=true"), for_training=True)
    assert "firewall the port" in capsys.readouterr().err


def test_network_training_server_is_refused_before_it_starts(tmp_path):
    rr = _rr("server.host=0.0.0.0", f"monitor.runs_dir={tmp_path}")
    with pytest.raises(WorkbenchError, match="allow_remote_weight_updates"):
        VLLMServer(rr, "/m", tmp_path, for_training=True).start()


def test_a_cpu_server_gets_huge_pages_added_to_the_users_glibc_tunables(monkeypatch):
    """glibc.malloc.hugetlb=1 is added to the tunables the server is launched with: a user's own are kept, their
    hugetlb setting wins; servers on accelerators get nothing of it."""
    assert launch.with_tunable("", "glibc.malloc.hugetlb", "1") == "glibc.malloc.hugetlb=1"
    assert launch.with_tunable("glibc.pthread.rseq=0", "glibc.malloc.hugetlb", "1") == \
        "glibc.pthread.rseq=0:glibc.malloc.hugetlb=1"
    assert launch.with_tunable("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb", "1") == "glibc.malloc.hugetlb=0"
    cpu = recipe.resolve(recipe.load("cpu-tiny"), platform="cpu")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert launch.environment(cpu)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert launch.environment(cpu)["GLIBC_TUNABLES"] == "glibc.pthread.rseq=0:glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in cpu.server.env  # the recipe's resolution does not read this shell's
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert launch.environment(cpu)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    monkeypatch.delenv("GLIBC_TUNABLES")
    npu = recipe.resolve(recipe.load("ascend-910b-8card"), platform="npu")
    assert "GLIBC_TUNABLES" not in launch.environment(npu)


def test_every_started_server_keeps_idle_connections_for_the_recipes_time(monkeypatch):
    """server.keep_alive_s reaches vLLM as VLLM_HTTP_TIMEOUT_KEEP_ALIVE (its own default, 5 s, is shorter than a
    step's scoring): on evaluation servers too, over a value inherited from the shell; server.env still decides."""
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")
    assert launch.environment(_rr(), for_training=True)["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "600"
    assert launch.environment(_rr("server.keep_alive_s=30"))["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "30"
    env = launch.environment(_rr("server.keep_alive_s=30", "server.env.VLLM_HTTP_TIMEOUT_KEEP_ALIVE=90"))
    assert env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "90"
    with pytest.raises(WorkbenchError, match="server.keep_alive_s"):
        _rr("server.keep_alive_s=0")
