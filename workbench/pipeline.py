"""`workbench run`: the staged notebooks, executed in order with papermill, into one run directory.

    workbench run --recipe cpu-tiny                          # what `make demo` runs: all six stages
    workbench run --recipe cpu-tiny --stages env,offline     # a subset, in the canonical order
    workbench run --recipe cpu-tiny trainer.max_steps=50     # overrides reach every notebook

Each stage is a notebook (workbench/notebooks/, package data), run on the project's kernel with the run's
recipe.yaml and the run directory as parameters; the layout of that directory is workbench/rundir.py's.

The first failing stage stops the run: its executed notebook keeps the traceback, the message names the stage,
the notebook and the log, and the report is still written from whatever the run produced. A kernel that dies (an
out-of-memory kill shows as nbclient's DeadKernelError) or a cell that times out fails its stage the same way; the
stage log keeps the kernel's last output.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform as platform_module
import sys
import time
from pathlib import Path

from workbench import envcheck, paths
from workbench.errors import WorkbenchError
from workbench.notebook import kernel_name
from workbench.observe.rundata import load
from workbench.recipe import Resolved
from workbench.rundir import RunDir, write_atomic
from workbench.secrets import redact, scrub, scrub_data
from workbench.tinymodel import ensure_model
from workbench.training.config import preflight

STAGES = {
    "env": "00_env_check",
    "offline": "01_offline_generation",
    "serving": "02_serving",
    "smoke": "03_smoke_grpo",
    "train": "04_full_grpo",
    "eval": "05_evaluation",
}
# notebooks to work in that are not pipeline stages (`workbench run` never runs them)
TOOLS = {
    "bench": "06_bench",
    "compare": "07_compare",
    "reward-lab": "08_reward_lab",
}
# Environment variables worth recording (values of secret-looking names are redacted in the report too).
RECORDED_PREFIXES = ("CUDA_", "ASCEND_", "HCCL_", "NCCL_", "VLLM_", "OMP_", "PYTORCH_", "TORCH_", "HF_", "WORKBENCH_")


def environment_summary() -> dict:
    import psutil

    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_PREFIXES)}
    # by name, then by value: a secret copied into a variable of another name (or a path, a URL) goes too
    return scrub_data({"python": sys.version.split()[0], "machine": platform_module.platform(),
                       "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                       "versions": {k: v for k, v in envcheck.installed_versions().items() if v},
                       "variables": redact(variables), "kernel": kernel_name()})


def stage_parameters(stage: str, run: RunDir, resuming: bool = False) -> dict:
    """Every notebook loads the run's resolved recipe (a name could mean something else tomorrow), with no
    further overrides (they are already in it), and writes into the run directory. A resumed run's training
    continues from its newest checkpoint when it has one."""
    params: dict = {"recipe": str(run.recipe), "overrides": [], "run_dir": str(run.path)}
    if stage == "train" and resuming and run.train.complete_checkpoints():
        params["resume"] = True
    if stage == "eval":
        params["models"] = run.eval_models()
    return params


def export_html(notebook: Path, out: Path) -> Path:
    """The executed notebook as HTML (at `out`), readable offline: no MathJax or require.js from a CDN, and no
    widget loader (widget views need it to render and cannot offline; the static figure and tables are there)."""
    import re

    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    nb.metadata.pop("widgets", None)
    body, _ = HTMLExporter(mathjax_url="", require_js_url="").from_notebook_node(nb)
    body = re.sub(r"<script[^>]*\ssrc=[\"']{2}[^>]*>\s*</script>", "", body)
    return write_atomic(out, body)


class _StderrTo:
    """Point this process's stderr (fd 2) at a file while a stage runs: the kernel papermill starts inherits it,
    so its own warnings and C-level output (vLLM, the NUMA binder) land in the stage log, not the terminal."""

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)


# the evaluation loads each model it scores into the shared server (evaluation/evaluate.py), so it shares it too
SHARED_STAGES = ("serving", "smoke", "train", "eval")


class _SharedServer:
    """One vLLM server for a run's serving, smoke, training and evaluation stages instead of one per stage (and
    per evaluated model; serving/shared.py): started before the first of those stages (the model exists by then),
    stopped after the last; without it (a failed start) every stage starts its own server as before."""

    def __init__(self, rr: Resolved, run: RunDir, stages: list[str], log):
        from workbench.serving.shared import SharedServer  # lazy: requests

        self.rr, self.run, self.log = rr, run, log
        self.stages = [s for s in stages if s in SHARED_STAGES]
        self.wanted = rr.recipe.server.managed and len(self.stages) >= 2
        self.shared = SharedServer(run.server.path, log)
        self.record: dict = {}

    def open(self) -> None:
        if not self.wanted:
            return

        self.wanted = False  # one attempt
        try:
            srv = self.shared.open(self.rr, ensure_model(self.rr, log=self.log))
        except Exception as exc:  # each stage then starts its own and reports the failure in its notebook
            self.log(f"   (no shared server: {str(exc).splitlines()[0][:200]}; each stage starts its own)")
            return
        self.record = {"url": srv.url, "startup_seconds": round(srv.startup_seconds or 0, 1), "stages": self.stages,
                       "log": str(srv.log_path.relative_to(self.run.path))}
        self.log(f"   shared by {', '.join(self.stages)}")

    @contextlib.contextmanager
    def answering(self):
        try:
            with self.shared.answering():
                yield
        finally:
            if self.shared.restarts:
                self.record["restarts"] = self.shared.restarts

    def close(self) -> None:
        self.shared.close()


class _Heartbeat:
    """While a stage runs, a line every `every` seconds: the notebook's output goes to its log, and a silent
    terminal for the length of a training run looks like a hang. For the training stage it tells the step."""

    def __init__(self, stage: str, run: RunDir, log, every: float = 30.0):
        import threading

        self.stage, self.run, self.log, self.every = stage, run, log, every
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _line(self) -> str:
        elapsed = f"{time.time() - self.started:.0f}s"
        if self.stage != "train" or not self.run.train.metrics.exists():
            return f"   ... {self.stage} running ({elapsed})"

        data = load(self.run.train)
        prog, rows = data.progress(), data.train_metrics
        reward = f", reward {rows[-1]['reward']:.3f}" if rows and "reward" in rows[-1] else ""
        eta = f", ETA {prog['eta_seconds'] / 60:.1f} min" if prog["eta_seconds"] is not None else ""
        return f"   ... train step {prog['step']}/{prog['max_steps']}{reward}{eta} ({elapsed})"

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.log(self._line())
            except Exception:  # a heartbeat must never fail a stage
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def run(rr: Resolved, stages: list[str] | None = None, log=print, resume: RunDir | None = None) -> Path:
    """Run the stages' notebooks into a new run directory, or (`resume`) continue an interrupted run in its own
    directory: the stages that passed are kept, the others run again, a training continues from its checkpoint."""
    import papermill

    from workbench.observe import report  # lazy: matplotlib

    stages = list(stages or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise WorkbenchError(f"unknown stage(s) {unknown}", f"choose from {', '.join(STAGES)}")
    stages = [s for s in STAGES if s in stages]  # canonical order: eval after train, whatever was typed
    notebooks = paths.notebooks_dir()
    missing = [STAGES[s] for s in stages if not (notebooks / f"{STAGES[s]}.ipynb").exists()]
    if missing:
        raise WorkbenchError(f"notebooks missing: {missing}", f"reinstall the package: they ship in {notebooks}")
    if {"smoke", "train"} & set(stages):
        preflight(rr)  # the training's checks before the first notebook starts, not an hour into the run
    kernel = kernel_name()
    recipe = rr.recipe
    if resume is not None:
        run = RunDir(resume.path.resolve())
        try:
            record = json.loads(run.record.read_text())
        except (OSError, json.JSONDecodeError):
            raise WorkbenchError(f"{run.record} is missing or unreadable", "resume a run made by `workbench run`") from None
        done = [s for s in stages if (record.get("results", {}).get(s) or {}).get("status") == "passed"]
        stages = [s for s in stages if s not in done]
        record.pop("failed_stage", None)
        record.pop("error", None)
        record.setdefault("started", time.time())
        record.setdefault("results", {})
        record.setdefault("resumed", []).append({"time": time.time(), "kept": done, "again": stages})
        log(f"resuming {run.path}: kept {', '.join(done) or 'nothing'}; running {', '.join(stages) or 'nothing'}")
    else:
        run = RunDir.create(recipe, "run")
        run = RunDir(run.path.resolve())
        record = {"recipe": recipe.name, "stages": stages, "kernel": kernel, "results": {}, "started": time.time()}
    run.notebooks.mkdir(exist_ok=True)
    run.logs.mkdir(exist_ok=True)
    write_atomic(run.environment, json.dumps(environment_summary(), indent=2))
    log(f"run directory: {run.path}  (kernel {kernel}; stages {', '.join(stages)})")
    shared = _SharedServer(rr, run, stages, log)
    try:
        for stage in stages:
            name = STAGES[stage]
            executed = run.notebook(name)
            stage_log = run.stage_log(name)
            started = time.time()
            log(f"== {stage}: {name}.ipynb  (log: {stage_log})")
            result = {"status": "running", "notebook": str(executed.relative_to(run.path)),
                      "log": str(stage_log.relative_to(run.path))}
            record["results"][stage] = result
            write_atomic(run.record, json.dumps(record, indent=2))
            failure: BaseException | None = None
            try:
                params = stage_parameters(stage, run, resuming=resume is not None)
                if stage in shared.stages:
                    shared.open()
                    if shared.record:
                        record["shared_server"] = shared.record
                with open(stage_log, "a") as out, _StderrTo(out), _Heartbeat(stage, run, log), shared.answering():
                    papermill.execute_notebook(
                        str(notebooks / f"{name}.ipynb"), str(executed), kernel_name=kernel,
                        parameters=params,
                        cwd=os.getcwd(), progress_bar=False, log_output=False, stdout_file=out, stderr_file=out)
                result["status"] = "passed"
            except Exception as exc:  # any way a stage can end short: a failed stage, its log, and the report
                failure = exc
                result["status"] = "failed"
                record["failed_stage"] = stage
                record["error"] = scrub(_stage_error(exc))[:500]
                with open(stage_log, "a") as out:  # the log ends with why, after the kernel's last output
                    out.write(f"\nworkbench: stage '{stage}' failed: {record['error']}\n")
            finally:
                result["seconds"] = round(time.time() - started, 1)
                if executed.exists():
                    try:
                        result["html"] = str(export_html(executed, run.notebook_page(name)).relative_to(run.path))
                    except Exception as exc:  # an export problem must not hide the stage's own result
                        log(f"   (HTML export failed: {exc})")
            log(f"   {stage}: {result['status']} in {result['seconds']:.0f}s")
            if shared.stages and stage == shared.stages[-1]:
                shared.close()
            if result["status"] == "failed":
                write_atomic(run.record, json.dumps(record, indent=2))
                report_path = report.build(run)
                raise WorkbenchError(
                    f"stage '{stage}' failed: {record['error']}",
                    f"read the traceback in {executed} (HTML: {run.notebook_page(name)}) and the log "
                    f"{stage_log}; the report so far is {report_path}") from failure
    finally:
        shared.close()
        record["seconds"] = round(time.time() - record["started"], 1)
        write_atomic(run.record, json.dumps(record, indent=2))
    report_path = report.build(run)
    _print_outcome(run, log)
    log("stage times (s): " + ", ".join(f"{s} {record['results'][s]['seconds']:.0f}" for s in stages))
    log(f"report: {report_path}")
    return run.path


def _stage_error(exc: BaseException) -> str:
    """One line for run.json and the report: what ended the stage's notebook."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    def line(text) -> str:
        return " ".join(str(text).split())

    if isinstance(exc, PapermillExecutionError):  # a cell raised: its traceback is in the executed notebook
        return f"{exc.ename}: {line(exc.evalue)}"
    if isinstance(exc, DeadKernelError):
        # nothing in the notebook says why: the kernel was killed (the OOM killer's SIGKILL shows as exactly this),
        # crashed in native code, or exited
        return (f"DeadKernelError: the kernel died while the stage ran ({line(exc)}); an out-of-memory kill shows as "
                "a dead kernel (see `dmesg` or the container's memory limit); the stage log holds its last output")
    if isinstance(exc, CellTimeoutError):
        return f"CellTimeoutError: a cell ran past the execution timeout ({line(exc)})"
    return f"{type(exc).__name__}: {line(exc)}"


def _print_outcome(run: RunDir, log) -> None:
    from workbench.evaluation.evaluate import Evaluation  # lazy: requests

    evaluation = Evaluation.load(run.eval)
    pair = evaluation.gain() if evaluation else None
    if pair:
        base, trained = pair
        log(f"{trained.split_label} accuracy {100 * base.accuracy_mean:.1f}% -> {100 * trained.accuracy_mean:.1f}% "
            f"({100 * (trained.accuracy_mean - base.accuracy_mean):+.1f} points) on {trained.n} problems")
