"""GRPO through the vLLM server, end to end: server up, trainer built, weights synced, metrics kept, model saved.

    workbench train --recipe smoke                 # a new run directory; starts the server, trains, saves, stops it
    workbench train --recipe cpu-tiny trainer.max_steps=50
    workbench train --run-dir runs/<id>            # into an existing run (its recipe.yaml), as notebook 04 does

    from workbench.training.train import train
    result = train(rr, run.train)                  # -> TrainSummary, also saved as run.train.summary

One server per run, started here before any trainer rank; with more than one trainer process (the recipe's
`distributed` section) this node's ranks run under `accelerate launch` (workbench/training/launch.py, rank.py),
every rank gathers the sharded parameters for a weight push, the main rank pushes and is the only one that
writes metrics, device samples, completions and summaries. A single trainer on an accelerator (or with variables
from devices.env) runs as one child process with the trainer role's environment; its output comes through `log`
and its error is raised here as it was raised there. On the CPU with nothing to set, it trains in this process.

On the CPU the server is pinned to the server role's cores and this process to the trainer role's: the CPU
analogue of "four cards serve, four cards train".
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench import tinymodel
from workbench.errors import WorkbenchError
from workbench.platform import limits
from workbench.recipe import Resolved
from workbench.recipe.resolve import VISIBLE_DEVICES
from workbench.records import append_event, read_jsonl, truncate_after
from workbench.rundir import TrainDir, recipe_text, write_atomic
from workbench.secrets import redact
from workbench.serving import sync
from workbench.serving.offline import keep_live_weights, prepare_engine_environment
from workbench.serving.rewards import RewardEngines
from workbench.serving.server import VLLMServer, child_setup, popen
from workbench.training import launch, rewardmodel
from workbench.training.canary import CanaryAlarm
from workbench.training.config import preflight
from workbench.training.gauge import training_cores
from workbench.training.monitor import Monitor
from workbench.training.recovery import Recovery, ServerLost, serve_restart_requests
from workbench.training.scoring import FailureLedger


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
    restarts: int = 0  # server restarts during this training, before a resume too (events.jsonl has each)
    resumed_from: int | None = None  # the checkpoint step a resumed training continued from
    # a LoRA run: {"prefix": its adapters' names on the server, "rank", "bytes": the adapter's weights on disk}
    adapter: dict | None = None
    # completion tokens sampled for training by every rank, refills included (a resumed run: since its resume)
    generated_tokens: int | None = None
    refill_prompts: int | None = None  # extra prompts dynamic sampling generated (training/dynamic.py)
    # requests sent again, every rank, after the server dropped their connection unanswered (serving/sync.py)
    resent_requests: int = 0
    # each learned reward's (serving/rewards.py): requests this rank sent, completions failed on every rank, engine
    # restarts, and its scoring seconds on this rank
    learned_rewards: dict = field(default_factory=dict)

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
    cores = training_cores(rr)
    if local_rank is not None and rr.trainer_processes > 1:
        cores = [cores[local_rank % len(cores)]]
    with limits.on_cores(cores):
        yield


def shared_settings(rr: Resolved) -> str:
    """A digest of the recipe settings every rank on every node must share (the model, what is trained, how, on
    which data, and the distributed layout), less what is each node's own: its node_rank, the main address as it
    names it, local data and model directories (the model by its directory's name)."""
    d = rr.recipe.to_dict()
    model = {k: v for k, v in d["model"].items() if k != "path"} | {"name": Path(str(d["model"]["path"])).name}
    shared = {"model": model, "trainer": d["trainer"], "rewards": d["rewards"], "rollout": d["rollout"],
              "data": {k: v for k, v in d["data"].items() if k != "path"},
              "distributed": {k: v for k, v in d["distributed"].items() if k not in ("node_rank", "main_address")}}
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:12]


