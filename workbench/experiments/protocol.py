"""The honest protocol: settings chosen on the validation split, the result reported on the test split over seeds.

    workbench protocol --recipe cpu-tiny-async \\
        --candidate "lr 2.5e-5: trainer.learning_rate=2.5e-5" --candidate "lr 1e-4: trainer.learning_rate=1e-4" \\
        --choose-seed 0 --seeds 1,2,3
    workbench protocol --resume runs/<id>-protocol          # continue after a crash or a kill; --seeds adds seeds
    workbench protocol --recipe cpu-tiny-async --data-seeds 0,1,2 --seeds 1,2,3     # over three base models too
    workbench protocol --recipe cpu-tiny-async --report-all --seeds 1,2,3 \
        --candidate "dynamic: rollout.dynamic_sampling=true"                       # both settings on test

1. Choose: the recipe as it is ("recipe") and each candidate (a name, then space-separated overrides) are trained
   once with the choice's seed and evaluated on the validation split (`eval.split=validation`); the candidate whose
   trained model scores highest there is chosen (the recipe on a tie: a change must earn its place).
2. Report: the chosen setting is trained afresh for each test seed and evaluated on the test split ("heldout").
   The result is the gain on the test split (trained − base, the same base for every seed) as mean ± sample
   standard deviation over the test seeds. The model the choice picked is also scored on the test split, shown
   beside the result and kept out of it: picked for its validation score, it carries some of that luck along
   (the gap between the two is the choice's optimism), which is why the choice's seed may not be a test seed.

Seeds are `trainer.seed`: the data, its splits and the base model (data.seed) stay the same, so the spread is the
training's. `--data-seeds` adds the base: each data seed is its own splits and its own tiny model (data.seed and
model.tiny.seed), every candidate is trained once per base on validation and chosen by its mean over the bases,
and the test seeds are trained on every base; the result is the gain's mean ± std over every (base, seed) pair,
each gain against its own base, with each base's mean shown. `--report-all` is a head-to-head comparison of
settings fixed beforehand: no choice (nothing is trained on validation), every candidate trained per base and test
seed and reported on the test split, each training with the completion tokens it generated (a setting that
generates more per step is compared at its real cost). Each training is one `workbench train` in its own process (one after the other, so their timings do not
compete for cores), under RUN/protocol/runs/<label>/. Every model is scored once per split: one evaluation of the
base and all the split's trained models together, after their trainings, in this process (the base's score is the
same number for every training of the split). The trainings and the evaluations share one server (serving/shared.py:
each training pushes its weights before its first rollout, the evaluation loads each model before scoring it and
checks the server answers as that model); a candidate that changes the server's flags gets a server of its own. Each
training's run directory receives its own base-vs-trained evaluation, analysis and report, so `workbench compare`
and `workbench report` read them as any run.

Every candidate's recipe and evaluation rows are checked before the first training starts, and a candidate may not
change the data or the evaluation (that would compare settings on different problems). Output:
RUN/protocol/protocol.json, written after every training and evaluation (what `--resume` continues from: nothing
recorded or finished is done again), and protocol.md (the tables), printed at the end.
"""
from __future__ import annotations

import contextlib
import functools
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

from workbench.errors import WorkbenchError
from workbench.records import read_jsonl
from workbench.rundir import RunDir, set_aside, trained_weights, write_atomic
from workbench.tasks.task import Task

BASELINE = "recipe"
VALIDATION, TEST = "validation", "heldout"
# what a candidate may not change: the problems it is trained and scored on, and how they are scored
FIXED_KEYS = ("data.", "eval.", "model.", "trainer.seed")


@dataclass
class Candidate:
    name: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """One training (or one evaluation of a trained model) in the protocol."""

    candidate: str
    seed: int
    split: str
    run: str
    base: float
    trained: float
    train_seconds: float | None = None
    data_seed: int | None = None  # the base model and splits (--data-seeds); None: the recipe's own
    generated_tokens: int | None = None  # completion tokens the training generated (its summary)
    # the training's mean share of groups with reward spread: in the batches it trained, and in all it generated
    # (dynamic sampling replaces groups without; otherwise the two are the same)
    signal: float | None = None
    signal_generated: float | None = None

    @property
    def gain(self) -> float:
        return self.trained - self.base


@dataclass
class Training:
    """One finished training: scored on `split` in that split's evaluation (`label` names it there)."""

    label: str
    candidate: str
    seed: int
    split: str
    run: str
    train_seconds: float | None = None
    data_seed: int | None = None
    generated_tokens: int | None = None
    signal: float | None = None
    signal_generated: float | None = None


