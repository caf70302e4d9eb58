"""Base vs trained, problem by problem: which problems training fixed, which it broke, and where.

    from workbench.evaluation import analysis, evaluate
    found = analysis.analyse(evaluate.Evaluation.load(run.eval), rr, stage=run.eval)   # -> Analysis, analysis.json
    print(found.markdown())                      # outcome counts, a breakdown per category, a few flipped problems
    problems = found.frame()                     # one row per problem (pandas), for breakdowns of your own:
    analysis.breakdown(problems, ["operation", "carry"])

Notebook 05 and `workbench eval` run it after the comparison and the report shows its counts and breakdown table
(computed from samples.jsonl and recipe.yaml when the eval directory has no analysis.json: an older run).

Two models are compared: the ones labelled "base" and "trained" (the pipeline's labels), else the first two
evaluated (the note says so). Each problem falls in one of four outcomes: fixed (wrong → right), broken
(right → wrong), both right, both wrong. A sample that errored or could not be scored counts as wrong, as in the
summaries.

With eval.repeats > 1 a model's correctness on a problem is the fraction of its repeats that were right (b for
base, t for trained), and the problem counts b·(1-t) as broken, (1-b)·t as fixed, b·t as both right and
(1-b)·(1-t) as both wrong: the chance of each outcome for one base and one trained answer drawn from the repeats.
These counts add up like the summaries: both right + broken = Σ b = base accuracy × n, both right + fixed =
trained accuracy × n, the four sum to n, and net = fixed - broken = (trained - base accuracy) × n. With one repeat
(or greedy repeats that agree) they are whole problems. The `outcome` column names each problem's class by majority
(more than half of the repeats right; a tie counts as wrong); it is for filtering only, the counts use the weights.

Breakdowns: for the arithmetic task, by `operation` (addition | subtraction), `carry` (the units column needs a
carry or a borrow) and `phrasing` (the template that worded the problem), read from the generated rows
(workbench.tasks.arithmetic); for another dataset, by each field eval.breakdown names (a column of its records,
read as text); for every task, by `response_length`: the trained model's mean response length in tokens, in up to
three buckets of about equal size, and "truncated" where most of its responses hit eval.max_tokens.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import WorkbenchError
from workbench.recipe.schema import ANALYSIS_COLUMNS, ANALYSIS_OUTCOMES
from workbench.rundir import StageDir, write_atomic
from workbench.tasks import arithmetic
from workbench.tasks.task import Task

if TYPE_CHECKING:
    import pandas as pd

    from workbench.evaluation.evaluate import Evaluation
    from workbench.recipe import Recipe, Resolved

OUTCOMES = ANALYSIS_OUTCOMES
OUTCOME_NAMES = {"fixed": "fixed (wrong → right)", "broken": "broken (right → wrong)", "both_right": "both right",
                 "both_wrong": "both wrong"}
LENGTH = "response_length"
COLUMNS = ANALYSIS_COLUMNS  # the columns per_problem computes (the recipe refuses a breakdown field named so)
LENGTH_AT = COLUMNS.index(LENGTH)
MISSING = "(missing)"


# ----------------------------------------------------------------------------------------------------------------
# Which models, which categories

def compared_models(evaluation: Evaluation) -> tuple[str, str, str]:
    """(label compared as base, label compared as trained, a note when that choice needs saying)."""
    labels = list(dict.fromkeys(s.model for s in evaluation.summaries))
    if len(labels) < 2:
        raise WorkbenchError(f"the evaluation has {len(labels)} model{'s' if len(labels) != 1 else ''} "
                             f"({', '.join(labels) or 'none'}): nothing to compare per problem",
                             "evaluate two models, e.g. --model base=base --model trained=RUN/train/final")
    if "base" in labels and "trained" in labels:
        first, second, note = "base", "trained", ""
    else:
        first, second = labels[:2]
        note = (f"no models labelled base and trained: compared the first two evaluated, {first!r} as base with "
                f"{second!r} as trained")
    others = [label for label in labels if label not in (first, second)]
    if others:
        note = (note + "; " if note else "") + f"also evaluated, not compared here: {', '.join(others)}"
    return first, second, note


def breakdown_fields(recipe: Recipe) -> list[str]:
    """The category columns the recipe's analysis breaks down by: eval.breakdown, or for the arithmetic task all
    of its categories when that is empty (the names were checked when the recipe was loaded: recipe/load.py)."""
    fields = list(recipe.eval.breakdown)
    if recipe.data.name == "arithmetic":
        return fields or list(arithmetic.CATEGORIES)
    return fields


def category_values(recipe: Recipe, fields: list[str]) -> dict[str, dict[str, Any]]:
    """Problem id -> {field: value} for the recipe's eval rows (the problems the evaluation scored): generated
    rows carry their categories, a source's rows every column it has beyond question, answer and id."""
    if not fields:
        return {}
    rows = Task.build(recipe).eval_rows(recipe.eval)
    for name in fields:
        missing = next((row["id"] for row in rows if row.get(name) is None), None)
        if missing is not None:
            raise WorkbenchError(f"eval.breakdown names {name!r}, which cannot be read from the eval rows: row "
                                 f"{missing} has no {name!r} field",
                                 "name columns that every record of the eval split has in eval.breakdown, or drop it")
    return {row["id"]: {f: row[f] for f in fields} for row in rows}