def physical_card(device, visible: str | None) -> int | str | None:
    """The physical card a process's device is: its index into the visible-devices list the driver was given (the
    whole machine's numbering when none was)."""
    kind = getattr(device, "type", "cpu")
    if kind == "cpu":
        return None  # the CPU (a rank's device is cpu:0 under accelerate): the cores say where it runs
    index = getattr(device, "index", None)
    if index is None:  # a single process: accelerate gives torch.device("cuda") / ("npu"), the backend's current card
        index = _current_index(kind)
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids:
        return index
    entry = ids[index] if index < len(ids) else None
    return int(entry) if entry is not None and entry.isdigit() else entry


def _current_index(kind: str) -> int:
    """The index an indexless device of backend `kind` means: that backend's current device (0 until a process sets
    another); where the backend cannot say (not initialised, not this build), the process's LOCAL_RANK."""
    import torch

    try:
        return int(torch.get_device_module(kind).current_device())
    except Exception:  # torch without that backend (AssertionError, RuntimeError, AttributeError...)
        return int(os.environ.get("LOCAL_RANK") or 0)


def _rank_record(rr: Resolved, accelerator) -> dict:
    """What one rank really got: its process, device and physical card, visible devices, the recipe's environment
    variables and the digest of its shared settings."""
    visible = VISIBLE_DEVICES.get(rr.platform, "")
    names = sorted(set(rr.recipe.devices.env) | {visible} - {""})
    return {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
            "pid": os.getpid(), "parent_pid": os.getppid(), "device": str(accelerator.device),
            "card": physical_card(accelerator.device, os.environ.get(visible) if visible else None),
            "cores": sorted(os.sched_getaffinity(0)),
            # a devices.env value that looks like a secret (a token passed through to the trainer) is not written
            "env": redact({name: os.environ.get(name) for name in names}), "recipe": shared_settings(rr)}


def check_same_recipe(ranks: list[dict]) -> None:
    """Every rank (each node started its own `workbench train`) trains the same recipe: a node started with other
    settings would go on silently (DDP ranks with different learning rates drift apart) or hang at the end."""
    digests = {r["recipe"] for r in ranks}
    if len(digests) > 1:
        by = {digest: [r["rank"] for r in ranks if r["recipe"] == digest] for digest in sorted(digests)}
        raise WorkbenchError(f"the trainer ranks train different recipes (settings digest: ranks {by})",
                             "start every node from node 0's run recipe: workbench train --recipe RUN/recipe.yaml "
                             "distributed.node_rank=N")