def signal_shares(train_dir) -> tuple[float | None, float | None]:
    """A finished training's mean share of groups with reward spread, trained and generated (its metrics)."""
    from workbench.training.dynamic import ZERO_SPREAD_GENERATED
    from workbench.training.groups import ZERO_SPREAD

    rows = [r for r in read_jsonl(train_dir.metrics) if "loss" in r]

    def mean_share(key: str) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return 1.0 - statistics.fmean(values) if values else None

    trained = mean_share(ZERO_SPREAD)
    generated = mean_share(ZERO_SPREAD_GENERATED)
    return trained, generated if generated is not None else trained


@dataclass
class Protocol:
    recipe: str
    choose_seed: int
    seeds: list[int]
    candidates: list[Candidate]
    common: list[str] = field(default_factory=list)
    trainings: list[Training] = field(default_factory=list)
    base: dict[str, float] = field(default_factory=dict)  # split -> the base model's accuracy, scored once
    base_evaluation: dict[str, str] = field(default_factory=dict)  # split -> the evaluation that scored the base
    validation: list[Outcome] = field(default_factory=list)
    chosen: str | None = None
    selected: Outcome | None = None  # the model the choice picked, scored on test: shown, kept out of the result
    test: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    concurrent: int = 1  # trainings at once on the shared LoRA server (--concurrent)
    data_seeds: list[int] = field(default_factory=list)  # base models (--data-seeds); empty: the recipe's one
    report_all: bool = False  # every candidate trained and scored on test, not only the chosen one
    picked: list[Outcome] = field(default_factory=list)  # the choice's model on test, per base (`selected`: first)

    @property
    def bases(self) -> list[int | None]:
        return list(self.data_seeds) or [None]

    @property
    def reported(self) -> list[str]:
        """The candidates trained and scored on the test split."""
        if self.report_all:
            return [c.name for c in self.candidates]
        return [self.chosen] if self.chosen else []

    def _name(self, candidate: str | None) -> str | None:
        return candidate or self.chosen or next(iter(self.reported), None)

    def gains(self, candidate: str | None = None) -> list[float]:
        name = self._name(candidate)
        return [o.gain for o in self.test if o.candidate == name]

    def headline(self, candidate: str | None = None) -> str:
        name = self._name(candidate)
        test = [o for o in self.test if o.candidate == name]
        gains = [o.gain * 100 for o in test]
        if not gains:
            return "no test result yet"
        spread = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else ""
        base = statistics.fmean(o.base for o in test) * 100
        trained = statistics.fmean(o.trained for o in test) * 100
        over = f"{len(gains)} seed(s)"
        if self.data_seeds:
            over = (f"{len(gains)} trainings ({len({o.data_seed for o in test})} base model(s) x "
                    f"{len({o.seed for o in test})} seed(s))")
        tokens = [o.generated_tokens for o in test if o.generated_tokens]
        cost = f"; {statistics.fmean(tokens):,.0f} completion tokens generated per training" if tokens else ""
        kept = [o.signal for o in test if o.signal is not None]
        generated = [o.signal_generated for o in test if o.signal_generated is not None]
        if kept and generated:
            cost += (f"; groups with reward spread {statistics.fmean(kept):.0%} of those trained, "
                     f"{statistics.fmean(generated):.0%} of those generated")
        how = ("settings fixed beforehand, every one reported" if self.report_all else
               f"settings chosen on the validation split with seed {self.choose_seed}")
        return (f"{name}: test accuracy {base:.1f}% → {trained:.1f}%, gain {statistics.fmean(gains):+.1f}"
                f"{spread} points over {over} (mean ± sample std; {how}){cost}")

    def base_means(self, candidate: str | None = None) -> dict[int | None, float]:
        """Per base model, the mean test gain (points) of a candidate."""
        name = self._name(candidate)
        out = {}
        for d in self.bases:
            gains = [o.gain * 100 for o in self.test if o.candidate == name and o.data_seed == d]
            if gains:
                out[d] = statistics.fmean(gains)
        return out

    def markdown(self) -> str:
        based = bool(self.data_seeds)
        base_col, base_sep = ("| base (data seed) ", "|---") if based else ("", "")
        by_name = {c.name: c for c in self.candidates}
        lines = [f"Settings chosen on the validation split (trainer.seed={self.choose_seed}"
                 + (", by the mean over the base models" if based else "") + "):", "",
                 f"| candidate {base_col}| overrides | validation base → trained | gain | chosen |",
                 f"|---{base_sep}|---|---|---|---|"]
        if self.report_all:
            lines = ["Settings fixed beforehand, compared on the test split (no choice on validation):", "",
                     *(f"- {c.name}: `{' '.join(c.overrides) or '(as the recipe)'}`" for c in self.candidates)]
        for o in self.validation:
            over = " ".join(by_name[o.candidate].overrides) or "(as the recipe)"
            where = f"| {o.data_seed} " if based else ""
            lines.append(f"| {o.candidate} {where}| `{over}` | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | "
                         f"{'**yes**' if o.candidate == self.chosen else ''} |")
        what = "every candidate" if self.report_all else "the chosen setting"
        lines += ["", f"Reported on the test split ({TEST}), {what} trained afresh per seed:", "",
                  f"| candidate {base_col}| seed | test base → trained | gain | completion tokens | groups with spread "
                  "(trained / generated) | training s | run |",
                  f"|---{base_sep}|---|---|---|---|---|---|---|"]
        for o in self.test:
            secs = f"{o.train_seconds:.0f}" if o.train_seconds is not None else "—"
            tokens = f"{o.generated_tokens:,}" if o.generated_tokens else "—"
            spread = (f"{o.signal:.0%} / {o.signal_generated:.0%}" if o.signal is not None
                      and o.signal_generated is not None else "—")
            where = f"| {o.data_seed} " if based else ""
            lines.append(f"| {o.candidate} {where}| {o.seed} | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | "
                         f"{tokens} | {spread} | {secs} | {o.run} |")
        lines.append("")
        for name in self.reported:
            lines.append(self.headline(name))
            means = self.base_means(name)
            if based and means:
                lines.append("  per base model (data seed: mean gain): "
                             + ", ".join(f"{d}: {g:+.1f}" for d, g in means.items()))
        for s in self.picked or ([self.selected] if self.selected is not None else []):
            on = f" on base {s.data_seed}" if s.data_seed is not None else ""
            lines.append(f"The model the choice picked (seed {s.seed}{on}), on the test split: {s.base:.1%} → "
                         f"{s.trained:.1%} ({s.gain * 100:+.1f}); not part of the result (picked for its validation "
                         "score).")
        return "\n".join(lines + [""])

    def to_json(self) -> dict:
        out = asdict(self)
        out["headline"] = self.headline()
        gains = self.gains()
        out["test_gain_mean"] = statistics.fmean(gains) if gains else None
        out["test_gain_std"] = statistics.stdev(gains) if len(gains) > 1 else None
        out["by_candidate"] = {name: {"headline": self.headline(name), "gains": self.gains(name),
                                      "base_means": {str(d): g for d, g in self.base_means(name).items()}}
                               for name in self.reported}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Protocol":
        outcome = lambda o: Outcome(**o) if o else None  # noqa: E731
        return cls(data["recipe"], data["choose_seed"], list(data["seeds"]),
                   [Candidate(**c) for c in data["candidates"]], list(data.get("common") or []),
                   [Training(**t) for t in data.get("trainings") or []], dict(data.get("base") or {}),
                   dict(data.get("base_evaluation") or {}),
                   [Outcome(**o) for o in data.get("validation") or []], data.get("chosen"),
                   outcome(data.get("selected")), [Outcome(**o) for o in data.get("test") or []],
                   data.get("seconds") or 0.0, int(data.get("concurrent") or 1), list(data.get("data_seeds") or []),
                   bool(data.get("report_all")), [Outcome(**o) for o in data.get("picked") or []])

    def training(self, label: str) -> Training | None:
        return next((t for t in self.trainings if t.label == label), None)


