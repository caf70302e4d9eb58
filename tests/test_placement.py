"""Where every trainer process lands, proven by the launchers' own code.

For every shipped recipe and every split the schema can express (each strategy × each accelerator platform × the
layouts below), the trainer launch `workbench train` would make is handed to accelerate's own `launch_command`
(its `_validate_launch_command`, its multi-GPU / DeepSpeed / FSDP env preparation) with the platform faked as NPU
or CUDA, and torch.distributed.run's own `config_from_args` reads what accelerate would start; only the final
spawn is caught. Each rank's visible-devices variable must be the trainer role's physical cards, each rank on a
card of its own, never one of the server's on the same node. A single trainer process (no accelerate) must be
started with the same variables. A recipe added to workbench/recipe/recipes/ is covered without editing this file.
No server, no training: seconds.
"""
from __future__ import annotations

import os
import subprocess
import typing
from unittest import mock

import pytest
import torch.distributed.run as distributed_run

from workbench import recipe
from workbench.platform import compat
from workbench.recipe.resolve import VISIBLE_DEVICES
from workbench.recipe.schema import DevicesConfig, DistributedConfig
from workbench.rundir import TrainDir
from workbench.training import launch

STRATEGIES = typing.get_args(typing.get_type_hints(DistributedConfig)["strategy"])
ACCELERATORS = tuple(p for p in typing.get_args(typing.get_type_hints(DevicesConfig)["platform"])
                     if p in VISIBLE_DEVICES)
REMOTE = ["server.mode=attach", "server.url=http://10.0.0.1:8001"]  # the server on a machine of its own

# name -> overrides: the splits beside the shipped recipes (each with every strategy and accelerator)


def TP(tp: int, dp: int) -> list[str]:
    return [f"server.tensor_parallel_size={tp}", f"server.data_parallel_size={dp}"]


TWO_NODES = [*REMOTE, *TP(4, 2), "devices.server=[0,1,2,3,4,5,6,7]", "devices.trainer=[0,1,2,3,4,5,6,7]",
             "distributed.nodes=2", "distributed.main_address=10.0.0.2"]
LAYOUTS = {
    "4+4": [*TP(4, 1), "devices.server=[0,1,2,3]", "devices.trainer=[4,5,6,7]"],
    "1+3": [*TP(1, 1), "devices.server=[0]", "devices.trainer=[1,2,3]"],
    "1+1": [*TP(1, 1), "devices.server=[0]", "devices.trainer=[1]"],
    "trainer first": [*TP(4, 1), "devices.server=[4,5,6,7]", "devices.trainer=[0,1,2,3]"],
    "interleaved": [*TP(2, 1), "devices.server=[0,2]", "devices.trainer=[1,3,5]"],
    "2 nodes x 8, node 0": [*TWO_NODES, "distributed.node_rank=0"],
    "2 nodes x 8, node 1": [*TWO_NODES, "distributed.node_rank=1"],
}


def _versions(platform: str) -> dict:
    # an Ascend split is planned with the recommended row (no vllm-ascend here); CUDA with the installed vLLM
    return ({"vllm": compat.recommended()["vllm"], "vllm_ascend": compat.recommended()["vllm_ascend"]}
            if platform == "npu" else {"vllm": "0.31.0", "vllm_ascend": None})


def _variants() -> list[tuple[str, list[str]]]:
    cases = [(f"{name} (shipped)", name, []) for name in recipe.available()]
    for layout, overrides in LAYOUTS.items():
        for platform in ACCELERATORS:
            for strategy in STRATEGIES:
                single = "nodes=2" not in " ".join(overrides) and layout == "1+1"
                if single and strategy != "ddp":
                    continue  # one process: no strategy (refused up front, tested below)
                base = "ascend-910b-8card" if platform == "npu" else "cuda-8gpu"
                cases.append((f"{layout} {platform} {strategy}", base,
                              [*overrides, f"devices.platform={platform}", f"distributed.strategy={strategy}",
                               "distributed.processes=null" if not single else "distributed.processes=1"]))
    return [pytest.param(name, overrides, id=case) for case, name, overrides in cases]


def _resolve(name: str, overrides: list[str]):
    r = recipe.load(name, overrides)
    platform = r.devices.platform if r.devices.platform != "auto" else "cpu"
    return recipe.resolve(r, platform=platform, versions=_versions(platform))