def run_trainer(rr: Resolved, train_dir: TrainDir, model_path: str, server_pid: int | None = None,
                server_url: str | None = None, log=print, restart=None, resume_from: Path | None = None,
                reward_restart: dict | None = None) -> TrainSummary | None:
    """Build the trainer against a server that already answers, train, save. Runs in the single training
    process or in every rank under `accelerate launch`; only the main rank writes files and returns a summary.

    `restart` brings a dead server back (VLLMServer.restart here, a RestartRequest in a rank; None: a server fault
    ends the run); `reward_restart` does the same for each learned reward's engine, by reward name;
    `resume_from` is the checkpoint a resumed training continues from (see prepare_resume)."""
    from workbench.training.callbacks import JsonlMetrics, StopFlag  # lazy: transformers
    from workbench.training.trainer import build_trainer  # lazy: accelerate

    several = rr.trainer_processes > 1 or rr.recipe.distributed.nodes > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if several else None
    weight_sync = sync.make(rr, tag=f"{train_dir.path.parent.name}-{os.getpid()}")
    if isinstance(weight_sync, sync.LoraSync):
        weight_sync.events = train_dir.events  # another run's adapter on the same server: an event of this run
    recovery = Recovery(rr, train_dir, restart, log=log) if restart is not None else None
    trainer = None
    try:
        with _pinned_to_trainer_cores(rr, local_rank):
            if rr.recipe.server.colocated:  # TRL builds a vLLM engine in this process, on its cores
                prepare_engine_environment(rr, cores=sorted(os.sched_getaffinity(0)))
                if rr.platform == "cpu":
                    keep_live_weights()
            trainer = build_trainer(rr, model_path, train_dir.checkpoints, weight_sync, train_dir=train_dir,
                                    recovery=recovery, log=log, reward_restart=reward_restart)
            accelerator = trainer.accelerator
            main = accelerator.is_main_process
            ranks = accelerator.gather_for_metrics([_rank_record(rr, accelerator)], use_gather_object=True)
            check_same_recipe(ranks)  # every rank holds the gathered list: all of them stop together
            if main:
                write_atomic(train_dir.ranks, json.dumps(ranks, indent=2))
                if isinstance(weight_sync, sync.LoraSync):  # how this run's adapters are named on a shared server
                    append_event(train_dir.events, "lora_adapters", f"this run's adapters on the server are named "
                                 f"{weight_sync.prefix}*", prefix=weight_sync.prefix)
            trainer.add_callback(JsonlMetrics(train_dir.metrics))
            stop_flag = StopFlag(train_dir, log=log)
            trainer.add_callback(stop_flag)
            if main:
                log(f"training: {trainer.args.max_steps} steps on {accelerator.num_processes} process(es), weight sync "
                    f"{rr.weight_sync!r}, metrics -> {train_dir.metrics}")
            # started inside the pinned block: the sampler thread shares the trainer's cores, so its cost shows in the
            # step time it is measured against; one sampler per run (main rank). Under accelerate the ranks are
            # children of its launcher: that process tree is the trainer role.
            served = rr.recipe.server.over_http
            sampler = Monitor(rr, train_dir, server_pid=server_pid,
                              server_url=(server_url or rr.server_url) if served else None,
                              trainer_pid=os.getppid() if several else os.getpid(), enabled=main)
            started = time.time()
            with sampler:
                try:
                    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
                except (ServerLost, CanaryAlarm) as exc:
                    raise _stopped_with_checkpoint(trainer, train_dir, exc, several, log) from None
            train_seconds = time.time() - started
        trainer.save_model(str(train_dir.final))  # every rank: sharded weights are gathered collectively
        from accelerate.utils import gather_object  # not gather_for_metrics: it trims to a dataloader's remainder

        generated = sum(gather_object([trainer._generated_total]))
        resent = sum(gather_object([sync.resent_requests()]))
        if not main:
            return None
        trainer.processing_class.save_pretrained(str(train_dir.final))
        summary = TrainSummary(steps=trainer.state.global_step, train_seconds=round(train_seconds, 2),
                               server_start_seconds=None, weight_sync=rr.weight_sync, platform=rr.platform,
                               final_model=str(train_dir.final), stopped_early_at=stop_flag.stopped_at,
                               monitor=sampler.overhead(), processes=accelerator.num_processes,
                               restarts=_restarts_recorded(train_dir),
                               resumed_from=_checkpoint_step(resume_from) if resume_from else None,
                               adapter=_adapter_record(rr, weight_sync, train_dir), generated_tokens=int(generated),
                               refill_prompts=trainer.refill_prompts if trainer.dynamic is not None else None,
                               resent_requests=int(resent), learned_rewards=learned_record(trainer))
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


def learned_record(trainer) -> dict:
    """What each learned reward cost and lost in this training, a resume's earlier part included (the main rank's
    Scorers: its requests and seconds, every rank's failed completions)."""
    from workbench.serving.rewards import Scorer

    return {f.__name__: f.totals() for f in trainer.reward_funcs if isinstance(f, Scorer)}


def _adapter_record(rr: Resolved, weight_sync, train_dir: TrainDir) -> dict | None:
    if not rr.recipe.lora:
        return None
    from workbench.training.export import adapter_bytes

    return {"prefix": getattr(weight_sync, "prefix", None), "rank": rr.recipe.lora_rank,
            "bytes": adapter_bytes(train_dir.final), "shared_with": list(getattr(weight_sync, "others_seen", []))}


