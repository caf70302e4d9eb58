"""Run comparison: several runs side by side as pandas DataFrames, their curves overlaid, the recipe keys that
differ next to the outcomes; and a tag that names a run for it (`workbench tag`).

    workbench compare runs/A runs/B [--out DIR] [--metrics reward,kl,length,step_time]
    workbench tag runs/A lr-high --note "learning rate 1e-4"      # label the run in every comparison

    from workbench.observe import compare
    runs = compare.load_runs(["runs/A", "runs/B"])    # -> Runs: .metrics .step_times .evaluation .recipes
    compare.differing_keys(runs)        # recipe keys whose values differ, one column per run
    compare.outcomes(runs)              # reward, held-out accuracy before/after and gain, steps, seconds
    compare.curves_figure(runs, ["reward", "kl"], path="cmp.png")
    compare.save(runs, "runs/cmp")      # compare.md, compare.png, compare.json

A run is a directory made by `workbench run` or `workbench train` (workbench/rundir.py's layout); its training
is train/, or smoke/ when the run has no train/. A training directory itself (RUN/train, a bench path's directory)
is taken too. Runs are labelled by their tag (tag.json, written by `workbench tag`) when they have one, else by
their directory name. Everything here reads files only: no model, no server, no torch; notebook 07_compare is the
same calls with the frames shown for exploring.
"""
from __future__ import annotations

import glob
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pandas as pd
import yaml

from workbench import plots
from workbench.errors import WorkbenchError
from workbench.notebook import parameter_list
from workbench.observe import figures, rundata
from workbench.plots import plt
from workbench.rundir import RECIPE, RunDir, TrainDir, comparison, write_atomic

# Recipe keys that differ between runs without changing what is trained; differing_keys leaves them out.
IGNORED_KEYS = {
    "monitor.runs_dir": "where the run directory was made, not how it trained",
    "server.port": "the port the server listened on (parallel runs and tests pick free ports)",
    "distributed.main_port": "the trainer ranks' rendezvous port, chosen like server.port",
    "description": "the recipe's prose; the `name` row already tells recipes apart",
}
# Short names for the curves most worth overlaying; any other metrics.jsonl key is taken as it is.
METRIC_ALIASES = {
    "reward": "reward",
    "kl": "kl",
    "loss": "loss",
    "entropy": "entropy",
    "length": "completions/mean_length",
    "clipped": "completions/clipped_ratio",
    "reward_std": "reward_std",
    "lr": "learning_rate",
    "step_time": "time/step",
    "tokens_per_second": "rollout/tokens_per_second",
}
DEFAULT_METRICS = ("reward", "kl", "loss", "entropy", "length", "step_time")
TITLES = {"reward": "reward (mean per completion)", "kl": "KL to the reference", "loss": "loss",
          "entropy": "entropy (nats/token)", "completions/mean_length": "completion length (tokens)",
          "time/step": "step time (s)", "learning_rate": "learning rate",
          "rollout/tokens_per_second": "generation tokens/s"}
TAG_NAME_LIMIT = 64
ABSENT = "(absent)"  # a recipe key one run's recipe does not have (a recipe from before the key existed)
_STAGE_DIRS = ("train", "smoke")


# ----------------------------------------------------------------------------------------------------------------
# Tags