def accelerate_ranks(rr, train_dir: TrainDir) -> tuple[dict, list[dict]]:
    """What accelerate's launcher starts for the config `workbench train` writes: (the launch, one dict per rank)."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    import accelerate.utils.launch as accelerate_launch

    cmd, env = launch.trainer_processes(rr, train_dir, server_pid=4242)
    assert "launch" in cmd and "--config_file" in cmd, cmd
    args = launch_command_parser().parse_args(cmd[cmd.index("--config_file"):])
    seen: dict = {}

    def spawn(run_args) -> None:  # torch.distributed.run.run: read its launch config, start nothing
        config, _, _ = distributed_run.config_from_args(run_args)
        seen.update(config=config, env=dict(os.environ), node_rank=int(config.rdzv_configs.get("rank", 0)),
                    endpoint=config.rdzv_endpoint, rdzv=config.rdzv_backend)

    def no_ssh(*a, **k):
        raise AssertionError(f"accelerate would start {a[0][:3] if a else k} (pdsh / ssh into the nodes)")

    npu = rr.platform == "npu"
    # the port check is accelerate's, but nothing is bound here (the spawn is caught): another process on the
    # rendezvous port must not fail it
    import contextlib

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env, clear=True))
        # the platform as accelerate asks for it: is_npu_available up to 1.15, torch.accelerator's backend from 1.16
        asked = [name for name in ("is_npu_available", "get_torch_accelerator_backend")
                 if hasattr(accelerate_launch, name)]
        # neither: this accelerate asks for the platform some other way, and the test would place for the CPU only
        assert asked, "accelerate's launch has neither is_npu_available nor get_torch_accelerator_backend"
        if "is_npu_available" in asked:
            stack.enter_context(mock.patch.object(accelerate_launch, "is_npu_available", lambda *a, **k: npu))
        if "get_torch_accelerator_backend" in asked:
            stack.enter_context(mock.patch.object(accelerate_launch, "get_torch_accelerator_backend",
                                                  lambda *a, **k: ("npu" if npu else "cuda", None)))
        stack.enter_context(mock.patch.object(accelerate_launch, "is_port_in_use", lambda *a, **k: False))
        stack.enter_context(mock.patch.object(distributed_run, "run", spawn))
        stack.enter_context(mock.patch.object(subprocess, "Popen", no_ssh))
        launch_command(args)
    config = seen["config"]
    nproc = int(config.nproc_per_node)
    visible = seen["env"].get(VISIBLE_DEVICES.get(rr.platform, ""), "")
    ids = [int(v) for v in visible.split(",")] if visible else []
    ranks = [{"rank": seen["node_rank"] * nproc + local, "local_rank": local,
              "card": ids[local] if local < len(ids) else None, "env": seen["env"]} for local in range(nproc)]
    return {"nodes": (config.min_nodes, config.max_nodes), **seen}, ranks


def _server_here(rr) -> bool:
    """The server's cards are on this node: a managed server on node 0 (an attached one is another machine's)."""
    return rr.recipe.server.managed and rr.recipe.distributed.node_rank == 0


@pytest.mark.parametrize("name,overrides", _variants())
def test_each_trainer_process_gets_the_trainer_roles_physical_cards(name, overrides, tmp_path):
    rr = _resolve(name, overrides)
    assert not launch.placement_problems(rr), [str(p) for p in launch.placement_problems(rr)]
    train_dir = TrainDir(tmp_path / "train")
    # the cards as the recipe states them (not as the resolution that is checked here computes them)
    trainer, server = list(rr.recipe.devices.trainer), set(rr.recipe.devices.server)
    assert trainer and all(isinstance(c, int) for c in trainer), trainer
    where = launch.trainer_placement(rr)
    if rr.platform == "cpu":
        if rr.trainer_processes * rr.recipe.distributed.nodes == 1:
            assert where in ("here", "process")
        if where != "accelerate":
            return  # cores, not cards: tests/test_distributed.py checks the ranks' cores in a real run
    variable = VISIBLE_DEVICES.get(rr.platform)
    if where == "accelerate":
        launched, ranks = accelerate_ranks(rr, train_dir)
        d = rr.recipe.distributed
        assert launched["nodes"] == (d.nodes, d.nodes)
        assert len(ranks) == rr.trainer_processes
        assert [r["rank"] for r in ranks] == [d.node_rank * rr.trainer_processes + i for i in range(len(ranks))]
        if d.nodes > 1:  # every node meets node 0's main rank at the recipe's address, started per node (no pdsh)
            assert launched["endpoint"] == f"{d.main_address}:{d.main_port}" and launched["rdzv"] == "static"
            assert launched["node_rank"] == d.node_rank
    else:
        cmd, env = launch.trainer_processes(rr, train_dir)
        assert "accelerate" not in " ".join(cmd) and cmd[-2:] == ["--train-dir", str(train_dir.path)]
        ranks = [{"rank": 0, "local_rank": 0, "card": int(env[variable].split(",")[0]) if variable else None,
                  "env": env}]
    for r in ranks:
        if variable:
            assert r["env"][variable] == ",".join(map(str, trainer)), (r["env"].get(variable), trainer)
        for key, value in rr.recipe.devices.env.items():  # devices.env (HCCL timeouts, ...) reaches every rank
            assert r["env"][key] == value
    if variable:
        cards = [r["card"] for r in ranks]
        assert len(set(cards)) == len(cards) and set(cards) <= set(trainer), cards
        if _server_here(rr):
            assert not set(cards) & server, f"ranks on the server's cards: {cards} vs {sorted(server)}"


def test_the_variants_cover_every_strategy_and_accelerator():
    ids = {p.id for p in _variants()}
    assert {f"4+4 {p} {s}" for p in ACCELERATORS for s in STRATEGIES} <= ids
    assert {"ascend-910b-8card (shipped)", "cuda-8gpu (shipped)", "cuda-2gpu (shipped)", "cuda-1gpu (shipped)"} <= ids


def test_the_8card_recipe_keeps_its_ranks_off_the_servers_cards(tmp_path):
    """The case that failed first: 4 cards serving, 4 training, ZeRO-3 through accelerate's DeepSpeed launcher."""
    rr = _resolve("ascend-910b-8card", [])
    _, ranks = accelerate_ranks(rr, TrainDir(tmp_path))
    assert [r["card"] for r in ranks] == [4, 5, 6, 7]
    assert {r["env"]["ASCEND_RT_VISIBLE_DEVICES"] for r in ranks} == {"4,5,6,7"}
    assert ranks[0]["env"]["HCCL_CONNECT_TIMEOUT"] == "1800"