def _stopped_with_checkpoint(trainer, train_dir: TrainDir, exc, several: bool, log) -> Exception:
    """A run that cannot go on (server lost, canary alarm): keep a resumable checkpoint of the trainer's state
    when this process holds all of it, and say where to resume from."""
    step = trainer.state.global_step
    if several:  # the other ranks are blocked in a collective: only their last periodic checkpoint counts
        where = _last_checkpoint(train_dir)
        saved = f"resume from {where.name}" if where else "no checkpoint was saved yet"
    else:
        try:
            trainer._save_checkpoint(trainer.model, trial=None)  # model, optimizer, scheduler, RNG, data position
            for callback in trainer.callback_handler.callbacks:  # what transformers' on_save adds to a checkpoint
                if isinstance(callback, FailureLedger):
                    callback.on_save(trainer.args, trainer.state, trainer.control)
            saved = f"checkpoint-{step} saved"
        except Exception as save_error:  # the original cause matters more
            saved = f"no checkpoint ({type(save_error).__name__}: {save_error})"
    append_event(train_dir.events, "failure", f"training stopped at step {step}: {exc.cause}; {saved}", step=step)
    log(f"training stopped at step {step}; {saved}")
    return type(exc)(f"{exc.cause} (training stopped at step {step}; {saved})", exc.fix)


def _restarts_recorded(train_dir: TrainDir) -> int:
    """The server restarts of this training, the part before a resume included (one server_restart event each)."""
    return sum(1 for e in read_jsonl(train_dir.events, normalised=False) if e.get("kind") == "server_restart")


def _checkpoint_step(path: Path) -> int:
    return int(Path(path).name.rsplit("-", 1)[1])


def _last_checkpoint(train_dir: TrainDir) -> Path | None:
    """The newest complete checkpoint."""
    done = train_dir.complete_checkpoints()
    return done[max(done)] if done else None


def prepare_resume(rr: Resolved, train_dir: TrainDir, log=print) -> Path:
    """Make a killed or stopped training continue from its newest checkpoint: what it recorded after that
    checkpoint is dropped (metrics, canary, completions; it is trained and logged again), the stop flag is cleared,
    the interruption is an event. Returns the checkpoint directory."""
    if not train_dir.path.is_dir():
        raise WorkbenchError(f"{train_dir.path} does not exist", "resume a run directory that trained (runs/<id>)")
    checkpoint = _last_checkpoint(train_dir)
    if checkpoint is None:
        raise WorkbenchError(f"{train_dir.checkpoints} holds no complete checkpoint to resume from",
                             "train it anew; set trainer.save_steps to checkpoint more often")
    step = _checkpoint_step(checkpoint)
    max_steps = int(rr.recipe.trainer.get("max_steps", -1))
    summary = TrainSummary.load(train_dir)
    if summary and summary.stopped_early_at is None and summary.steps >= max_steps > 0:
        raise WorkbenchError(f"{train_dir.path} already finished its {max_steps} steps",
                             "raise trainer.max_steps in a new run, or resume a run that was interrupted")
    logged = [r.get("step", 0) for r in read_jsonl(train_dir.metrics, normalised=False)]
    reached = max(logged, default=0)
    dropped = {path.name: truncate_after(path, step)
               for path in (train_dir.metrics, train_dir.canary, train_dir.eval_curve)}
    kept_best = train_dir.best / "best_step.json"
    if kept_best.exists() and json.loads(kept_best.read_text()).get("step", 0) > step:
        shutil.rmtree(train_dir.best)  # the best of a trajectory the resume discards
    for logged_at, parquet in train_dir.completion_logs().items():
        if logged_at > step:
            parquet.unlink()
    train_dir.stop_flag.unlink(missing_ok=True)
    train_dir.summary.unlink(missing_ok=True)
    message = (f"resumed from checkpoint-{step}; the interrupted training had logged up to step {reached} "
               f"({dropped[train_dir.metrics.name]} metrics line(s) after the checkpoint dropped, trained again)")
    append_event(train_dir.events, "resume", message, step=step, reached=reached)
    log(message)
    return checkpoint


