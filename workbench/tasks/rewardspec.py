"""Which reward functions a recipe names, with their weights and arguments, checked before anything is built.

    rewards:
      correctness: 1.0                        # a built-in reward (workbench/tasks/rewards.py's registry)
      format: 0.2
      "my_rewards:brevity": 0.1               # module:function, importable from where you run the workbench
      length_cap:                             # a name of your own, with keyword arguments for the function
        function: my_project.rewards:length_penalty     # or a file: path/to/rewards.py:length_penalty
        weight: 0.1
        args: {max_tokens: 40}

    from workbench.tasks import rewardspec
    specs = rewardspec.specs(recipe.rewards)        # [RewardSpec(name, weight, function, args)], imported and checked
    fn = specs[0].callable()                        # the function with its args bound; TRL logs rewards/<name>/mean

A function has TRL's reward signature: `fn(prompts, completions, **kwargs) -> list[float | None]` — it is called
with keywords (prompts, completions, completion_ids, trainer_state, log_extra, log_metric and every dataset
column), so it must take `prompts` and `completions` and a `**kwargs` catch-all; `args` must be parameters it takes.
`check()` finds an unimportable module, a missing attribute, something not callable, a wrong signature or unknown
args, each as one error with its fix; `probe()` calls each function on a few training rows before training and
rejects a return value that is not one finite number (or None) per completion.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workbench.errors import WorkbenchError
from workbench.tasks import rewards

SPEC_KEYS = ("function", "weight", "args")


@dataclass
class RewardSpec:
    name: str  # TRL's metric name: rewards/<name>/mean
    weight: float
    function: str  # a registry name, or module:function / path.py:function
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def external(self) -> bool:
        return ":" in self.function

    def resolve(self) -> Callable:
        """The function itself (imported for module:function), unbound."""
        if not self.external:
            try:
                return rewards.get(self.function)
            except WorkbenchError as exc:
                raise WorkbenchError(f"rewards.{self.name}: {exc.cause}",
                                     f"{exc.fix}; or a function of your own as module:function") from None
        return _import(self.function, f"rewards.{self.name}")

    def callable(self) -> Callable:
        """The function with the spec's args bound, named after the spec (TRL names its metrics by __name__)."""
        fn = self.resolve()
        bound = functools.partial(fn, **self.args) if self.args else fn

        @functools.wraps(fn)
        def reward(prompts, completions, **kwargs):
            return bound(prompts=prompts, completions=completions, **kwargs)

        reward.__name__ = self.name
        return reward


def parse(rewards: dict) -> list[RewardSpec]:
    """The recipe's `rewards:` mapping as specs, without importing anything (shape and types only)."""
    out: list[RewardSpec] = []
    for name, value in rewards.items():
        where = f"rewards.{name}"
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise WorkbenchError(f"{where} is {value!r}: expected a weight or a mapping with function/weight/args",
                                 f"write `{name}: 1.0`, or `{name}: {{function: module:function, weight: 1.0}}`")
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(SPEC_KEYS))
            if unknown:
                raise WorkbenchError(f"{where} has unknown key(s) {unknown}", f"use only {', '.join(SPEC_KEYS)}")
            weight = value.get("weight", 1.0)
            function = value.get("function", name)
            args = value.get("args") or {}
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise WorkbenchError(f"{where}.weight is {weight!r}", "set a number, e.g. weight: 0.5")
            if not isinstance(function, str) or not function:
                raise WorkbenchError(f"{where}.function is {function!r}",
                                     "name a built-in reward or module:function")
            if not isinstance(args, dict):
                raise WorkbenchError(f"{where}.args is {args!r}", "give keyword arguments as a mapping, e.g. {limit: 40}")
            out.append(RewardSpec(str(name).split(":")[-1] if name == function else str(name), float(weight),
                                  function, dict(args)))
        else:
            out.append(RewardSpec(str(name).split(":")[-1], float(value), str(name)))
        if not math.isfinite(out[-1].weight):
            raise WorkbenchError(f"{where} has weight {out[-1].weight}", "set a finite weight")
    names = [s.name for s in out]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise WorkbenchError(f"rewards: two rewards would both log as rewards/{clash[0]}/mean",
                             "give one of them its own name: `other_name: {function: ..., weight: ...}`")
    return out


def check(spec: RewardSpec) -> Callable:
    """Import and check one spec's function (callable, TRL's signature, its args); the function, or one error."""
    where = f"rewards.{spec.name}"
    fn = spec.resolve()
    if not callable(fn):
        raise WorkbenchError(f"{where}: {spec.function} is a {type(fn).__name__}, not a function",
                             "point function: at a function fn(prompts, completions, **kwargs)")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it will be called and probed instead
        return fn
    kinds = {p.kind for p in params.values()}
    takes_any = inspect.Parameter.VAR_KEYWORD in kinds
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [n for n in ("prompts", "completions") if n not in named and not takes_any]
    if missing or not takes_any:
        raise WorkbenchError(
            f"{where}: {spec.function}{inspect.signature(fn)} does not have TRL's reward signature "
            f"({'no ' + ' or '.join(missing) if missing else 'no **kwargs'})",
            "define it as fn(prompts, completions, **kwargs) -> list[float | None]: TRL passes every dataset "
            "column and its own extras as keywords")
    unknown = sorted(set(spec.args) - named)
    if unknown:
        raise WorkbenchError(f"{where}.args has {unknown}, which {spec.function} does not name as parameters",
                             f"its parameters are {sorted(named - {'prompts', 'completions'})}; a **kwargs "
                             "catch-all would also receive TRL's columns, so args must be named parameters")
    return fn