def test_a_single_trainer_is_started_with_the_trainer_roles_environment(tmp_path):
    rr = _resolve("cuda-2gpu", [])
    assert launch.trainer_placement(rr) == "process"
    cmd, env = launch.trainer_processes(rr, TrainDir(tmp_path), server_pid=4242)
    assert cmd[1:3] == ["-m", "workbench.training.rank"]
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["WORKBENCH_SERVER_PID"] == "4242"
    # on the CPU with nothing to set, the trainer stays in `workbench train`'s process
    assert launch.trainer_placement(_resolve("smoke", [])) == "here"
    assert launch.trainer_placement(_resolve("smoke", ["devices.env.WORKBENCH_ROLE_PROBE=1"])) == "process"


@pytest.mark.parametrize("overrides,expected", [
    (["devices.trainer=[3,4,5,6]"], "devices.server [0, 1, 2, 3] and devices.trainer [3, 4, 5, 6] share card(s) [3]"),
    (["devices.trainer=[4]", "distributed.processes=1"], "distributed.strategy=deepspeed with one trainer process"),
])
def test_bad_splits_are_refused_before_anything_starts(overrides, expected):
    problems = launch.placement_problems(_resolve("ascend-910b-8card", overrides))
    assert any(expected in str(p) for p in problems), [str(p) for p in problems]


def test_plan_refuses_two_roles_on_one_card_as_training_does():
    """`workbench plan` said "fits" for a layout training refuses: each role planned the shared card for itself."""
    from workbench import plan
    from workbench.errors import WorkbenchError

    for name, overrides, shared in (("cuda-2gpu", ["devices.trainer=[0]"], "[0]"),
                                    ("ascend-910b-8card", ["devices.trainer=[3,4,5,6]"], "[3]")):
        with pytest.raises(WorkbenchError, match=rf"share card\(s\) \{shared}"):
            plan.plan(_resolve(name, overrides))
    assert "fits" in plan.plan(_resolve("cuda-2gpu", [])).text()  # disjoint cards still plan
    # one card for both on purpose: colocate plans the engine's share and the trainer's rest on it
    text = plan.plan(_resolve("cuda-2gpu", ["server.mode=colocate", "devices.trainer=[0]"])).text()
    assert "vLLM colocated" in text