# ----------------------------------------------------------------------------------------------------------------
# Per problem

def _recipe(rr_or_recipe: Resolved | Recipe) -> Recipe:
    return getattr(rr_or_recipe, "recipe", rr_or_recipe)


def _per_model(evaluation: Evaluation, label: str) -> dict[str, dict]:
    """id -> fraction right, mean tokens, fraction truncated, prompt, gold, first response."""
    out: dict[str, dict] = {}
    for s in sorted((s for s in evaluation.samples if s.model == label), key=lambda s: s.repeat):
        entry = out.setdefault(s.id, {"right": [], "tokens": [], "truncated": [], "prompt": s.prompt, "gold": s.gold,
                                      "response": s.response})
        entry["right"].append(bool(s.correct))  # an errored or unscored sample (None) counts as wrong
        entry["tokens"].append(s.completion_tokens)
        entry["truncated"].append(s.finish_reason == "length")
    return out


def per_problem(evaluation: Evaluation, rr_or_recipe: Resolved | Recipe,
                models: tuple[str, str] | None = None) -> pd.DataFrame:
    """One row per problem: each model's correctness (fraction of repeats right), the outcome weights, the
    majority outcome, response lengths, the category columns and both models' first responses.

    `models`: the (base, trained) labels to compare; default compared_models(). df.attrs holds the labels, the
    note, the category columns and the repeats."""
    import pandas as pd

    recipe = _recipe(rr_or_recipe)
    if models is None:
        first, second, note = compared_models(evaluation)
    else:
        (first, second), note = models, ""
    base, trained = _per_model(evaluation, first), _per_model(evaluation, second)
    for label, got in ((first, base), (second, trained)):
        if not got:
            raise WorkbenchError(f"the evaluation has no samples of {label!r}",
                                 f"compare two of: {', '.join(dict.fromkeys(s.model for s in evaluation.summaries))}")
    if base.keys() != trained.keys():
        only = sorted(base.keys() ^ trained.keys())
        raise WorkbenchError(f"{first!r} and {second!r} were scored on different problems ({len(only)} in one only, "
                             f"e.g. {only[0]!r})", "evaluate both models in one `workbench eval` (one eval split)")
    fields = breakdown_fields(recipe)
    values = category_values(recipe, fields)
    records = []
    for pid, b_entry in base.items():
        t_entry = trained[pid]
        b = sum(b_entry["right"]) / len(b_entry["right"])
        t = sum(t_entry["right"]) / len(t_entry["right"])
        weights = {"fixed": (1 - b) * t, "broken": b * (1 - t), "both_right": b * t, "both_wrong": (1 - b) * (1 - t)}
        outcome = {(False, True): "fixed", (True, False): "broken", (True, True): "both_right",
                   (False, False): "both_wrong"}[(b > 0.5, t > 0.5)]
        records.append({
            "id": pid, "base": b, "trained": t, **weights, "outcome": outcome,
            "base_tokens": sum(b_entry["tokens"]) / len(b_entry["tokens"]),
            "trained_tokens": sum(t_entry["tokens"]) / len(t_entry["tokens"]),
            "trained_truncated": sum(t_entry["truncated"]) / len(t_entry["truncated"]),
            **{f: values.get(pid, {}).get(f, MISSING) for f in fields},
            "prompt": b_entry["prompt"], "gold": b_entry["gold"],
            "base_response": b_entry["response"], "trained_response": t_entry["response"]})
    df = pd.DataFrame.from_records(records, columns=[*COLUMNS[:LENGTH_AT], *fields, *COLUMNS[LENGTH_AT + 1:]])
    df.insert(LENGTH_AT, LENGTH, length_buckets(df["trained_tokens"], df["trained_truncated"]))
    repeats = max((len(e["right"]) for e in (*base.values(), *trained.values())), default=1)
    df.attrs.update(models=[first, second], note=note, categories=fields, repeats=repeats)
    return df