def read_tag(path: Path | str) -> dict:
    """The run's tag ({"name", "note", "tagged"}), or {} when it has none or the file is unreadable."""
    try:
        tag = json.loads(RunDir(path).tag.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return tag if isinstance(tag, dict) and isinstance(tag.get("name"), str) else {}


def write_tag(path: Path | str, name: str, note: str | None = None) -> Path:
    """Name a run for comparisons (tag.json in the run directory, replaced atomically when tagged again)."""
    clean = " ".join(str(name).split())
    if not clean:
        raise WorkbenchError("the tag name is empty", "give the run a short name, e.g. `workbench tag RUN lr-high`")
    if len(clean) > TAG_NAME_LIMIT:
        raise WorkbenchError(f"the tag name is {len(clean)} characters long",
                             f"keep it to {TAG_NAME_LIMIT} and put the rest in --note")
    run = _check_run(RunDir.open(path))
    text = json.dumps({"name": clean, "note": note or "", "tagged": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2)
    return write_atomic(run.tag, text + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Loading

@dataclass
class Run:
    """One compared run: its label, where its files are, and what was read from them."""
    label: str
    path: Path                # what was given: the run directory, or a training directory itself
    root: Path                # the run directory: its recipe.yaml, tag.json and eval/ (path when that is a run)
    train: TrainDir
    recipe: dict
    data: rundata.RunData
    tag: dict = field(default_factory=dict)
    evaluation: list[dict] = field(default_factory=list)   # eval/summary.json's per-model summaries


@dataclass
class Runs:
    """The loaded runs and their DataFrames (every frame has the run's label in a `run` column or its index)."""
    runs: list[Run]
    metrics: pd.DataFrame       # one row per logged training step: run, step, time, every logged metric
    step_times: pd.DataFrame    # per run (index): the median of time/step and of each phase in figures.PHASES
    evaluation: pd.DataFrame    # one row per run and evaluated model: accuracy, gain over the run's base, ...
    recipes: pd.DataFrame       # every resolved recipe key, dotted (index), one column per run

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.runs]

    def __len__(self) -> int:
        return len(self.runs)


def _check_run(run: RunDir) -> RunDir:
    if not (run.recipe.exists() or run.train.exists() or run.smoke.exists()):
        raise WorkbenchError(f"{run.path} is not a run directory (no {RECIPE}, no training in it)",
                             "pass a directory made by `workbench run` or `workbench train` (see `ls runs`)")
    return run


def _training(path: Path) -> tuple[TrainDir, Path, str]:
    """(training directory, run directory, default label) of one path given by the user."""
    if TrainDir(path).metrics.exists():  # a training directory itself: RUN/train, RUN/smoke, a bench path's
        path = path.resolve()  # its parent, even for `.` or `train`
        if path.name in _STAGE_DIRS and (path.parent / RECIPE).exists():
            return TrainDir(path), path.parent, f"{path.parent.name}/{path.name}"
        return TrainDir(path), path, path.name
    run = _check_run(RunDir.open(path))
    train = run.train if run.train.exists() or not run.smoke.exists() else run.smoke
    return train, run.path, run.path.resolve().name


def _load_recipe(train: TrainDir, root: Path) -> dict:
    path = train.recipe if train.recipe.exists() else root / RECIPE
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkbenchError(f"{path} is not valid YAML ({type(exc).__name__})",
                             "restore the run's recipe.yaml, or leave that run out of the comparison") from None
    return data if isinstance(data, dict) else {}


def _evaluation(root: Path) -> list[dict]:
    from workbench.evaluation.evaluate import Evaluation  # lazy: requests

    result = Evaluation.load(RunDir(root).eval)
    if result is None:
        return []
    return [{"model": s.model, "split": s.split, "n": s.n, "repeats": s.repeats, "accuracy": s.accuracy_mean,
             "accuracy_std": s.accuracy_std, "pass_at_1": s.pass_at_1, "mean_output_tokens": s.mean_output_tokens,
             "truncation_rate": s.truncation_rate} for s in result.summaries]


def _unique(labels: list[str]) -> list[str]:
    out: list[str] = []
    for label in labels:
        name, n = label, 1
        while name in out:
            n += 1
            name = f"{label} ({n})"
        out.append(name)
    return out


def flatten(data: dict, prefix: str = "") -> dict:
    """A nested recipe as dotted keys: {"trainer": {"beta": 0}} -> {"trainer.beta": 0}; lists and empty
    sections are values."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def load_run(path: Path | str, label: str | None = None) -> Run:
    """One run (or training directory), read; a missing path or a directory that is not a run is a clear error."""
    path = Path(path)
    train, root, name = _training(path)
    tag = read_tag(root)
    if label is None:
        label = tag["name"] if tag else name
    return Run(label=label, path=path, root=root, train=train, recipe=_load_recipe(train, root),
               data=rundata.load(train), tag=tag, evaluation=_evaluation(root))


def load_runs(paths: Iterable[Path | str], labels: Iterable[str] | None = None) -> Runs:
    """Read runs into DataFrames; labels default to each run's tag, else its directory name (made unique)."""
    paths = list(paths)
    if not paths:
        raise WorkbenchError("no run to compare", "pass one or more run directories (see `ls runs`)")
    given = list(labels) if labels is not None else [None] * len(paths)
    runs = [load_run(p, label) for p, label in zip(paths, given)]
    for run, label in zip(runs, _unique([r.label for r in runs])):
        run.label = label
    return Runs(runs=runs, metrics=_metrics_frame(runs), step_times=_step_times_frame(runs),
                evaluation=_evaluation_frame(runs), recipes=_recipes_frame(runs))


def _metrics_frame(runs: list[Run]) -> pd.DataFrame:
    frames = [pd.DataFrame(run.data.train_metrics).assign(run=run.label) for run in runs]
    frame = pd.concat([f for f in frames if len(f)], ignore_index=True, sort=False) if any(len(f) for f in frames) \
        else pd.DataFrame(columns=["run", "step"])
    first = [c for c in ("run", "step", "time") if c in frame.columns]
    return frame[first + [c for c in frame.columns if c not in first]]


def _step_times_frame(runs: list[Run]) -> pd.DataFrame:
    keys = ["time/step"] + [key for key, _ in figures.PHASES]
    rows = {}
    for run in runs:
        timed = [r for r in run.data.train_metrics if isinstance(r.get("time/step"), (int, float))]
        rows[run.label] = {key: (pd.Series([figures.phase(r, key) for r in timed]).median() if timed else math.nan)
                           for key in keys}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=keys)
    frame.index.name = "run"
    return frame


def _evaluation_frame(runs: list[Run]) -> pd.DataFrame:
    rows = []
    for run in runs:
        base = next((e["accuracy"] for e in run.evaluation if e["model"] == "base"), None)
        for entry in run.evaluation:
            gain = entry["accuracy"] - base if base is not None and entry["model"] != "base" else math.nan
            rows.append({"run": run.label, **entry, "gain": gain})
    columns = ["run", "model", "split", "n", "repeats", "accuracy", "accuracy_std", "gain", "pass_at_1",
               "mean_output_tokens", "truncation_rate"]
    return pd.DataFrame(rows, columns=columns)


def _recipes_frame(runs: list[Run]) -> pd.DataFrame:
    flat = [flatten(run.recipe) for run in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))  # first-seen order: the recipe's own section order
    frame = pd.DataFrame({run.label: pd.Series([f.get(k, ABSENT) for k in keys], index=keys, dtype=object)
                          for run, f in zip(runs, flat)}, index=keys, dtype=object)
    frame.index.name = "key"
    return frame


