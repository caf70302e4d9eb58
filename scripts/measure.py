"""Every figure the README and docs/results.md state, measured on the current commit.

    make measure                                  # python scripts/measure.py --quick: the demo and the tiny bench
    MEASURE=--full make measure                   # + the bench at ~100M, its reload part by part
                                                  #   (scripts/reload_parts.py), the protocol over 3 bases x 3 seeds,
                                                  #   dynamic sampling over the same bases and seeds (variants),
                                                  #   LoRA against full fine-tuning (lora), the recipe's learning
                                                  #   rate chosen on validation (choice), make test
    python scripts/measure.py --only lora         # one measurement (demo, bench, bench-100m, reload, protocol,
                                                  #   variants, lora, choice, suite)
    python scripts/measure.py --status            # per measurement: fresh, or which later commit staled it
    python scripts/measure.py --suite JUNIT.xml --commit SHA   # the suite's timing, from `make test`'s JUnit XML
    python scripts/measure.py --render            # docs/results.md and the README's block, from the files alone

Each measurement runs the workbench's own commands (`workbench run`, `workbench bench`, `workbench protocol`; the
reload's parts: vLLM's own reload, timed in-process) into runs/measure-<time>/ and writes docs/results/<name>.json:
the commit it ran on, the code it measured (the last commit up to it that changed what the measurement depends
on, MEASURED, and that commit's date), whether the tree was clean, the date, the machine (CPU model and vector
extensions, cores, memory), the versions, the command and its figures. docs/results.md, the block between the
README's `<!-- measured:begin -->` and `<!-- measured:end -->` lines and the `<!-- measured:begin NAME -->` blocks
of other docs pages are rendered from those files and nothing else (tests/test_results.py).

Figures are labelled, never frozen: a commit that changes measured code after a measurement leaves its figures in
place, named by the code they measured; `--status` (`make status`, printed at the end of every CI run) says per
measurement whether later commits changed that code, the first of them and how many.

The measurements over base models and seeds (protocol, variants, lora) run one arm at a time: an arm is one
training on one base with one seed, scored on the test split (`workbench protocol --report-all` restricted to that
base and seed). Each finished arm is written at once to docs/results/pieces/<name>/<arm>.json, keyed by the code,
the arm's command, the machine and the versions. Running the measurement again (in this session or a later one,
once the pieces are committed) skips the arms already measured on the same key and goes on; any other key starts
the measurement afresh. The results file is written only when every arm is done, and the pieces are then removed.

A measurement refuses a tree whose measured code has uncommitted changes (the figure would name a commit that is
not what ran). The suite's timing is measured by running the suite, so it is always of a commit before the one
that records it, or of this one with the results still uncommitted (its commit and date are shown beside it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PIECES = RESULTS / "pieces"  # the finished arms of a measurement over bases and seeds, until all are done
PAGE = REPO / "docs" / "results.md"
README = REPO / "README.md"
BEGIN, END = "<!-- measured:begin -->", "<!-- measured:end -->"

DEMO_RECIPE = "cpu-tiny-async"  # what `make demo` runs
BENCH_RECIPE = "cpu-tiny"
PROTOCOL_DATA_SEEDS = "0,1,2"
PROTOCOL_SEEDS = "1,2,3"
# Dynamic sampling against plain GRPO (the demo's recipe): the variant's own protocol over the protocol's bases and
# training seeds. Its plain arm is the protocol measurement: a training repeats itself under fixed seeds
# (workbench/training/seeding.py), so training the recipe again here would repeat those trainings, an hour on two
# cores. The two are compared only when measured on one commit and one machine. Dynamic sampling spends more
# generation per step, so it trains fewer steps, to about the plain arm's generated tokens
# (docs/async-and-bench.md).
VARIANT = ("dynamic", ["rollout.dynamic_sampling=true", "trainer.max_steps=180"])
# LoRA against full fine-tuning (docs/lora.md): the recipe with a rank-16 adapter on every linear layer at ten times
# the recipe's learning rate (the usual rule for LoRA, fixed beforehand: not chosen on any split), on one base model
# (data seed 0) with the protocol's training seeds. Its full arm is the protocol's trainings of that base and those
# seeds (the same trainings under fixed seeds), compared only on the same code and machine, as the variants are.
LORA = ("lora", ["peft.r=16", "peft.lora_alpha=32", "peft.target_modules=all-linear", "trainer.learning_rate=5e-4"])
LORA_DATA_SEEDS = "0"
# A learned reward against the correctness rule (docs/rewards.md): cpu-tiny-rm (trained on the tiny reward model,
# scored by its own vLLM pooling engine beside the server; the rule logged at weight 0) against the same recipe
# trained on the rule (the reward model scored and logged at weight 0), one base model (data seed 0, the base tiny-rm
# is built on) x the protocol's training seeds, both arms in one protocol: paired by seed, on one code and machine.
REWARDS_COMMAND = ["protocol", "--recipe", "cpu-tiny-rm", "--report-all", "--seeds", PROTOCOL_SEEDS,
                   "--candidate", "rule: rewards.correctness=1.0 rewards.preference.weight=0.0"]
RM_COMMAND = ["reward-model", "--recipe", "cpu-tiny-rm", "--force"]
# The recipe's learning rate, chosen on the validation split against these candidates over the protocol's bases
# (training seed 0), then the chosen setting trained with seed 1 on test: `workbench protocol`'s own choice. Under
# fixed seeds, the recipe's seed-1 test trainings repeat the protocol measurement's (results page: the check).
CHOICE = [("lr 1e-4", "trainer.learning_rate=1e-4"),
          ("lr 1.5e-4 warm-up 30", "trainer.learning_rate=1.5e-4 trainer.warmup_steps=30")]

# What each measurement's figures depend on: a commit touching one of these after the measured commit makes the
# figures stale (`--status`; a label, not a failure). The notebooks `workbench run` executes are package data
# (workbench/notebooks).
MEASURED = {
    "demo": ["workbench", "pyproject.toml", "Makefile"],
    "bench": ["workbench", "pyproject.toml"],
    "bench-100m": ["workbench", "pyproject.toml"],
    "protocol": ["workbench", "pyproject.toml"],
    "variants": ["workbench", "pyproject.toml"],
    "lora": ["workbench", "pyproject.toml"],
    "choice": ["workbench", "pyproject.toml"],
    "reload": ["workbench", "pyproject.toml", "scripts/reload_parts.py"],
    "suite": ["workbench", "tests", "pyproject.toml", "Makefile"],
    "reward-model": ["workbench", "pyproject.toml", "scripts/judge_agreement.py"],
    "rewards": ["workbench", "pyproject.toml"],
}
QUICK = ["demo", "bench"]
FULL = ["demo", "bench", "bench-100m", "reload", "protocol", "variants", "lora", "choice", "reward-model", "rewards",
        "suite"]


# ----------------------------------------------------------------------------------------------------------------
# Where and on what

def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def code_commit(name: str, commit: str, cwd: Path = REPO) -> str:
    """The last commit, up to `commit`, that changed what measurement `name` depends on (MEASURED): two results
    files with the same code commit measured the same code, whatever else (docs, this script) changed between."""
    return git("log", "-1", "--format=%H", commit, "--", *MEASURED[name], cwd=cwd)


def dirty(paths: list[str], cwd: Path = REPO) -> list[str]:
    """The measured paths with uncommitted changes (tracked or not)."""
    out = git("status", "--porcelain", "--", *paths, cwd=cwd)
    return [line[3:] for line in out.splitlines() if line.strip()]


def machine() -> dict:
    """The CPU (model, vector extensions), cores this process may use, memory, accelerator."""
    import psutil

    model, flags = platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                     model)
        flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")),
                         []))
    except OSError:
        pass
    vector = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags]
    cores = len(os.sched_getaffinity(0))
    memory = psutil.virtual_memory().total / 2**30
    accelerator = "none"
    try:
        import torch

        if torch.cuda.is_available():
            accelerator = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch, no accelerator to name
        pass
    return {"cpu": model, "vector": vector, "cores": cores, "memory_gib": round(memory, 1), "accelerator": accelerator,
            "summary": f"{model} ({', '.join(vector) or 'no AVX2'}), {cores} cores, {memory:.0f} GiB, "
                       f"accelerator: {accelerator}"}


def versions() -> dict:
    from workbench.envcheck import installed_versions

    return {k: v for k, v in installed_versions().items() if v and k in
            ("python", "torch", "vllm", "trl", "transformers", "accelerate", "peft")}


def commit_date(commit: str, cwd: Path = REPO) -> str:
    """A commit's date (committer's, YYYY-MM-DD): what the results page shows beside the code it measured."""
    return git("log", "-1", "--format=%cs", commit, cwd=cwd)


def where(name: str, commit: str) -> dict:
    """What a measurement of `name` on `commit` runs on: the code (and its date), the machine, the versions."""
    code = code_commit(name, commit)
    return {"commit": commit, "code": code, "code_date": commit_date(code), "machine": machine(),
            "versions": versions()}


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def record(name: str, command: str, seconds: float, figures: dict, at: dict, clean: bool,
           results: Path | None = None) -> Path:
    """docs/results/<name>.json: the figures with where they were measured (`at`, from where())."""
    from workbench.rundir import write_atomic

    results = results or RESULTS
    results.mkdir(parents=True, exist_ok=True)
    data = {"name": name, "commit": at["commit"], "code": at["code"], "code_date": at["code_date"], "clean": clean,
            "date": now(), "machine": at["machine"], "versions": at["versions"], "command": command,
            "seconds": round(seconds, 1), "figures": figures}
    return write_atomic(results / f"{name}.json", json.dumps(data, indent=2) + "\n")


def load_results() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))} if RESULTS.exists() else {}


def workbench(args: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """One workbench command (with `env` added to the environment), its output in `log`; its seconds. A failure stops
    the measurement with the log's tail."""
    started = time.time()
    with open(log, "w") as out:
        done = subprocess.run([str(Path(sys.executable).parent / "workbench"), *args], stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"measure: `{command_line(args, env)}` failed ({done.returncode}); its log: {log}\n{tail}")
    return time.time() - started