def test_a_single_cpu_trainer_with_role_variables_runs_in_a_process_that_has_them(smoke_run):
    """The session's smoke training (tests/conftest.py) sets devices.env.WORKBENCH_TEST_ROLE: `workbench train`
    started its one trainer as a child process with the trainer role's environment, not in its own process."""
    import json

    run, _ = smoke_run
    (rank,) = json.loads(run.train.ranks.read_text())
    assert rank["env"]["WORKBENCH_TEST_ROLE"] == "trainer"
    assert rank["parent_pid"] != os.getpid(), "the trainer ran inside `workbench train` (the test's child)"
    import yaml  # the run's recipe names the user's reward module, importable from its project only: read, not load

    assert rank["cores"] == yaml.safe_load(run.recipe.read_text())["devices"]["trainer"], rank["cores"]


def test_the_tiny_model_runs_in_bfloat16_on_an_ascend_card():
    """vllm-ascend's attention kernels take 16-bit inputs: the NPU smoke run of docs/ascend.md
    (`workbench train --recipe smoke devices.platform=npu ...`) serves and trains the tiny model in bfloat16, and says
    so in the server's command."""
    from workbench.serving import launch as serving_launch

    rr = _resolve("smoke", ["devices.platform=npu", "devices.server=[0]", "devices.trainer=[1]"])
    assert (rr.recipe.server.dtype, rr.recipe.model.dtype) == ("bfloat16", "bfloat16")
    command = serving_launch.command(rr, rr.model_path)
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert _resolve("smoke", []).recipe.server.dtype == "float32"  # the CPU keeps the recipe's float32


@pytest.mark.parametrize("overrides,expected", [
    (["distributed.main_address=10.0.0.2"], "10.0.0.2"),          # the recipe names this node's address
    ([], "127.0.0.1"),                                             # a server on this machine: loopback
    (["server.mode=attach", "server.url=http://127.0.0.9:8001"], "127.0.0.1"),
])
def test_the_weight_transfer_master_address_comes_from_the_recipe_or_the_route(overrides, expected):
    """The trainer's main rank hosts the HCCL weight-transfer group; the server's workers connect to the address
    passed as master_address: distributed.main_address when it is a network address, else the interface that
    routes to the server (asked of the kernel), never the first interface found."""
    from workbench.serving import sync

    rr = _resolve("ascend-910b-8card", overrides)
    assert rr.weight_sync == "hccl"
    adapter = sync.make(rr)
    assert adapter.master_address == expected


@pytest.mark.parametrize("name", recipe.available())
def test_recipe_show_check_builds_every_shipped_recipe(name, capsys):
    """`workbench recipe show NAME --check`: the real GRPOConfig and the placement, for every shipped recipe."""
    from workbench.cli import main

    assert main(["recipe", "show", name, "--check"]) == 0
    out = capsys.readouterr().out
    assert "# built trl.GRPOConfig" in out and "# placement: trainer on" in out


@pytest.mark.parametrize("device,visible,card", [
    ("cuda:1", "4,5,6,7", 5), ("cuda:0", None, 0), ("cuda:3", "0,2,4,6", 6), ("cpu", "4,5", None), ("cpu:0", None, None),
    ("cuda:0", "GPU-0000aaaa", "GPU-0000aaaa"), ("cuda:4", "4,5", None),
])
def test_ranks_json_records_the_physical_card(device, visible, card):
    import torch

    from workbench.training.train import physical_card

    assert physical_card(torch.device(device), visible) == card


INDEXLESS = """
import json, os, sys
from types import SimpleNamespace

import torch
import accelerate.state as state
from workbench.training.train import _rank_record, physical_card

torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
for kind, visible, local_rank in json.loads(sys.argv[1]):
    os.environ.pop("LOCAL_RANK", None)
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = local_rank
    state.get_torch_accelerator_backend = lambda *a, k=kind, **kw: (k, None)  # the backend accelerate would detect
    device = state.PartialState.default_device.fget(None)  # accelerate's own choice for a single process
    print(json.dumps({"device": str(device), "index": device.index, "card": physical_card(device, visible)}))
# the rank record a single trainer on the last of 4 GPUs writes, as scripts/device_check.py reads it
from workbench import recipe

os.environ.pop("LOCAL_RANK", None)
os.environ.update(CUDA_VISIBLE_DEVICES="3", WORKBENCH_DEVICE_CHECK="trainer-role")
rr = recipe.resolve(recipe.load("smoke", ["devices.platform=cuda", "server.mode=off", "devices.trainer=[3]",
                                          "devices.server=[0]", "devices.env.WORKBENCH_DEVICE_CHECK=trainer-role"]))
print(json.dumps(_rank_record(rr, SimpleNamespace(process_index=0, local_process_index=0, device=torch.device("cuda")))))
"""
# (kind, CUDA/ASCEND visible devices, LOCAL_RANK) -> the card ranks.json must record
INDEXLESS_CASES = [(("cuda", "3,5", None), 3), (("npu", "4,5,6,7", None), 4), (("npu", "4,5,6,7", "2"), 6),
                   (("cuda", "", None), 0)]