def _run_ranks(rr: Resolved, train_dir: TrainDir, server_pid: int | None, log, server=None,
               resume_from: Path | None = None, engines=None) -> None:
    """This node's trainer processes against the running server, with the trainer role's environment: `accelerate
    launch` of its ranks, or the single trainer as one child process; waits, and fails with the log tail."""
    cmd, env = launch.trainer_processes(rr, train_dir, server_pid)
    if launch.trainer_placement(rr) == "accelerate":
        log(f"trainer: {rr.trainer_processes} process(es) on this node through accelerate "
            f"({train_dir.accelerate_config}):\n  " + " ".join(cmd))
    else:
        placed = {k: env[k] for k in sorted(rr.trainer.env) if k in VISIBLE_DEVICES.values()}
        log(f"trainer: one process with the trainer role's environment ({len(rr.trainer.env)} variable(s)"
            + "".join(f", {k}={v}" for k, v in placed.items()) + ")")
    if resume_from is not None:
        cmd += ["--resume-from", str(resume_from)]
    train_dir.failure.unlink(missing_ok=True)
    # the processes' output through `log`: a notebook that called train() shows it as the in-process trainer's
    proc = popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 preexec_fn=child_setup())
    forward = threading.Thread(target=_forward, args=(proc.stdout, log), name="workbench-trainer-output", daemon=True)
    forward.start()
    try:
        while True:  # the main rank may ask for a server restart: this process owns the server
            try:
                code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if server is not None or engines is not None:
                    serve_restart_requests(train_dir, server.restart if server is not None else None, engines)
    except BaseException:  # Ctrl-C or a kill of this process: the ranks go too
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        raise
    finally:
        forward.join(timeout=10)
    if code != 0:
        raise _failure(train_dir) or WorkbenchError(
            f"the trainer process(es) exited with status {code}",
            f"read the tracebacks above (and {train_dir.log} when started from a notebook)")


def _forward(stream, log) -> None:
    for raw in iter(stream.readline, b""):
        log(raw.decode(errors="replace").rstrip("\n"))
    stream.close()