def only_dir(root: Path, pattern: str) -> Path:
    found = sorted(root.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"measure: expected one {pattern} under {root}, found {[p.name for p in found]}")
    return found[0]


def later_changes(name: str, commit: str, cwd: Path = REPO) -> list[str]:
    """The commits after `commit` that changed what measurement `name` depends on, oldest first ('hash subject')."""
    out = git("log", "--reverse", "--format=%h %s", f"{commit}..HEAD", "--", *MEASURED[name], cwd=cwd)
    return out.splitlines() if out else []


def current_command(name: str) -> str | None:
    """The command measurement `name` runs now (None for those whose command is not a fixed setting)."""
    if name in ARMED:
        return ARMED[name].command
    return {"choice": command_line(CHOICE_ARGS)}.get(name)


def status_lines(results: dict[str, dict] | None = None, cwd: Path = REPO, pieces: Path | None = None) -> list[str]:
    """One line per measurement: fresh, or stale (the first later commit that changed its code, and how many did;
    or settings that differ from this script's), not measured, and any arms kept of one under way. A shallow clone
    cannot tell and says so. Never a failure: figures are labelled, not frozen."""
    results = load_results() if results is None else results
    shallow = git("rev-parse", "--is-shallow-repository", cwd=cwd) == "true"
    lines = []
    for name in MEASURED:
        r = results.get(name)
        under_way = progress(name, pieces)
        if r is None:
            line = f"{name}: not measured"
        else:
            code = r.get("code", r["commit"])
            line = f"{name}: measured code {code[:10]}" + (f" ({r['code_date']})" if r.get("code_date") else "")
            known = subprocess.run(["git", "merge-base", "--is-ancestor", r["commit"], "HEAD"], cwd=cwd,
                                   capture_output=True).returncode == 0
            if shallow:
                line += " - cannot tell whether it is fresh: a shallow clone (git fetch --unshallow, then again)"
            elif not known:
                line += f" - cannot tell whether it is fresh: its commit {r['commit'][:10]} is not in this history"
            else:
                later = later_changes(name, r["commit"], cwd)
                command = current_command(name)
                if later:
                    line += (f" - stale: {len(later)} later commit(s) changed {', '.join(MEASURED[name])}, the "
                             f"first {later[0][:80]}" + (f"; the latest {later[-1][:80]}" if len(later) > 1 else ""))
                elif command is not None and r["command"] != command:
                    line += " - stale: scripts/measure.py runs other settings now"
                else:
                    line += " - fresh"
        if under_way:
            line += f"; under way: {under_way} (python scripts/measure.py --only {name} goes on)"
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The measurements

def measure_demo(root: Path) -> tuple[str, float, dict]:
    seconds = workbench(["run", "--recipe", DEMO_RECIPE, f"monitor.runs_dir={root / 'demo'}"], root / "demo.log")
    return f"workbench run --recipe {DEMO_RECIPE}", seconds, demo_figures(only_dir(root / "demo", "*"), seconds)


def demo_figures(path: Path, seconds: float) -> dict:
    """What a `workbench run` directory says: base and trained accuracy on the evaluated split, stage times, the
    training's steps, the learning curve and its cost, the signal, the drift, the roofline gauge's mean shares and
    what monitoring cost."""
    from workbench.observe.rundata import load
    from workbench.platform import limits
    from workbench.rundir import RunDir
    from workbench.training.drift import KEY as DRIFT
    from workbench.training.groups import ZERO_SPREAD

    run = RunDir.open(path)
    record_ = json.loads(run.record.read_text())
    evaluation = {s["model"]: s for s in json.loads(run.eval.summary.read_text())}
    base, trained = evaluation["base"], evaluation["trained"]
    data = load(run.train)
    rows = data.train_metrics
    steps = [r["time/step"] for r in rows if isinstance(r.get("time/step"), (int, float))]
    curve_cost = [r["time/eval_curve"] for r in rows if isinstance(r.get("time/eval_curve"), (int, float))]
    fifth = max(1, len(rows) // 5)

    def spread_share(part: list[dict]) -> float | None:
        values = [r[ZERO_SPREAD] for r in part if isinstance(r.get(ZERO_SPREAD), (int, float))]
        return 1 - statistics.fmean(values) if values else None

    points = data.eval_curve
    best = max(points, key=lambda p: (p["accuracy"], -p["step"])) if points else None
    drift = [r[DRIFT] for r in rows if isinstance(r.get(DRIFT), (int, float))]
    summary = data.train_summary or {}

    def mean_of(key: str) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else None

    noun, peak = limits.basis(data.limits) if data.limits else (None, None)
    return {
        "split": base.get("split", "heldout"), "n": base["n"],
        "base_accuracy": base["accuracy_mean"], "trained_accuracy": trained["accuracy_mean"],
        "gain_points": (trained["accuracy_mean"] - base["accuracy_mean"]) * 100,
        "minutes": seconds / 60,
        "stage_seconds": {stage: r.get("seconds") for stage, r in record_["results"].items()},
        "steps": summary.get("steps"), "train_seconds": summary.get("train_seconds"),
        "step_seconds": statistics.median(steps) if steps else None,
        "curve": ({"split": points[0].get("split", "validation"), "n": points[0]["n"], "points": len(points),
                   "start": points[0]["accuracy"], "best": best["accuracy"], "best_step": best["step"],
                   "last": points[-1]["accuracy"], "last_step": points[-1]["step"],
                   "cost_share": sum(curve_cost) / sum(steps) if steps and curve_cost else None} if points else None),
        "groups_with_spread": {"first_fifth": spread_share(rows[:fifth]), "last_fifth": spread_share(rows[-fifth:])},
        "kl_probes": {"max": max(drift), "last": drift[-1]} if drift else None,
        # training/gauge.py: the training's mean shares of the machine's limits, and what the limits are
        "gauge": ({"basis": noun, "peak": peak, "generation_share": mean_of("gauge/generation"),
                   "optimisation_share": mean_of("gauge/optimisation")} if data.limits else None),
        # the monitor's sampler and the roofline gauge, each as a share of one core over the training
        "overhead": {"sampler_core_share": (summary.get("monitor") or {}).get("core_share"),
                     "gauge_cpu_seconds": (data.gauge_cost or {}).get("cpu_seconds"),
                     "gauge_core_share": ((data.gauge_cost or {}).get("cpu_seconds") or 0) / summary["train_seconds"]
                     if data.gauge_cost and summary.get("train_seconds") else None},
    }


def _bench(root: Path, name: str, sizes: str, paths: str) -> tuple[str, float, dict]:
    args = ["bench", "--recipe", BENCH_RECIPE, "--sizes", sizes, "--paths", paths, "--repeats", "3",
            f"monitor.runs_dir={root / name}"]
    seconds = workbench(args, root / f"{name}.log")
    return " ".join(["workbench", *args[:-1]]), seconds, bench_figures(only_dir(root / name, "*"))


def bench_figures(path: Path) -> dict:
    """What a `workbench bench` directory says, per path: its median step, its repeats, its ratio to the
    synchronous server path's step of the same repeat (median and range), its generation rate and push, and the
    bench's own lines setting the path against the machine's limits (None where the bench had none)."""
    from workbench.experiments.bench import Bench, sync_line
    from workbench.rundir import RunDir

    bench = Bench.load(RunDir.open(path).bench)
    (size,) = {r.size for r in bench.results}
    rows = {}
    for r in bench.medians():
        ratios = bench.ratios(r.size, r.path) if r.path != "server" else []
        rows[r.path] = {"step_seconds": r.step_seconds,
                        "step_seconds_repeats": [x.step_seconds for x in bench.repeats_of(r.size, r.path)],
                        "ratio_to_server": statistics.median(ratios) if ratios else None,
                        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                        "generation_tokens_per_second": r.generation_tokens_per_second,
                        "sync_megabytes": r.sync_megabytes, "sync_seconds": r.sync_seconds,
                        # the bench's own lines against the machine: the roofline gauge, the push against copying
                        "gauge": bench.gauge_line(r),
                        "sync": (sync_line(r, bench.machine.get("copy_gbps") or {})
                                 if r.sync_megabytes and r.sync_seconds else None)}
    return {"size": size, "parameters": (bench.sizes.get(size) or {}).get("parameters"), "repeats": bench.repeats,
            "steps": bench.steps, "paths": rows}


def measure_bench(root: Path) -> tuple[str, float, dict]:
    return _bench(root, "bench", "tiny", "in-process,server,async")


def measure_bench_100m(root: Path) -> tuple[str, float, dict]:
    return _bench(root, "bench-100m", "100m", "server,async")


# --report-all: the demo's recipe is the setting measured, fixed beforehand; with no other candidate there is
# nothing to choose, so no training on the validation split (9 trainings instead of 12)
# --report-all: the demo's recipe is the setting measured, fixed beforehand; with no other candidate there is
# nothing to choose, so no training on the validation split (9 trainings instead of 12)
_OVER_BASES = ["protocol", "--recipe", DEMO_RECIPE, "--report-all", "--data-seeds", PROTOCOL_DATA_SEEDS]
PROTOCOL_ARGS = [*_OVER_BASES, "--seeds", PROTOCOL_SEEDS]
VARIANTS_ARGS = [*PROTOCOL_ARGS, *VARIANT[1]]
LORA_ARGS = ["protocol", "--recipe", DEMO_RECIPE, "--report-all", "--data-seeds", LORA_DATA_SEEDS, "--seeds",
             PROTOCOL_SEEDS, *LORA[1]]

# vLLM's server closes a keep-alive connection left idle 5 s by default (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a request sent
# on one as it closed came back "connection reset by peer" and ended a training of this measurement at its step 80
# (2026-12-04). Servers now keep idle connections for server.keep_alive_s and the client re-sends such requests
# (docs/reliability.md); the variable stays in this measurement's recorded command so that its settings, and so its
# pieces and results file, keep their key. No sampled token depends on it.
VARIANTS_ENV = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"}
CHOICE_ARGS = ["protocol", "--recipe", DEMO_RECIPE, "--data-seeds", PROTOCOL_DATA_SEEDS, "--choose-seed", "0",
               "--seeds", "1", *(a for name, overrides in CHOICE for a in ("--candidate", f"{name}: {overrides}"))]


def command_line(args: list[str], env: dict[str, str] | None = None) -> str:
    """The workbench command as recorded (and as a shell takes it): `--status` compares a results file's command
    with what its measurement runs now, so a changed setting labels the file stale."""
    return " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), "workbench",
                     *(f'"{a}"' if " " in a else a for a in args)])