def parse_candidate(text: str) -> Candidate:
    """'name: k=v k=v' or 'k=v k=v' (named by its overrides)."""
    name, sep, rest = text.partition(":")
    if not sep or "=" in name:
        name, rest = "", text
    overrides = rest.split()
    if not overrides:
        raise WorkbenchError(f"--candidate {text!r} has no override",
                             "write it as 'name: section.key=value ...', e.g. 'lr 1e-4: trainer.learning_rate=1e-4'")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise WorkbenchError(f"--candidate {text!r}: {bad[0]!r} is not section.key=value",
                             "separate overrides by spaces, each section.key=value")
    name = name.strip() or " ".join(overrides)
    if name == BASELINE:
        raise WorkbenchError(f"--candidate {text!r} is named {BASELINE!r}, the name of the recipe as it is",
                             "give the candidate another name")
    return Candidate(name, overrides)


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def concurrent_overrides(recipe_name: str, candidates: list[Candidate], common: list[str], concurrent: int
                         ) -> list[str]:
    """What a protocol of LoRA candidates adds for every training: the largest rank any candidate trains (the one
    shared server, started from the first recipe, must load every candidate's adapter, also to score it), and with
    `--concurrent N` two slots per training at once. Refused: `--concurrent` with full-weight pushes, or with
    candidates whose server would differ (they could not adopt the one server)."""
    from workbench import recipe  # lazy: yaml
    from workbench.recipe.schema import VLLM_LORA_RANKS
    from workbench.serving import launch

    loaded = [recipe.load(recipe_name, [*common, *c.overrides]) for c in candidates]
    adapters = [r.lora and r.server.weight_sync in ("auto", "lora") for r in loaded]
    if concurrent > 1 and not all(adapters):
        full = [c.name for c, a in zip(candidates, adapters) if not a]
        raise WorkbenchError(f"--concurrent {concurrent} trains several runs on one server at once, but "
                             f"{', '.join(map(repr, full))} pushes full weights, which would overwrite the others'",
                             "give the recipe a peft: section (each training then pushes its own adapter), or drop "
                             "--concurrent")
    if concurrent > 1:
        from workbench.tasks.rewardspec import parse  # lazy: the rewards' own imports

        engines = sorted({s.name for r in loaded for s in parse(r.rewards)
                          if s.is_learned and s.learned.engine.managed and not s.learned.on_policy_server})
        if engines:
            raise WorkbenchError(f"--concurrent {concurrent}: every training would start its own engine for "
                                 f"{', '.join(f'rewards.{n}' for n in engines)} on the same port beside the shared "
                                 "server, and they would clash",
                                 "serve the reward model once and attach the trainings to it (engine.mode: attach, "
                                 "engine.url), or drop --concurrent")
    if not any(adapters):
        return []
    rank = max(r.lora_rank for r, a in zip(loaded, adapters) if a)
    served = next((v for v in VLLM_LORA_RANKS if v >= rank), VLLM_LORA_RANKS[-1])
    added = [f"server.max_lora_rank={max([served, *(r.server.max_lora_rank or 0 for r in loaded)])}"]
    if concurrent > 1:
        added.insert(0, f"server.lora_slots={max(2 * concurrent, max(r.server.lora_slots for r in loaded))}")
        commands = {tuple(launch.command(recipe.resolve(recipe.load(recipe_name, [*common, *added, *c.overrides])),
                                         "MODEL")) for c in candidates}
        if len(commands) > 1:
            raise WorkbenchError(f"--concurrent {concurrent}: the candidates' servers differ (a candidate changes a "
                                 "server. setting), so they cannot share the protocol's one server",
                                 "vary training settings only, or drop --concurrent")
    return added


