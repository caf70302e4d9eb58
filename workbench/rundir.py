"""Run directories: the only code that knows the names of the files a run leaves behind.

    run = RunDir.create(recipe, "run")          # runs/<stamp>-<name>-run/, recipe.yaml written once (no secrets)
    run = RunDir.open("runs/<id>")               # an existing run (clear error when it is not one)
    run.train.metrics, run.eval.summary, run.serving.json, run.notebook("04_full_grpo")

One layout for every run, whether `workbench run` executed all stages or `workbench train` only one:

    runs/<stamp>-<name>-<kind>/
        recipe.yaml  environment.json  run.json  report.html  report.png
        tag.json (`workbench tag`: the run's name and note in comparisons, workbench/observe/compare.py)
        notebooks/NN_*.ipynb + .html      logs/NN_*.log
        env.json
        server/  vllm-server-<port>.log (the server shared by serving, smoke and train)  restart.request/.answer
        offline/offline.json
        serving/serving.json  serving.png  vllm-server-<port>.log
        smoke/   (a training directory, below) + smoke_checks.json + recipe.yaml (the smoke variant)
        train/   metrics.jsonl  devices.jsonl  rollout.jsonl  train.json  train.log  server_metrics.prom
                 vllm-server-<port>.log  checkpoints/ (TRL's, with completions/)  final/  STOP
                 groups/step_NNNNNN.parquet (each step's GRPO groups: completions, rewards, advantages)
                 accelerate.yaml (several ranks)  ranks.json (each rank's process, device and environment)
                 failure.json (why a trainer process that `workbench train` started stopped, for it to raise)
        eval/    samples.jsonl  summary.json  comparison.md  comparison.png  vllm-server-<port>-<model>.log
                 analysis.json (base vs trained per problem: fixed, broken, breakdowns by category and length)
        bench/   bench.json  bench.md  bench.png  <size>-<path>/ (a training directory per rollout path)
                 <size>/vllm-server-<port>.log (the server the served paths of one size share)
        lab/     lab.json  lab.md  lab.png (the reward lab: rewards scored, warnings; experiments/rewardlab.py)
        protocol/ protocol.json  protocol.md  runs/<label>/<run>/  logs/<label>.log  server/ (`workbench protocol`;
                 a training that did not finish is kept aside as <run>.incomplete[-N])

    <stamp>-compare/  compare.md  compare.png  compare.json (`workbench compare` without --out: beside the runs)
    servers/          vllm-server-<port>.log (a server started outside any run directory)

Each stage's result type saves and loads itself through these paths (offline, serving sweep, smoke checks,
training summary, evaluation); readers (report, advisor, dashboard, analysis) go through the same object.
Every file is written atomically (`write_atomic`) or appended one whole line at a time, so a reader or a crash
never sees half a file.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.secrets import redact, scrub, scrub_data, secret_values

RECIPE = "recipe.yaml"
STOP = "STOP"
WEIGHTS = "model.safetensors"  # what a Hugging Face save writes (a run's final/ and checkpoints, a base model)
# what peft's save writes for a LoRA run's final/ (and what the adapter sync hands the server): the adapter alone
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LEARNED_REWARDS = "learned-rewards.json"  # in a checkpoint: each learned reward's totals, for a resume to count on
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def checkpoint_path(output_dir: Path | str, step: int) -> Path:
    """transformers' folder for step `step`'s checkpoint under a trainer's output_dir (TrainDir.checkpoints)."""
    return Path(output_dir) / f"checkpoint-{step}"


def write_atomic(path: Path | str, text: str | bytes) -> Path:
    """Write through a temporary file and rename: a reader (or a crash) never sees half a file."""
    path = Path(path)
    # one temporary name per process and thread: two threads writing one file (askers of one restart) must not
    # share the temporary file either
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def recipe_text(recipe) -> str:
    """The recipe as a run directory keeps it (recipe.yaml): no secret in it. Values in the env dicts
    (server.env, devices.env) whose names look secret are redacted, and every known secret value (this process's
    secret-named variables, those env dicts' and the API key's variable) is replaced wherever it appears.
    Stages read this copy: a redacted variable reaches their processes from the environment they inherit instead.
    A recipe without secrets is written exactly as `recipe.to_yaml()`."""
    import yaml

    data = recipe.to_dict()
    envs = {**data["devices"]["env"], **data["server"]["env"]}
    values = secret_values(envs, names=[data["server"].get("api_key_env") or ""])
    clean = scrub_data({**data, "server": {**data["server"], "env": redact(data["server"]["env"], values)},
                        "devices": {**data["devices"], "env": redact(data["devices"]["env"], values)}}, values)
    if clean == data:
        return recipe.to_yaml()
    # the same layout as Recipe.to_yaml; the text is scrubbed again in case the dump split or quoted a value
    return scrub(yaml.safe_dump(clean, sort_keys=False, default_flow_style=False, width=110), values)