# ----------------------------------------------------------------------------------------------------------------
# Measurements in arms: one training per base and seed, each kept as a piece as soon as it is done

@dataclass(frozen=True)
class Arm:
    """One training of a measurement over bases and seeds: `workbench protocol --report-all` on one base (data
    seed) with one training seed, scored on the test split."""

    label: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def command(self) -> str:
        return command_line(list(self.args), dict(self.env))


@dataclass(frozen=True)
class Armed:
    """A measurement made of arms: its whole command (what the results file records), its arms, and for a
    head-to-head against the protocol, the arm's name and overrides (None: the protocol itself)."""

    args: list[str]
    arms: list[Arm]
    env: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return command_line(self.args, self.env)


def over_bases(data_seeds: str, seeds: str, overrides: list[str] = (), env: dict[str, str] | None = None
               ) -> list[Arm]:
    """One arm per (base, seed): the protocol's command restricted to that base and that seed."""
    return [Arm(f"base{d}-seed{s}", ("protocol", "--recipe", DEMO_RECIPE, "--report-all", "--data-seeds", d,
                                     "--seeds", s, *overrides), tuple((env or {}).items()))
            for d in data_seeds.split(",") for s in seeds.split(",")]


ARMED = {
    "protocol": Armed(PROTOCOL_ARGS, over_bases(PROTOCOL_DATA_SEEDS, PROTOCOL_SEEDS)),
    "variants": Armed(VARIANTS_ARGS, over_bases(PROTOCOL_DATA_SEEDS, PROTOCOL_SEEDS, VARIANT[1], VARIANTS_ENV),
                      VARIANTS_ENV, VARIANT[0], VARIANT[1]),
    "lora": Armed(LORA_ARGS, over_bases(LORA_DATA_SEEDS, PROTOCOL_SEEDS, LORA[1]), {}, LORA[0], LORA[1]),
}


def run_arm(arm: Arm, root: Path) -> tuple[float, dict]:
    """One arm: its protocol into root/<label>; its seconds and its training's figures (training_figures)."""
    directory = root / arm.label
    seconds = workbench([*arm.args, f"monitor.runs_dir={directory}"], root / f"{arm.label}.log", env=dict(arm.env))
    result = load_protocol(only_dir(directory, "*-protocol"))
    if len(result.test) != 1:
        raise SystemExit(f"measure: {directory} holds {len(result.test)} test results, one expected")
    return seconds, training_figures(result.test[0])


def piece_key(at: dict) -> dict:
    """What a piece must share with the measurement it goes on: the code, the machine and the stack's versions."""
    return {"code": at["code"], "machine": at["machine"]["summary"], "versions": at["versions"]}


def pieces_of(name: str, pieces: Path | None = None) -> dict[str, dict]:
    """The finished arms of measurement `name`, by label."""
    folder = (pieces or PIECES) / name
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))} if folder.exists() else {}


def progress(name: str, pieces: Path | None = None) -> str | None:
    """'5 of 9 arms on <code>' for a measurement under way, None when none of its arms is kept."""
    have = pieces_of(name, pieces)
    if not have or name not in ARMED:
        return None
    codes = sorted({p["code"][:10] for p in have.values()})
    return f"{len(have)} of {len(ARMED[name].arms)} arms on {', '.join(codes)}"


def measure_armed(name: str, armed: Armed, root: Path, at: dict, run: Callable[[Arm, Path], tuple[float, dict]]
                  = run_arm, log: Callable[[str], None] = print, pieces: Path | None = None
                  ) -> tuple[str, float, dict]:
    """Every arm of `armed` not kept yet under the same key (piece_key, and the arm's command), one at a time, each
    written as a piece when it ends; pieces of another key are removed first (the measurement starts afresh). When
    all are done: the whole measurement's command, the arms' seconds summed, and its figures (assemble); the pieces
    are removed once the caller has recorded them (drop_pieces)."""
    from workbench.rundir import write_atomic

    folder = (pieces or PIECES) / name
    folder.mkdir(parents=True, exist_ok=True)
    key, labels = piece_key(at), {a.label: a for a in armed.arms}
    have = pieces_of(name, pieces)
    kept = {label: p for label, p in have.items()
            if label in labels and p["command"] == labels[label].command
            and {k: p.get(k) for k in key} == key}
    if len(kept) < len(have):
        log(f"measure: {name}: {len(have) - len(kept)} kept arm(s) of other code or settings; starting afresh")
        for p in folder.glob("*.json"):
            p.unlink()
        kept = {}
    if kept:
        log(f"measure: {name}: {len(kept)} of {len(armed.arms)} arms kept on {short(at['code'])} "
            f"({', '.join(kept)}); measuring the rest")
    for arm in armed.arms:
        if arm.label in kept:
            continue
        log(f"measure: {name}: arm {arm.label} ({len(kept) + 1} of {len(armed.arms)}): {arm.command}")
        seconds, figures = run(arm, root)
        piece = {"arm": arm.label, "command": arm.command, "commit": at["commit"], **key, "date": now(),
                 "seconds": round(seconds, 1), "figures": figures}
        write_atomic(folder / f"{arm.label}.json", json.dumps(piece, indent=2) + "\n")
        kept[arm.label] = piece
        log(f"measure: {name}: arm {arm.label} done in {seconds / 60:.1f} min -> {folder / arm.label}.json")
    ordered = [kept[a.label] for a in armed.arms]
    return armed.command, sum(p["seconds"] for p in ordered), assemble(armed, ordered)


def drop_pieces(name: str, pieces: Path | None = None) -> None:
    """After the results file is written: its arms live there."""
    shutil.rmtree((pieces or PIECES) / name, ignore_errors=True)


def assemble(armed: Armed, pieces: list[dict]) -> dict:
    """The results file's figures from its arms' pieces: the protocol's own (arm_figures), or for a head-to-head
    its one arm, named, with its overrides. Each arm's commit, date and seconds are kept ("arms")."""
    trainings = [p["figures"] for p in pieces]
    provenance = [{"arm": p["arm"], "commit": p["commit"], "date": p["date"], "seconds": p["seconds"]}
                  for p in pieces]
    if armed.name is None:
        return {**arm_figures("recipe", trainings), "arms_measured": provenance}
    return {"arms": [{**arm_figures(armed.name, trainings), "name": armed.name, "overrides": list(armed.overrides)}],
            "arms_measured": provenance}


def training_figures(o) -> dict:
    """One protocol Outcome, as the results files keep a training: its base, seed, test accuracies and gain
    (points), shares of groups with spread (trained, generated), seconds, completion tokens, learning curve."""
    return {"data_seed": o.data_seed, "seed": o.seed, "gain": o.gain * 100, "base": o.base, "trained": o.trained,
            "signal": o.signal, "signal_generated": o.signal_generated, "train_seconds": o.train_seconds,
            "generated_tokens": o.generated_tokens, "curve": training_curve(Path(o.run))}


def arm_figures(name: str, trainings: list[dict], how: str = "settings fixed beforehand, every one reported"
                ) -> dict:
    """One setting over its trainings (training_figures): the gain's mean and sample sd, per base its mean gain and
    base accuracy, the mean completion tokens and shares of groups with spread, and a headline saying what the ±
    is. `how`: how the setting was arrived at."""
    gains = [t["gain"] for t in trainings]
    bases = list(dict.fromkeys(t["data_seed"] for t in trainings))
    seeds = list(dict.fromkeys(t["seed"] for t in trainings))
    sd = statistics.stdev(gains) if len(gains) > 1 else None
    over = (f"{len(gains)} trainings ({len(bases)} base model(s) x {len(seeds)} seed(s))" if bases != [None]
            else f"{len(gains)} seed(s)")
    tokens = mean([t.get("generated_tokens") or None for t in trainings])
    signal = mean([t.get("signal") for t in trainings])
    generated = mean([t.get("signal_generated") for t in trainings])
    cost = f"; {tokens:,.0f} completion tokens generated per training" if tokens else ""
    if signal is not None and generated is not None:
        cost += f"; groups with reward spread {signal:.0%} of those trained, {generated:.0%} of those generated"
    base = statistics.fmean(t["base"] for t in trainings) * 100
    trained = statistics.fmean(t["trained"] for t in trainings) * 100
    headline = (f"{name}: test accuracy {base:.1f}% → {trained:.1f}%, gain {statistics.fmean(gains):+.1f}"
                + (f" ± {sd:.1f}" if sd is not None else "") + f" points over {over} (mean ± sample std; {how})"
                + cost)
    return {"setting": name, "gains": trainings, "gain_mean": statistics.fmean(gains), "gain_std": sd,
            "trainings": len(gains), "data_seeds": [d for d in bases if d is not None], "seeds": seeds,
            "base_means": {str(d): statistics.fmean(t["gain"] for t in trainings if t["data_seed"] == d)
                           for d in bases},
            "base_accuracy": {str(t["data_seed"]): t["base"] for t in trainings},
            "headline": headline, "generated_tokens": tokens, "signal": signal, "signal_generated": generated}