def data_overrides(data_seed: int | None) -> list[str]:
    """What one base model is: its data seed's splits and the tiny model built from them with that seed."""
    return [] if data_seed is None else [f"data.seed={data_seed}", f"model.tiny.seed={data_seed}"]


def check(recipe_name: str, candidates: list[Candidate], choose_seed: int, seeds: list[int],
          common: list[str], concurrent: int = 1, data_seeds: list[int] | None = None) -> None:
    """Everything that would stop the protocol after hours, refused before its first training: seeds, names,
    overrides that load, a validation split to choose on, evaluation rows on both splits, candidates that change
    the data or the evaluation."""
    from workbench import recipe  # lazy: yaml

    if not seeds or len(set(seeds)) != len(seeds):
        raise WorkbenchError(f"--seeds {seeds} must name one or more distinct seeds", "e.g. --seeds 1,2,3")
    if choose_seed in seeds:
        raise WorkbenchError(f"the choice's seed {choose_seed} is also a test seed: that test result would be the "
                             "model picked for its validation score",
                             "choose with a seed that is not among --seeds, e.g. --choose-seed 0 --seeds 1,2,3")
    if concurrent < 1:
        raise WorkbenchError(f"--concurrent {concurrent}", "train 1 or more at once")
    data_seeds = list(data_seeds or [])
    if len(set(data_seeds)) != len(data_seeds):
        raise WorkbenchError(f"--data-seeds {data_seeds} must be distinct", "e.g. --data-seeds 0,1,2")
    if data_seeds:
        fixed = [o for o in common if _key(o) in ("data.seed", "model.tiny.seed")]
        if fixed:
            raise WorkbenchError(f"the override {fixed[0]!r} sets what --data-seeds varies",
                                 "drop it, or drop --data-seeds")
        r = recipe.load(recipe_name, common)
        if r.data.name != "arithmetic" or r.data.path or r.model.path != "tiny":
            raise WorkbenchError(f"--data-seeds varies the generated splits and the tiny model built on them, but the "
                                 f"recipe trains {r.model.path!r} on {r.data.path or r.data.name!r}",
                                 "use --data-seeds with the tiny model on arithmetic (cpu-tiny, cpu-tiny-async)")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise WorkbenchError(f"two candidates share a name: {names}", "give each candidate its own name")
    for o in common:
        if _key(o) in ("trainer.seed", "eval.split"):
            raise WorkbenchError(f"the override {o!r} sets {_key(o)}, which the protocol sets for each training",
                                 "drop it (seeds go in --choose-seed and --seeds)")
    for c in candidates:
        fixed = [o for o in c.overrides if _key(o).startswith(FIXED_KEYS)]
        if fixed:
            raise WorkbenchError(f"candidate {c.name!r} changes {_key(fixed[0])}: candidates would be compared on "
                                 "different problems or scoring",
                                 "vary only training settings (trainer., rewards., rollout., server.); data, model "
                                 "and eval settings go before the options, for every candidate")
        for split, d in ((split, d) for split in (VALIDATION, TEST) for d in data_seeds or [None]):
            try:
                r = recipe.load(recipe_name, [*common, *data_overrides(d), *c.overrides, f"eval.split={split}"])
            except WorkbenchError as exc:
                raise WorkbenchError(f"candidate {c.name!r}: {exc.cause}", exc.fix) from None
            sources = Task.build(r).sources  # a test or validation source that is the training one: refused
            if sources["train"] is None or sources["validation"] is None:
                raise WorkbenchError(f"dataset {r.data.name!r} has no "
                                     f"{'training' if sources['train'] is None else 'validation'} split to choose on",
                                     "name data.train (and data.validation, or keep data.validation_size above 0)")
            if r.data.name == "arithmetic":  # generated: the rows themselves are checked here, cheaply
                Task.build(r).eval_rows(r.eval)