def specs(rewards: dict) -> list[RewardSpec]:
    """Parsed and checked (imported) specs; the first problem raises."""
    out = parse(rewards)
    for spec in out:
        check(spec)
    return out


def problems(rewards: dict) -> list[WorkbenchError]:
    """Every problem of the `rewards:` section at once (recipe load reports them together)."""
    if not rewards:
        return [WorkbenchError("rewards is empty", "name at least one reward, e.g. correctness: 1.0")]
    try:
        parsed = parse(rewards)
    except WorkbenchError as exc:
        return [exc]
    found = []
    for spec in parsed:
        try:
            check(spec)
        except WorkbenchError as exc:
            found.append(exc)
    return found


TRL_KEYWORDS = ("completion_ids", "trainer_state", "log_extra", "log_metric")  # what TRL adds to the columns


def _required(spec: RewardSpec) -> list[str]:
    try:
        params = inspect.signature(spec.resolve()).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
            p.KEYWORD_ONLY) and n not in ("prompts", "completions") and n not in spec.args]


def probe(spec: RewardSpec, rows: list[dict]) -> None:
    """Call the reward as TRL would on a few training rows (a well-formed answer and an empty completion each),
    before training: an exception or a return value that is not one finite number (or None) per completion is an
    error that names the reward and what it returned."""
    fn = spec.callable()
    rows = rows[:2]
    if not rows:
        return
    completions = []
    for row in rows:
        completions += [[{"role": "assistant", "content": f"<answer>{row.get('answer', '')}</answer>"}],
                        [{"role": "assistant", "content": ""}]]
    prompts = [row["prompt"] for row in rows for _ in range(2)]
    columns = {k: [row.get(k) for row in rows for _ in range(2)] for k in rows[0] if k != "prompt"}
    where = f"rewards.{spec.name} ({spec.function})"
    # a parameter without a default must be an arg or a column of the rows (a data file's own columns come as
    # keywords), which only the rows can tell: checked here, before the call would fail on it
    required = [n for n in _required(spec) if n not in columns and n not in TRL_KEYWORDS]
    if required:
        raise WorkbenchError(f"rewards.{spec.name}: {spec.function} requires {required}, which is neither in its args "
                             f"nor a column of the training rows (they have: {', '.join(sorted(columns))})",
                             f"give it in rewards.{spec.name}.args, add the column to the data, map it with "
                             "data.fields, or default it in the function")
    try:
        scores = fn(prompts, completions, completion_ids=[[] for _ in completions], trainer_state=None,
                    log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None, **columns)
    except Exception as exc:
        raise WorkbenchError(f"{where} raised {type(exc).__name__}: {str(exc)[:200]} on the first training rows",
                             "fix the function (it gets prompts, completions and the dataset's columns as "
                             "keywords) and run again") from None
    if not isinstance(scores, (list, tuple)) or len(scores) != len(completions):
        got = f"{type(scores).__name__}" + (f" of length {len(scores)}" if hasattr(scores, "__len__") else "")
        raise WorkbenchError(f"{where} returned {got} for {len(completions)} completions",
                             "return a list with one score (a number, or None) per completion")
    for value in scores:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise WorkbenchError(f"{where} returned {value!r} ({type(value).__name__}) as a score",
                                 "return a finite float per completion, or None for one it cannot score")


def _import(ref: str, where: str) -> Any:
    """`pkg.module:function` (importable from the working directory or sys.path) or `path/file.py:function`."""
    target, _, attr = ref.rpartition(":")
    if not target or not attr:
        raise WorkbenchError(f"{where}: {ref!r} is not module:function", "write e.g. my_rewards:brevity")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise WorkbenchError(f"{where}: no file {path} (from {os.getcwd()})",
                                 "give the file's path relative to where you run the workbench, or absolute")
        name = f"workbench_user_rewards.{path.stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader)
            try:
                loader.loader.exec_module(module)
            except Exception as exc:
                raise WorkbenchError(f"{where}: importing {path} raised {type(exc).__name__}: {exc}",
                                     "fix that file") from None
            sys.modules[name] = module
    else:
        # The user's project is the working directory (`workbench` runs from a console script, whose sys.path does
        # not have it): first on the path, as for `python -m` there. A module of it imported before is imported
        # afresh: edited since (the reward lab is for iterating), or another project's module of the same name.
        cwd = os.getcwd()
        if cwd in sys.path:
            sys.path.remove(cwd)
        sys.path.insert(0, cwd)
        top = target.split(".")[0]
        if top in sys.modules and not _installed(sys.modules[top]):
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
            importlib.invalidate_caches()
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise WorkbenchError(f"{where}: cannot import module {target!r} ({exc})",
                                 f"run from the directory that contains it, add it to PYTHONPATH, or give a file "
                                 f"path: path/to/{target.replace('.', '/')}.py:{attr}") from None
        except Exception as exc:
            raise WorkbenchError(f"{where}: importing {target} raised {type(exc).__name__}: {exc}",
                                 "fix that module") from None
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise WorkbenchError(f"{where}: {target} has no {attr!r}",
                             f"name one of its functions: {', '.join(public[:8]) or '(none)'}")
    return getattr(module, attr)


def _installed(module) -> bool:
    """Part of the Python installation or of the workbench (never re-imported), not of the user's project."""
    origin = getattr(module, "__file__", None)
    if origin is None:
        return True  # built in, or a namespace package
    roots = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(__file__).resolve().parents[1]}
    path = Path(origin).resolve()
    return any(root in path.parents for root in roots)