@pytest.fixture(scope="module")
def indexless_probe(tmp_path_factory) -> list[dict]:
    """One process (torch, accelerate and the workbench's imports once): each case's device and card, then a
    single trainer's rank record."""
    import json
    import subprocess
    import sys

    probe = tmp_path_factory.mktemp("indexless") / "probe.py"
    probe.write_text(INDEXLESS)
    out = subprocess.run([sys.executable, str(probe), json.dumps([case for case, _ in INDEXLESS_CASES])],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(INDEXLESS_CASES) - 1:]]


def test_a_single_trainers_indexless_device_records_its_card(indexless_probe):
    """A single accelerator trainer: accelerate's device has no index (torch.device("cuda"), ("npu")); its card is
    the backend's current device (here, without that backend, LOCAL_RANK or 0) in the visible list."""
    for ((kind, visible, local_rank), card), got in zip(INDEXLESS_CASES, indexless_probe):
        assert got["device"] == kind and got["index"] is None  # the indexless device accelerate really returns
        assert got["card"] == card, (kind, visible, local_rank, got)


def test_the_device_checks_single_trainer_check_passes_on_an_indexless_gpu_trainer(indexless_probe):
    """scripts/device_check.py's "single trainer placed" on the record a single trainer on the last of 4 GPUs writes
    (accelerate's torch.device("cuda"), CUDA_VISIBLE_DEVICES=3): it failed there while the card read null."""
    from conftest import script

    rank = indexless_probe[-1]
    assert rank["card"] == 3 and rank["device"] == "cuda"
    check = script("device_check")
    assert check.single_trainer_placed(rank, "cuda", last=3)
    assert not check.single_trainer_placed({**rank, "card": None}, "cuda", last=3)  # what it read before


def test_a_node_started_with_other_settings_is_refused_by_every_rank():
    from workbench.errors import WorkbenchError
    from workbench.training.train import check_same_recipe, shared_settings

    same = _resolve("smoke", ["distributed.nodes=2"])
    other = _resolve("smoke", ["distributed.nodes=2", "distributed.node_rank=1", "trainer.learning_rate=2e-3"])
    node1 = _resolve("smoke", ["distributed.nodes=2", "distributed.node_rank=1", "monitor.runs_dir=/elsewhere"])
    assert shared_settings(same) == shared_settings(node1)  # its own node rank and runs directory are its own
    check_same_recipe([{"rank": 0, "recipe": shared_settings(same)}, {"rank": 1, "recipe": shared_settings(node1)}])
    with pytest.raises(WorkbenchError, match="train different recipes"):
        check_same_recipe([{"rank": 0, "recipe": shared_settings(same)}, {"rank": 1, "recipe": shared_settings(other)}])


def test_an_npu_run_directory_holds_the_recipe_its_trainer_process_reads(tmp_path):
    """On an Ascend card the tiny model runs in bf16 (the resolved recipe), while the run directory holds the recipe
    as loaded (float32, the CPU's); the trainer process re-resolves it: the check that the run's recipe is the one
    being trained compares the loaded recipe, so the NPU smoke run of docs/ascend.md starts."""
    from workbench.rundir import RunDir
    from workbench.training.train import _rank_recipe

    loaded = recipe.load("smoke", ["devices.platform=npu", "devices.server=[0]", "devices.trainer=[1]",
                                   f"monitor.runs_dir={tmp_path}"])
    run = RunDir.create(loaded, "train")  # as `workbench train` makes it
    rr = recipe.resolve(loaded, platform="npu", versions=_versions("npu"))
    assert rr.recipe.server.dtype == "bfloat16" and launch.trainer_placement(rr) == "process"
    _rank_recipe(rr, run.train.make(), log=lambda *_: None)  # raised "is not the recipe being trained" before
    again = recipe.resolve(recipe.load(str(run.train.recipe)), platform="npu", versions=_versions("npu"))
    assert again.recipe.server.dtype == "bfloat16"  # the trainer process resolves the same dtype