T = TypeVar("T")
_RUNNING: set[subprocess.Popen] = set()  # the protocol's workbench commands now running (one per worker thread)
_RUNNING_LOCK = threading.Lock()


def _call(cmd: list[str], out) -> int:
    """Runs one command to its end. When this process is interrupted (Ctrl-C, SIGTERM: `terminate_running`),
    the command gets SIGTERM and time to clean up (a training stops its trainer and removes its RAM-disk files),
    then SIGKILL: the protocol's commands never outlive it."""
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        return proc.wait()
    except BaseException:
        _end(proc)
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)


def _end(proc: subprocess.Popen, grace: float = 60.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def terminate_running() -> None:
    """End every command the worker threads are running (they wait in `_call`, which the main thread's
    interruption does not reach), in parallel."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    enders = [threading.Thread(target=_end, args=(p,)) for p in running]
    for t in enders:
        t.start()
    for t in enders:
        t.join()


def concurrently(calls: list[Callable[[], T]], workers: int, done: Callable[[T], None]) -> None:
    """The calls, `workers` at a time; `done` gets each result in the calls' order, whichever finished first, and
    the first failure is raised: the queued calls do not start, the running ones finish. Interrupted (Ctrl-C,
    SIGTERM), the running workbench commands are ended too (`terminate_running`), not waited for."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(call) for call in calls]
        try:
            for future in futures:
                done(future.result())
        except BaseException as exc:
            for future in futures:
                future.cancel()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                terminate_running()
            pool.shutdown(wait=True)
            raise


def _workbench(args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "workbench", *args]
    with log.open("w") as out:  # a file, not a pipe: an unread pipe would block the training
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        code = _call(cmd, out)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        raise WorkbenchError(f"`workbench {args[0]}` exited with status {code}; last lines of {log}:\n{tail}\n",
                             "fix what the log says, then continue with `workbench protocol --resume RUN`")


def _only_run(directory: Path) -> RunDir | None:
    runs = sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    return RunDir(runs[0]) if len(runs) == 1 else None


def _finished(directory: Path) -> RunDir | None:
    """The training in `directory` when it ran to its end (its summary and final model are there): a protocol
    killed after a training and before recording it keeps it."""
    run = _only_run(directory)
    if run is None or not run.train.summary.exists():
        return None
    if not trained_weights(run.train.final).exists():  # a model, or a LoRA run's adapter
        return None
    return run


def _evaluate(rr, models: dict[str, str], stage, server, log):
    """The split's one evaluation (evaluation/evaluate.py): every model scored once, loaded in turn into `server`
    when the protocol shares one."""
    from workbench.evaluation import evaluate  # lazy: requests

    return evaluate.evaluate(rr, models, stage=stage, quiet=True, log=log, server=server)


def _split_out(evaluation, base_samples: list, base_summary, label: str, run: RunDir, rr) -> None:
    """One trained model's part of a split's evaluation, written into its own run as a `workbench run` evaluation
    leaves it (base and trained, samples, table, figure, problem-by-problem analysis), and the run's report."""
    from dataclasses import replace

    from workbench.evaluation import analysis  # lazy: yaml
    from workbench.evaluation.evaluate import Evaluation  # lazy: requests
    from workbench.observe import report  # lazy: matplotlib

    trained = evaluation.by_model()[label]
    own = Evaluation([replace(base_summary, model="base"), replace(trained, model="trained")],
                     [replace(s, model="base") for s in base_samples]
                     + [replace(s, model="trained") for s in evaluation.samples if s.model == label])
    own.save(run.eval)
    try:
        analysis.analyse(own, rr, stage=run.eval)
    except Exception:  # the report computes it again from the samples; the scores themselves are saved
        pass
    report.build(run)


def _label(index: int, seed: int, split: str, data_seed: int | None = None) -> str:
    """The name of one training's (or evaluation's) directory and log under RUN/protocol/."""
    base = "" if data_seed is None else f"data{data_seed}-"
    return f"c{index}-{base}seed{seed}-{split}"


def _base_key(split: str, data_seed: int | None) -> str:
    """Where a split's base score is kept: the split, or the split of one base model."""
    return split if data_seed is None else f"{split}@data{data_seed}"


def _fresh(directory: Path) -> None:
    """A training that did not finish (a crash, a kill) leaves its directory: kept aside, started again."""
    if directory.exists():
        shutil.move(str(directory), str(set_aside(directory)))


def run(recipe_name: str, candidates: list[Candidate], choose_seed: int, seeds: list[int],
        common: list[str] | None = None, resume: str | Path | None = None, log=print, concurrent: int = 1,
        data_seeds: list[int] | None = None, report_all: bool = False) -> tuple[Protocol, RunDir]:
    """Choose on validation, report on test (module docstring); saves and returns the protocol and its run. With
    `resume`, an earlier protocol's directory: its recorded trainings and evaluations are kept, the rest done;
    `seeds` may add test seeds to it."""
    from workbench import recipe  # lazy: yaml
    from workbench.evaluation.evaluate import Evaluation  # lazy: requests
    from workbench.serving.shared import SharedServer  # lazy: requests
    from workbench.tinymodel import ensure_model  # lazy: yaml

    if resume is not None:
        out = RunDir.open(resume)
        if not out.protocol.json.exists():
            raise WorkbenchError(f"{resume} holds no protocol ({out.protocol.json} is missing)",
                                 "pass the directory `workbench protocol` printed (runs/<id>-protocol)")
        result = Protocol.from_json(json.loads(out.protocol.json.read_text()))
        result.seeds += [s for s in seeds if s not in result.seeds]
        check(result.recipe, result.candidates, result.choose_seed, result.seeds, result.common, result.concurrent,
              result.data_seeds)
        log(f"resuming {out.path}: {len(result.trainings)} training(s), {len(result.validation)} validation and "
            f"{len(result.test)} test result(s) kept")
    else:
        common = list(common or [])
        candidates = [Candidate(BASELINE, []), *candidates]
        check(recipe_name, candidates, choose_seed, seeds, common, concurrent, data_seeds)
        # LoRA candidates: one server that loads every candidate's adapter (and, concurrent, runs them at once)
        common = [*common, *concurrent_overrides(recipe_name, candidates, common, concurrent)]
        out = RunDir.create(recipe.load(recipe_name, common), "protocol")
        result = Protocol(recipe_name, choose_seed, list(seeds), candidates, common, concurrent=concurrent,
                          data_seeds=list(data_seeds or []), report_all=report_all)
    stage = out.protocol.make()
    started = time.time() - result.seconds
    shared = SharedServer(stage.server, log)

    def save() -> None:
        result.seconds = time.time() - started
        write_atomic(stage.json, json.dumps(result.to_json(), indent=2))
        write_atomic(stage.table, result.markdown())

    def resolved(overrides: list[str], data_seed: int | None = None):
        return recipe.resolve(recipe.load(result.recipe, [*result.common, *data_overrides(data_seed), *overrides]))

    def share(rr) -> None:
        """The protocol's one server for what comes next, when it can be started: else each process its own."""
        try:
            shared.open(rr, ensure_model(rr, log=log))
        except WorkbenchError as exc:
            shared.close()
            log(f"(no shared server: {exc.cause.splitlines()[0][:200]}; each training starts its own)")

    def train(c: Candidate, index: int, seed: int, split: str, data_seed: int | None = None, answer: bool = True,
              record: bool = True) -> Training:
        label = _label(index, seed, split, data_seed)
        directory = stage.runs / label
        done = _finished(directory)
        if done is None:
            _fresh(directory)
            overrides = [*c.overrides, f"trainer.seed={seed}", f"eval.split={split}"]
            if answer:  # concurrent trainings: the batch opened the server and answers for all of them
                share(resolved(overrides, data_seed))
            on = f" on base {data_seed}" if data_seed is not None else ""
            log(f"[{time.time() - started:5.0f}s] {c.name!r}, seed {seed}{on}: train, to be scored on {split} "
                f"(log: {out.protocol_log(label)})")
            with shared.answering() if answer else contextlib.nullcontext():
                _workbench(["train", "--recipe", result.recipe, *result.common, *data_overrides(data_seed),
                            *overrides, f"monitor.runs_dir={directory}"], out.protocol_log(label))
            done = _finished(directory)
            if done is None:
                raise WorkbenchError(f"the training {label} ended without its final model",
                                     f"see {out.protocol_log(label)}")
        summary = json.loads(done.train.summary.read_text())
        training = Training(label, c.name, seed, split, str(done.path), summary.get("train_seconds"), data_seed,
                            summary.get("generated_tokens"), *signal_shares(done.train))
        if record:
            result.trainings.append(training)
            save()
        return training

    def train_all(jobs: list[tuple[Candidate, int, int, str, int | None]]) -> None:
        """The jobs one after the other, or `result.concurrent` at a time on the shared LoRA server: each training
        adopts it and pushes its own adapter (serving/sync.py LoraSync)."""
        jobs = [j for j in jobs if not result.training(_label(j[1], j[2], j[3], j[4]))]
        if result.concurrent <= 1 or len(jobs) < 2:
            for job in jobs:
                train(*job)
            return
        for d in dict.fromkeys(j[4] for j in jobs):  # one base model at a time: the shared server serves it
            batch = [j for j in jobs if j[4] == d]
            c, _, seed, split, _ = batch[0]
            share(resolved([*c.overrides, f"trainer.seed={seed}", f"eval.split={split}"], d))
            if shared.server is None:
                raise WorkbenchError("--concurrent needs the protocol's shared server, which did not start",
                                     "read the shared server's log under RUN/protocol/server, or drop --concurrent")
            log(f"[{time.time() - started:5.0f}s] {len(batch)} trainings, {result.concurrent} at a time on "
                f"{shared.server.url}")

            def record(training: Training) -> None:  # a finished training is kept for --resume
                result.trainings.append(training)
                save()

            with shared.answering():
                concurrently([functools.partial(train, *job, answer=False, record=False) for job in batch],
                             result.concurrent, record)

    def evaluate_split(split: str, data_seed: int | None, pending: list[tuple[Training, RunDir]]
                       ) -> dict[str, Outcome]:
        """One evaluation of the split on one base: the base (unless scored already) and every pending model, each
        once; each pending training's run gets its part. Returns the outcome by label."""
        if not pending:
            return {}
        key = _base_key(split, data_seed)
        rr = resolved([f"eval.split={split}"], data_seed)
        models = {} if key in result.base else {"base": "base"}
        models.update({t.label: str(RunDir(t.run).train.final) for t, _ in pending})
        # named by what the split had scored before it: an evaluation that was interrupted is set aside and redone
        done = result.validation if split == VALIDATION else result.test + result.picked
        before = len([o for o in done if o.data_seed == data_seed])
        if split == TEST and not result.picked and result.selected is not None:
            before += 1  # a protocol from before the picked list
        name = f"eval-{split}" if data_seed is None else f"eval-data{data_seed}-{split}"
        directory = stage.runs / (name if before == 0 else f"{name}-after-{before}")
        _fresh(directory)
        into = RunDir.at(directory, rr.recipe)
        log(f"[{time.time() - started:5.0f}s] evaluate on {split}" + (f" (base {data_seed})" if data_seed is not None
                                                                      else "") + f": {', '.join(models)}")
        share(rr)
        evaluation = _evaluate(rr, models, into.eval, shared.server if shared.serves(rr, ensure_model(rr)) else None,
                               log)
        by = evaluation.by_model()
        if "base" in by:
            result.base[key], result.base_evaluation[key] = by["base"].accuracy_mean, str(directory)
        earlier = Evaluation.load(RunDir(result.base_evaluation[key]).eval)
        base_summary = earlier.by_model()["base"]
        base_samples = [s for s in earlier.samples if s.model == "base"]
        outcomes = {}
        for t, run in pending:
            _split_out(evaluation, base_samples, base_summary, t.label, run, rr)
            outcomes[t.label] = Outcome(t.candidate, t.seed, split, t.run, result.base[key],
                                        by[t.label].accuracy_mean, t.train_seconds, data_seed, t.generated_tokens,
                                        t.signal, t.signal_generated)
        return outcomes

    names = [c.name for c in result.candidates]
    try:
        # 1. choose on the validation split: every candidate once per base model, with the choice's seed (a
        # head-to-head comparison, --report-all, has nothing to choose)
        validate = not result.report_all
        train_all([] if not validate else [(c, i, result.choose_seed, VALIDATION, d) for d in result.bases
                   for i, c in enumerate(result.candidates)])
        for d in result.bases if validate else []:
            scored = {o.run for o in result.validation}
            pending = [(t, RunDir(t.run)) for t in result.trainings
                       if t.split == VALIDATION and t.data_seed == d and t.run not in scored]
            result.validation += evaluate_split(VALIDATION, d, pending).values()
            save()  # each base's scores kept as soon as they exist (--resume)
        result.validation.sort(key=lambda o: (result.bases.index(o.data_seed), names.index(o.candidate)))
        save()

        def mean_trained(name: str) -> float:  # one base: its accuracy; several: the mean (the same bases each)
            return statistics.fmean(o.trained for o in result.validation if o.candidate == name)

        index = chosen = None
        if validate:
            result.chosen = max(names, key=mean_trained)  # max keeps the first of equals: the recipe
            index = names.index(result.chosen)
            chosen = result.candidates[index]
            log(f"chosen on validation: {chosen.name!r} (mean trained accuracy {mean_trained(chosen.name):.1%})")

        # 2. report on the test split: the chosen setting (or every one) trained afresh per base and seed, and the
        # picked model itself
        reported = [(names.index(n), result.candidates[names.index(n)]) for n in result.reported]
        train_all([(c, i, seed, TEST, d) for d in result.bases for seed in result.seeds for i, c in reported])
        for d in result.bases:
            scored = {o.run for o in result.test}
            pending = [(t, RunDir(t.run)) for t in result.trainings
                       if t.split == TEST and t.data_seed == d and t.run not in scored]
            picked = None
            if chosen is not None and not any(o.data_seed == d for o in result.picked) and (
                    d is not None or result.selected is None):
                picked_from = result.training(_label(index, result.choose_seed, VALIDATION, d))
                picked = Training(_label(index, result.choose_seed, TEST, d), chosen.name, result.choose_seed, TEST,
                                  picked_from.run, picked_from.train_seconds, d, picked_from.generated_tokens,
                                  picked_from.signal, picked_from.signal_generated)
                _fresh(stage.runs / picked.label)
                pending.append((picked, RunDir.at(stage.runs / picked.label,
                                                  resolved([f"eval.split={TEST}"], d).recipe)))
            outcomes = evaluate_split(TEST, d, pending)
            if picked is not None:
                result.picked.append(outcomes.pop(picked.label))
                result.selected = result.selected or result.picked[0]
            result.test += sorted(outcomes.values(), key=lambda o: (names.index(o.candidate),
                                                                     result.seeds.index(o.seed)))
            save()
    finally:
        shared.close()
    save()
    log(result.markdown())
    log(f"saved: {stage.json}, {stage.table} ({result.seconds / 60:.1f} min)")
    return result, out
