"""Reward functions: plain functions with TRL's signature, in a registry the recipe names them from (a recipe may
also name a function of its own as module:function: workbench/tasks/rewardspec.py).

    fn(prompts, completions, **kwargs) -> list[float | None]

kwargs carry the dataset's other columns as lists (here `answer`, the gold string). `None` means "cannot score
this one" (no gold answer, or a gold answer that does not parse): TRL then leaves it out of the mean instead of
counting it as wrong. Scores are 0/1; the recipe's `rewards:` section gives each function its weight
(correctness 1.0, format 0.2 by default), kept separate so a badly formatted right answer is not scored as wrong.

    from workbench.tasks import rewards
    rewards.score("correctness", ["<answer>42</answer>"], answer=["42"])   # [1.0]
"""
from __future__ import annotations

import functools
import math
import re
import threading
from typing import Callable

from workbench.errors import WorkbenchError

RewardFn = Callable[..., list]
REGISTRY: dict[str, RewardFn] = {}

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"^[-+]?\d[\d,]*(\.\d+)?$")
# The whole completion: optional working, then exactly one tagged answer, then nothing but whitespace.
_FORMAT = re.compile(r"^(?:(?!<answer>).)*<answer>[^<>]{1,64}</answer>\s*$", re.DOTALL)


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Add a reward function under `name`; TRL logs it as rewards/<name>/mean."""

    def add(fn: RewardFn) -> RewardFn:
        fn.__name__ = name
        REGISTRY[name] = fn
        return fn

    return add


def get(name: str) -> RewardFn:
    if name not in REGISTRY:
        raise WorkbenchError(f"unknown reward {name!r}", f"use one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


class RewardFailure(WorkbenchError):
    """A reward function raised, or returned something that is not a finite score (or None), during training."""


def _sample(prompts, completions, columns: dict, i: int) -> str:
    prompt = prompts[i] if prompts is not None and i < len(prompts) else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content")
    gold = {k: v[i] for k, v in columns.items() if isinstance(v, list) and i < len(v) and k in ("answer", "id")}
    return f"sample {i}: prompt {str(prompt)[:120]!r}, completion {completion_text(completions[i])[:160]!r}" + (
        f", {gold}" if gold else "")


def guarded(spec) -> RewardFn:
    """The reward a recipe names (a registry name or a `rewardspec.RewardSpec`: module:function with args), stopping
    the run with its name and the offending sample when it raises or returns a score that is not a finite number or
    None: training on NaN advantages silently ruins the policy.

    TRL names the reward's metrics after `__name__`; the wrapper keeps it."""
    if isinstance(spec, str):
        fn, name = get(spec), spec
    else:
        fn, name = spec.callable(), spec.name

    @functools.wraps(fn)
    def checked(prompts, completions, **columns):
        try:
            scores = fn(prompts, completions, **columns)
        except Exception as exc:
            # find the first sample that raises on its own, so the message points at it
            for i in range(len(completions)):
                one = {k: [v[i]] if isinstance(v, list) and i < len(v) else v for k, v in columns.items()}
                try:
                    fn([prompts[i]] if prompts is not None else None, [completions[i]], **one)
                except Exception:
                    raise RewardFailure(f"reward {name!r} raised {type(exc).__name__}: {str(exc)[:200]} on "
                                        f"{_sample(prompts, completions, columns, i)}",
                                        "fix the reward function (or return None for what it cannot score); the "
                                        "run stopped rather than train on it") from exc
            raise RewardFailure(f"reward {name!r} raised {type(exc).__name__}: {str(exc)[:200]} on a batch of "
                                f"{len(completions)}", "fix the reward function") from exc
        if not isinstance(scores, list) or len(scores) != len(completions):
            raise RewardFailure(f"reward {name!r} returned {type(scores).__name__} of length "
                                f"{len(scores) if hasattr(scores, '__len__') else '?'} for {len(completions)} "
                                "completions", "return a list with one score (or None) per completion")
        for i, value in enumerate(scores):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardFailure(f"reward {name!r} returned {value!r} for {_sample(prompts, completions, columns, i)}",
                                    "return a finite number, or None for a completion it cannot score; the run "
                                    "stopped rather than train on it")
        return scores

    return checked


def completion_text(completion) -> str:
    """A completion as text, whether TRL passed a string or chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer a completion commits to: last <answer> tag, else last \\boxed{}, else '#### x'."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


def as_number(text: str) -> float | None:
    text = text.strip().rstrip(".").replace("$", "").strip()
    if _NUMBER.match(text):
        return float(text.replace(",", ""))
    return None


def answers_match(gold: str, predicted: str) -> bool | None:
    """True/False when the two answers can be compared, None when the gold answer cannot be parsed.

    Plain numbers are compared exactly (the synthetic task and most GSM8K answers); anything else goes to
    math-verify, which understands LaTeX, fractions, sets and units.
    """
    g, p = as_number(gold), as_number(predicted)
    if g is not None and p is not None:
        return abs(g - p) < 1e-9
    import math_verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if on_main else None
    wrap = lambda s: s if "$" in s or "\\boxed" in s else f"${s}$"  # noqa: E731
    # No string fallback for the gold: an answer key that does not parse cannot score anything.
    gold_parsed = math_verify.parse(wrap(gold), fallback_mode="no_fallback", parsing_timeout=timeout)
    if not gold_parsed:
        return None
    pred_parsed = math_verify.parse(wrap(predicted), parsing_timeout=timeout)
    if not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


@register("correctness")
def correctness(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the extracted final answer equals the gold answer, 0.0 when not, None without a usable gold."""
    golds = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = []
    for completion, gold in zip(completions, golds):
        if gold is None or str(gold).strip() == "":
            scores.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        if predicted is None:
            scores.append(0.0)
            continue
        match = answers_match(str(gold), predicted)
        scores.append(None if match is None else float(match))
    return scores


@register("digits")
def digits(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """Partial credit for an integer answer: the share of its digits right in their place (units under units,
    the shorter number padded with zeros; 0.0 for a wrong sign, no answer or no integer), None without an integer
    gold. A group whose completions are all wrong has no spread under `correctness`, so it teaches nothing; where
    its wrong answers differ in how many digits they get right (a carry dropped in one, not in another), this
    reward still ranks them. The evaluation stays exact: this is a shaping term, weighted below correctness."""
    golds = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = []
    for completion, gold in zip(completions, golds):
        g = as_number(str(gold)) if gold is not None else None
        if g is None or not g.is_integer():
            scores.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        p = as_number(predicted) if predicted is not None else None
        if p is None or not p.is_integer() or (g < 0) != (p < 0):
            scores.append(0.0)
            continue
        a, b = str(abs(int(g))), str(abs(int(p)))
        width = max(len(a), len(b))
        scores.append(sum(x == y for x, y in zip(a.zfill(width), b.zfill(width))) / width)
    return scores


@register("format")
def format_reward(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 when the completion ends with exactly one short <answer>...</answer> and nothing after it."""
    return [1.0 if _FORMAT.match(completion_text(c).strip()) else 0.0 for c in completions]


def score(name: str, completions: list, prompts: list | None = None, **columns) -> list[float | None]:
    """Call a registered reward outside training (evaluation, tests)."""
    return get(name)(prompts or [None] * len(completions), completions, **columns)
