"""The honest protocol: settings chosen on the validation split, the result reported on the test split over seeds.

    workbench protocol --recipe cpu-tiny-async \\
        --candidate "lr 2.5e-5: trainer.learning_rate=2.5e-5" --candidate "lr 1e-4: trainer.learning_rate=1e-4" \\
        --seeds 0,1,2

1. Choose: the recipe as it is ("recipe") and each candidate (a name, then space-separated overrides) are trained
   once with the first seed and evaluated on the validation split (`eval.split=validation`); the candidate whose
   trained model scores highest there is chosen (the recipe on a tie: a change must earn its place).
2. Report: the chosen setting's first-seed model is evaluated on the test split ("heldout"), and it is trained
   and evaluated on the test split once more for each further seed. The result is the gain on the test split
   (trained − base, the same base for every seed) as mean ± sample standard deviation over the seeds.

The seeds are `trainer.seed`: the data, its splits and the base model (data.seed) stay the same, so the spread is
the training's. Each training is one `workbench run --stages train,eval` in its own process (runs one after the
other, so their timings do not compete for cores), under RUN/protocol/runs/<label>/; every override is checked
before the first one starts. Output: RUN/protocol/protocol.json and protocol.md (the two tables), printed at the
end; each training's own run directory keeps its report, and `workbench compare` reads them side by side.
"""
from __future__ import annotations

import json
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
    seeds: list[int]
    candidates: list[Candidate]
    common: list[str] = field(default_factory=list)
    validation: list[Outcome] = field(default_factory=list)
    test: list[Outcome] = field(default_factory=list)
    chosen: str | None = None
    seconds: float = 0.0

    def gains(self) -> list[float]:
        return [o.gain for o in self.test]

    def headline(self) -> str:
        gains = [g * 100 for g in self.gains()]
        if not gains:
            return "no test result"
        spread = f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else ""
        base = statistics.fmean(o.base for o in self.test) * 100
        trained = statistics.fmean(o.trained for o in self.test) * 100
        return (f"{self.chosen}: test accuracy {base:.1f}% → {trained:.1f}%, gain {statistics.fmean(gains):+.1f}"
                f"{spread} points over {len(gains)} seed(s) (mean ± sample std; settings chosen on the validation "
                "split)")

    def markdown(self) -> str:
        lines = [f"Settings chosen on the validation split (trainer.seed={self.seeds[0]}):", "",
                 "| candidate | overrides | validation base → trained | gain | chosen |", "|---|---|---|---|---|"]
        by_name = {c.name: c for c in self.candidates}
        for o in self.validation:
            over = " ".join(by_name[o.candidate].overrides) or "(as the recipe)"
            lines.append(f"| {o.candidate} | `{over}` | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | "
                         f"{'**yes**' if o.candidate == self.chosen else ''} |")
        lines += ["", f"Reported on the test split ({TEST}), the chosen setting:", "",
                  "| seed | test base → trained | gain | training s | run |", "|---|---|---|---|---|"]
        for o in self.test:
            secs = f"{o.train_seconds:.0f}" if o.train_seconds is not None else "—"
            lines.append(f"| {o.seed} | {o.base:.1%} → {o.trained:.1%} | {o.gain * 100:+.1f} | {secs} | {o.run} |")
        return "\n".join(lines + ["", self.headline(), ""])

    def to_json(self) -> dict:
        out = asdict(self)
        out["headline"] = self.headline()
        gains = self.gains()
        out["test_gain_mean"] = statistics.fmean(gains) if gains else None
        out["test_gain_std"] = statistics.stdev(gains) if len(gains) > 1 else None
        return out


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


def _label(candidate: Candidate, index: int, seed: int, split: str) -> str:
    return f"c{index}-seed{seed}-{split}"


def check(recipe_name: str, candidates: list[Candidate], seeds: list[int], common: list[str]) -> None:
    """Every training's recipe loads (bad overrides are refused before any training) and has a validation split."""
    from workbench import recipe

    if len(seeds) < 1 or len(set(seeds)) != len(seeds):
        raise WorkbenchError(f"--seeds {seeds} must name one or more distinct seeds", "e.g. --seeds 0,1,2")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise WorkbenchError(f"two candidates share a name: {names}", "give each candidate its own name")
    for c in candidates:
        for split in (VALIDATION, TEST):
            try:
                r = recipe.load(recipe_name, [*common, *c.overrides, f"eval.split={split}"])
            except WorkbenchError as exc:
                raise WorkbenchError(f"candidate {c.name!r}: {exc.cause}", exc.fix) from None
            if r.data.validation_size == 0 and r.data.name == "arithmetic":
                raise WorkbenchError(f"candidate {c.name!r} has data.validation_size=0: nothing to choose on",
                                     "keep data.validation_size above 0")
    if any(o.partition("=")[0].strip() == "trainer.seed" for o in common + [o for c in candidates for o in c.overrides]):
        raise WorkbenchError("an override sets trainer.seed, which the protocol sets for each training",
                             "drop it and pass the seeds with --seeds")


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
                             "fix what the log says, then run the protocol again")


