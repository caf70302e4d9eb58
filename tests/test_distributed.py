"""Several trainer processes: real `accelerate launch` ranks (gloo) on the CPU: two nodes on loopback (DDP, one rank
each) through one managed keyed server that is killed and restarted; ZeRO-3 and FSDP2 with two ranks on one node
against the session's keyed server; the accelerate configs the recipes generate, parsed by accelerate itself;
`workbench plan` for one and two nodes. Where each rank lands on an accelerator is tests/test_placement.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import KEYED, SERVER_KEY_ENV, VENV_BIN, free_port, sync_dirs_of, tree
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.records import read_jsonl
from workbench.rundir import RunDir

WORKBENCH = [str(VENV_BIN / "workbench")] if (VENV_BIN / "workbench").exists() else [sys.executable, "-m", "workbench"]


def _server_processes(port: int) -> set[int]:
    """API-server processes of the CPU launcher serving on `port` (other tests' servers and the engine core
    children excluded). Only a group leader counts: the workbench starts each server in its own session, and a
    child the server forks carries the server's command line until it sets its own title, which a 0.2 s poll
    catches now and then (a third "server" in a CI run)."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "workbench.serving.vllm_cpu" in cmd and "serve" in cmd and str(port) in cmd:
            try:
                if os.getpgid(p.info["pid"]) == p.info["pid"]:
                    found.add(p.info["pid"])
            except ProcessLookupError:
                pass
    return found


def _killed_after(servers: set[int], runs: Path, steps: int) -> bool:
    """SIGKILL the process group of one of `servers` once the run under `runs` has logged `steps` steps; True when
    it did."""
    metrics = next(runs.glob("*/train/metrics.jsonl"), None)
    if not (servers and metrics and len([r for r in read_jsonl(metrics) if "loss" in r]) >= steps):
        return False
    os.killpg(os.getpgid(next(iter(servers))), signal.SIGKILL)
    return True


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, tiny_model_dir):
    """Two nodes on loopback, as docs/multi-node.md says to start them: node 0 `workbench train --recipe smoke
    distributed.nodes=2` (the keyed managed server, then its one rank), node 1 `workbench train --recipe
    <node 0's run recipe> distributed.node_rank=1` (no server, one rank); they meet at the rendezvous on
    main_address:main_port. The server is SIGKILLed after step 2: the main rank asks node 0's `workbench train`,
    which owns the server, for a restart (with the key again), and pushes the weights again; node 1's rank waits in
    the collective meanwhile. Returns (node 0's run, server pids seen, node 0's output, most servers at once,
    node 1's run directory)."""
    runs = tmp_path_factory.mktemp("two-nodes")
    runs0, runs1 = runs / "node0", runs / "node1"
    port = free_port()
    before = _server_processes(port)
    ours: set[int] = set()  # every process of the two nodes (their RAM-disk copies must go with them)
    seen: set[int] = set()
    keys: dict[int, str | None] = {}
    at_once: list[int] = []
    done = threading.Event()
    node1: list[subprocess.Popen] = []
    log1 = open(runs / "node1.log", "w")

    def watch() -> None:  # node 1 once node 0 wrote its recipe; every server seen; kill the first after step 2
        killed = False
        while not done.is_set():
            copy = next(runs0.glob("*-smoke-train/recipe.yaml"), None)
            if not node1 and copy is not None:  # what a user copies to the other node and starts there
                node1.append(subprocess.Popen([*WORKBENCH, "train", "--recipe", str(copy), "distributed.node_rank=1",
                                               f"monitor.runs_dir={runs1}"], stdout=log1, stderr=subprocess.STDOUT))
            ours.update(tree())
            now = _server_processes(port) - before
            for pid in now - seen:  # the key each server was started with (it guards the OpenAI routes)
                try:
                    keys[pid] = psutil.Process(pid).environ().get("VLLM_API_KEY")
                except psutil.Error:
                    pass
            seen.update(now)
            at_once.append(len(now))
            killed = killed or _killed_after(now, runs0, steps=2)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = subprocess.run([*WORKBENCH, "train", "--recipe", "smoke", "distributed.nodes=2",
                              "distributed.processes=1", "distributed.main_address=127.0.0.1",
                              f"distributed.main_port={free_port()}", f"server.port={port}", f"monitor.runs_dir={runs0}",
                              "trainer.log_completions=true", "trainer.max_steps=4",
                              # groups of 2 on 2 ranks: a refill's group is split between them (training/dynamic.py)
                              "rollout.dynamic_sampling=true", "monitor.groups_per_step=8",
                              "devices.env.WORKBENCH_TEST_CANARY=from-the-recipe", *KEYED],
                             capture_output=True, text=True, timeout=900)
        code1 = node1[0].wait(timeout=120) if node1 else None
    finally:
        done.set()
        watcher.join()
        for p in node1:  # node 1 would wait 15 minutes at the rendezvous for a node 0 that died
            if p.poll() is None:
                p.kill()
                p.wait()
        log1.close()
    node1_log = (runs / "node1.log").read_text()[-3000:]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + node1_log
    assert code1 == 0, node1_log
    # the reload adapter's copy of the weights in RAM went with the run
    assert ours and not sync_dirs_of(ours - {os.getpid()})
    (run_dir,) = runs0.iterdir()
    (other,) = runs1.iterdir()
    assert set(keys) == seen and set(keys.values()) == {os.environ[SERVER_KEY_ENV]}, "a server started without the key"
    return RunDir(run_dir), seen, out.stdout + out.stderr, max(at_once), other