def measure_choice(root: Path) -> tuple[str, float, dict]:
    """The protocol's own choice on validation between the recipe and CHOICE, the chosen one then trained on test."""
    seconds = workbench([*CHOICE_ARGS, f"monitor.runs_dir={root / 'choice'}"], root / "choice.log")
    return command_line(CHOICE_ARGS), seconds, choice_figures(only_dir(root / "choice", "*-protocol"))


def choice_figures(path: Path) -> dict:
    """A protocol's choice: each candidate's trainings on validation (per base: base and trained accuracy, share of
    groups with reward spread) and its mean trained accuracy, the one chosen, the chosen model on test (picked, kept
    out of the result) and the chosen setting's test trainings (protocol_figures)."""
    result = load_protocol(path)
    if result.chosen is None or not result.test:
        raise SystemExit(f"measure: {path} has no choice and test result: the protocol did not finish")
    candidates = []
    for c in result.candidates:
        rows = [o for o in result.validation if o.candidate == c.name]
        candidates.append({"name": c.name, "overrides": c.overrides, "mean_trained": mean([o.trained for o in rows]),
                           "validation": [{"data_seed": o.data_seed, "base": o.base, "trained": o.trained,
                                           "signal": o.signal} for o in rows]})
    return {"chosen": result.chosen, "choose_seed": result.choose_seed, "data_seeds": result.data_seeds,
            "candidates": candidates,
            "picked": [{"data_seed": o.data_seed, "base": o.base, "trained": o.trained} for o in result.picked],
            "test": protocol_figures(path, result.chosen, result)}


def variants_figures(path: Path, name: str | None = None) -> dict:
    """Each arm the protocol reported on test (every candidate with --report-all, else the chosen one): its
    protocol figures (protocol_figures) and overrides (the command line's, then the candidate's), in the protocol's
    order; `name` names the arm of a protocol that reports one."""
    result = load_protocol(path)
    common = [o for o in result.common if not o.startswith("monitor.runs_dir=")]
    arms = []
    for c in (c for c in result.candidates if c.name in result.reported):
        if not any(o.candidate == c.name for o in result.test):
            raise SystemExit(f"measure: {path} has no test result for {c.name}: the protocol did not finish")
        arms.append({**protocol_figures(path, c.name, result), "name": c.name, "overrides": common + c.overrides})
    if name is not None:
        if len(arms) != 1:
            raise SystemExit(f"measure: {path} reports {len(arms)} settings; a variant's protocol reports one")
        arms[0]["name"] = name
    return {"arms": arms}


def mean(values: list) -> float | None:
    """The mean of the values that were recorded, None when none was."""
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


RELOAD_COMMAND = ["scripts/reload_parts.py", "--size", "100m", "--reloads", "5"]


def measure_reload(root: Path) -> tuple[str, float, dict]:
    """vLLM's CPU reload of the ~100M bench model, part by part (scripts/reload_parts.py)."""
    out = root / "reload.json"
    started = time.time()
    with open(root / "reload.log", "w") as log:
        done = subprocess.run([sys.executable, *RELOAD_COMMAND, "--json", str(out)], cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"measure: scripts/reload_parts.py failed ({done.returncode}): {root / 'reload.log'}")
    return " ".join(["python", *RELOAD_COMMAND]), time.time() - started, reload_figures(out)


def reload_figures(path: Path) -> dict:
    """What scripts/reload_parts.py wrote: the model's bytes, each part's median seconds, one core's copy rate."""
    data = json.loads(Path(path).read_text())
    return {"size": data["size"], "megabytes": data["megabytes"], "reloads": data["reloads"],
            "median_seconds": data["median_seconds"], "reload_seconds": data["reload_seconds"],
            "copy_gb_s": data["copy_bandwidth"]["median"], "env": data["env"]}


def training_curve(run: Path) -> dict | None:
    """A training's learning curve (eval.every_steps): its split, size and (step, accuracy) points, or None."""
    from workbench.errors import WorkbenchError
    from workbench.observe.rundata import load
    from workbench.rundir import RunDir

    try:
        points = load(RunDir.open(run).train).eval_curve
    except (OSError, ValueError, WorkbenchError):
        return None
    if not points:
        return None
    return {"split": points[0].get("split", "validation"), "n": points[0]["n"],
            "points": [[p["step"], p["accuracy"]] for p in points]}


def load_protocol(path: Path):
    """The Protocol a `workbench protocol` directory recorded."""
    from workbench.experiments.protocol import Protocol
    from workbench.rundir import RunDir

    return Protocol.from_json(json.loads(RunDir.open(path).protocol.json.read_text()))


def protocol_figures(path: Path, name: str | None = None, result=None) -> dict:
    """What a `workbench protocol` directory says of setting `name` (default: the chosen, or the only reported one):
    arm_figures over its test trainings. `result`: the directory's Protocol, when the caller has loaded it already."""
    result = result or load_protocol(path)
    if not (result.chosen or result.reported):
        raise SystemExit(f"measure: {path} has no chosen or reported setting: the protocol did not finish")
    name = name or result.chosen or result.reported[0]
    how = ("settings fixed beforehand, every one reported" if result.report_all else
           f"settings chosen on the validation split with seed {result.choose_seed}")
    figures = arm_figures(name, [training_figures(o) for o in result.test if o.candidate == name], how)
    return {**figures, "data_seeds": result.data_seeds, "seeds": result.seeds}


