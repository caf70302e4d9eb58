"""GRPO through the vLLM server, end to end: server up, trainer built, weights synced, metrics kept, model saved.

    workbench train --recipe smoke                 # a new run directory; starts the server, trains, saves, stops it
    workbench train --recipe cpu-tiny trainer.max_steps=50
    workbench train --run-dir runs/<id>            # into an existing run (its recipe.yaml), as notebook 04 does

    from workbench.training.train import train
    result = train(rr, run.train)                  # -> TrainSummary, also saved as run.train.summary

One server per run, started here before any trainer rank; with more than one trainer process (the recipe's
`distributed` section) this node's ranks run under `accelerate launch` (workbench/training/launch.py, rank.py),
every rank gathers the sharded parameters for a weight push, the main rank pushes and is the only one that
writes metrics, device samples, completions and summaries.

On the CPU the server is pinned to the server role's cores and this process to the trainer role's: the CPU
analogue of "four cards serve, four cards train".
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.observe.monitor import Monitor
from workbench.recipe import Resolved
from workbench.rundir import TrainDir, write_atomic
from workbench.serving import sync
from workbench.serving.server import VLLMServer
from workbench.tasks import tinymodel


@dataclass
class TrainSummary:
    """What a finished (or stopped) training reports: saved as train.json, read by the report and the smoke checks."""
    steps: int
    train_seconds: float
    server_start_seconds: float | None
    weight_sync: str
    platform: str
    final_model: str
    stopped_early_at: int | None = None
    monitor: dict = field(default_factory=dict)
    processes: int = 1  # trainer ranks (all nodes)

    def save(self, train_dir: TrainDir) -> Path:
        return write_atomic(train_dir.summary, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, train_dir: TrainDir) -> "TrainSummary | None":
        try:
            raw = json.loads(train_dir.summary.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


@contextlib.contextmanager
def _pinned_to_trainer_cores(rr: Resolved, local_rank: int | None = None):
    """On the CPU, train on the trainer role's cores only (one core per rank when there are several ranks);
    afterwards give this process its cores back (a later stage in the same process, such as the evaluation's
    server, must be able to use the server's cores again)."""
    if rr.platform != "cpu":
        yield
        return
    import torch

    cores = list(rr.trainer.devices)
    if local_rank is not None and rr.trainer_processes > 1:
        cores = [cores[local_rank % len(cores)]]
    saved_cores, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_cores)
        torch.set_num_threads(saved_threads)


def _rank_record(rr: Resolved, accelerator) -> dict:
    """What one rank really got: its process, device, visible devices and the recipe's environment variables."""
    from workbench.recipe.resolve import VISIBLE_DEVICES

    names = sorted(set(rr.recipe.devices.env) | {VISIBLE_DEVICES.get(rr.platform, "")} - {""})
    return {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
            "pid": os.getpid(), "device": str(accelerator.device), "cores": sorted(os.sched_getaffinity(0)),
            "env": {name: os.environ.get(name) for name in names}}


def run_trainer(rr: Resolved, train_dir: TrainDir, model_path: str, server_pid: int | None = None,
                server_url: str | None = None, log=print) -> TrainSummary | None:
    """Build the trainer against a server that already answers, train, save. Runs in the single training
    process or in every rank under `accelerate launch`; only the main rank writes files and returns a summary."""
    from workbench.training.callbacks import JsonlMetrics, StopFlag
    from workbench.training.trainer import build_trainer

    several = rr.trainer_processes > 1 or rr.recipe.distributed.nodes > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if several else None
    weight_sync = sync.make(rr)
    trainer = None
    try:
        with _pinned_to_trainer_cores(rr, local_rank):
            trainer = build_trainer(rr, model_path, train_dir.checkpoints, weight_sync)
            accelerator = trainer.accelerator
            main = accelerator.is_main_process
            ranks = accelerator.gather_for_metrics([_rank_record(rr, accelerator)], use_gather_object=True)
            if main:
                write_atomic(train_dir.ranks, json.dumps(ranks, indent=2))
            trainer.add_callback(JsonlMetrics(train_dir.metrics))
            stop_flag = StopFlag(train_dir, log=log)
            trainer.add_callback(stop_flag)
            if main:
                log(f"training: {trainer.args.max_steps} steps on {accelerator.num_processes} process(es), weight sync "
                    f"{rr.weight_sync!r}, metrics -> {train_dir.metrics}")
            # started inside the pinned block: the sampler thread shares the trainer's cores, so its cost shows in the
            # step time it is measured against; one sampler per run (main rank). Under accelerate the ranks are
            # children of its launcher: that process tree is the trainer role.
            sampler = Monitor(rr, train_dir, server_pid=server_pid, server_url=server_url or rr.server_url,
                              trainer_pid=os.getppid() if several else os.getpid(), enabled=main)
            started = time.time()
            with sampler:
                trainer.train()
            train_seconds = time.time() - started
        trainer.save_model(str(train_dir.final))  # every rank: sharded weights are gathered collectively
        if not main:
            return None
        trainer.processing_class.save_pretrained(str(train_dir.final))
        summary = TrainSummary(steps=trainer.state.global_step, train_seconds=round(train_seconds, 2),
                               server_start_seconds=None, weight_sync=rr.weight_sync, platform=rr.platform,
                               final_model=str(train_dir.final), stopped_early_at=stop_flag.stopped_at,
                               monitor=sampler.overhead(), processes=accelerator.num_processes)
        summary.save(train_dir)
        return summary
    finally:
        # TRL closes its communicator at exit; the workbench's client must too: the reload adapter's weights copy in
        # RAM goes with it, also when training fails
        client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)
        if client is not None:
            client.close_communicator()
        elif isinstance(weight_sync, sync.ReloadSync):
            weight_sync.close()