def _failure(train_dir: TrainDir) -> WorkbenchError | None:
    """The error the trainer process stopped with (rank.py writes it), as the class it was: a lost server or a
    canary alarm reads the same as when the trainer ran in this process."""
    try:
        raw = json.loads(train_dir.failure.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    kind = {"ServerLost": ServerLost, "CanaryAlarm": CanaryAlarm}.get(raw.get("kind"), WorkbenchError)
    return kind(raw["cause"], raw.get("fix"))


def _rank_recipe(rr: Resolved, train_dir: TrainDir, log) -> None:
    """Every rank reads the recipe from disk: it must be this one. Node 0 says how the other nodes start."""
    loaded = rr.source or rr.recipe  # the platform's adjustments (bf16 on an NPU) are made again by each process
    if not train_dir.recipe.exists():
        write_atomic(train_dir.own_recipe, recipe_text(loaded))
    elif train_dir.recipe.read_text() not in (recipe_text(loaded), loaded.to_yaml()):
        raise WorkbenchError(f"{train_dir.recipe} is not the recipe being trained",
                             "train into a new run directory, or train the recipe that run was made with")
    nodes = rr.recipe.distributed.nodes
    if nodes > 1 and rr.recipe.distributed.node_rank == 0:
        log(f"the other {nodes - 1} node(s): with a copy of {train_dir.recipe} (every setting, overrides included), "
            f"run on node N (1..{nodes - 1}): workbench train --recipe {train_dir.recipe} distributed.node_rank=N")


def check_device_split(rr: Resolved) -> None:
    """The recipe's devices, nodes and strategy (workbench.training.launch.placement_problems): the first problem."""
    problems = launch.placement_problems(rr)
    if problems:
        raise problems[0]


def train(rr: Resolved, train_dir: TrainDir, log=print, resume: bool = False, checked: bool = False
          ) -> TrainSummary | None:
    """Start (or attach to) the server, run GRPO (one process, or this node's ranks through accelerate), save the
    final model in Hugging Face format, stop the server. `resume`: continue the training in `train_dir` from its
    newest checkpoint (optimizer, scheduler, RNG and data position included). `checked`: the caller already ran
    the preflight (before it wrote the run directory)."""
    recipe = rr.recipe
    own_process = launch.trainer_placement(rr) != "here"  # accelerate's ranks, or one placed child process
    if not checked:
        # the whole GRPOConfig, batch rules, data, rewards, devices and key: before any model build or server start
        preflight(rr)
    resume_from = prepare_resume(rr, train_dir, log) if resume else None
    train_dir.make()
    if own_process:  # every trainer process reads the recipe from disk: checked before the model is built
        _rank_recipe(rr, train_dir, log)
    model_path = tinymodel.ensure_model(rr, log=log)
    tinymodel.check_tokenizer(model_path)
    if recipe.distributed.node_rank != 0:
        # another node's ranks: the run's one server and its main rank live on node 0; these ranks only compute
        _run_ranks(rr, train_dir, None, log, resume_from=resume_from)
        log(f"node {recipe.distributed.node_rank}: ranks done (metrics and the model are written on node 0)")
        return None
    if recipe.server.in_process:  # no server: TRL's in-process generate, or its in-process engine
        if own_process:
            _run_ranks(rr, train_dir, None, log, resume_from=resume_from)
            summary = TrainSummary.load(train_dir)
            if summary is None:
                raise WorkbenchError("the trainer process(es) ended without a train.json", f"read {train_dir.log}")
        else:
            summary = run_trainer(rr, train_dir, model_path, None, None, log=log, resume_from=resume_from)
        log(f"done: {summary.steps} steps in {summary.train_seconds:.0f}s (generation: {recipe.server.mode}); "
            f"final model {train_dir.final}")
        return summary
    managed = recipe.server.managed
    if rewardmodel.needed(rr):  # the tiny reward model, built on first use like the tiny model
        rewardmodel.ensure(rr, log=log)
    with VLLMServer(rr, model_path, train_dir.path, for_training=True) as srv, \
            RewardEngines(rr, train_dir.path, events=train_dir.events, log=log) as engines:
        log(f"server: {srv.url} serving {recipe.server.served_model_name!r}"
            + (f", started in {srv.startup_seconds:.0f}s" if srv.startup_seconds else " (attached)"))
        server_pid = srv.pid
        try:  # counters before this training: the server may have served other stages (a shared server)
            write_atomic(train_dir.server_metrics_start, srv.metrics())
        except Exception:
            train_dir.server_metrics_start.unlink(missing_ok=True)
        if own_process:
            _run_ranks(rr, train_dir, server_pid, log, server=srv if managed else None, resume_from=resume_from,
                       engines=engines)
            summary = TrainSummary.load(train_dir)
            if summary is None:
                raise WorkbenchError("the trainer process(es) ended without a train.json", f"read {train_dir.log}")
        else:
            summary = run_trainer(rr, train_dir, model_path, server_pid, srv.url, log=log,
                                  restart=srv.restart if managed else None, resume_from=resume_from,
                                  reward_restart={name: engines.restarter(name) for name in engines.servers})
        try:
            write_atomic(train_dir.server_metrics, srv.metrics())
        except Exception as exc:  # the run is saved; a missing snapshot only costs the rollout summary
            log(f"warning: could not read the server's /metrics ({exc})")
    summary.server_start_seconds = srv.startup_seconds
    summary.save(train_dir)
    overhead = summary.monitor
    log(f"done: {summary.steps} steps in {summary.train_seconds:.0f}s; final model {train_dir.final}"
        + (f"; {summary.resent_requests} request(s) sent again after the server dropped their connection"
           if summary.resent_requests else "")
        + (f"; sampler used {overhead['cpu_seconds']:.2f} CPU-s ({overhead['samples']} samples)" if overhead else ""))
    return summary
