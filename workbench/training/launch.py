"""Starting the trainer: in a separate process for the notebook, and through `accelerate launch` for several ranks.

    from workbench.training import launch
    proc = launch.start_training(run)                  # `workbench train --run-dir RUN` (notebook 04)
    cfg = launch.accelerate_config(rr)                 # the accelerate config the recipe asks for, as a dict
    cmd = launch.rank_command(rr, run.train)           # accelerate launch --config_file RUN/train/accelerate.yaml ...
    launch.trainer_placement(rr)                       # 'accelerate' | 'process' | 'here': where the trainer runs

More than one trainer process (`distributed.processes`, default one per devices.trainer card) goes through
accelerate, the field's engine for it: DDP, DeepSpeed ZeRO or FSDP, NPU / GPU / CPU, one node or several. The
config is generated from the recipe and written into the run directory, so the exact launch can be re-run by hand.
The vLLM server is started once, by the process that runs `accelerate launch`, never by a rank.

Placement: device ids in the recipe are physical. accelerate's launcher *replaces* the visible-devices variable
(CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) with the config's gpu_ids (accelerate/utils/launch.py,
prepare_multi_gpu_env and prepare_deepspeed_cmd_env), so gpu_ids are the trainer role's physical cards, never
0..n-1 (which would be the server's). A single trainer process gets the same variables by being started as a child
with the trainer role's environment: the variables must be set before the device runtime initialises, which in
the parent (which already asked torch about the platform) is too late. tests/test_placement.py runs accelerate's
own launch code on every recipe and checks each rank's cards.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import yaml

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.rundir import RunDir, TrainDir, write_atomic

DISTRIBUTED_TYPE = {"cuda": "MULTI_GPU", "npu": "MULTI_NPU",
                    # accelerate starts multi-process CPU jobs itself only through mpirun; its torch.distributed.run
                    # launcher (MULTI_GPU) with use_cpu gives gloo CPU ranks, which the trainer's use_cpu confirms
                    "cpu": "MULTI_GPU"}


def start_training(run: RunDir, extra_env: dict | None = None, resume: bool = False) -> subprocess.Popen:
    """`workbench train --run-dir RUN` (or `--resume RUN`) in a subprocess; its output to RUN/train/train.log."""
    run.train.make()
    log = open(run.train.log, "ab")
    cmd = [sys.executable, "-m", "workbench", "train", *(["--resume"] if resume else ["--run-dir"]), str(run.path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=os.getcwd())
    finally:
        log.close()  # the child holds its own descriptor


def mixed_precision(rr: Resolved) -> str:
    wanted = rr.recipe.distributed.mixed_precision
    if wanted != "auto":
        return wanted
    if rr.platform == "cpu":
        return "no"
    return "bf16" if rr.recipe.trainer.get("bf16", True) else ("fp16" if rr.recipe.trainer.get("fp16") else "no")


def accelerate_config(rr: Resolved) -> dict:
    """accelerate's cluster config for the recipe (what `accelerate config` would write), as a dict."""
    d = rr.recipe.distributed
    total = rr.trainer_processes * d.nodes
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": DISTRIBUTED_TYPE[rr.platform],
        "num_processes": total,  # accelerate counts every node's processes
        "num_machines": d.nodes,
        "machine_rank": d.node_rank,
        "main_process_ip": d.main_address,
        "main_process_port": d.main_port,
        "rdzv_backend": "static",
        "same_network": True,
        "mixed_precision": mixed_precision(rr),
        "use_cpu": rr.platform == "cpu",
        "downcast_bf16": "no",
        "debug": False,
    }
    if rr.platform != "cpu":
        # accelerate sets the ranks' visible-devices variable to exactly this list (it replaces the inherited one):
        # the trainer role's physical cards; rank i of a node then runs on the i-th of them
        config["gpu_ids"] = ",".join(str(i) for i in rr.trainer.devices)
    if d.strategy == "deepspeed":
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": d.zero_stage,
            "gradient_accumulation_steps": int(rr.recipe.trainer.get("gradient_accumulation_steps", 1)),
            "gradient_clipping": float(rr.recipe.trainer.get("max_grad_norm", 1.0)),
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": d.zero_stage == 3,
            "zero3_save_16bit_model": d.zero_stage == 3,
        }
        if d.nodes > 1:
            # accelerate's default multi-node DeepSpeed launcher is pdsh over a hostfile (ssh into every node);
            # the workbench starts each node's ranks itself, as for DDP and FSDP: torch.distributed.run per node
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    elif d.strategy == "fsdp":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
        }
    return config