def test_two_ranks_train_through_one_server(two_rank_run):
    run, servers, output, most, other = two_rank_run
    # one server for both nodes' ranks at any time (node 1 started none); two in all: the first was killed and
    # replaced once
    assert most == 1 and len(servers) == 2, f"server processes seen: {servers}, at most {most} at once"
    assert len(list(run.train.path.glob("vllm-server-*.log"))) == 2  # the dead one's log kept beside the new
    assert other.name.endswith("-train-node1") and not list(other.rglob("vllm-server-*.log"))
    ranks = json.loads(run.train.ranks.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert ranks[0]["parent_pid"] != ranks[1]["parent_pid"]  # each node's own launcher
    assert len({r["recipe"] for r in ranks}) == 1  # both nodes train the same settings
    # the recipe's devices.env reached every rank, and each CPU rank runs on the trainer role's core
    assert all(r["env"]["WORKBENCH_TEST_CANARY"] == "from-the-recipe" for r in ranks)
    assert all(r["cores"] == [1] for r in ranks)
    assert "1 process(es) on this node through accelerate" in output
    assert "workbench train --recipe" in output and "distributed.node_rank=N" in output  # how to start node 1
    config = yaml.safe_load(run.train.accelerate_config.read_text())
    assert (config["num_processes"], config["num_machines"], config["use_cpu"]) == (2, 2, True)
    assert config["main_process_ip"] == "127.0.0.1"
    # each rank's device reaches the dashboard's summary and the report
    from workbench.observe import report
    from workbench.observe.rundata import load
    from workbench.observe.views import summary_rows

    rows = dict(summary_rows(load(run.train)))
    assert rows["trainer rank 0"].startswith("cpu:0, cores [1]") and "trainer rank 1" in rows
    assert "trainer rank 1" in report.build(run).read_text()


def test_two_ranks_refill_the_same_batch_with_dynamic_sampling(two_rank_run):
    """Each rank holds one group of 2 (smoke: 2 completions per rank); a refill's groups straddle the ranks. Both
    ranks took the same decisions (a disagreement would hang a collective) and TRL trained the refilled batch."""
    import pandas as pd

    from workbench.training import dynamic

    run = two_rank_run[0]
    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert all(dynamic.PROMPTS_PER_KEPT in r for r in rows)
    assert any(r[dynamic.PROMPTS_PER_KEPT] > 1 for r in rows)  # groups of 2 are often flat: refills happened
    for r in rows:
        assert r["signal/zero_spread"] == pytest.approx(r[dynamic.UNFILLED])
    for r in rows:
        groups = pd.read_parquet(run.train.group_file(r["step"]))
        assert groups["group"].nunique() == 2 and len(groups) == 4  # both ranks' completions, once each
        spread = groups.groupby("group")["reward"].agg(lambda v: v.max() - v.min())
        assert (spread > 1e-6).sum() == round(2 * (1 - r[dynamic.UNFILLED])), (r["step"], spread)


def test_two_ranks_write_each_record_once_and_stay_in_sync(two_rank_run):
    run, _, _, _, _ = two_rank_run
    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the main rank alone writes: no step twice
    # the server's log-probs track the trainer's after every push (the weights reached the server each step)
    for r in rows:
        assert r["sampling/sampling_logp_difference/mean"] < 1e-4, r  # exact sync: kernel rounding only
    # one push a step; the step whose server was replaced pushed again to the new one (counted once more when the
    # fault hit its generation, not when it hit the push itself, which then never completed)
    counts = [r["sync/count"] for r in rows]
    assert all(c in (1, 2) for c in counts) and sum(counts) in (4, 5), counts
    completions = sorted(run.train.completions.glob("completions_*.parquet"))
    assert len(completions) == 4  # one file per logged step, not one per rank
    summary = json.loads(run.train.summary.read_text())
    assert summary["processes"] == 2 and summary["steps"] == 4 and summary["restarts"] == 1
    kinds = [e["kind"] for e in read_jsonl(run.train.events, normalised=False)]
    assert kinds == ["server_fault", "server_restart"], kinds
    after = [c for c in read_jsonl(run.train.canary, normalised=False) if c["reason"] == "after restart"]
    assert len(after) == 1 and after[0]["gap_mean"] < 1e-4  # the new server got the trained weights
    assert (run.train.final / "model.safetensors").exists()
    devices = read_jsonl(run.train.devices)
    roles = {d["role"] for d in devices if "role" in d}
    assert roles == {"server", "trainer"}
    # the trainer role (the ranks under accelerate) no longer counts the server's memory
    trainer_mb = max(d["mem_used_mb"] for d in devices if d.get("role") == "trainer")
    server_mb = max(d["mem_used_mb"] for d in devices if d.get("role") == "server")
    assert 0 < trainer_mb and 0 < server_mb


@pytest.mark.parametrize("name,processes,distributed_type", [
    ("ascend-910b-8card", 4, "DEEPSPEED"),
    ("ascend-910b-2node", 8, "DEEPSPEED"),
])
def test_accelerate_parses_the_generated_configs(name, processes, distributed_type, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from workbench.rundir import TrainDir
    from workbench.training import launch

    rr = recipe.resolve(recipe.load(name))
    path = launch.write_accelerate_config(rr, TrainDir(tmp_path))
    config = load_config_from_file(str(path))
    assert config.num_processes == processes and config.num_machines == 1
    assert str(config.distributed_type).endswith(distributed_type)
    assert config.deepspeed_config["zero_stage"] == 3
    assert config.mixed_precision == "bf16"
    # the ZeRO section is one DeepSpeed itself accepts (deepspeed is installed by `make install`)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=config.deepspeed_config["zero_stage"],
                             gradient_accumulation_steps=config.deepspeed_config["gradient_accumulation_steps"],
                             gradient_clipping=config.deepspeed_config["gradient_clipping"],
                             zero3_init_flag=config.deepspeed_config["zero3_init_flag"])
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("overrides,expected", [
    (["distributed.strategy=ddp", "distributed.processes=4"], "MULTI_NPU"),
    (["distributed.strategy=fsdp"], "FSDP"),
    (["distributed.nodes=2", "distributed.node_rank=1", "distributed.main_address=10.0.0.2"], "DEEPSPEED"),
])
def test_accelerate_config_variants(overrides, expected, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from workbench.rundir import TrainDir
    from workbench.training import launch

    rr = recipe.resolve(recipe.load("ascend-910b-8card", overrides))
    config = load_config_from_file(str(launch.write_accelerate_config(rr, TrainDir(tmp_path))))
    assert str(config.distributed_type).endswith(expected)
    if "distributed.nodes=2" in overrides:
        assert (config.num_machines, config.machine_rank, config.num_processes) == (2, 1, 8)
        assert config.main_process_ip == "10.0.0.2"


def test_plan_for_one_node(capsys):
    from workbench.cli import main

    assert main(["plan", "--recipe", "ascend-910b-8card"]) == 0
    text = capsys.readouterr().out
    assert "server on devices [0, 1, 2, 3]" in text and "trainer ×4 on devices [4, 5, 6, 7]" in text
    server_env = next(line for line in text.splitlines() if "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in line)
    trainer_env = next(line for line in text.splitlines() if "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7" in line)
    for line in (server_env, trainer_env):  # the recipe's HCCL timeouts reach both roles
        assert "HCCL_CONNECT_TIMEOUT=1800" in line and "HCCL_EXEC_TIMEOUT=1800" in line
    assert "VLLM_ASCEND_ENABLE_NZ=0" in server_env and "VLLM_ASCEND_ENABLE_NZ" not in trainer_env
    assert "vllm serve Qwen/Qwen2.5-7B-Instruct" in text and "--tensor-parallel-size 4" in text
    assert "accelerate launch --config_file" in text and "51216/tcp" in text
    assert "7.62B parameters" in text and "of 64.0 GiB (fits)" in text


def test_plan_memory_estimate_for_7b_bf16_on_64gb_cards():
    from workbench import plan

    rr = recipe.resolve(recipe.load("ascend-910b-8card", ["distributed.strategy=ddp"]))
    p = plan.plan(rr)
    trainer = next(m for m in p.memory if m.role == "trainer")
    gib = {k: v / plan.GIB for k, v in trainer.parts.items()}
    assert abs(gib["weights"] - 7.62e9 * 2 / plan.GIB) < 0.1  # bf16: 2 bytes a parameter
    assert abs(gib["optimizer"] - 2 * gib["weights"]) < 0.1  # AdamW's two moments in bf16
    assert not trainer.fits and trainer.budget == 64 * plan.GIB
    assert any("DeepSpeed" in w or "deepspeed" in w for w in p.warnings)
    sharded = next(m for m in plan.plan(recipe.resolve(recipe.load("ascend-910b-8card"))).memory if m.role == "trainer")
    assert sharded.fits and sharded.total < trainer.total / 2
    no_ckpt = plan.trainer_memory(rr, p.shape, 64 * plan.GIB, checkpointing=False)
    assert no_ckpt.parts["activations"] > 5 * trainer.parts["activations"]


def test_plan_for_two_nodes(capsys):
    from workbench.cli import main

    assert main(["plan", "--recipe", "ascend-910b-2node"]) == 0
    text = capsys.readouterr().out
    server_part, training_part = text.split("== training node")
    assert "== server node (10.0.0.1)" in server_part and "server.mode=managed" in server_part
    assert "--data-parallel-size 2" in server_part and "--host 0.0.0.0" in server_part
    assert "VLLM_API_KEY='$WORKBENCH_SERVER_KEY'" in server_part
    assert "(10.0.0.2)" in training_part and "trainer ×8 on devices [0, 1, 2, 3, 4, 5, 6, 7]" in training_part
    assert "51216/tcp" in training_part and "from the server node" in training_part
    assert "HCCL_SOCKET_IFNAME=eth0" in training_part
    assert "ZeRO-3" in text


def test_remote_reload_needs_a_shared_directory():
    with pytest.raises(WorkbenchError, match="one both machines see"):
        recipe.resolve(recipe.load("cpu-tiny", ["server.mode=attach", "server.url=http://10.9.9.9:8000"]))
    rr = recipe.resolve(recipe.load("cpu-tiny", ["server.mode=attach", "server.url=http://10.9.9.9:8000",
                                                 "server.sync_dir=/mnt/nfs/sync"]))
    assert rr.weight_sync == "reload"


def test_trainer_devices_and_counts_are_checked_up_front():
    with pytest.raises(WorkbenchError, match="one trainer process per card"):
        recipe.resolve(recipe.load("ascend-910b-8card", ["distributed.processes=6"]))
    with pytest.raises(WorkbenchError, match="node_rank"):
        recipe.load("ascend-910b-8card", ["distributed.node_rank=2"])
    from workbench.training.train import check_device_split

    with pytest.raises(WorkbenchError, match=r"share card\(s\)"):
        check_device_split(recipe.resolve(recipe.load("ascend-910b-8card", ["devices.trainer=[3,4,5,6]"])))


# --- the scale strategies, trained for real on the CPU ------------------------------------------------------------
# Two steps that move the weights (no warm-up, a learning rate the tiny model feels, 4 completions a group so that
# step 1's groups have reward spread): only the second push carries trained weights, and the canary after every
# push proves the server holds them.
MOVING = ["trainer.max_steps=2", "monitor.canary_every=1", "trainer.warmup_steps=0", "trainer.learning_rate=1e-3",
          "trainer.num_generations=4", "trainer.per_device_train_batch_size=8"]


def _synced_every_step(run: RunDir, base_model: Path) -> None:
    """Two steps trained, the server's log-probs on the trainer's after every push, the saved model loads and moved."""
    from transformers import AutoModelForCausalLM

    from workbench.training import smoke

    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["grad_norm"] > 0, rows
    assert all(r["sampling/sampling_logp_difference/mean"] < 1e-4 for r in rows), rows
    canary = read_jsonl(run.train.canary, normalised=False)
    assert len(canary) >= 2 and all(c["gap_mean"] < 1e-4 for c in canary), canary
    AutoModelForCausalLM.from_pretrained(run.train.final)
    assert smoke._max_weight_change(base_model, run.train.final) > 0


@pytest.mark.parametrize("strategy", [["distributed.strategy=fsdp"]], ids=["fsdp2"])  # ZeRO-3: the test below
@pytest.mark.timeout(420)  # about a minute here, the session's server already up
def test_sharded_strategies_train_two_ranks_against_the_keyed_server(strategy, tmp_path, restored_server,
                                                                     tiny_model_dir):
    """DeepSpeed ZeRO-3 (its CPU accelerator on gloo) and accelerate's FSDP2 with two ranks on this node, attached
    to the session's keyed server: every rank takes part in gathering the sharded parameters for each push (ZeRO's
    GatheredParameters, FSDP's DTensor.full_tensor), the main rank pushes them."""
    out = subprocess.run([*WORKBENCH, "train", "--recipe", "smoke", "distributed.processes=2", *strategy,
                          f"distributed.main_port={free_port()}", "server.mode=attach",
                          f"server.url={restored_server.url}", *KEYED, f"monitor.runs_dir={tmp_path}", *MOVING],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = [RunDir(p) for p in tmp_path.iterdir()]
    config = yaml.safe_load(run.train.accelerate_config.read_text())
    if "fsdp" in strategy[0]:
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    else:
        assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 3
    assert [r["rank"] for r in json.loads(run.train.ranks.read_text())] == [0, 1]
    _synced_every_step(run, tiny_model_dir)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_zero3_two_ranks_survive_a_killed_server(tmp_path, tiny_model_dir):
    """ZeRO-3 with two ranks and a managed server SIGKILLed once the first step is logged: the main rank asks
    `workbench train` for a restart and pushes its host copy of the last push alone (the other rank waits in its
    collective); the run finishes and the server samples from the trainer's weights at every step after it.
    Without the copy the new server holds the base weights and the canary stops the run (shown once by hand)."""
    port = free_port()
    before = _server_processes(port)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        killed = False
        while not done.is_set():
            now = _server_processes(port) - before
            seen.update(now)
            killed = killed or _killed_after(now, tmp_path, steps=1)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = subprocess.run([*WORKBENCH, "train", "--recipe", "smoke", "distributed.processes=2",
                              "distributed.strategy=deepspeed", "distributed.zero_stage=3",
                              f"distributed.main_port={free_port()}", f"server.port={port}",
                              f"monitor.runs_dir={tmp_path}", *MOVING, "trainer.max_steps=3"],
                             capture_output=True, text=True, timeout=560)
    finally:
        done.set()
        watcher.join()
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-4000:]
    (run,) = [RunDir(p) for p in tmp_path.iterdir()]
    assert len(seen) == 2 and len(list(run.train.path.glob("vllm-server-*.log"))) == 2, seen
    kinds = [e["kind"] for e in read_jsonl(run.train.events, normalised=False)]
    assert kinds.count("server_fault") == 1 and kinds.count("server_restart") == 1 and "server_lost" not in kinds
    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    # every batch after the restart was sampled from the trainer's weights (the base model's would be far off)
    assert all(r["sampling/sampling_logp_difference/mean"] < 1e-4 for r in rows), rows
    canary = read_jsonl(run.train.canary, normalised=False)
    assert canary and all(c["gap_mean"] < 1e-4 for c in canary), canary
    # the proof after the restart: the new server against the lost one's answers for the same push, or, when the
    # fault cut a push, the scheduled canary that follows it
    assert any("after restart" in c["reason"] for c in canary) or "which no server answered for yet" in output
    config = yaml.safe_load(run.train.accelerate_config.read_text())
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 3
    assert [r["rank"] for r in json.loads(run.train.ranks.read_text())] == [0, 1]


def test_cpu_zero_ranks_skip_deepspeeds_shared_memory_op():
    """A CPU ZeRO rank: DeepSpeed's own build_shm_op answers None (the path it takes where the op is unsupported)
    instead of compiling it, which costs a minute on a fresh machine and fails without a C++ compiler."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from workbench.training import rank

    rr = recipe.resolve(recipe.load("smoke", ["distributed.processes=2", "distributed.strategy=deepspeed",
                                              "distributed.zero_stage=3"]))
    saved = dict(deepspeed.ops.__compatible_ops__)
    try:
        rank._deepspeed_cpu_collectives(rr)
        assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
        assert build_shm_op() is None
    finally:
        deepspeed.ops.__compatible_ops__.clear()
        deepspeed.ops.__compatible_ops__.update(saved)