def length_buckets(tokens: pd.Series, truncated: pd.Series, parts: int = 3) -> pd.Series:
    """Response lengths as an ordered category: up to `parts` buckets of about equal size (quantiles), each named
    by the lengths it holds ("27–30 tokens"), and "truncated" where more than half the responses hit max_tokens."""
    import pandas as pd

    cut = truncated > 0.5
    labels = pd.Series("truncated", index=tokens.index, dtype=object)
    order: list[str] = []
    whole = tokens[~cut]
    if len(whole):
        edges = sorted({float(v) for v in whole.quantile([i / parts for i in range(parts + 1)])})
        if len(edges) == 1:
            bins = pd.Series(0, index=whole.index)
        else:
            bins = pd.cut(whole, edges, labels=False, include_lowest=True)
        for number in sorted(bins.unique()):
            members = whole[bins == number]
            low, high = members.min(), members.max()
            name = f"{low:g} tokens" if low == high else f"{low:g}–{high:g} tokens"
            labels[members.index] = name
            order.append(name)
    if cut.any():
        order.append("truncated")
    return pd.Series(pd.Categorical(labels, categories=order, ordered=True), index=tokens.index)


def outcome_counts(df: pd.DataFrame) -> dict[str, float]:
    """n, the four outcome counts, net (fixed - broken) and each model's correct count (Σ of its column).
    Whole numbers are ints (always so with one repeat)."""
    sums = {"n": len(df), **{o: df[o].sum() for o in OUTCOMES}, "base_correct": df["base"].sum(),
            "trained_correct": df["trained"].sum()}
    sums["net"] = sums["fixed"] - sums["broken"]
    return {k: _number(v) for k, v in sums.items()}


