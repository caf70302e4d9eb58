"""The GRPO group record (train/groups/, written by workbench/training/groups.py) as DataFrames, a browsing widget
and a few illustrative groups for the report.

    from workbench.observe import groups
    df = groups.load(run.train)                # one row per completion: step, group, member, prompt, completion,
                                               # reward/<fn>..., reward, advantage, length, truncated
    table = groups.summary(df)                 # one row per (step, group): spread, zero_spread, truncated, ...
    groups.inspector(run.train)                # in a notebook: step slider, filters, the groups as tables

A group with zero reward spread (every completion scored the same) gives GRPO no learning signal: its advantages
are all zero. Many of them means the task is too easy or too hard for the policy at that point; truncated
completions mean max_completion_length cuts answers off.
"""
from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from workbench.rundir import TrainDir
from workbench.training.groups import spread_tolerance


def files(train: TrainDir) -> list[Path]:
    return train.group_files()


def load(train: TrainDir, steps: list[int] | None = None) -> pd.DataFrame:
    """Every recorded completion (of the given steps), in step / group / member order; empty when none."""
    chosen = [p for p in files(train) if steps is None or int(p.stem.split("_")[1]) in steps]
    if not chosen:
        return pd.DataFrame()
    df = pd.concat([pd.read_parquet(p) for p in chosen], ignore_index=True)
    return df.sort_values(["step", "group", "member"], kind="stable").reset_index(drop=True)


def reward_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("reward/")]


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, group): size, mean/min/max reward, spread (std), zero_spread, truncated count, longest
    completion, mean |advantage| and each reward function's mean."""
    if df.empty:
        return pd.DataFrame()
    grouped = df.groupby(["step", "group"], sort=True)
    out = grouped.agg(prompt=("prompt", "first"), size=("member", "size"), reward_mean=("reward", "mean"),
                      reward_min=("reward", "min"), reward_max=("reward", "max"),
                      reward_std=("reward", lambda r: float(r.std(ddof=0))),
                      truncated=("truncated", "sum"), longest=("length", "max"), mean_length=("length", "mean"),
                      abs_advantage=("advantage", lambda a: float(a.abs().mean())))
    for column in reward_columns(df):
        out[f"{column}_mean"] = grouped[column].mean()
    # the trainer's rule (training/groups.group_signal): equal within a tolerance relative to the rewards' scale
    tol = spread_tolerance(float(df["reward"].abs().max())) if df["reward"].notna().any() else 0.0
    out["zero_spread"] = (out["reward_max"] - out["reward_min"]).fillna(0.0) <= tol
    return out.reset_index()


def per_step(df: pd.DataFrame) -> pd.DataFrame:
    """Per recorded step: groups, fraction with zero spread, truncated fraction, mean reward and length."""
    table = summary(df)
    if table.empty:
        return pd.DataFrame()
    by = table.groupby("step")
    out = pd.DataFrame({"groups": by.size(), "zero_spread": by["zero_spread"].mean(),
                        "reward": by["reward_mean"].mean(), "mean_length": by["mean_length"].mean()})
    out["truncated"] = df.groupby("step")["truncated"].mean()
    return out.reset_index()


def filtered(df: pd.DataFrame, zero_spread: bool | None = None, truncated: bool = False,
             reward_range: tuple[float, float] | None = None) -> pd.DataFrame:
    """The summary rows that match: zero_spread True/False (None: either), only groups with a truncated
    completion, group mean reward within reward_range."""
    table = summary(df)
    if table.empty:
        return table
    keep = pd.Series(True, index=table.index)
    if zero_spread is not None:
        keep &= table["zero_spread"] == zero_spread
    if truncated:
        keep &= table["truncated"] > 0
    if reward_range is not None:
        low, high = reward_range
        keep &= table["reward_mean"].between(low, high)
    return table[keep]