def measure_suite(root: Path) -> tuple[str, float, dict]:
    """`make test` as CI runs it, its JUnit XML kept; the figures are recorded as of this commit."""
    junit = root / "suite.xml"
    started = time.time()
    with open(root / "suite.log", "w") as out:
        done = subprocess.run(["make", "test"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTEST_ADDOPTS": f"--junitxml={junit}"})
    figures = suite_figures(junit)
    if done.returncode != 0 and not (figures["failed"] or figures["errors"]):
        raise SystemExit(f"measure: `make test` failed before its tests ended ({done.returncode}): {root / 'suite.log'}")
    return "make test", time.time() - started, figures


# the measurements run whole (ARMED: those run in arms)
def measure_reward_model(root: Path) -> tuple[str, float, dict]:
    """The tiny reward model built afresh (`workbench reward-model --force`): its held-out agreement with the rule."""
    from workbench import recipe
    from workbench.recipe.resolve import tiny_reward_model_dir

    seconds = workbench(RM_COMMAND, root / "reward-model.log")
    info = json.loads((tiny_reward_model_dir(recipe.load("cpu-tiny-rm")) / "reward-model.json").read_text())
    figures = {k: info[k] for k in ("settings", "train", "heldout", "build_seconds", "sample_seconds", "architecture")}
    judge = root / "judge.json"  # the frozen base as a judge on the same held-out completions
    started = time.time()
    with open(root / "judge.log", "w") as log:
        done = subprocess.run([sys.executable, "scripts/judge_agreement.py", "--json", str(judge)], cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"measure: scripts/judge_agreement.py failed ({done.returncode}): {root / 'judge.log'}")
    figures["judge"] = json.loads(judge.read_text())
    seconds += time.time() - started
    # the bench's reward-model path against the server path, taking turns: what scoring the model costs per step
    bench_line, bench_seconds, figures["bench"] = _bench(root, "reward-bench", "tiny", "server,reward-model")
    figures["bench"]["reward_share"] = reward_share(only_dir(root / "reward-bench", "*"))
    return (command_line(RM_COMMAND) + " && python scripts/judge_agreement.py && " + bench_line,
            seconds + bench_seconds, figures)


def reward_share(path: Path) -> list[float]:
    """Each repeat of the bench's reward-model path: its time/reward over its step time."""
    from workbench.experiments.bench import Bench
    from workbench.rundir import RunDir

    bench = Bench.load(RunDir.open(path).bench)
    (size,) = {r.size for r in bench.results}
    return [r.breakdown.get("time/reward", 0.0) / r.step_seconds for r in bench.repeats_of(size, "reward-model")]


def measure_rewards(root: Path) -> tuple[str, float, dict]:
    """cpu-tiny-rm's learned reward against the rule, both arms in one protocol (REWARDS_COMMAND)."""
    seconds = workbench([*REWARDS_COMMAND, f"monitor.runs_dir={root / 'rewards'}"], root / "rewards.log")
    return command_line(REWARDS_COMMAND), seconds, rewards_figures(only_dir(root / "rewards", "*-protocol"))


def learned_training(run: Path) -> dict:
    """What a training with a learned reward recorded beside its test gain: the reward's share of the step time, its
    requests, failures and engine restarts, the learned reward and the verified accuracy (the correctness rule) in
    the first and last fifth of the steps, and whether the advisor named reward hacking."""
    from workbench.observe import advisor, rundata
    from workbench.records import read_jsonl

    train = run / "train"
    rows = [r for r in read_jsonl(train / "metrics.jsonl") if "loss" in r]
    learned = json.loads((train / "train.json").read_text()).get("learned_rewards", {}).get("preference", {})
    fifth = max(1, len(rows) // 5)

    def ends(key: str) -> list:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return [mean(values[:fifth]), mean(values[-fifth:])]

    share = mean([r["time/reward"] / r["time/step"] for r in rows if r.get("time/step")])
    findings = {f.rule for f in advisor.advise(rundata.load(train))}
    return {"reward_share": share, "requests": learned.get("requests"), "failed": learned.get("failed"),
            "restarts": learned.get("restarts"), "learned_reward": ends("rewards/preference/mean"),
            "verified": ends("rewards/correctness/mean"), "reward_hacking": "reward_hacking" in findings}


def rewards_figures(path: Path) -> dict:
    """Both arms of the rewards protocol (variants_figures), each training with learned_training's figures, and
    the reward model's gain minus the rule's, paired by seed (paired)."""
    result = load_protocol(path)
    arms = variants_figures(path)["arms"]
    for arm in arms:
        runs = [o for o in result.test if o.candidate == arm["name"]]
        for training, o in zip(arm["gains"], runs):
            training.update(learned_training(Path(o.run)))
    model = next(a for a in arms if a["name"] == "recipe")
    rule = next(a for a in arms if a["name"] == "rule")
    return {"arms": arms, "paired": paired(rule, model)}


MEASURES = {"demo": measure_demo, "bench": measure_bench, "bench-100m": measure_bench_100m,
            "choice": measure_choice, "reload": measure_reload, "reward-model": measure_reward_model,
            "rewards": measure_rewards,
            "suite": measure_suite}


def suite_figures(junit: Path) -> dict:
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = lambda key: sum(int(s.get(key) or 0) for s in suites)  # noqa: E731
    tests, failures, errors, skipped = count("tests"), count("failures"), count("errors"), count("skipped")
    # how it ran, as the suite's harness wrote it into the XML (tests/harness.py _record_run); None: not recorded
    props = {p.get("name"): p.get("value") for s in suites for p in s.iter("property")}
    number = lambda key: int(props[key]) if props.get(key, "").lstrip("-").isdigit() else None  # noqa: E731
    return {"tests": tests, "passed": tests - failures - errors - skipped, "failed": failures, "errors": errors,
            "skipped": skipped, "seconds": sum(float(s.get("time") or 0) for s in suites),
            "workers": number("workers"), "exit_status": number("exit_status")}


# ----------------------------------------------------------------------------------------------------------------
# Rendering: docs/results.md and the README's block, from the files only

RELOAD_PARTS = [  # scripts/reload_parts.py's parts (they interleave layer by layer; each is summed over the reload)
    ("init", "setting each layer aside for re-creation (`initialize_layerwise_reload`)"),
    ("read", "the safetensors iterator (tensors are views of a memory map: the bytes are read by the copies)"),
    ("layers", "re-creating each layer's tensors (`materialize_layer`)"),
    ("copies", "the weight loaders' copies into them, and the copy back into the tensors the engine runs on"),
    ("repack", "repacking each layer for the CPU kernels (`process_weights_after_loading`)"),
    ("finalize", "`finalize_layerwise_reload`, less the layers it processes (counted above)"),
    ("rest", "the rest of `load_weights` (each layer's weights held until the layer is complete)"),
]


def pct(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def short(commit: str) -> str:
    return commit[:10]


def curve_text(curve: dict) -> tuple[str, str]:
    """The learning curve as 'start → best (step) → last (step)' ('start → best at the last step (step)' when the
    last point is the best), and its cost as a share of the step time."""
    if curve["best_step"] == curve["last_step"]:
        path = f"{pct(curve['start'])} → best {pct(curve['best'])} at the last point (step {curve['last_step']})"
    else:
        path = (f"{pct(curve['start'])} → best {pct(curve['best'])} (step {curve['best_step']}) → "
                f"{pct(curve['last'])} (step {curve['last_step']})")
    return path, f"{curve['cost_share']:.1%}" if curve.get("cost_share") is not None else ""


def readme_block(results: dict[str, dict]) -> str:
    """The README's measured lines: what `make demo` gives a newcomer, and the async ratio, each with its machine."""
    lines = [BEGIN]
    demo = results.get("demo")
    if demo:
        f = demo["figures"]
        lines += [f"**Measured** (`make measure`, {demo['date'][:10]}, {demo['machine']['summary']}; one run of "
                  f"`make demo` without the install, one training seed): **{f['minutes']:.0f} min**, test accuracy "
                  f"**{pct(f['base_accuracy'])} → {pct(f['trained_accuracy'])} ({f['gain_points']:+.1f} points)** on "
                  f"the {f['n']} held-out problems."]
        curve = f.get("curve")
        if curve:
            path, cost = curve_text(curve)
            lines.append(f"The learning curve on {curve['n']} {curve['split']} problems: {path} ({curve['points']} "
                         f"points{f', {cost} of the step time' if cost else ''}).")
    for name, what in (("bench", "on the demo's model"),
                       ("bench-100m", "on a random-weight model of the demo's architecture")):
        bench = results.get(name)
        a = (bench["figures"]["paths"].get("async") or {}) if bench else {}
        if a.get("ratio_to_server") is not None:
            lo, hi = a["ratio_range"]
            params = bench["figures"].get("parameters")
            size = f" ({params / 1e6:.0f}M parameters)" if params and name != "bench" else ""
            lines.append(f"Async rollouts {what}{size}: a step takes {a['ratio_to_server']:.2f}× the synchronous "
                         f"server step (range {lo:.2f}–{hi:.2f} over {bench['figures']['repeats']} repeats; "
                         f"{bench['machine']['summary']}).")
    protocol = results.get("protocol")
    if protocol:
        f = protocol["figures"]
        spread = f" ± {f['gain_std']:.1f}" if f.get("gain_std") is not None else ""
        gains = [t["gain"] for t in f.get("gains") or []]
        span = f", each training between {min(gains):+.1f} and {max(gains):+.1f}" if len(gains) > 1 else ""
        bases = ", ".join(f"{pct(a)}" for a in f["base_accuracy"].values())
        lines.append(f"The demo's recipe over {len(f['data_seeds'])} base models (test accuracy {bases}) × "
                     f"{len(f['seeds'])} training seeds (`workbench protocol`, {protocol['date'][:10]}): test gain "
                     f"**{f['gain_mean']:+.1f}{spread} points** (mean ± sample sd over the {f['trainings']} "
                     f"trainings){span}. `make demo` trains base 0 with training seed "
                     "0: compare it with base 0's trainings in docs/results.md.")
    for name, (what, _) in HEAD_TO_HEAD.items():
        arms, differ = head_to_head(results, name)
        if not arms or differ:
            continue
        plain, other = arms[0], arms[1]

        def gain(a: dict) -> str:
            return f"{a['gain_mean']:+.1f}" + (f" ± {a['gain_std']:.1f}" if a.get("gain_std") is not None else "")

        tokens = (f" at {other['generated_tokens'] / plain['generated_tokens']:.2f}× the recipe's completion tokens"
                  if other.get("generated_tokens") and plain.get("generated_tokens") else "")
        p = paired(plain, other)
        diff = (f"; paired difference {p['mean']:+.1f} points (95% CI {bound(p['ci'][0])} to {bound(p['ci'][1])} over "
                f"{p['n']} pairs: {'told apart from zero' if p['excludes_zero'] else 'not told apart from zero'})"
                if p else "")
        lines.append(f"{what[0].upper()}{what[1:]} (`{' '.join(other['overrides'])}`) against the recipe on "
                     f"{len(plain['data_seeds']) or 1} base model(s) × training seed(s) "
                     f"{', '.join(map(str, plain['seeds']))} ({results[name]['date'][:10]}): test gain "
                     f"{gain(other)} against {gain(plain)} points (mean ± sample sd over {plain['trainings']} "
                     f"trainings each){tokens}{diff}.")
    choice = results.get("choice")
    if choice:
        f = choice["figures"]
        def named(setting: str) -> str:
            return "the recipe" if setting == "recipe" else setting

        means = "; ".join(f"{named(c['name'])} {pct(c['mean_trained'])}" for c in f["candidates"])
        lines.append(f"The recipe's learning rate, chosen on the validation split over base models "
                     f"{', '.join(map(base_name, f['data_seeds'])) or '—'} (training seed {f['choose_seed']}, "
                     f"{choice['date'][:10]}), mean trained accuracy: {means}; chosen: "
                     f"{named(f['chosen'])}.")
    if len(lines) == 1:
        lines.append("No figure is measured on this code yet: `make measure` writes them.")
    lines.append("Every figure, its machine, its command and the code it measured: [docs/results.md](docs/results.md); "
                 "which figures are older than the code: `make status`.")
    return "\n".join(lines + [END])


def results_page(results: dict[str, dict]) -> str:
    out = ["# Results", "",
           "Generated by `python scripts/measure.py` from docs/results/*.json: do not edit by hand. `make measure`",
           "(`--quick`: the demo and the tiny bench) or `MEASURE=--full make measure` (with the ~100M bench, its",
           "reload part by part, the protocol over base models and seeds, the recipe against dynamic sampling and",
           "against LoRA, the choice of its learning rate and the suite) measures them again on the current commit.",
           "",
           "Each section names the code it measured: the last commit, up to the one it ran on, that changed what",
           "the measurement depends on, with that commit's date. Later commits may have changed that code since;",
           "the figures stay, labelled by the code that produced them. Which of them are older than the code now:",
           "`make status` (`python scripts/measure.py --status`), which names, per measurement, the first later",
           "commit that changed its code and how many did; every CI run prints it at its end.",
           "",
           "Every ± on this page is labelled: a gain's ± is the sample standard deviation over the trainings",
           "named beside it; a paired difference comes with its 95% confidence interval (Student's t over the",
           "pairs).", ""]

    def head(title: str, r: dict) -> list[str]:
        v = ", ".join(f"{k} {x}" for k, x in r["versions"].items())
        code = r.get("code", r["commit"])
        return [f"## {title}", "", f"Measured code `{short(code)}`" + (f" ({r['code_date']})" if r.get("code_date")
                                                                        else "")
                + f": `{r['command']}` on commit `{short(r['commit'])}`, {r['date']}; {r['machine']['summary']}; {v}. "
                f"{r['seconds'] / 60:.1f} min.", ""]

    demo = results.get("demo")
    if demo:
        f = demo["figures"]
        out += head("The demo (`make demo`)", demo)
        out += ["| | |", "|---|---|",
                f"| test accuracy ({f['n']} held-out problems) | {pct(f['base_accuracy'])} → "
                f"{pct(f['trained_accuracy'])} ({f['gain_points']:+.1f} points), one training seed |",
                "| stages (s) | " + ", ".join(f"{k} {v:.0f}" for k, v in f["stage_seconds"].items()
                                              if v is not None) + " |",
                f"| training | {f['steps']} steps in {f['train_seconds']:.0f} s, median step {f['step_seconds']:.2f} s |"]
        curve = f.get("curve")
        if curve:
            path, cost = curve_text(curve)
            out.append(f"| learning curve ({curve['n']} {curve['split']} problems, {curve['points']} points) | "
                       f"{path}{f'; its cost {cost} of the step time' if cost else ''} |")
        g = f.get("groups_with_spread") or {}
        if g.get("first_fifth") is not None:
            out.append(f"| groups with reward spread (first → last fifth of the steps) | {pct(g['first_fifth'])} → "
                       f"{pct(g['last_fifth'])} |")
        if f.get("kl_probes"):
            out.append(f"| KL from the start on the probes (nats/token) | max {f['kl_probes']['max']:.3g}, last "
                       f"{f['kl_probes']['last']:.3g} |")
        g = f.get("gauge") or {}
        if g.get("generation_share") is not None and g.get("optimisation_share") is not None:
            out.append(f"| against the machine's limits (mean over the steps) | generation at "
                       f"{g['generation_share']:.0%} of the server {g['basis']}' decode ceiling, optimisation at "
                       f"{g['optimisation_share']:.0%} of the trainer {g['basis']}' {g['peak']} (completion tokens "
                       "only: a lower bound) |")
        o = f.get("overhead") or {}
        if o.get("sampler_core_share") is not None and o.get("gauge_core_share") is not None:
            out.append(f"| monitoring's cost (share of one core over the training) | the sampler "
                       f"{o['sampler_core_share']:.2%}, the roofline gauge {o['gauge_core_share']:.2%} "
                       f"({o['gauge_cpu_seconds']:.2f} CPU-s before the first step) |")
        out += ["", "One run and one seed: the gain's spread over seeds and base models is the protocol's "
                    "(below, `--full`).", ""]
    for name, title in (("bench", "The bench on the demo's model"), ("bench-100m", "The bench at ~100M parameters")):
        r = results.get(name)
        if not r:
            continue
        f = r["figures"]
        out += head(title, r)
        params = f" ({f['parameters'] / 1e6:.2f}M parameters)" if f.get("parameters") else ""
        out += [f"Size {f['size']}{params}, {f['steps']} measured steps per training, {f['repeats']} repeats taking "
                "turns; the ratio is each repeat's step time over the synchronous server path's of the same repeat "
                "(median, range).", "",
                "| path | step s (median) | step s (repeats) | × server step | generation tok/s | push MB | push s |",
                "|---|---|---|---|---|---|---|"]
        for path, p in f["paths"].items():
            ratio = (f"{p['ratio_to_server']:.2f} ({p['ratio_range'][0]:.2f}–{p['ratio_range'][1]:.2f})"
                     if p.get("ratio_to_server") is not None else "—")
            gen = f"{p['generation_tokens_per_second']:.0f}" if p.get("generation_tokens_per_second") else "—"
            out.append(f"| {path} | {p['step_seconds']:.2f} | "
                       + ", ".join(f"{x:.2f}" for x in p["step_seconds_repeats"])
                       + f" | {ratio} | {gen} | {p['sync_megabytes']:.1f} | {p['sync_seconds']:.3f} |")
        out.append("")
        against = [line for p in f["paths"].values() for line in (p.get("gauge"), p.get("sync")) if line]
        if against:  # the bench's own lines (workbench/experiments/bench.py), of each path's median repeat
            out += ["Against the machine's limits (each path's median repeat):", "",
                    *(f"- {line.strip()}" for line in against), ""]
    reload_ = results.get("reload")
    if reload_:
        f = reload_["figures"]
        m = f["median_seconds"]
        out += head("The server's reload, part by part", reload_)
        env = ", ".join(f"{k}={v}" for k, v in f["env"].items() if v)
        out += [f"The bench's {f['size']} model ({f['megabytes']:.1f} MB of float32 weights) written as a push writes "
                f"it and reloaded {f['reloads']} times (after one more) by vLLM's own `reload_weights`, in one process "
                f"on the server's core with the server's environment ({env}); median seconds of each part:", "",
                "| part | seconds | share of the reload |", "|---|---|---|"]
        for key, what in RELOAD_PARTS:
            out.append(f"| {what} | {m[key]:.3f} | {m[key] / m['reload']:.0%} |")
        out += [f"| **the reload** | **{m['reload']:.3f}** | {f['megabytes'] / 1e3 / m['reload']:.2f} GB/s |",
                f"| the prefix-cache reset after it | {m['cache']:.3f} | |", "",
                f"One copy of the weights on that core takes {f['megabytes'] / 1e3 / f['copy_gb_s']:.3f} s (its copy "
                f"bandwidth, {f['copy_gb_s']:.2f} GB/s): the reload takes "
                f"{m['reload'] / (f['megabytes'] / 1e3 / f['copy_gb_s']):.1f} copies' time. The bench's push times the "
                "server's whole reload call instead (the HTTP request and the API server's RPC to the engine core "
                "included), in a running server.", ""]
    protocol = results.get("protocol")
    out += ["## The protocol over base models and seeds", ""]
    if protocol:
        f = protocol["figures"]
        out += head("", protocol)[2:]
        out += [f["headline"], "", "| base (data seed) | test base accuracy | mean gain (points) |", "|---|---|---|"]
        for d, g in f["base_means"].items():
            out.append(f"| {d} | {pct(f['base_accuracy'].get(d))} | {g:+.1f} |")
        out.append("")
        out += trainings_table([("", t) for t in f.get("gains") or []])
    else:
        out += ["Not measured on this code: `MEASURE=--full make measure` runs it (hours on two cores).", ""]
    rm = results.get("reward-model")
    out += ["## The tiny reward model", ""]
    if rm:
        f = rm["figures"]
        held, train, st = f["heldout"], f["train"], f["settings"]
        out += head("", rm)[2:]
        out += [f"A one-label classification head ({f['architecture']}) on the cpu-tiny base, trained on the base's own "
                f"completions ({st['samples']} per prompt at temperature {st['temperature']:g}) of "
                f"{st['train_prompts']} training prompts, each labelled by the correctness rule; scored on "
                f"{st['heldout_prompts']} validation prompts' completions, none of whose prompts it trained on. "
                f"Agreement with the rule (a completion counts as judged right when its logit is above 0):", "",
                "| completions | how many | right by the rule | accuracy | AUC |", "|---|---|---|---|---|",
                f"| trained on | {train['completions']} | {pct(train['positive_share'])} | {pct(train['accuracy'])} | "
                f"{train['auc']:.3f} |",
                f"| **held out** | {held['completions']} | {pct(held['positive_share'])} | **{pct(held['accuracy'])}** "
                f"| **{held['auc']:.3f}** |", "",
                f"Always saying \"wrong\" would score {pct(1 - held['positive_share'])} on the held-out completions: the "
                f"AUC is the figure to read. Build: {f['build_seconds']:.0f} s ({f['sample_seconds']:.0f} s of it "
                "sampling), in one thread under the tiny model's pinned kernels.", ""]
        j = f.get("judge")
        if j:
            auc_text = f"{j['auc']:.3f}" if j.get("auc") is not None else "—"
            out += [f"A judge on the same {j['completions']} held-out completions: the frozen tiny base on a LoRA "
                    f"server (`model: policy-base`), asked with a fixed grading prompt, its first number read on a "
                    f"0–10 scale (scripts/judge_agreement.py). Its answer parsed to a score for {j['parsed']} of "
                    f"them ({pct(j['parsed'] / j['completions'])}); over those, accuracy {pct(j['accuracy'])} and "
                    f"AUC {auc_text} against the rule; {1000 * j['seconds_per_completion']:.1f} ms per completion "
                    f"at {j['concurrency']} requests in flight. The tiny base was never taught to grade: this is "
                    "what it does, not a good judge.", ""]
        b = f.get("bench")
        if b:
            row, share = b["paths"]["reward-model"], b.get("reward_share") or []
            out += [f"Its cost per step (`workbench bench --paths server,reward-model`, {b['repeats']} repeats of "
                    f"{b['steps']} steps taking turns, the tiny policy): the reward-model path's step is "
                    f"{row['ratio_to_server']:.2f} × the server path's (range {row['ratio_range'][0]:.2f}–"
                    f"{row['ratio_range'][1]:.2f}); scoring the reward model is "
                    f"{pct(statistics.median(share))} of its step (range {pct(min(share))}–{pct(max(share))}).", ""]
    else:
        out += ["Not measured yet: `python scripts/measure.py --only reward-model` (a few minutes on two cores).", ""]
    out += rewards_section(results.get("rewards"), head)
    for name, (what, title) in HEAD_TO_HEAD.items():
        out += head_to_head_section(results, name, what, title, head)
    choice = results.get("choice")
    out += ["## The recipe's learning rate, chosen on validation", ""]
    if choice:
        f = choice["figures"]
        out += head("", choice)[2:]
        bases = [base_name(v["data_seed"]) for v in f["candidates"][0]["validation"]]
        out += [f"Each setting trained once per base model with training seed {f['choose_seed']}, its final model "
                "scored on the validation split; the setting with the highest mean over the bases is chosen. One "
                "training per setting and base decides a choice; it does not measure a spread.", "",
                "| setting | overrides | " + " | ".join(f"base {b}" for b in bases)
                + " | mean of the trained | groups with spread (per base) |",
                "|---|---|" + "---|" * len(bases) + "---|---|",
                "| the base model | | " + " | ".join(pct(v["base"]) for v in f["candidates"][0]["validation"])
                + " | | |"]
        for c in f["candidates"]:
            b = "**" if c["name"] == f["chosen"] else ""
            out.append(f"| {b}{c['name']}{b} | `{' '.join(c['overrides']) or '(as the recipe)'}` | "
                       + " | ".join(pct(v["trained"]) for v in c["validation"])
                       + f" | {b}{pct(c['mean_trained'])}{b} | "
                       + " / ".join(pct(v["signal"]) for v in c["validation"]) + " |")
        picked = ", ".join(f"base {base_name(p['data_seed'])} {pct(p['base'])} → {pct(p['trained'])}"
                           for p in f["picked"])
        out += ["", f"Chosen: **{f['chosen']}**. The chosen model itself on the test split (picked for its validation "
                    f"score, so kept out of any result): {picked}. The chosen setting trained again on test: "
                    f"{f['test']['headline']}", ""]
        check = repeats(choice, results.get("protocol"))
        out += [check, ""] if check else []
    else:
        out += ["Not measured on this code: `python scripts/measure.py --only choice` runs it (about 75 minutes on "
                "two cores).", ""]
    suite = results.get("suite")
    out += ["## The test suite", ""]
    if suite:
        f = suite["figures"]
        out += [f"`{suite['command']}` on commit `{short(suite['commit'])}`, {suite['date']}; "
                f"{suite['machine']['summary']}: **{f['passed']} passed, {f['failed']} failed, {f['errors']} errors, "
                f"{f['skipped']} skipped in {f['seconds'] / 60:.1f} min** on "
                f"{f['workers'] if f.get('workers') is not None else 'an unrecorded number of'} workers, exit status "
                f"{f['exit_status'] if f.get('exit_status') is not None else 'not recorded'}. Its time per "
                "file: tests/README.md. (The suite's own timing is of the commit before the one that records it.)", ""]
    else:
        out += ["Not recorded yet: `python scripts/measure.py --suite JUNIT.xml` after `make test`.", ""]
    return "\n".join(out)


def rewards_section(r: dict | None, head) -> list[str]:
    """The results page's section for the learned reward against the rule (measure_rewards)."""
    out = ["## A learned reward against the correctness rule", ""]
    if not r:
        return out + ["Not measured yet: `python scripts/measure.py --only rewards` (about an hour on two cores; "
                      "`workbench protocol --resume` continues an interrupted one).", ""]
    out += head("", r)[2:]
    out += ["cpu-tiny-rm trains on the tiny reward model (weight 1, its probability) with the correctness rule "
            "scored and logged at weight 0; the rule arm is the same recipe trained on the rule (weight 1) with the "
            "reward model scored and logged at weight 0. Both on one base model, each seed in both arms, scored on "
            "the test split by the rule. The learned reward and the verified accuracy (the rule on the training "
            "completions) are the means of the first and last fifth of the steps. The advisor column is the "
            "advisor's reading of each training's recorded files when the figures were recorded (its rule may be "
            "newer than the code that trained).", "",
            "| arm | seed | test: base → trained | gain | learned reward (first → last fifth) | verified accuracy "
            "(first → last fifth) | reward share of the step | requests failed | advisor |",
            "|---|---|---|---|---|---|---|---|---|"]
    names = {"recipe": "reward model", "rule": "rule"}
    for arm in r["figures"]["arms"]:
        for t in arm["gains"]:
            lr, v = t["learned_reward"], t["verified"]
            out.append(f"| {names.get(arm['name'], arm['name'])} | {t['seed']} | {pct(t['base'])} → {pct(t['trained'])}"
                       f" | {t['gain']:+.1f} | {lr[0]:.2f} → {lr[1]:.2f} | {pct(v[0])} → {pct(v[1])} | "
                       f"{pct(t['reward_share'])} | {t['failed']} of {t['requests']} | "
                       f"{'reward hacking' if t['reward_hacking'] else '—'} |")
    out.append("")
    for arm in r["figures"]["arms"]:
        out.append(f"- {names.get(arm['name'], arm['name'])}: {arm['headline'].split(': ', 1)[-1]}")
    p = r["figures"].get("paired")
    if p:
        out += ["", f"{paired_text('the reward model', p).replace('minus the recipe', 'minus the rule').replace('than the recipe', 'than the rule').replace('and the recipe', 'and the rule')}. "
                "One base model and three seeds: a first reading, not a general finding."]
    return out + [""]


def head_to_head_section(results: dict[str, dict], name: str, what: str, title: str,
                         head: Callable[[str, dict], list[str]]) -> list[str]:
    """The results page's section for head-to-head `name`: each arm's gain (mean ± sample sd), per base, completion
    tokens, training time, groups with spread, the paired difference with its 95% interval, and each training."""
    out = [f"## {title}", ""]
    arms, differ = head_to_head(results, name)
    if not arms:
        return out + [f"Not measured yet: `python scripts/measure.py --only {name}` runs it, one arm at a time "
                      "(resumable), beside the protocol of the same code.", ""]
    plain = arms[0]
    out += head("", results[name])[2:]
    out += ([f"Not compared with the recipe: {differ}. `python scripts/measure.py --only protocol --only {name}` "
             "measures both on one code.", ""] if differ else [])
    out += [f"Each arm trained on {len(plain['data_seeds']) or 1} base model(s) "
            f"({', '.join(map(base_name, plain['data_seeds'])) or '—'}) with training seed(s) "
            f"{', '.join(map(str, plain['seeds']))}, scored on the test split; a gain is the mean ± sample sd over "
            f"that arm's {plain['trainings']} trainings."
            + ("" if differ else " The recipe's arm is the protocol's trainings of the same bases and seeds (above): "
               "under the same seeds a training repeats itself, so they are not trained twice.")
            + " Completion tokens are what a training generated (refills included); training s is a training's "
            "wall time from its first step to its last, mean over the arm.", "",
            "| arm | overrides | test: base → trained | gain (points, mean ± sample sd) | per base | completion "
            "tokens per training | training s (mean) | points per 100k completion tokens (mean gain ÷ mean tokens) "
            "| groups with spread (trained / generated) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        base = statistics.fmean(t["base"] for t in a["gains"])
        trained = statistics.fmean(t["trained"] for t in a["gains"])
        spread = f" ± {a['gain_std']:.1f}" if a.get("gain_std") is not None else ""
        tokens = a.get("generated_tokens")
        ratio = (f" ({tokens / plain['generated_tokens']:.2f}×)" if tokens and plain.get("generated_tokens")
                 and a is not plain and not differ else "")
        per = f"{a['gain_mean'] / tokens * 1e5:+.2f}" if tokens else "—"
        seconds = mean([t.get("train_seconds") for t in a["gains"]])
        out.append(f"| {a['name']} | `{' '.join(a['overrides']) or '(as the recipe)'}` | {pct(base)} → "
                   f"{pct(trained)} | {a['gain_mean']:+.1f}{spread} | "
                   + ", ".join(f"{base_name(d)}: {g:+.1f}" for d, g in a["base_means"].items())
                   + f" | {f'{tokens:,.0f}' if tokens else '—'}{ratio} | "
                   f"{f'{seconds:.0f}' if seconds is not None else '—'} | {per} | {pct(a.get('signal'))} / "
                   f"{pct(a.get('signal_generated'))} |")
    out.append("")
    p = paired(plain, arms[1]) if not differ else None
    if p:
        out += ["Paired by (base, seed), " + arms[1]["name"] + " minus the recipe, in test points: "
                + ", ".join(f"base {base_name(x['data_seed'])} seed {x['seed']} {x['difference']:+.1f}"
                            for x in p["pairs"]) + ".", "",
                f"**{paired_text(what, p)}.**", ""]
    out += trainings_table([(a["name"], t) for a in arms for t in a["gains"]])
    return out


def apart(a: dict, b: dict) -> list[str]:
    """What keeps two results files' trainings from being the same trainings: other code (their code commits, or
    their commits for a file without one; a tree with uncommitted changes is other code), another machine, other
    versions of the stack."""
    differ = [what for what, x, y in (
        ("another commit", a.get("code", a["commit"]), b.get("code", b["commit"])),
        ("another machine", a["machine"]["summary"], b["machine"]["summary"]),
        ("other versions of the stack", a.get("versions"), b.get("versions"))) if x != y]
    return differ + ([] if a.get("clean", True) and b.get("clean", True) else ["a tree with uncommitted changes"])


def repeats(choice: dict, protocol: dict | None) -> str | None:
    """The recipe's test trainings in the choice against the protocol measurement's of the same base and seed: under
    fixed seeds, on the same code and machine, they are the same trainings and must score the same. None when there
    is nothing to compare (another setting chosen, other code or machine, no common training)."""
    f = choice["figures"]
    if f["chosen"] != "recipe" or not protocol or apart(choice, protocol):
        return None
    theirs = {(t["data_seed"], t["seed"]): t for t in protocol["figures"]["gains"]}
    pairs = [(t, theirs[key]) for t in f["test"]["gains"] if (key := (t["data_seed"], t["seed"])) in theirs]
    if not pairs:
        return None
    differ = [f"base {base_name(a['data_seed'])} seed {a['seed']}: {pct(a['trained'])} here, {pct(b['trained'])} there"
              for a, b in pairs if a["trained"] != b["trained"]]
    return (f"The recipe's {len(pairs)} test training(s) here (training seed(s) "
            f"{', '.join(sorted({str(a['seed']) for a, _ in pairs}))}) repeat the protocol measurement's of the same "
            "base and seed, on the same code and machine: "
            + (f"the same test accuracy on all {len(pairs)}." if not differ else
               f"**they differ** ({'; '.join(differ)}): a training does not repeat itself here (docs/recipes.md)."))


# The head-to-head measurements: each measures one setting over some of the protocol's (base, seed) pairs; the
# protocol's trainings of the same pairs are its plain arm. Name -> (what the arm is called in prose, section title).
HEAD_TO_HEAD = {"variants": ("dynamic sampling", "The recipe against dynamic sampling"),
                "lora": ("LoRA", "LoRA against full fine-tuning")}


def head_to_head(results: dict[str, dict], name: str = "variants") -> tuple[list[dict], str | None]:
    """The arms to compare: the plain one (the protocol's recipe, over the same (base, seed) pairs as the other
    arm), then measurement `name`'s arms, when both files measured the same code (their code commits, or their
    commits for a file without one) on one machine; otherwise `name`'s arms alone and what differs. No arms when
    `name` is not measured."""
    other, protocol = results.get(name), results.get("protocol")
    arms = list(other["figures"]["arms"]) if other else []
    if not arms:
        return [], None
    if protocol is None:
        return arms, "the protocol, its plain arm, is not measured"
    f = protocol["figures"]
    theirs = {(t["data_seed"], t["seed"]): t for t in f["gains"]}
    wanted = [(t["data_seed"], t["seed"]) for t in arms[0]["gains"]]
    differs = apart(protocol, other) + (["other base models or training seeds"]
                                        if any(k not in theirs for k in wanted) else [])
    if differs:
        return arms, f"the protocol, its plain arm, ran on {' and '.join(differs)}"
    if len(wanted) == len(theirs):
        plain = f
    else:  # the protocol's trainings of the other arm's pairs only
        plain = arm_figures("recipe", [theirs[k] for k in wanted])
        if plain["signal_generated"] is None and f.get("signal_generated") == f.get("signal"):
            plain["signal_generated"] = plain["signal"]  # no refills in the recipe: generated = trained
    return [{**plain, "name": "recipe", "overrides": []}, *arms], None


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p > 0.5), by bisection on its CDF integrated with Simpson's rule: no scipy here."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired(plain: dict, other: dict) -> dict | None:
    """`other` minus `plain`, training by training on the same (base, seed): each difference (test points), their
    mean, sample sd and the mean's 95% interval (Student's t over the pairs), and whether it excludes zero. None
    with fewer than two pairs."""
    theirs = {(t["data_seed"], t["seed"]): t for t in plain["gains"]}
    pairs = [{"data_seed": t["data_seed"], "seed": t["seed"], "difference": t["gain"] - theirs[k]["gain"]}
             for t in other["gains"] if (k := (t["data_seed"], t["seed"])) in theirs]
    if len(pairs) < 2:
        return None
    d = [p["difference"] for p in pairs]
    m, sd = statistics.fmean(d), statistics.stdev(d)
    half = t_quantile(0.975, len(d) - 1) * sd / math.sqrt(len(d))
    return {"pairs": pairs, "n": len(d), "mean": m, "sd": sd, "ci": [m - half, m + half],
            "excludes_zero": m - half > 0 or m + half < 0}


def bound(x: float) -> str:
    """An interval's end in points: one decimal, two where one would round it onto zero."""
    return f"{x:+.2f}" if abs(x) < 0.05 else f"{x:+.1f}"


def paired_text(what: str, p: dict) -> str:
    """The paired difference in words: its mean, its 95% interval and whether it is told apart from zero."""
    lo, hi = p["ci"]
    verdict = (f"the interval excludes zero: {what} {'gains more' if p['mean'] > 0 else 'gains less'} than the "
               "recipe on these pairs" if p["excludes_zero"] else
               f"the interval includes zero: no difference between {what} and the recipe can be told apart over "
               f"these {p['n']} pairs")
    return (f"{what} minus the recipe, paired by base and seed: {p['mean']:+.1f} points (95% CI {bound(lo)} to "
            f"{bound(hi)}, Student's t over {p['n']} pairs; sample sd of the differences {p['sd']:.1f}); {verdict}")


def base_name(data_seed: int | str | None) -> str:
    """A base model by its data seed; the recipe's own (a protocol without --data-seeds) as "—"."""
    return "—" if data_seed in (None, "None") else str(data_seed)


def trainings_table(trainings: list[tuple[str, dict]]) -> list[str]:
    """One row per (arm, training): its base, seed, test result, share of groups with spread and learning curve."""
    if not trainings:
        return []
    arm = any(name for name, _ in trainings)
    curves = [t["curve"] for _, t in trainings if t.get("curve")]
    what = (f"; the learning curve: the served weights on {curves[0]['n']} {curves[0]['split']} problems at "
            "each step shown" if curves else "")
    steps = sorted({s for c in curves for s, _ in c["points"]})
    out = [f"Each training (test split{what}):", "",
           ("| arm " if arm else "") + "| base | seed | test: base → trained | gain | groups with spread |"
           + "".join(f" step {s} |" for s in steps),
           ("|---" if arm else "") + "|---|---|---|---|---|" + "---|" * len(steps)]
    for name, t in trainings:
        at = dict((s, a) for s, a in (t["curve"] or {}).get("points", []))
        out.append((f"| {name} " if arm else "") + f"| {base_name(t['data_seed'])} | {t['seed']} | "
                   f"{pct(t['base'])} → {pct(t['trained'])} | {t['gain']:+.1f} | {pct(t.get('signal'))} |"
                   + "".join(f" {pct(at.get(s))} |" for s in steps))
    return out + [""]


def with_block(readme: str, block: str, name: str = "") -> str:
    """The page with its measured block (`<!-- measured:begin -->`, or `<!-- measured:begin NAME -->` on docs pages)
    replaced by `block`."""
    begin = BEGIN if not name else BEGIN.replace(" -->", f" {name} -->")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"measure: the page has no {begin} ... {END} block to fill")
    return pattern.sub(lambda _: block if not name else block.replace(BEGIN, begin, 1), readme, count=1)


def lora_block(results: dict[str, dict]) -> str:
    """docs/lora.md's measured lines: LoRA against full fine-tuning, paired, with the code it measured."""
    lines = [BEGIN]
    arms, differ = head_to_head(results, "lora")
    if not arms:
        lines.append("Not measured yet.")
    elif differ:
        lines.append(f"Measured, but not comparable with full fine-tuning: {differ} (docs/results.md).")
    else:
        plain, lora = arms
        r = results["lora"]
        p = paired(plain, lora)
        lines += [f"Measured code `{short(r['code'])}` ({r.get('code_date', r['date'][:10])}), "
                  f"{r['machine']['summary']}: test gain **{lora['gain_mean']:+.1f} ± {lora['gain_std']:.1f}** with "
                  f"LoRA against **{plain['gain_mean']:+.1f} ± {plain['gain_std']:.1f}** points with full fine-tuning "
                  f"(mean ± sample sd over {lora['trainings']} trainings each, base "
                  f"{', '.join(map(base_name, plain['data_seeds']))}, seeds {', '.join(map(str, plain['seeds']))}), "
                  f"at {lora['generated_tokens'] / plain['generated_tokens']:.2f}× the completion tokens and "
                  f"{mean([t['train_seconds'] for t in lora['gains']]) / mean([t['train_seconds'] for t in plain['gains']]):.2f}× "
                  "the training time."]
        if p:
            lines.append(f"{paired_text('LoRA', p)}. Three pairs on one base model: a first reading, not a "
                         "general finding.")
    lines.append("Each training and its learning curve: [results.md](results.md#lora-against-full-fine-tuning).")
    return "\n".join(lines + [END])


# docs pages with a measured block of their own: the page and what renders its block
DOC_BLOCKS = {"lora": (REPO / "docs" / "lora.md", lora_block)}


def render() -> None:
    from workbench.rundir import write_atomic

    results = load_results()
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(PAGE, results_page(results))
    write_atomic(README, with_block(README.read_text(), readme_block(results)))
    for name, (page, block) in DOC_BLOCKS.items():
        write_atomic(page, with_block(page.read_text(), block(results), name))


# ----------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)} (the default; under 30 min on 2 cores)")
    what.add_argument("--full", action="store_true", help=f"{', '.join(FULL)} (hours)")
    what.add_argument("--only", choices=sorted(MEASURED), action="append", help="one measurement (repeatable)")
    what.add_argument("--status", action="store_true",
                      help="per measurement: fresh, or stale with the first later commit that changed its code")
    what.add_argument("--suite", metavar="JUNIT", type=Path, help="record the suite's timing from this JUnit XML")
    what.add_argument("--render", action="store_true", help="only render docs/results.md and the README block")
    what.add_argument("--rewards-from", metavar="RUN", type=Path,
                      help="record the rewards measurement from this finished protocol directory (REWARDS_COMMAND "
                           "run by hand, e.g. resumed over sessions); --commit names the commit it ran on")
    parser.add_argument("--commit", help="with --suite or --rewards-from: the commit it ran on (default: HEAD)")
    parser.add_argument("--command", default="make test", help="with --suite: how the suite was run")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="measure a tree with uncommitted changes (recorded as not clean; the test refuses it)")
    args = parser.parse_args(argv)

    if args.render:
        render()
        return 0
    if args.status:
        print("\n".join(status_lines()))
        return 0
    if args.rewards_from:
        commit = git("rev-parse", args.commit or "HEAD")
        seconds = float(json.loads((args.rewards_from / "protocol" / "protocol.json").read_text())["seconds"])
        record("rewards", command_line(REWARDS_COMMAND), seconds, rewards_figures(args.rewards_from),
               where("rewards", commit), True)
        render()
        return 0
    if args.suite:
        commit = git("rev-parse", args.commit or "HEAD")  # a short or symbolic name, recorded in full
        record("suite", args.command, 0.0, suite_figures(args.suite), where("suite", commit), True)
        render()
        return 0
    names = args.only or (FULL if args.full else QUICK)
    changed = sorted({p for name in names for p in dirty(MEASURED[name])})
    if changed and not args.allow_dirty:
        raise SystemExit(f"measure: uncommitted changes in what is measured ({', '.join(changed[:5])}); commit them "
                         "first, so the figures name the code that ran (or --allow-dirty for a trial)")
    commit = git("rev-parse", "HEAD")
    root = REPO / "runs" / f"measure-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    print(f"measure: {', '.join(names)} on {short(commit)}; runs and logs in {root}", flush=True)
    for name in names:
        started, at = time.time(), where(name, commit)
        if name in ARMED:
            if changed:
                raise SystemExit(f"measure: {name} keeps its arms as pieces, keyed by their code: not on a tree "
                                 "with uncommitted changes")
            command, seconds, figures = measure_armed(name, ARMED[name], root, at,
                                                      log=lambda line: print(line, flush=True))
        else:
            command, seconds, figures = MEASURES[name](root)
        path = record(name, command, seconds, figures, at, not changed)
        drop_pieces(name)
        print(f"measure: {name} in {(time.time() - started) / 60:.1f} min -> {path.relative_to(REPO)}", flush=True)
        render()  # after each: a later failure keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