def write_accelerate_config(rr: Resolved, train_dir: TrainDir) -> "os.PathLike":
    train_dir.make()
    text = ("# accelerate config generated by the workbench from the run's recipe (distributed section);\n"
            "# re-run by hand: accelerate launch --config_file THIS -m workbench.training.rank --train-dir DIR\n"
            + yaml.safe_dump(accelerate_config(rr), sort_keys=False))
    return write_atomic(train_dir.accelerate_config, text)


def accelerate_executable() -> list[str]:
    """`accelerate` next to this Python (the console script), else the module form."""
    script = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    return [script] if script else [sys.executable, "-m", "accelerate.commands.launch"]


def rank_command(rr: Resolved, train_dir: TrainDir) -> list[str]:
    """The command that starts this node's trainer ranks (the server must already answer)."""
    cmd = accelerate_executable()
    if cmd[-1] != "accelerate.commands.launch":
        cmd.append("launch")
    return cmd + ["--config_file", str(train_dir.accelerate_config), "-m", "workbench.training.rank",
                  "--train-dir", str(train_dir.path)]


def shared_cards(rr: Resolved) -> WorkbenchError | None:
    """A server the training starts on node 0 and that node's trainer given the same card: each role plans the whole
    card for itself (vLLM takes gpu_memory_utilization of it, the trainer the rest of what it finds), so the second
    to start runs out of memory or fights the first for it. Sharing one card on purpose is server.mode=colocate."""
    devices = rr.recipe.devices
    overlap = sorted(set(devices.server) & set(devices.trainer))
    if rr.platform == "cpu" or not rr.recipe.server.managed or not overlap:
        return None
    return WorkbenchError(
        f"devices.server {list(devices.server)} and devices.trainer {list(devices.trainer)} share card(s) {overlap}: "
        "the server and the trainer would each plan those cards' memory for themselves",
        "give devices.server and devices.trainer disjoint device ids (one card for both: server.mode=colocate)")


def placement_problems(rr: Resolved) -> list[WorkbenchError]:
    """What is wrong with the recipe's devices, nodes and strategy, found before any server starts or any run
    directory is written; one error each."""
    # (repeated or negative ids and a node_rank outside 0..nodes-1 are refused by the recipe loader already)
    d, problems = rr.recipe.distributed, []
    shared = shared_cards(rr)
    if shared is not None and d.node_rank == 0:  # another node's ranks run beside no server
        problems.append(shared)
    if d.strategy != "ddp" and rr.trainer_processes * d.nodes == 1:
        problems.append(WorkbenchError(
            f"distributed.strategy={d.strategy} with one trainer process: accelerate is not used, so the strategy "
            "would do nothing", "set distributed.processes (one per trainer card) or distributed.nodes above 1, "
                                "or distributed.strategy=ddp"))
    if d.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        problems.append(WorkbenchError("distributed.strategy=deepspeed but DeepSpeed is not installed",
                                       "pip install 'deepspeed==0.19.8' (`make install` does), or choose ddp / fsdp"))
    return problems


def trainer_processes(rr: Resolved, train_dir: TrainDir, server_pid: int | None = None) -> tuple[list[str], dict]:
    """The command and environment `workbench train` starts this node's trainer with: `accelerate launch` of its
    ranks (the config written into the run directory), or the single trainer process itself; both with the trainer
    role's environment."""
    env = rank_environment(rr, server_pid)
    if trainer_placement(rr) == "accelerate":
        write_accelerate_config(rr, train_dir)
        return rank_command(rr, train_dir), env
    return [sys.executable, "-m", "workbench.training.rank", "--train-dir", str(train_dir.path)], env


def trainer_placement(rr: Resolved) -> str:
    """Where `workbench train` runs the trainer: 'accelerate' (several ranks, or several nodes), 'process' (one
    process started with the trainer role's environment: an accelerator's cards, or variables from devices.env
    that this process lacks) or 'here' (in this process: the CPU, nothing to set)."""
    if rr.trainer_processes > 1 or rr.recipe.distributed.nodes > 1:
        return "accelerate"
    return "process" if (rr.platform != "cpu" or role_env_missing(rr)) else "here"


def role_env_missing(rr: Resolved) -> dict[str, str]:
    """The trainer role's variables this process does not have (with their values)."""
    return {k: v for k, v in rr.trainer.env.items() if os.environ.get(k) != v}


def rank_environment(rr: Resolved, server_pid: int | None = None) -> dict[str, str]:
    """Every trainer process's environment: this one's, the trainer role's variables (visible devices, HCCL
    timeouts, ...) and where the already running server is."""
    env = {**os.environ, **rr.trainer.env, "PYTHONUNBUFFERED": "1"}
    if rr.platform == "cpu":  # DeepSpeed's own device detection would take an NPU or GPU it finds over accelerate's CPU
        env.setdefault("DS_ACCELERATOR", "cpu")
    if server_pid:
        env["WORKBENCH_SERVER_PID"] = str(server_pid)
    return env
