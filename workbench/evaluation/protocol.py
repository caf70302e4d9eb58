"""The honest protocol: settings chosen on the validation split, the result reported on the test split over seeds.

    workbench protocol --recipe cpu-tiny-async \\
        --candidate "lr 2.5e-5: trainer.learning_rate=2.5e-5" --candidate "lr 1e-4: trainer.learning_rate=1e-4" \\
        --choose-seed 0 --seeds 1,2,3
    workbench protocol --resume runs/<id>-protocol          # continue after a crash or a kill; --seeds adds seeds

1. Choose: the recipe as it is ("recipe") and each candidate (a name, then space-separated overrides) are trained
   once with the choice's seed and evaluated on the validation split (`eval.split=validation`); the candidate whose
   trained model scores highest there is chosen (the recipe on a tie: a change must earn its place).
2. Report: the chosen setting is trained afresh for each test seed and evaluated on the test split ("heldout").
   The result is the gain on the test split (trained − base, the same base for every seed) as mean ± sample
   standard deviation over the test seeds. The model the choice picked is also scored on the test split, shown
   beside the result and kept out of it: picked for its validation score, it carries some of that luck along
   (the gap between the two is the choice's optimism), which is why the choice's seed may not be a test seed.

Seeds are `trainer.seed`: the data, its splits and the base model (data.seed) stay the same, so the spread is the
training's. Each training is one `workbench run --stages train,eval` in its own process (one after the other, so
their timings do not compete for cores), under RUN/protocol/runs/<label>/; every candidate's recipe and evaluation
rows are checked before the first training starts, and a candidate may not change the data or the evaluation
(that would compare settings on different problems). Output: RUN/protocol/protocol.json, written after every
training (what `--resume` continues from), and protocol.md (the tables), printed at the end; each training's
run directory keeps its report, and `workbench compare` reads them side by side.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.rundir import RunDir, write_atomic

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

    @property
    def gain(self) -> float:
        return self.trained - self.base


@dataclass
class Protocol:
    recipe: str
    choose_seed: int
    seeds: list[int]
    candidates: list[Candidate]
    common: list[str] = field(default_factory=list)
    validation: list[Outcome] = field(default_factory=list)
    chosen: str | None = None
    selected: Outcome | None = None  # the model the choice picked, scored on test: shown, kept out of the result
    test: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def gains(self) -> list[float]:
        return [o.gain for o in self.test]

    def headline(self) -> str:
        gains = [g * 100 for g in self.gains()]
        if not gains:
            return "no test result yet"
        spread = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else ""
        base = statistics.fmean(o.base for o in self.test) * 100
        trained = statistics.fmean(o.trained for o in self.test) * 100
        return (f"{self.chosen}: test accuracy {base:.1f}% → {trained:.1f}%, gain {statistics.fmean(gains):+.1f}"
                f"{spread} points over {len(gains)} seed(s) (mean ± sample std; settings chosen on the validation "
                f"split with seed {self.choose_seed})")

    def markdown(self) -> str:
        lines = [f"Settings chosen on the validation split (trainer.seed={self.choose_seed}):", "",
                 "| candidate | overrides | validation base → trained | gain | chosen |", "|---|---|---|---|---|"]
        by_name = {c.name: c for c in self.candidates}
        for o in self.validation:
            over = " ".join(by_name[o.candidate].overrides) or "(as the recipe)"
            lines.append(f"| {o.candidate} | `{over}` | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | "
                         f"{'**yes**' if o.candidate == self.chosen else ''} |")
        lines += ["", f"Reported on the test split ({TEST}), the chosen setting trained afresh per seed:", "",
                  "| seed | test base → trained | gain | training s | run |", "|---|---|---|---|---|"]
        for o in self.test:
            secs = f"{o.train_seconds:.0f}" if o.train_seconds is not None else "—"
            lines.append(f"| {o.seed} | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | {secs} | {o.run} |")
        lines += ["", self.headline()]
        if self.selected is not None:
            s = self.selected
            lines.append(f"The model the choice picked (seed {s.seed}), on the test split: {s.base:.1%} → "
                         f"{s.trained:.1%} ({s.gain * 100:+.1f}); not part of the result (picked for its validation "
                         "score).")
        return "\n".join(lines + [""])

    def to_json(self) -> dict:
        out = asdict(self)
        out["headline"] = self.headline()
        gains = self.gains()
        out["test_gain_mean"] = statistics.fmean(gains) if gains else None
        out["test_gain_std"] = statistics.stdev(gains) if len(gains) > 1 else None
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Protocol":
        outcome = lambda o: Outcome(**o) if o else None  # noqa: E731
        return cls(data["recipe"], data["choose_seed"], list(data["seeds"]),
                   [Candidate(**c) for c in data["candidates"]], list(data.get("common") or []),
                   [Outcome(**o) for o in data.get("validation") or []], data.get("chosen"),
                   outcome(data.get("selected")), [Outcome(**o) for o in data.get("test") or []],
                   data.get("seconds") or 0.0)


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


def check(recipe_name: str, candidates: list[Candidate], choose_seed: int, seeds: list[int],
          common: list[str]) -> None:
    """Everything that would stop the protocol after hours, refused before its first training: seeds, names,
    overrides that load, a validation split to choose on, evaluation rows on both splits, candidates that change
    the data or the evaluation."""
    from workbench import recipe
    from workbench.tasks import dataset

    if not seeds or len(set(seeds)) != len(seeds):
        raise WorkbenchError(f"--seeds {seeds} must name one or more distinct seeds", "e.g. --seeds 1,2,3")
    if choose_seed in seeds:
        raise WorkbenchError(f"the choice's seed {choose_seed} is also a test seed: that test result would be the "
                             "model picked for its validation score",
                             "choose with a seed that is not among --seeds, e.g. --choose-seed 0 --seeds 1,2,3")
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
        for split in (VALIDATION, TEST):
            try:
                r = recipe.load(recipe_name, [*common, *c.overrides, f"eval.split={split}"])
            except WorkbenchError as exc:
                raise WorkbenchError(f"candidate {c.name!r}: {exc.cause}", exc.fix) from None
            if r.data.path:
                raise WorkbenchError(f"data.path is set ({r.data.path}): a file is one split, so validation and "
                                     "test would be the training rows", "run the protocol on a dataset with splits")
            if r.data.name != "arithmetic":
                spec = dataset.DATASETS.get(r.data.name) or {}
                if "validation" not in (spec.get("splits") or {}) or "train" not in (spec.get("splits") or {}):
                    raise WorkbenchError(f"dataset {r.data.name!r} has no validation split to choose on",
                                         "use a dataset that has one (arithmetic, gsm8k)")
                if r.data.validation_size < 1:
                    raise WorkbenchError("data.validation_size is 0: nothing to choose on",
                                         "keep data.validation_size above 0")
            else:  # generated: the rows themselves are checked here, cheaply
                dataset.eval_rows(r)


def _workbench(args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "workbench", *args]
    with log.open("w") as out:  # a file, not a pipe: an unread pipe would block the training
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
        raise WorkbenchError(f"`workbench {args[0]}` exited with status {code}; last lines of {log}:\n{tail}\n",
                             "fix what the log says, then continue with `workbench protocol --resume RUN`")


def _only_run(directory: Path) -> RunDir:
    runs = sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    if len(runs) != 1:
        raise WorkbenchError(f"expected one run directory in {directory}, found {len(runs)}",
                             "give the protocol a fresh output directory")
    return RunDir(runs[0])


def _outcome(candidate: str, seed: int, split: str, run: RunDir, log: Path,
             trained_from: RunDir | None = None) -> Outcome:
    try:
        summary = {s["model"]: s for s in json.loads(run.eval.summary.read_text())}
    except (OSError, ValueError):
        summary = {}
    if "base" not in summary or "trained" not in summary:
        raise WorkbenchError(f"{run.eval.summary} holds no base and trained results", f"see {log}")
    source = trained_from or run
    train = json.loads(source.train.summary.read_text()) if source.train.summary.exists() else {}
    return Outcome(candidate, seed, split, str(source.path), summary["base"]["accuracy_mean"],
                   summary["trained"]["accuracy_mean"], train.get("train_seconds"))


def _label(index: int, seed: int, split: str) -> str:
    """The name of one training's (or evaluation's) directory and log under RUN/protocol/."""
    return f"c{index}-seed{seed}-{split}"


def _fresh(directory: Path) -> None:
    """A training that did not finish (a crash, a kill) leaves its directory: kept aside, started again."""
    if directory.exists():
        aside, n = directory.with_name(f"{directory.name}.incomplete"), 1
        while aside.exists():
            n += 1
            aside = directory.with_name(f"{directory.name}.incomplete-{n}")
        shutil.move(str(directory), str(aside))


def run(recipe_name: str, candidates: list[Candidate], choose_seed: int, seeds: list[int],
        common: list[str] | None = None, resume: str | Path | None = None, log=print) -> tuple[Protocol, RunDir]:
    """Choose on validation, report on test (module docstring); saves and returns the protocol and its run. With
    `resume`, an earlier protocol's directory: its recorded trainings are kept, the rest done; `seeds` may add
    test seeds to it."""
    from workbench import recipe

    if resume is not None:
        out = RunDir.open(resume)
        if not out.protocol.json.exists():
            raise WorkbenchError(f"{resume} holds no protocol ({out.protocol.json} is missing)",
                                 "pass the directory `workbench protocol` printed (runs/<id>-protocol)")
        result = Protocol.from_json(json.loads(out.protocol.json.read_text()))
        result.seeds += [s for s in seeds if s not in result.seeds]
        check(result.recipe, result.candidates, result.choose_seed, result.seeds, result.common)
        log(f"resuming {out.path}: {len(result.validation)} validation and {len(result.test)} test result(s) kept")
    else:
        common = list(common or [])
        candidates = [Candidate(BASELINE, []), *candidates]
        check(recipe_name, candidates, choose_seed, seeds, common)
        out = RunDir.create(recipe.load(recipe_name, common), "protocol")
        result = Protocol(recipe_name, choose_seed, list(seeds), candidates, common)
    stage = out.protocol.make()
    started = time.time() - result.seconds

    def save() -> None:
        result.seconds = time.time() - started
        write_atomic(stage.json, json.dumps(result.to_json(), indent=2))
        write_atomic(stage.table, result.markdown())

    def train(c: Candidate, index: int, seed: int, split: str) -> Outcome:
        label = _label(index, seed, split)
        _fresh(stage.runs / label)
        log(f"[{time.time() - started:5.0f}s] {c.name!r}, seed {seed}: train and evaluate on {split} "
            f"(log: {stage.logs / f'{label}.log'})")
        _workbench(["run", "--recipe", result.recipe, "--stages", "train,eval", *result.common, *c.overrides,
                    f"trainer.seed={seed}", f"eval.split={split}", f"monitor.runs_dir={stage.runs / label}"],
                   stage.logs / f"{label}.log")
        return _outcome(c.name, seed, split, _only_run(stage.runs / label), stage.logs / f"{label}.log")

    done = {o.candidate for o in result.validation}
    for i, c in enumerate(result.candidates):
        if c.name not in done:
            result.validation.append(train(c, i, result.choose_seed, VALIDATION))
            save()
    best = max(result.validation, key=lambda o: o.trained)  # max keeps the first of equals: the recipe
    result.chosen = best.candidate
    index = next(i for i, c in enumerate(result.candidates) if c.name == result.chosen)
    chosen = result.candidates[index]
    log(f"chosen on validation: {chosen.name!r} ({best.base:.1%} → {best.trained:.1%})")

    if result.selected is None:  # the picked model itself on test: information, not the result
        label = _label(index, result.choose_seed, TEST)
        _fresh(stage.runs / label)
        log(f"[{time.time() - started:5.0f}s] the picked model ({chosen.name!r}, seed {result.choose_seed}): "
            f"evaluate on {TEST}")
        _workbench(["eval", "--recipe", result.recipe, *result.common, *chosen.overrides, f"eval.split={TEST}",
                    f"monitor.runs_dir={stage.runs / label}", "--model", "base=base",
                    "--model", f"trained={RunDir(best.run).train.final}"], stage.logs / f"{label}.log")
        result.selected = _outcome(chosen.name, result.choose_seed, TEST, _only_run(stage.runs / label),
                                   stage.logs / f"{label}.log", trained_from=RunDir(best.run))
        save()
    done_seeds = {o.seed for o in result.test}
    for seed in result.seeds:
        if seed not in done_seeds:
            result.test.append(train(chosen, index, seed, TEST))
            save()
    save()
    log(result.markdown())
    log(f"saved: {stage.json}, {stage.table} ({result.seconds / 60:.1f} min)")
    return result, out