def _only_run(directory: Path) -> RunDir:
    runs = sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    if len(runs) != 1:
        raise WorkbenchError(f"expected one run directory in {directory}, found {len(runs)}",
                             "give the protocol a fresh output directory")
    return RunDir(runs[0])


def _outcome(candidate: str, seed: int, split: str, run: RunDir, trained_from: RunDir | None = None) -> Outcome:
    summary = {s["model"]: s for s in json.loads(run.eval.summary.read_text())}
    if "base" not in summary or "trained" not in summary:
        raise WorkbenchError(f"{run.eval.summary} has no base and trained results", "see the run's eval log")
    source = trained_from or run
    train = json.loads(source.train.summary.read_text()) if source.train.summary.exists() else {}
    return Outcome(candidate, seed, split, str(source.path), summary["base"]["accuracy_mean"],
                   summary["trained"]["accuracy_mean"], train.get("train_seconds"))


def run(recipe_name: str, candidates: list[Candidate], seeds: list[int], common: list[str] | None = None,
        log=print) -> tuple[Protocol, RunDir]:
    """Choose on validation, report on test (module docstring); saves and returns the protocol and its run."""
    from workbench import recipe

    common = list(common or [])
    candidates = [Candidate(BASELINE, []), *candidates]
    check(recipe_name, candidates, seeds, common)
    base = recipe.load(recipe_name, common)
    out = RunDir.create(base, "protocol")
    stage = out.protocol.make()
    result = Protocol(recipe_name, seeds, candidates, common)
    started = time.time()

    def train(c: Candidate, index: int, seed: int, split: str) -> RunDir:
        label = _label(c, index, seed, split)
        runs_dir = stage.runs / label
        log(f"[{time.time() - started:5.0f}s] {c.name!r}, seed {seed}: train and evaluate on {split} "
            f"(log: {stage.logs / f'{label}.log'})")
        _workbench(["run", "--recipe", recipe_name, "--stages", "train,eval", *common, *c.overrides,
                    f"trainer.seed={seed}", f"eval.split={split}", f"monitor.runs_dir={runs_dir}"],
                   stage.logs / f"{label}.log")
        return _only_run(runs_dir)

    def save() -> None:
        result.seconds = time.time() - started
        write_atomic(stage.json, json.dumps(result.to_json(), indent=2))
        write_atomic(stage.table, result.markdown())

    first = seeds[0]
    trained_on_first: dict[str, RunDir] = {}
    for i, c in enumerate(candidates):
        r = train(c, i, first, VALIDATION)
        trained_on_first[c.name] = r
        result.validation.append(_outcome(c.name, first, VALIDATION, r))
        save()
    best = max(result.validation, key=lambda o: o.trained)  # max keeps the first of equals: the recipe
    result.chosen = best.candidate
    index = next(i for i, c in enumerate(candidates) if c.name == result.chosen)
    chosen = candidates[index]
    log(f"chosen on validation: {chosen.name!r} ({best.base:.1%} → {best.trained:.1%})")

    # the first seed's model, already trained: evaluated on the test split only
    first_run = trained_on_first[chosen.name]
    label = _label(chosen, index, first, TEST)
    log(f"[{time.time() - started:5.0f}s] {chosen.name!r}, seed {first}: evaluate on {TEST}")
    _workbench(["eval", "--recipe", recipe_name, *common, *chosen.overrides, f"eval.split={TEST}",
                f"monitor.runs_dir={stage.runs / label}", "--model", "base=base",
                "--model", f"trained={first_run.train.final}"], stage.logs / f"{label}.log")
    result.test.append(_outcome(chosen.name, first, TEST, _only_run(stage.runs / label), trained_from=first_run))
    save()
    for seed in seeds[1:]:
        r = train(chosen, index, seed, TEST)
        result.test.append(_outcome(chosen.name, seed, TEST, r))
        save()
    save()
    log(result.markdown())
    log(f"saved: {stage.json}, {stage.table} ({result.seconds / 60:.1f} min)")
    return result, out