def breakdown(df: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    """Per value of `by` (a category column, or several): n, base and trained accuracy, fixed, broken, net.
    The rows' n add up to the problems, their fixed and broken to the totals."""
    keys = [by] if isinstance(by, str) else list(by)
    missing = [k for k in keys if k not in df.columns]
    if missing:
        categories = [*df.attrs.get("categories", []), LENGTH]
        raise WorkbenchError(f"no column {missing} to break down by", f"use one of: {', '.join(categories)}")
    grouped = df.groupby(keys, observed=True, sort=True, dropna=False)
    table = grouped.agg(n=("id", "size"), base_accuracy=("base", "mean"), trained_accuracy=("trained", "mean"),
                        fixed=("fixed", "sum"), broken=("broken", "sum")).reset_index()
    table["net"] = table["fixed"] - table["broken"]
    return table


def examples(df: pd.DataFrame, outcome: str = "fixed", k: int = 3) -> pd.DataFrame:
    """Up to k problems of one outcome, the most certain first (its weight; all 1 with one repeat), with both
    models' first responses."""
    if outcome not in OUTCOMES:
        raise WorkbenchError(f"unknown outcome {outcome!r}", f"use one of: {', '.join(OUTCOMES)}")
    chosen = df[df[outcome] > 0].sort_values(outcome, ascending=False, kind="stable").head(k)
    return chosen[["id", "prompt", "gold", "base", "trained", "base_response", "trained_response"]]


def _number(value) -> float | int:
    value = float(value)
    rounded = round(value)
    return int(rounded) if abs(value - rounded) < 1e-9 else value


# ----------------------------------------------------------------------------------------------------------------
# The saved result

@dataclass
class Analysis:
    """The analysis as analysis.json keeps it: counts, breakdown tables, a few flipped problems, every problem."""
    models: list[str] = field(default_factory=list)  # [compared as base, compared as trained]; empty: none compared
    note: str = ""
    repeats: int = 1
    categories: list[str] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)
    breakdowns: dict[str, list[dict]] = field(default_factory=dict)  # column -> rows of breakdown()
    examples: dict[str, list[dict]] = field(default_factory=dict)  # fixed / broken -> rows of examples()
    problems: list[dict] = field(default_factory=list)  # per_problem() rows

    @classmethod
    def from_frame(cls, df: pd.DataFrame, k: int = 3) -> "Analysis":
        categories = list(df.attrs.get("categories", []))
        return cls(models=list(df.attrs["models"]), note=df.attrs.get("note", ""), repeats=df.attrs.get("repeats", 1),
                   categories=categories, counts=outcome_counts(df),
                   breakdowns={by: _records(breakdown(df, by)) for by in [*categories, LENGTH]},
                   examples={o: _records(examples(df, o, k)) for o in ("fixed", "broken")},
                   problems=_records(df))

    def save(self, stage: StageDir) -> Path:
        stage.make()
        return write_atomic(stage.analysis, json.dumps(asdict(self), indent=1, default=_plain))

    @classmethod
    def load(cls, stage: StageDir) -> "Analysis | None":
        try:
            return cls(**json.loads(Path(stage.analysis).read_text()))
        except (OSError, json.JSONDecodeError, TypeError):
            return None

    def frame(self) -> pd.DataFrame:
        """The per-problem table again (response_length as plain text)."""
        import pandas as pd

        df = pd.DataFrame.from_records(self.problems)
        df.attrs.update(models=self.models, note=self.note, categories=self.categories, repeats=self.repeats)
        return df

    def table_rows(self) -> list[list]:
        """Every breakdown in one table: [category, value, n, base, trained, fixed, broken, net], as text."""
        return [["response length" if by == LENGTH else by, str(r[by]), r["n"], f"{100 * r['base_accuracy']:.1f}%",
                 f"{100 * r['trained_accuracy']:.1f}%", _count(r["fixed"]), _count(r["broken"]),
                 _count(r["net"], sign=True)]
                for by, rows in self.breakdowns.items() for r in rows]

    def counts_row(self) -> list:
        c = self.counts
        return [c["n"], *(_count(c[o]) for o in ("both_right", "fixed", "broken", "both_wrong")),
                _count(c["net"], sign=True)]

    def markdown(self, k: int = 3) -> str:
        """Outcome counts, every breakdown and up to k fixed and k broken problems, as Markdown."""
        if not self.models:
            return f"*No per-problem comparison: {self.note}*\n"
        first, second = self.models
        out = [f"**{second} vs {first}, problem by problem** ({self.counts['n']} problems"
               + (f" × {self.repeats} repeats: counts are expected values, see workbench/evaluation/analysis.py"
                  if self.repeats > 1 else "") + ")" + (f". {self.note}." if self.note else ""), "",
               _markdown_table(COUNTS_HEADER, [self.counts_row()]), "",
               _markdown_table(BREAKDOWN_HEADER, self.table_rows(), left=2)]
        for outcome in ("fixed", "broken"):
            rows = [[e["id"], _clip(e["prompt"]), e["gold"], _clip(e["base_response"], tail=True),
                     _clip(e["trained_response"], tail=True)] for e in self.examples.get(outcome, [])[:k]]
            if rows:
                out += ["", f"*{OUTCOME_NAMES[outcome]}, {len(rows)} of {_count(self.counts[outcome])}:*", "",
                        _markdown_table(["id", "prompt", "gold", f"{first} answered", f"{second} answered"], rows,
                                        left=5)]
        return "\n".join(out) + "\n"


COUNTS_HEADER = ["problems", "both right", "fixed (wrong → right)", "broken (right → wrong)", "both wrong",
                 "net (fixed − broken)"]
BREAKDOWN_HEADER = ["category", "value", "n", "base", "trained", "fixed", "broken", "net"]


def analyse(evaluation: Evaluation, rr_or_recipe: Resolved | Recipe, stage: StageDir | None = None,
            k: int = 3) -> Analysis:
    """The whole analysis, saved as `stage`'s analysis.json when given. With fewer than two models it has no
    models and a note saying why (and is saved so, replacing an older analysis in that directory)."""
    try:
        compared_models(evaluation)
    except WorkbenchError as exc:
        result = Analysis(note=exc.cause)
    else:
        result = Analysis.from_frame(per_problem(evaluation, rr_or_recipe), k)
    if stage is not None:
        result.save(stage)
    return result


def _count(value: float, sign: bool = False) -> str:
    """A count as text: whole numbers as they are, expected values (repeats > 1) to one decimal."""
    value = _number(value)
    text = f"{value:d}" if isinstance(value, int) else f"{value:.1f}"
    return f"+{text}" if sign and value > 0 else text


def _clip(text: str, limit: int = 160, tail: bool = False) -> str:
    """A long text cut for a table cell: its start, or for a response its end (where the final answer is)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return "…" + text[-limit:] if tail else text[:limit] + "…"


def _records(df: pd.DataFrame) -> list[dict]:
    return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def _plain(value):
    """numpy scalars and categories as JSON values."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _markdown_table(header: list[str], rows: list[list], left: int = 0) -> str:
    def cell(value) -> str:
        return " ".join(str(value).split()).replace("|", "\\|")

    align = ["---" if i < left else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
