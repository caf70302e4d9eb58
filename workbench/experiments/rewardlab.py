"""The reward lab: score candidate reward functions on completions you already have, before spending a training run
on them, and see whether they would teach what you want.

    from workbench.experiments import rewardlab
    samples = rewardlab.from_run(run.train)                 # a run's group record (or TRL's completion logs)
    samples = rewardlab.sample(rr, num_prompts=16)          # or a fresh offline generation: G completions per prompt
    samples = rewardlab.completions(rr, source)             # either: a run directory's, or (source "") fresh
    lab = rewardlab.score(samples, {"correctness": 1.0, "short": {"function": "my_rewards:brevity", "args": {...}}},
                          rr.recipe)
    lab.table()          # per reward: mean, spread, unscored share, zero-spread groups, correlation with correctness
                         # and with length
    lab.warnings         # the classic hacks, each as one line: what was seen and why it matters
    lab.figure(path)     # each reward's score distribution, split by correct / wrong
    lab = rewardlab.score(samples, {"preference": {"kind": "model", "model": "tiny-rm", "score": "probability"}},
                          rr.recipe, rr=rr)   # a reward model or judge: its engine started for the scoring
    lab.disagreements("preference")           # where it and the rule disagree most: read those completions

Rewards are given as a recipe's `rewards:` section is (workbench/tasks/rewardspec.py: registry names or
module:function with args), checked and called as TRL calls them. Correctness comes from the built-in reward with
the gold answers looked up from the recipe's training rows by prompt; length is in tokens where the source has
them, else in characters. Warnings: a reward that follows length much more than correctness (the length hack), one
that rises over training while correctness stays flat (e.g. a format reward learnt instead of the task), one that
gives almost no group a spread (no learning signal), one that is constant.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from workbench.errors import WorkbenchError
from workbench.observe import groups
from workbench.rundir import RunDir, TrainDir, write_atomic
from workbench.tasks import rewards as builtin, rewardspec
from workbench.tasks.task import Task
from workbench.tasks.rewards import completion_text

LENGTH_CORRELATION = 0.7  # |Spearman| with length above this, and well above that with correctness: the length hack
MARGIN = 0.2
NO_SIGNAL = 0.9  # share of groups with zero spread above which a reward teaches (almost) nothing


def from_run(train: TrainDir) -> pd.DataFrame:
    """Completions a run generated: its group record (train/groups/) or, for older runs, TRL's completion logs.
    Columns: step, group, prompt, completion, length (tokens or, from TRL's logs, characters)."""
    df = groups.load(train)
    if not df.empty:
        return df[["step", "group", "prompt", "completion", "length"]].copy()
    logs = list(train.completion_logs().values())
    if not logs:
        raise WorkbenchError(f"no completions recorded in {train.path} (no groups/ and no TRL completion logs)",
                             "train with monitor.groups_per_step > 0 (the default), or use rewardlab.sample(rr)")
    frames = []
    for path in logs:
        raw = pd.read_parquet(path)
        text = lambda m: completion_text(list(m) if hasattr(m, "tolist") else m)  # noqa: E731 (parquet: arrays)
        frame = pd.DataFrame({"step": raw["step"], "prompt": raw["prompt"].map(text),
                              "completion": raw["completion"].map(text)})
        frame["group"] = (frame["prompt"] != frame["prompt"].shift()).cumsum() - 1
        frame["length"] = frame["completion"].str.len()
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def sample(rr, num_prompts: int = 16, num_generations: int | None = None, model_path: str | None = None,
           temperature: float | None = None, log=print) -> pd.DataFrame:
    """A fresh offline generation (vLLM in this process, the served engine's settings): G completions for each of
    the first training prompts, at the recipe's training temperature and completion length."""
    from workbench.serving import offline  # lazy: yaml

    recipe = rr.recipe
    size = num_generations or int(recipe.trainer.get("num_generations", 8))
    rows = rr.task.rows("train", limit=num_prompts)
    llm, _ = offline.engine(rr, model_path, log=log)
    from vllm import SamplingParams

    params = SamplingParams(n=size, temperature=temperature if temperature is not None else
                            float(recipe.trainer.get("temperature", 1.0)),
                            max_tokens=int(recipe.trainer.get("max_completion_length", 256)), seed=recipe.data.seed)
    outputs = llm.chat([row["prompt"] for row in rows], params, use_tqdm=False)
    del llm
    records = []
    for g, (row, out) in enumerate(zip(rows, outputs)):
        for member, c in enumerate(out.outputs):
            records.append({"step": 0, "group": g, "prompt": row["prompt"][-1]["content"], "completion": c.text,
                            "length": len(c.token_ids), "answer": row["answer"]})
    return pd.DataFrame(records)


def completions(rr, source: str = "", num_prompts: int = 16, log=print) -> pd.DataFrame:
    """What the lab scores: the completions recorded in the run directory `source`, or (empty) a fresh sample."""
    return from_run(RunDir.open(source).train) if source else sample(rr, num_prompts=num_prompts, log=log)


@dataclass
class Lab:
    scores: pd.DataFrame  # one row per completion: the sample's columns + correct + one column per reward
    rewards: list[str]
    warnings: list[str] = field(default_factory=list)

    def table(self) -> pd.DataFrame:
        """Per reward: mean, std, unscored share, share of groups with zero spread, Spearman correlation with
        correctness and with length."""
        df, out = self.scores, []
        for name in self.rewards:
            values = df[name]
            spread = df.groupby(["step", "group"])[name].agg(lambda v: (v.max() - v.min()) if v.notna().any() else 0.0)
            out.append({"reward": name, "mean": values.mean(), "std": values.std(ddof=0),
                        "unscored": values.isna().mean(), "zero_spread_groups": float((spread <= 1e-9).mean()),
                        "corr_correct": _corr(values, df["correct"]), "corr_length": _corr(values, df["length"])})
        return pd.DataFrame(out).set_index("reward")

    def disagreements(self, reward: str, against: str = "correct", n: int = 10) -> pd.DataFrame:
        """The completions on which `reward` and `against` (the rule's correctness by default, or another reward)
        disagree most: each turned into its rank among the completions (0..1), the largest gaps first."""
        df = self.scores.dropna(subset=[reward, against])
        if df.empty:
            return df
        gap = (df[reward].rank(pct=True) - df[against].rank(pct=True)).abs()
        out = df.assign(rank_gap=gap).sort_values("rank_gap", ascending=False).head(n)
        return out[["prompt", "completion", reward, against, "rank_gap"]]

    def by_step(self) -> pd.DataFrame:
        """Each reward's mean (and correctness) per training step: what a run would have seen rise or not."""
        return self.scores.groupby("step")[[*self.rewards, "correct"]].mean()

    def markdown(self) -> str:
        table = self.table()
        lines = ["| reward | mean | std | unscored | groups without spread | corr. correctness | corr. length |",
                 "|---|---|---|---|---|---|---|"]
        for name, r in table.iterrows():
            lines.append(f"| {name} | {r['mean']:.3f} | {r['std']:.3f} | {100 * r['unscored']:.0f}% | "
                         f"{100 * r['zero_spread_groups']:.0f}% | {r['corr_correct']:+.2f} | {r['corr_length']:+.2f} |")
        lines.append("")
        lines += [f"- **warning** {w}" for w in self.warnings] or ["- no warning"]
        return "\n".join(lines)

    def save(self, stage) -> Path:
        """lab.json (table, warnings, sample count), lab.md and lab.png into a run's lab/ directory."""
        import json

        stage.make()
        self.figure(stage.figure)
        write_atomic(stage.table, self.markdown() + "\n")
        record = {"rewards": self.rewards, "completions": len(self.scores), "warnings": self.warnings,
                  "table": json.loads(self.table().to_json(orient="index"))}
        return write_atomic(stage.json, json.dumps(record, indent=2))

    def figure(self, path: Path | str | None = None):
        """Each reward's score distribution, correct vs wrong completions overlaid."""
        from workbench.plots import plt, save_png  # lazy: matplotlib

        fig, axes = plt.subplots(1, len(self.rewards), figsize=(3.2 * len(self.rewards), 2.6), squeeze=False)
        for ax, name in zip(axes[0], self.rewards):
            for label, part in (("correct", self.scores[self.scores["correct"] == 1.0]),
                                ("wrong", self.scores[self.scores["correct"] == 0.0])):
                values = part[name].dropna()
                if len(values):
                    ax.hist(values, bins=12, alpha=0.55, label=label)
            ax.set_title(name, fontsize=10)
            ax.legend(fontsize=7)
        fig.tight_layout()
        if path is not None:
            save_png(fig, Path(path))
        return fig


def score(samples: pd.DataFrame, rewards: dict, recipe=None, rr=None, log=print) -> Lab:
    """Score `samples` (from_run / sample) with the rewards (a recipe's `rewards:` mapping); `recipe` supplies the
    gold answers (its training rows, matched by prompt) when the samples lack an `answer` column. A reward model or
    judge (kind model / judge) is scored on its engine, started here for the scoring from `rr` (the resolved recipe:
    the server's devices, sizes and platform) and stopped after it."""
    if samples.empty:
        raise WorkbenchError("no completions to score", "record some (a training run) or sample some first")
    specs = rewardspec.specs(rewards)  # the same checks as a recipe load: one clear error per bad spec
    learned = [s for s in specs if s.is_learned]
    if learned and rr is None:
        raise WorkbenchError(f"rewards.{learned[0].name} is a {learned[0].kind}, scored on an engine, and no resolved "
                             "recipe was given to start it from", "pass rr=recipe.resolve(...) to rewardlab.score")
    judge = next((s for s in learned if s.learned.on_policy_server), None)
    if judge is not None:
        raise WorkbenchError(f"rewards.{judge.name}: a policy-base judge is the policy server's base model, which the "
                             "lab does not start", "score it in a training (its per-step column), or give the judge a "
                             "model of its own for the lab")
    with contextlib.ExitStack() as stack:
        scorers = {}
        if learned:
            import dataclasses

            from workbench.serving.rewards import RewardEngines, Scorer

            lab_rr = dataclasses.replace(rr, recipe=dataclasses.replace(rr.recipe, rewards=dict(rewards)))
            stack.enter_context(RewardEngines(lab_rr, log=log))
            scorers = {s.name: Scorer(lab_rr, s) for s in learned}
        return _score(samples, specs, recipe, scorers)


def _score(samples: pd.DataFrame, specs, recipe, scorers: dict) -> Lab:
    df = samples.copy()
    if "answer" not in df.columns:
        df["answer"] = df["prompt"].map(_gold_lookup(recipe)) if recipe is not None else None
    completions = [[{"role": "assistant", "content": str(c)}] for c in df["completion"]]
    prompts = [[{"role": "user", "content": str(p)}] for p in df["prompt"]]
    answers = [a if isinstance(a, str) else None for a in df["answer"]]

    df["correct"] = pd.Series(builtin.correctness(prompts, completions, answer=answers), index=df.index, dtype=float)
    for spec in specs:
        fn = scorers[spec.name] if spec.is_learned else spec.callable()
        values = fn(prompts, completions, answer=answers, completion_ids=[[]] * len(df),
                    trainer_state=None, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
        if not isinstance(values, (list, tuple)) or len(values) != len(df):
            raise WorkbenchError(f"rewards.{spec.name} returned {type(values).__name__} for {len(df)} completions",
                                 "return one score (or None) per completion")
        df[spec.name] = pd.Series([math.nan if v is None else float(v) for v in values], index=df.index)
    lab = Lab(df, [s.name for s in specs])
    lab.warnings = _warnings(lab)
    return lab


def _corr(a: pd.Series, b: pd.Series) -> float:
    both = pd.concat([a, b], axis=1).dropna()
    if len(both) < 3 or both.iloc[:, 0].nunique() < 2 or both.iloc[:, 1].nunique() < 2:
        return math.nan
    # Spearman: Pearson on the ranks (pandas' method="spearman" needs scipy, which nothing else here uses)
    return float(both.iloc[:, 0].rank().corr(both.iloc[:, 1].rank()))


def _gold_lookup(recipe) -> dict[str, str]:
    return {row["prompt"][-1]["content"]: row["answer"] for row in Task.build(recipe).rows("train")}


def _warnings(lab: Lab) -> list[str]:
    table, out = lab.table(), []
    steps = lab.scores["step"].nunique()
    trend = lab.by_step() if steps >= 3 else None
    for name, row in table.iterrows():
        if name == "correctness":
            continue
        if row["std"] <= 1e-12:
            out.append(f"{name}: the same score for every completion: it adds nothing but an offset")
            continue
        length, correct = abs(row["corr_length"]), abs(row["corr_correct"])
        correct = 0.0 if math.isnan(correct) else correct
        if not math.isnan(length) and length >= LENGTH_CORRELATION and length >= correct + MARGIN:
            out.append(f"{name}: follows completion length (Spearman {row['corr_length']:+.2f}) far more than "
                       f"correctness ({row['corr_correct']:+.2f}): the policy can earn it by writing longer or "
                       "shorter answers instead of better ones")
        if row["zero_spread_groups"] >= NO_SIGNAL:
            out.append(f"{name}: {100 * row['zero_spread_groups']:.0f}% of groups get one score for every "
                       "completion: no learning signal from it there")
        if trend is not None:
            third = max(1, len(trend) // 3)
            early, late = trend.iloc[:third].mean(), trend.iloc[-third:].mean()
            rise = late[name] - early[name]
            scale = (lab.scores[name].max() - lab.scores[name].min()) or 1.0
            if rise / scale >= 0.2 and late["correct"] - early["correct"] < 0.05:
                out.append(f"{name}: rose by {rise:+.2f} over the run while correctness moved "
                           f"{late['correct'] - early['correct']:+.2f}: the policy learnt this reward, not the task")
    return out
