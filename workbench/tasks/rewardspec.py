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

Learned rewards (`kind: model` or `kind: judge`) are scored by an inference engine, not called here: their settings
are parsed and checked here (LearnedReward), and workbench/serving/rewards.py starts their engines and scores:

      preference:
        kind: model                   # a sequence-classification reward model, served by vLLM (--runner pooling)
        model: tiny-rm                # `workbench reward-model` builds it; or a model directory, or a hub id
        weight: 1.0
        score: logit                  # logit (the head's raw output) | probability (its sigmoid): said explicitly
        engine: {port: 8010, gpu_memory_utilization: 0.3}   # managed beside the policy server, on its cards
      grader:
        kind: judge                   # a chat model asked to grade; its answer parsed to a number
        model: policy-base            # the LoRA policy server's frozen base (no second copy); or a model of its own
        template: "Question: {question}\nAnswer: {completion}\nScore 0-10:"   # any dataset column too
        parser: number                # number | yes_no | regex:<pattern with one group>
        scale: [0, 10]                # the parsed number mapped to 0..1; outside it: a failed answer
        on_failure: drop_group        # drop_group (the group trains nothing) | stop (the first failure ends the run)
        max_failures: 50              # drop_group: the run stops past this many failed completions
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import re
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from workbench.errors import WorkbenchError
from workbench.tasks import rewards

SPEC_KEYS = ("function", "weight", "args")
KINDS = ("rule", "model", "judge")
COMMON_LEARNED = ("kind", "model", "weight", "engine", "timeout_s", "concurrency", "on_failure", "max_failures")
LEARNED_KEYS = {"model": COMMON_LEARNED + ("score", "normalize"),
                "judge": COMMON_LEARNED + ("template", "parser", "scale", "max_tokens")}
ENGINE_KEYS = ("mode", "url", "api_key_env", "served_model_name", "port", "gpu_memory_utilization",
               "kv_cache_space_gib", "max_model_len", "dtype", "startup_timeout_s", "max_restarts", "env")
POLICY_BASE = "policy-base"  # a judge that is the LoRA policy server's base model, asked without an adapter
TINY_RM = "tiny-rm"  # the reward model `workbench reward-model` builds from the tiny base


@dataclass
class RewardSpec:
    name: str  # TRL's metric name: rewards/<name>/mean
    weight: float
    function: str  # a registry name, or module:function / path.py:function
    args: dict[str, Any] = field(default_factory=dict)
    kind: str = "rule"  # rule (a Python function) | model | judge (scored by an engine: `learned`)
    learned: "LearnedReward | None" = None

    @property
    def external(self) -> bool:
        return ":" in self.function

    @property
    def is_learned(self) -> bool:
        return self.learned is not None

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
        if isinstance(value, dict) and value.get("kind", "rule") != "rule":
            out.append(_learned(str(name), value))
            continue
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(SPEC_KEYS) - {"kind"})
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


def check(spec: RewardSpec) -> Callable | None:
    """Import and check one spec's function (callable, TRL's signature, its args); the function, or one error.
    A learned reward has no function here (its settings were checked by parse)."""
    if spec.is_learned:
        return None
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
    if spec.is_learned:  # scored by its engine, which is not up yet: what the template asks of the rows
        spec.learned.check_columns(rows[0] if rows else {})
        return
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


# ----------------------------------------------------------------------------------------------------------------
# Learned rewards: a reward model or a judge, scored by an inference engine (workbench/serving/rewards.py)

FAILURE_POLICIES = ("drop_group", "stop")
PARSERS = ("number", "yes_no")  # or regex:<pattern>
SCORES = ("logit", "probability")
NORMALIZE = ("none", "batch")
TEMPLATE_FIELDS = ("question", "completion")  # always there; any other field must be a dataset column


@dataclass
class EngineSpec:
    """Where a learned reward runs: an engine the workbench starts beside the policy server, on the server role's
    devices (managed), or one someone else serves (attach, at url). Unset sizes follow the policy server's."""
    mode: str = "managed"  # managed | attach
    url: str | None = None  # attach: e.g. http://10.0.0.5:8010
    api_key_env: str | None = None  # the variable holding the attached engine's key (never the key)
    served_model_name: str | None = None  # None: reward-<name> (managed); attach: the name it answers to
    port: int | None = None  # managed: None = the policy server's port + 10 + the reward's index
    gpu_memory_utilization: float | None = None  # accelerators: this engine's share of each server card
    kv_cache_space_gib: int = 1  # CPU: the engine's KV space (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int | None = None  # None: the policy server's
    dtype: str | None = None  # None: the policy server's
    startup_timeout_s: float | None = None  # None: the policy server's
    max_restarts: int | None = None  # None: the policy server's
    env: dict[str, str] = field(default_factory=dict)

    @property
    def managed(self) -> bool:
        return self.mode == "managed"