def _run_ranks(rr: Resolved, train_dir: TrainDir, server_pid: int | None, log) -> None:
    """`accelerate launch` of this node's ranks against the running server; waits, and fails with the log tail."""
    from workbench.serving.server import child_setup
    from workbench.training import launch

    # every rank reads the recipe from disk: it must be this one
    if not train_dir.recipe.exists():
        write_atomic(train_dir.path / "recipe.yaml", rr.recipe.to_yaml())
    elif train_dir.recipe.read_text() != rr.recipe.to_yaml():
        raise WorkbenchError(f"{train_dir.recipe} is not the recipe being trained",
                             "train into a new run directory, or train the recipe that run was made with")
    config = launch.write_accelerate_config(rr, train_dir)
    cmd = launch.rank_command(rr, train_dir)
    log(f"trainer: {rr.trainer_processes} process(es) on this node through accelerate ({config}):\n  {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=launch.rank_environment(rr, server_pid), stdin=subprocess.DEVNULL,
                            preexec_fn=child_setup())
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C or a kill of this process: the ranks go too
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        raise
    if code != 0:
        raise WorkbenchError(f"the trainer ranks exited with status {code}",
                             f"read the rank tracebacks above (and {train_dir.log} when started from a notebook)")


def check_device_split(rr: Resolved) -> None:
    """The server this command starts and the trainer ranks share one node: on an accelerator their cards must
    differ (upstream puts the trainer on the card after the server's TP group, never on one of them)."""
    overlap = set(rr.server.devices) & set(rr.trainer.devices)
    if rr.platform != "cpu" and rr.recipe.server.mode == "managed" and rr.recipe.distributed.node_rank == 0 and overlap:
        raise WorkbenchError(f"devices {sorted(overlap)} are given to both server and trainer on this node",
                             "give devices.server and devices.trainer disjoint device ids")


def train(rr: Resolved, train_dir: TrainDir, log=print) -> TrainSummary | None:
    """Start (or attach to) the server, run GRPO (one process, or this node's ranks through accelerate), save the
    final model in Hugging Face format, stop the server."""
    recipe = rr.recipe
    if recipe.server.mode == "off":
        raise WorkbenchError("server.mode is 'off'", "`workbench train` trains through a vLLM server: set it to managed or attach")
    several = rr.trainer_processes > 1 or recipe.distributed.nodes > 1
    check_device_split(rr)
    model_path = tinymodel.ensure_model(rr, log=log)
    tinymodel.check_tokenizer(model_path)
    train_dir.make()
    if recipe.distributed.node_rank != 0:
        # another node's ranks: the run's one server and its main rank live on node 0; these ranks only compute
        _run_ranks(rr, train_dir, None, log)
        log(f"node {recipe.distributed.node_rank}: ranks done (metrics and the model are written on node 0)")
        return None
    with VLLMServer(rr, model_path, train_dir.path) as srv:
        log(f"server: {srv.url} serving {recipe.server.served_model_name!r}"
            + (f", started in {srv.startup_seconds:.0f}s" if srv.startup_seconds else " (attached)"))
        server_pid = srv.process.pid if srv.process else None
        if several:
            _run_ranks(rr, train_dir, server_pid, log)
            summary = TrainSummary.load(train_dir)
            if summary is None:
                raise WorkbenchError("the trainer ranks ended without a train.json", f"read {train_dir.log}")
        else:
            summary = run_trainer(rr, train_dir, model_path, server_pid, srv.url, log=log)
        try:
            write_atomic(train_dir.server_metrics, srv.metrics())
        except Exception as exc:  # the run is saved; a missing snapshot only costs the rollout summary
            log(f"warning: could not read the server's /metrics ({exc})")
    summary.server_start_seconds = srv.startup_seconds
    summary.save(train_dir)
    overhead = summary.monitor
    log(f"done: {summary.steps} steps in {summary.train_seconds:.0f}s; final model {train_dir.final}"
        + (f"; sampler used {overhead['cpu_seconds']:.2f} CPU-s ({overhead['samples']} samples)" if overhead else ""))
    return summary