def safe_name(name: str) -> str:
    """A recipe name as a path component: no separators, no '..', nothing a shell must quote."""
    cleaned = _SAFE_NAME.sub("-", name).strip(".-")
    return cleaned[:64] or "recipe"


class TrainDir:
    """What one GRPO training writes (the `train/` and `smoke/` stages, or a `workbench train` run)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    metrics = property(lambda self: self.path / "metrics.jsonl")
    devices = property(lambda self: self.path / "devices.jsonl")
    rollout = property(lambda self: self.path / "rollout.jsonl")
    summary = property(lambda self: self.path / "train.json")
    log = property(lambda self: self.path / "train.log")
    server_metrics = property(lambda self: self.path / "server_metrics.prom")
    # the server's counters when this training began: a shared server (workbench run) has served other stages before
    server_metrics_start = property(lambda self: self.path / "server_metrics.start.prom")
    checkpoints = property(lambda self: self.path / "checkpoints")
    completions = property(lambda self: self.path / "checkpoints" / "completions")
    final = property(lambda self: self.path / "final")
    stop_flag = property(lambda self: self.path / STOP)
    smoke_checks = property(lambda self: self.path / "smoke_checks.json")
    accelerate_config = property(lambda self: self.path / "accelerate.yaml")
    ranks = property(lambda self: self.path / "ranks.json")
    failure = property(lambda self: self.path / "failure.json")  # a trainer process's error, raised by its parent
    events = property(lambda self: self.path / "events.jsonl")  # restarts, resumes, canary alarms, failures
    canary = property(lambda self: self.path / "canary.jsonl")  # the weight-parity probe, one line per check
    eval_curve = property(lambda self: self.path / "eval_curve.jsonl")  # the learning curve (training/evalcurve.py)
    # the starting model's distributions on the probes, the drift's reference (training/drift.py)
    drift_reference = property(lambda self: self.path / "drift_reference.pt")
    limits = property(lambda self: self.path / "limits.json")  # the cores' measured limits (training/gauge.py)
    best = property(lambda self: self.path / "best")  # eval.keep_best: the best-scoring step's model
    groups = property(lambda self: self.path / "groups")  # step_NNNNNN.parquet: every GRPO group (training/groups.py)
    restart_request = property(lambda self: self.path / "server-restart.request")  # a rank asks for a new server
    restart_answer = property(lambda self: self.path / "server-restart.answer")
    own_recipe = property(lambda self: self.path / RECIPE)  # a training's own (the smoke variant, a resumed run)

    def reward_restart_files(self, name: str) -> tuple[Path, Path]:
        """A rank asks `workbench train` for a new engine of reward `name` (serving/rewards.py) through these."""
        return self.path / f"reward-{name}-restart.request", self.path / f"reward-{name}-restart.answer"

    def complete_checkpoints(self) -> dict[int, Path]:
        """Step -> checkpoint directory, for those whose trainer_state.json is written (transformers writes it
        last, so a checkpoint cut short by a kill is not among them)."""
        if not self.checkpoints.is_dir():
            return {}
        found = {}
        for path in self.checkpoints.glob("checkpoint-*"):
            step = path.name.rsplit("-", 1)[1]
            if step.isdigit() and (path / "trainer_state.json").exists():
                found[int(step)] = path
        return dict(sorted(found.items()))

    def completion_logs(self) -> dict[int, Path]:
        """Step -> TRL's completions_<step>.parquet (trainer.log_completions), in step order."""
        if not self.completions.is_dir():
            return {}
        found = {}
        for path in self.completions.glob("completions_*.parquet"):
            digits = "".join(c for c in path.stem if c.isdigit())
            if digits:
                found[int(digits)] = path
        return dict(sorted(found.items()))

    def group_file(self, step: int) -> Path:
        return self.groups / f"step_{step:06d}.parquet"

    def group_files(self) -> list[Path]:
        return sorted(self.groups.glob("step_*.parquet")) if self.groups.is_dir() else []

    @property
    def recipe(self) -> Path:
        """This training's recipe: its own (the smoke variant) or else the run's."""
        own = self.path / RECIPE
        return own if own.exists() else self.path.parent / RECIPE

    def exists(self) -> bool:
        return self.metrics.exists() or self.summary.exists()

    def make(self) -> "TrainDir":
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def request_stop(self, reason: str = "requested") -> Path:
        """Ask the training to stop after its current step (it checkpoints first)."""
        self.make()
        return write_atomic(self.stop_flag, f"{reason} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


class StageDir:
    """A stage's output directory with its known files as attributes."""

    def __init__(self, path: Path | str, **files: str):
        self.path = Path(path)
        for attr, name in files.items():
            setattr(self, attr, self.path / name)

    def make(self) -> "StageDir":
        self.path.mkdir(parents=True, exist_ok=True)
        return self


class RunDir:
    """One run's directory and every file name in it."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.recipe = self.path / RECIPE
        self.environment = self.path / "environment.json"
        self.record = self.path / "run.json"
        self.report = self.path / "report.html"
        self.screenshot = self.path / "report.png"
        self.tag = self.path / "tag.json"  # `workbench tag`: {"name", "note", "tagged"}
        self.env_check = self.path / "env.json"
        self.notebooks = self.path / "notebooks"
        self.logs = self.path / "logs"
        self.offline = StageDir(self.path / "offline", json="offline.json")
        self.serving = StageDir(self.path / "serving", json="serving.json", figure="serving.png")
        self.eval = StageDir(self.path / "eval", samples="samples.jsonl", summary="summary.json",
                             table="comparison.md", figure="comparison.png", analysis="analysis.json")
        self.bench = StageDir(self.path / "bench", json="bench.json", table="bench.md", figure="bench.png")
        self.lab = StageDir(self.path / "lab", json="lab.json", table="lab.md", figure="lab.png")
        # `workbench protocol`: the choice on validation and the result on test; each training's run under runs/
        self.protocol = StageDir(self.path / "protocol", json="protocol.json", table="protocol.md", runs="runs",
                                 logs="logs", server="server")
        # the vLLM server `workbench run` shares between its serving, smoke and training stages, and its restart
        # requests (workbench/pipeline.py _SharedServer)
        self.server = StageDir(self.path / "server")
        self.smoke = TrainDir(self.path / "smoke")
        self.train = TrainDir(self.path / "train")

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @classmethod
    def create(cls, recipe, kind: str = "run", root: Path | str | None = None) -> "RunDir":
        """A fresh directory under monitor.runs_dir named by time, recipe and kind; the resolved recipe written
        in it, once, without secrets (`recipe_text`): every stage and process of the run reads this file."""
        path = _fresh(Path(root or recipe.monitor.runs_dir), f"{safe_name(recipe.name)}-{safe_name(kind)}")
        path.mkdir(parents=True)
        run = cls(path)
        write_atomic(run.recipe, recipe_text(recipe))
        return run

    @classmethod
    def at(cls, path: Path | str, recipe=None) -> "RunDir":
        """The run at `path`, created if missing; the recipe is written when the run has none yet."""
        run = cls(path)
        run.path.mkdir(parents=True, exist_ok=True)
        if recipe is not None and not run.recipe.exists():
            write_atomic(run.recipe, recipe_text(recipe))
        return run

    @classmethod
    def latest(cls, root: Path | str, recipe_name: str, kind: str, recipe=None) -> "RunDir | None":
        """The newest run under `root` that `create` made for this recipe and kind (names start with the time);
        with `recipe`, only one whose recipe.yaml is that recipe, every override included."""
        # exactly `<stamp>-<recipe>-<kind>` or its `-N` twin: "cpu-tiny" must not find "my-cpu-tiny" or "cpu-tiny-x"
        pattern = re.compile(r"(\d{8}-\d{6})-" + re.escape(f"{safe_name(recipe_name)}-{safe_name(kind)}") + r"(?:-(\d+))?")
        found = []
        for p in Path(root).glob("*") if Path(root).is_dir() else []:
            m = pattern.fullmatch(p.name)
            if m and (p / RECIPE).is_file() and (recipe is None or (p / RECIPE).read_text() == recipe_text(recipe)):
                found.append(((m.group(1), int(m.group(2) or 1)), p))
        return cls(max(found)[1]) if found else None

    def eval_models(self) -> dict[str, str]:
        """What an evaluation of this run compares: the recipe's base, and the trained model when the training
        saved one (a model, or a LoRA run's adapter)."""
        models = {"base": "base"}
        if trained_weights(self.train.final).exists():
            models["trained"] = str(self.train.final)
        return models

    @classmethod
    def open(cls, path: Path | str) -> "RunDir":
        """An existing run; a stage directory (RUN/train) or a missing path is a clear error."""
        path = Path(path)
        if not path.is_dir():
            raise WorkbenchError(f"no run directory {path}", "pass a directory under runs/ (see `ls runs`)")
        if path.name in ("train", "smoke", "eval", "serving", "offline") and (path.parent / RECIPE).exists() \
                and not (path / RECIPE).exists():
            raise WorkbenchError(f"{path} is the '{path.name}' stage of the run {path.parent}",
                                 f"pass the run directory itself: {path.parent}")
        return cls(path)

    def notebook(self, name: str) -> Path:
        return self.notebooks / f"{name}.ipynb"

    def notebook_page(self, name: str) -> Path:
        """The executed notebook as HTML beside it."""
        return self.notebooks / f"{name}.html"

    def protocol_log(self, label: str) -> Path:
        """The output of one `workbench protocol` training (its label: candidate, seed, split)."""
        return self.protocol.logs / f"{label}.log"

    def bench_training(self, size: str, path: str, repeat: int = 0) -> TrainDir:
        """One rollout path's training at one model size, in `workbench bench` (its first repeat, or a later one)."""
        return TrainDir(self.bench.path / (f"{size}-{path}" + (f"-r{repeat + 1}" if repeat else "")))

    def bench_server_logs(self, size: str) -> Path:
        """The logs of the server the served paths of one size share, in `workbench bench`."""
        return self.bench.path / size

    def stage_log(self, name: str) -> Path:
        return self.logs / f"{name}.log"



def _unused(path: Path) -> Path:
    """`path`, or when it exists `path-2`, `path-3`...: the first that does not."""
    found, suffix = path, 1
    while found.exists():
        suffix += 1
        found = path.with_name(f"{path.name}-{suffix}")
    return found


def _fresh(base: Path, name: str) -> Path:
    """A path under `base` named `<stamp>-<name>` that does not exist yet."""
    return _unused(base / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}")


def comparison(out: Path | str | None = None, beside: Path | str | None = None) -> StageDir:
    """What `workbench compare` writes: compare.md, compare.png, compare.json, into `out`, or else into a new
    `<stamp>-compare/` in the directory `beside` (the runs directory of the first run compared)."""
    path = Path(out) if out else _fresh(Path(beside), "compare")
    return StageDir(path, table="compare.md", figure="compare.png", json="compare.json")


def weights(model_dir: Path | str) -> Path:
    """The weights file of a saved model directory (final/, a checkpoint, a base model)."""
    return Path(model_dir) / WEIGHTS


def is_adapter(model_dir: Path | str) -> bool:
    """A peft adapter directory (a LoRA run's final/): its config, no config.json of a model of its own."""
    return (Path(model_dir) / ADAPTER_CONFIG).is_file() and not (Path(model_dir) / "config.json").is_file()


def trained_weights(model_dir: Path | str) -> Path:
    """The weights a training saved in `model_dir`: the model's, or a LoRA run's adapter's."""
    return Path(model_dir) / (ADAPTER_WEIGHTS if is_adapter(model_dir) else WEIGHTS)


def set_aside(directory: Path) -> Path:
    """Where an unfinished directory is moved so it can be started again: `<name>.incomplete`, then -2, -3..."""
    return _unused(directory.with_name(f"{directory.name}.incomplete"))


def loose_server_logs(runs_dir: Path | str) -> Path:
    """Where a server started outside any run directory logs: <runs_dir>/servers/."""
    return Path(runs_dir) / "servers"


def server_restart_files(directory: Path | str) -> tuple[Path, Path]:
    """The request and answer files through which a training asks its owner for a new server."""
    return Path(directory) / "restart.request", Path(directory) / "restart.answer"


def kept_server_log(log_path: Path, restart: int) -> Path:
    """Where a dead server's log is kept when its replacement starts: vllm-server-<port>.before-restart-N.log."""
    return log_path.with_name(f"{log_path.stem}.before-restart-{restart}.log")


def server_log(directory: Path | str, port: int, name: str | None = None) -> Path:
    """Where a managed server started for a stage writes its output; `name` tells apart the servers of one stage
    (the evaluation serves each model in turn: vllm-server-<port>-<model>.log)."""
    suffix = f"-{name}" if name else ""
    return Path(directory) / f"vllm-server-{port}{suffix}.log"