@dataclass
class LearnedReward:
    """A `kind: model` or `kind: judge` reward's settings, checked at load."""
    name: str
    kind: str  # model | judge
    model: str  # a directory, a hub id, tiny-rm, or (judge) policy-base
    engine: EngineSpec
    score: str = "logit"  # model: logit | probability
    normalize: str = "none"  # model: none | batch (standardised over the gathered batch, every rank's completions)
    template: str = ""  # judge: the grading prompt
    parser: str = "number"  # judge: number | yes_no | regex:<pattern>
    scale: tuple[float, float] | None = None  # judge: the parsed number's range, mapped to 0..1
    max_tokens: int = 16  # judge: tokens its answer may take
    timeout_s: float = 60.0  # one request's bound; a request past it is a failed completion
    concurrency: int = 16  # requests in flight at once
    on_failure: str = "drop_group"
    max_failures: int = 50

    @property
    def on_policy_server(self) -> bool:
        """A judge that is the policy server's own base model (a LoRA run): no engine of its own."""
        return self.kind == "judge" and self.model == POLICY_BASE

    @property
    def pattern(self):
        import re

        return re.compile(self.parser[len("regex:"):]) if self.parser.startswith("regex:") else None

    def template_fields(self) -> list[str]:
        import string

        return [f for _, f, _, _ in string.Formatter().parse(self.template) if f]

    def check_columns(self, row: dict) -> None:
        """A judge's template asks only for question, completion and columns the training rows have."""
        if self.kind != "judge":
            return
        missing = [f for f in self.template_fields() if f not in TEMPLATE_FIELDS and f not in row]
        if missing:
            raise WorkbenchError(f"rewards.{self.name}.template asks for {{{missing[0]}}}, which is neither question, "
                                 f"completion nor a column of the training rows (they have: "
                                 f"{', '.join(sorted(k for k in row if k != 'prompt'))})",
                                 "use a column the data has, or add it to the data file")