def illustrative(df: pd.DataFrame, step: int | None = None) -> list[tuple[str, pd.DataFrame]]:
    """A few groups worth looking at from one step (default: the last recorded): the widest reward spread (a
    strong signal), one with none (no signal), the one with the longest completion."""
    if df.empty:
        return []
    step = int(df["step"].max()) if step is None else step
    rows = df[df["step"] == step]
    table = summary(rows)
    picks: list[tuple[str, int]] = []
    if (~table["zero_spread"]).any():
        picks.append(("widest reward spread", int(table.loc[table["reward_std"].idxmax(), "group"])))
    if table["zero_spread"].any():
        picks.append(("no reward spread (no learning signal)", int(table[table["zero_spread"]].iloc[0]["group"])))
    longest = int(rows.loc[rows["length"].idxmax(), "group"])
    if longest not in [g for _, g in picks]:
        picks.append(("longest completion", longest))
    return [(f"step {step}, group {g}: {why}", rows[rows["group"] == g]) for why, g in picks]


def group_html(rows: pd.DataFrame, title: str = "", max_chars: int = 400) -> str:
    """One group as an HTML table: the prompt once, then each completion with its scores."""
    scores = reward_columns(rows)
    prompt = html.escape(str(rows["prompt"].iloc[0]))
    head = "".join(f"<th>{html.escape(c.split('/', 1)[1])}</th>" for c in scores)
    body = []
    for _, r in rows.iterrows():
        text = str(r["completion"])
        text = text if len(text) <= max_chars else text[:max_chars] + " …"
        cells = "".join(f"<td>{_number(r[c])}</td>" for c in scores)
        cut = "yes" if r["truncated"] else ""
        body.append(f"<tr><td style='text-align:left;white-space:pre-wrap'>{html.escape(text)}</td>{cells}"
                    f"<td><b>{_number(r['reward'])}</b></td><td>{r['advantage']:+.2f}</td><td>{int(r['length'])}</td>"
                    f"<td>{cut}</td></tr>")
    caption = f"<div><b>{html.escape(title)}</b></div>" if title else ""
    return (f"{caption}<div style='margin:4px 0'><i>prompt:</i> {prompt}</div>"
            f"<table class='groups'><tr><th>completion</th>{head}<th>reward</th><th>advantage</th><th>tokens</th>"
            f"<th>cut off</th></tr>{''.join(body)}</table>")


def _number(value) -> str:
    return "–" if pd.isna(value) else f"{value:.2f}"


def inspector(train: TrainDir, per_page: int = 4):
    """A widget to browse the record: a step slider, filters (zero spread, truncated, group reward range) and the
    matching groups of that step as tables. Returns the widget (display it, or leave it as a cell's last value)."""
    import ipywidgets as w

    df = load(train)
    if df.empty:
        return w.HTML(f"<i>no groups recorded in {train.groups} (monitor.groups_per_step is 0, or the run has not "
                      "trained a step yet)</i>")
    steps = sorted(df["step"].unique().tolist())
    low, high = float(df["reward"].min(skipna=True)), float(df["reward"].max(skipna=True))
    step = w.SelectionSlider(options=steps, value=steps[-1], description="step", continuous_update=False)
    spread = w.Dropdown(options=[("all groups", None), ("zero spread only", True), ("with spread only", False)],
                        description="groups")
    cut = w.Checkbox(description="with a cut-off completion")
    rewards = w.FloatRangeSlider(value=(low, high), min=low, max=max(high, low + 1e-6), step=0.05,
                                 description="mean reward", continuous_update=False)
    out = w.HTML()  # one HTML value, replaced on each change (also renders in a saved notebook's widget state)

    def show(*_):
        rows = df[df["step"] == step.value]
        table = filtered(rows, zero_spread=spread.value, truncated=cut.value, reward_range=rewards.value)
        stats = per_step(rows).iloc[0]
        parts = [f"<p>step {step.value}: {int(stats['groups'])} groups recorded, "
                 f"{100 * stats['zero_spread']:.0f}% with zero reward spread, "
                 f"{100 * stats['truncated']:.0f}% of completions cut off; {len(table)} match the filters"
                 f"{f' (showing {per_page})' if len(table) > per_page else ''}</p>"]
        parts += [group_html(rows[rows["group"] == g], f"group {g}") for g in table["group"].tolist()[:per_page]]
        out.value = "".join(parts)

    for control in (step, spread, cut, rewards):
        control.observe(show, names="value")
    show()
    return w.VBox([w.HBox([step, spread]), w.HBox([cut, rewards]), out])