# ----------------------------------------------------------------------------------------------------------------
# Analysis

def differing_keys(runs: Runs, ignore: Iterable[str] = tuple(IGNORED_KEYS)) -> pd.DataFrame:
    """The recipe keys whose values are not the same in every run (index: dotted key; one column per run), less
    the `ignore` keys (IGNORED_KEYS: ports and paths that differ without changing the training)."""
    skip = set(ignore)
    frame = runs.recipes
    keep = [key for key in frame.index if key not in skip
            and any(value != frame.loc[key].iloc[0] for value in frame.loc[key].iloc[1:])]
    return frame.loc[keep]


def _mean_of_part(values: pd.Series, last: bool) -> float:
    values = values.dropna()
    if values.empty:
        return math.nan
    n = max(1, len(values) // 5)
    return float((values.iloc[-n:] if last else values.iloc[:n]).mean())


def outcomes(runs: Runs) -> pd.DataFrame:
    """One row per run: steps, reward over the first and last fifth of the logged steps, held-out
    accuracy of the base and the trained model and the gain (fractions; NaN when not evaluated), training seconds,
    median step seconds."""
    rows = {}
    for run in runs.runs:
        metrics = runs.metrics[runs.metrics["run"] == run.label] if len(runs.metrics) else runs.metrics
        summary = run.data.train_summary or {}
        reward = metrics["reward"] if "reward" in metrics.columns else pd.Series(dtype=float)
        steps = summary.get("steps") if isinstance(summary.get("steps"), (int, float)) else (
            int(metrics["step"].max()) if len(metrics) else math.nan)
        by_model = {e["model"]: e["accuracy"] for e in run.evaluation}
        before, after = by_model.get("base", math.nan), by_model.get("trained", math.nan)
        rows[run.label] = {
            "steps": steps,
            "reward_first": _mean_of_part(reward, last=False),
            "reward_last": _mean_of_part(reward, last=True),
            "accuracy_before": before,
            "accuracy_after": after,
            "gain": after - before,
            "train_seconds": summary.get("train_seconds", math.nan),
            "step_seconds": runs.step_times.loc[run.label, "time/step"],
        }
    adapters = {run.label: _adapter_names(run) for run in runs.runs}
    if any(prefix for prefix, _ in adapters.values()):  # LoRA runs: which of them trained on one server at once
        for run in runs.runs:
            prefix, seen = adapters[run.label]
            rows[run.label]["shared_server_with"] = ", ".join(
                other for other, (their_prefix, their_seen) in adapters.items()
                if other != run.label and their_prefix and (their_prefix in seen or prefix in their_seen)) or "–"
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index.name = "run"
    return frame


def _adapter_names(run: Run) -> tuple[str | None, list[str]]:
    """A LoRA run's adapter-name prefix and the other runs' prefixes it saw on its server (train.json, or the
    events of a run that did not finish)."""
    summary = (run.data.train_summary or {}).get("adapter") or {}
    events = run.data.events
    prefix = summary.get("prefix") or next((e.get("prefix") for e in events if e.get("kind") == "lora_adapters"), None)
    seen = summary.get("shared_with") or [e["adapter"].rsplit(".s", 1)[0] + ".s" for e in events
                                          if e.get("kind") == "server_shared" and e.get("adapter")]
    return prefix, list(seen)


def side_by_side(runs: Runs, ignore: Iterable[str] = tuple(IGNORED_KEYS), readable: bool = False) -> pd.DataFrame:
    """The differing recipe keys, then the outcomes (rows named `→ outcome`), one column per run: what changed next
    to what it did. `readable`: outcomes as text (percent, points, rounded seconds) for printing."""
    keys = differing_keys(runs, ignore)
    results = (_outcome_cells(outcomes(runs)) if readable else outcomes(runs)).T
    results.index = [f"→ {name}" for name in results.index]
    return pd.concat([keys.astype(object), results.astype(object)])


def metric_keys(metrics: str | Iterable[str] | None = None) -> list[str]:
    """Curve names (short names of METRIC_ALIASES or metrics.jsonl keys; a comma-separated string or a list) as
    metrics.jsonl keys."""
    if metrics is None:
        metrics = DEFAULT_METRICS
    given = metrics if isinstance(metrics, str) else ",".join(metrics)
    names = [m.strip() for m in given.split(",") if m.strip()]
    if not names:
        raise WorkbenchError(f"--metrics {given!r} names no metric",
                             f"list curves to overlay, e.g. --metrics {','.join(DEFAULT_METRICS)}")
    return list(dict.fromkeys(METRIC_ALIASES.get(n, n) for n in names))


def _check_metrics(runs: Runs, keys: list[str]) -> None:
    """A key that is neither a known curve nor logged by any run is a typo: say so instead of drawing nothing."""
    logged = set(runs.metrics.columns)
    unknown = [k for k in keys if k not in logged and k not in METRIC_ALIASES.values()]
    if unknown:
        some = sorted(c for c in logged if c not in ("run", "step", "time"))[:8]
        raise WorkbenchError(f"--metrics names {', '.join(repr(u) for u in unknown)}, which no compared run logged",
                             f"use short names ({', '.join(METRIC_ALIASES)}) or metrics.jsonl keys"
                             + (f" such as {', '.join(some)}" if some else ""))


# ----------------------------------------------------------------------------------------------------------------
# Figure and tables

def curves_figure(runs: Runs, metrics: str | Iterable[str] | None = None, path: Path | str | None = None):
    """One panel per metric, one line per run in each (against the step); saved as PNG to `path` when given.
    Returns the matplotlib figure (its axes keep their lines after saving)."""
    keys = metric_keys(metrics)
    _check_metrics(runs, keys)
    cols = min(2, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.8 * rows), squeeze=False)
    names = " vs ".join(runs.labels) if len(runs) <= 3 else f"{len(runs)} runs"
    fig.suptitle(f"Run comparison: {names}", fontsize=12)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    frame = runs.metrics
    for ax, key in zip(axes.flat, keys):
        drawn = 0
        for i, label in enumerate(runs.labels):
            if key not in frame.columns:
                break
            part = frame.loc[frame["run"] == label, ["step", key]].dropna()
            if part.empty:
                continue
            ax.plot(part["step"], part[key], label=label, color=colors[i % len(colors)], lw=1.5)
            drawn += 1
        ax.set_title(TITLES.get(key, key), fontsize=10)
        if drawn:
            ax.set_xlabel("step", fontsize=8)
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no run logged {key}" + (" (beta = 0?)" if key == "kl" else ""), ha="center",
                    va="center", transform=ax.transAxes, color="gray", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    if path is not None:
        plots.save_png(fig, path)
    return fig