def _number(value, where: str, fix: str, low: float | None = None, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise WorkbenchError(f"{where} is {value!r}", fix)
    if low is not None and not value > low:
        raise WorkbenchError(f"{where} is {value!r}: it must be above {low:g}", fix)
    return value


def _choice(value, choices, where: str):
    if value not in choices:
        raise WorkbenchError(f"{where} is {value!r}", f"use one of: {', '.join(choices)}")
    return value


def _learned(name: str, value: dict) -> RewardSpec:
    """A `kind: model | judge` entry as a spec, every key checked (one error with its fix)."""
    where = f"rewards.{name}"
    kind = value.get("kind")
    if kind not in KINDS:
        raise WorkbenchError(f"{where}.kind is {kind!r}", f"use one of: {', '.join(KINDS)}")
    unknown = sorted(set(value) - set(LEARNED_KEYS[kind]))
    if unknown:
        raise WorkbenchError(f"{where} has unknown key(s) {unknown} for kind {kind}",
                             f"use only {', '.join(LEARNED_KEYS[kind])}")
    model = value.get("model")
    if not isinstance(model, str) or not model:
        hint = (f"`model: {TINY_RM}` (built by `workbench reward-model`), a model directory or a hub id"
                if kind == "model" else f"`model: {POLICY_BASE}` (a LoRA run's frozen base) or a chat model")
        raise WorkbenchError(f"{where}.model is not set", f"name the {kind}: {hint}")
    if kind == "model" and model == POLICY_BASE:
        raise WorkbenchError(f"{where}: {POLICY_BASE} is a judge's model (the policy's base asked to grade)",
                             "a reward model is a sequence-classification checkpoint: name its directory or hub id")
    weight = value.get("weight", 1.0)
    _number(weight, f"{where}.weight", "set a number, e.g. weight: 0.5")
    if not math.isfinite(weight):
        raise WorkbenchError(f"{where} has weight {weight}", "set a finite weight")
    raw_engine = value.get("engine") or {}
    if not isinstance(raw_engine, dict):
        raise WorkbenchError(f"{where}.engine is {raw_engine!r}", "give a mapping, e.g. {port: 8010}")
    bad = sorted(set(raw_engine) - set(ENGINE_KEYS))
    if bad:
        raise WorkbenchError(f"{where}.engine has unknown key(s) {bad}", f"use only {', '.join(ENGINE_KEYS)}")
    types = {"mode": str, "url": str, "api_key_env": str, "served_model_name": str, "dtype": str, "env": dict,
             "port": int, "kv_cache_space_gib": int, "max_model_len": int, "max_restarts": int,
             "startup_timeout_s": (int, float), "gpu_memory_utilization": (int, float)}
    for key, given in raw_engine.items():
        if given is not None and (isinstance(given, bool) or not isinstance(given, types[key])):
            raise WorkbenchError(f"{where}.engine.{key} is {given!r} ({type(given).__name__})",
                                 f"give {where}.engine.{key} a value of type "
                                 f"{' or '.join(t.__name__ for t in (types[key] if isinstance(types[key], tuple) else (types[key],)))}")
    engine = EngineSpec(**raw_engine)
    _choice(engine.mode, ("managed", "attach"), f"{where}.engine.mode")
    if engine.mode == "attach" and not engine.url:
        raise WorkbenchError(f"{where}.engine.mode is attach without a url",
                             f"set {where}.engine.url (e.g. http://10.0.0.5:8010) and its served_model_name")
    if engine.gpu_memory_utilization is not None:
        _number(engine.gpu_memory_utilization, f"{where}.engine.gpu_memory_utilization",
                "give this engine's share of a card, e.g. 0.3", low=0.0)
        if engine.gpu_memory_utilization >= 1.0:
            raise WorkbenchError(f"{where}.engine.gpu_memory_utilization is {engine.gpu_memory_utilization}",
                                 "give a share below 1: the policy server holds the rest of the card")
    if engine.port is not None:
        _number(engine.port, f"{where}.engine.port", "give a port number, e.g. 8010", low=0, integer=True)
    if kind == "judge" and model == POLICY_BASE and raw_engine:
        raise WorkbenchError(f"{where}: a {POLICY_BASE} judge runs on the policy server and has no engine of its own",
                             f"drop {where}.engine, or name a judge model of its own")
    spec = LearnedReward(name=name, kind=kind, model=model, engine=engine)
    spec.timeout_s = float(_number(value.get("timeout_s", spec.timeout_s), f"{where}.timeout_s",
                                   "give seconds, e.g. timeout_s: 30", low=0.0))
    if not math.isfinite(spec.timeout_s):
        raise WorkbenchError(f"{where}.timeout_s is {spec.timeout_s}", "give a bound in seconds, e.g. timeout_s: 60")
    spec.concurrency = _number(value.get("concurrency", spec.concurrency), f"{where}.concurrency",
                               "give a count, e.g. concurrency: 16", low=0, integer=True)
    spec.on_failure = _choice(value.get("on_failure", spec.on_failure), FAILURE_POLICIES, f"{where}.on_failure")
    spec.max_failures = _number(value.get("max_failures", spec.max_failures), f"{where}.max_failures",
                                "give a count, e.g. max_failures: 50", low=-1, integer=True)
    if kind == "model":
        if "score" not in value:
            raise WorkbenchError(f"{where}.score is not set: vLLM hands back the head's sigmoid unless asked for the "
                                 "logit, and the two train differently", "say which: score: logit, or "
                                 "score: probability")
        spec.score = _choice(value["score"], SCORES, f"{where}.score")
        spec.normalize = _choice(value.get("normalize", "none"), NORMALIZE, f"{where}.normalize")
    else:
        template = value.get("template")
        if not isinstance(template, str) or "{completion}" not in template:
            raise WorkbenchError(f"{where}.template must be a prompt that contains {{completion}}",
                                 "e.g. template: \"Question: {question}\\nAnswer: {completion}\\nScore 0-10:\"")
        spec.template = template
        try:
            spec.template_fields()
            template.format(**{f: "" for f in spec.template_fields()})
        except (ValueError, IndexError, KeyError) as exc:
            raise WorkbenchError(f"{where}.template does not format ({exc})",
                                 "name fields as {question}; write a literal brace as {{ or }}") from None
        parser = value.get("parser", "number")
        if not isinstance(parser, str) or (parser not in PARSERS and not parser.startswith("regex:")):
            raise WorkbenchError(f"{where}.parser is {parser!r}", "use number, yes_no, or regex:<pattern with one "
                                 "group that captures the number>")
        spec.parser = parser
        try:
            spec.pattern
        except re.error as exc:
            raise WorkbenchError(f"{where}.parser's pattern does not compile ({exc})",
                                 "give a regular expression with one group, e.g. regex:Score: (\\d+)") from None
        if spec.pattern is not None and spec.pattern.groups != 1:
            raise WorkbenchError(f"{where}.parser's pattern has {spec.pattern.groups} groups",
                                 "give it exactly one group, the number: regex:Score: (\\d+)")
        scale = value.get("scale")
        if scale is not None:
            if (not isinstance(scale, (list, tuple)) or len(scale) != 2
                    or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in scale)
                    or not scale[1] > scale[0]):
                raise WorkbenchError(f"{where}.scale is {scale!r}", "give the low and high score, e.g. scale: [0, 10]")
            spec.scale = (float(scale[0]), float(scale[1]))
        spec.max_tokens = _number(value.get("max_tokens", spec.max_tokens), f"{where}.max_tokens",
                                  "give a token count, e.g. max_tokens: 16", low=0, integer=True)
    return RewardSpec(name, float(weight), f"{kind}:{model}", kind=kind, learned=spec)