def _cell(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, index: str | None = None) -> str:
    """A DataFrame as a GitHub markdown table (its index as the first column, named `index`)."""
    head = [index or frame.index.name or ""] + [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in frame.iterrows():
        lines.append("| " + " | ".join([_cell(name)] + [_cell(v) for v in row.tolist()]) + " |")
    return "\n".join(lines) + "\n"


def _outcome_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Outcomes for reading: accuracies in percent, the gain in points, seconds rounded."""
    out = frame.astype(object).copy()
    for column in ("accuracy_before", "accuracy_after"):
        out[column] = [("–" if pd.isna(v) else f"{100 * v:.1f}%") for v in frame[column]]
    out["gain"] = [("–" if pd.isna(v) else f"{100 * v:+.1f} pts") for v in frame["gain"]]
    for column in ("train_seconds", "step_seconds"):
        out[column] = [("–" if pd.isna(v) else f"{v:.2f}") for v in frame[column]]
    for column in ("reward_first", "reward_last"):
        out[column] = [("–" if pd.isna(v) else f"{v:.3f}") for v in frame[column]]
    return out


def markdown(runs: Runs, figure: str | None = None) -> str:
    """The comparison as markdown: the runs, what differs next to the outcomes, step times, evaluation."""
    lines = [f"# Run comparison ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    for run in runs.runs:
        note = f" — {run.tag['note']}" if run.tag.get("note") else ""
        lines.append(f"- **{run.label}**: `{run.path}`{note}")
    keys = differing_keys(runs)
    lines += ["", "## Recipe keys that differ, and the outcomes", ""]
    if len(runs) > 1 and keys.empty:
        lines.append("The recipes are the same (apart from " + ", ".join(f"`{k}`" for k in IGNORED_KEYS) + ").\n")
    lines.append(markdown_table(keys, "key") if not keys.empty else "")
    lines.append(markdown_table(_outcome_cells(outcomes(runs)).T, "outcome"))
    lines.append("Reward: mean over the first and the last fifth of the logged steps. Accuracy: exact match of the "
                 "base and the trained model on the run's evaluation split (eval/summary.json, the split column "
                 "below: held-out is the test split, validation the one settings are chosen on); gain in points.\n")
    labels = {key: label for key, label in figures.PHASES}
    steps = runs.step_times.rename(columns={"time/step": "step", **labels})
    lines += ["## Step time (median seconds per step, by phase)", "", markdown_table(steps, "run")]
    if not runs.evaluation.empty:
        evaluation = runs.evaluation.set_index("run").astype(object)
        for column in ("accuracy", "accuracy_std", "pass_at_1", "truncation_rate"):
            evaluation[column] = [("–" if pd.isna(v) else f"{100 * v:.1f}%") for v in runs.evaluation[column]]
        evaluation["gain"] = [("–" if pd.isna(v) else f"{100 * v:+.1f} pts") for v in runs.evaluation["gain"]]
        lines += ["## Evaluation (through the server, on each run's evaluation split)", "",
                  markdown_table(evaluation, "run")]
    if figure:
        lines += ["## Curves", "", f"![curves]({figure})", ""]
    return "\n".join(lines)


def _jsonable(frame: pd.DataFrame) -> list[dict]:
    records = frame.reset_index().astype(object).to_dict("records")
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in records]


def save(runs: Runs, out: Path | str | None = None, metrics: str | Iterable[str] | None = None) -> dict[str, Path]:
    """Write compare.md, compare.png and compare.json into `out` (made if missing), or without it into a new
    `<stamp>-compare/` beside the first run; returns their paths."""
    stage = comparison(out, beside=runs.runs[0].root.parent).make()
    paths = {"table": stage.table, "figure": stage.figure, "json": stage.json}
    curves_figure(runs, metrics, paths["figure"])
    write_atomic(paths["table"], markdown(runs, figure=stage.figure.name))
    keys = differing_keys(runs)
    data = {
        "runs": [{"label": r.label, "path": str(r.path), "tag": r.tag or None} for r in runs.runs],
        "metrics": metric_keys(metrics),
        "ignored_keys": IGNORED_KEYS,
        "differing_keys": {key: dict(zip(keys.columns, keys.loc[key].tolist())) for key in keys.index},
        "outcomes": _jsonable(outcomes(runs)),
        "step_times": _jsonable(runs.step_times),
        "evaluation": _jsonable(runs.evaluation.set_index("run")) if not runs.evaluation.empty else [],
    }
    write_atomic(paths["json"], json.dumps(data, indent=2, default=str) + "\n")
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Choosing runs and where the comparison goes

def trained_runs(root: Path | str, newest: int | None = None, exclude: Iterable[Path | str] = ()) -> list[Path]:
    """The run directories under `root` that trained (train/ or smoke/ has metrics), oldest first by when their
    recipe was written; the `newest` last ones when given."""
    skip = {Path(p).resolve() for p in exclude}
    found = []
    for path in (sorted(Path(root).iterdir()) if Path(root).is_dir() else []):
        run = RunDir(path)
        trained = run.train.metrics.exists() or run.smoke.metrics.exists()
        if not path.is_dir() or path.resolve() in skip or not trained:
            continue
        stamp = (run.recipe if run.recipe.exists() else path).stat().st_mtime
        found.append((stamp, path.name, path))
    found.sort()
    chosen = [p for _, _, p in found]
    return chosen[-newest:] if newest else chosen


def select(entries: Iterable[str] | str | None, root: Path | str, newest: int = 2,
           exclude: Iterable[Path | str] = ()) -> list[Path]:
    """Run paths from a notebook's parameter: a list of directories or glob patterns (what `papermill -p` passes, a
    string, is split like a shell line, or read as a list when written as one: '["runs/A", "runs/B"]'), or, when
    empty, the `newest` trained runs under `root`."""
    entries = parameter_list(entries, "runs", "runs/A")
    if not entries:
        chosen = trained_runs(root, newest, exclude)
        if not chosen:
            raise WorkbenchError(f"no trained run under {root}",
                                 "train one (workbench train) or list the run directories to compare")
        return chosen
    paths: list[Path] = []
    for entry in entries:
        matches = sorted(glob.glob(str(entry))) if any(ch in str(entry) for ch in "*?[") else [str(entry)]
        if not matches:
            raise WorkbenchError(f"no run directory matches {entry!r}", "check the pattern against `ls runs`")
        paths += [Path(m) for m in matches]
    return paths
