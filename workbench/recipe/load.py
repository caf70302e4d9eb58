"""Reading a recipe: YAML (with `extends:`), dotted overrides, every key and type checked, one clear error line.

    from workbench import recipe
    r = recipe.load("cpu-tiny", ["trainer.learning_rate=5e-6", "server.port=8011"])
    python -m workbench.recipe.load smoke          # print it resolved

Recipes ship in workbench/recipe/recipes/; one may `extends:` another and override only what differs. Overrides use
dotted keys and YAML values, on the command line and as papermill parameters alike. Unknown keys, wrong types and
lengths that cannot fit get one line naming the cause and the fix before anything starts. Nothing here imports
TRL, torch or vLLM: the trainer keys are checked against GRPOConfig's fields read from TRL's source.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from workbench.errors import WorkbenchError
from workbench.recipe import trl_fields
from workbench.recipe.schema import ANALYSIS_COLUMNS, DERIVED_PEFT_KEYS, SECTIONS, VLLM_LORA_RANKS, Recipe
from workbench.tasks import rewardspec, task
from workbench.tasks.arithmetic import CATEGORIES
from workbench.tasks.dataset import FIELD_KEYS, KNOWN

RECIPES_DIR = Path(__file__).parent / "recipes"


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. PyYAML's 1.1 rules read `save_strategy: no` as False."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


# ----------------------------------------------------------------------------------------------------------------
# Loading

def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _read_yaml(source: str, chain: tuple[Path, ...] = ()) -> tuple[dict, str]:
    path = Path(source)
    if path.suffix not in (".yaml", ".yml"):
        if chain and (chain[-1].parent / f"{source}.yaml").is_file():  # a sibling of the recipe that extends it
            path = chain[-1].parent / f"{source}.yaml"
        else:
            path = RECIPES_DIR / f"{source}.yaml"
    elif chain and not path.is_absolute() and (chain[-1].parent / path).is_file():
        path = chain[-1].parent / path
    if not path.is_file():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise WorkbenchError(f"recipe {source!r} does not exist{where}",
                             f"use one of: {', '.join(available())}, or the path of a YAML file")
    if path.resolve() in [p.resolve() for p in chain]:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise WorkbenchError(f"recipe `extends:` forms a cycle: {cycle}", "make one of them extend nothing")
    try:
        raw = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise WorkbenchError(f"recipe {path} is not valid YAML ({exc.__class__.__name__}: {exc})".replace("\n", " "),
                             "fix the YAML syntax at the line named") from None
    if not isinstance(raw, dict):
        raise WorkbenchError(f"recipe {path} holds a {type(raw).__name__}, not a mapping of sections",
                             f"write it as sections: {', '.join(SECTIONS)}")
    base = raw.pop("extends", None)
    if base is not None and not isinstance(base, str):
        raise WorkbenchError(f"recipe {path}: extends is {base!r}", "name one recipe (or YAML path) to extend")
    if base:
        parent, _ = _read_yaml(base, (*chain, path))
        parent.pop("description", None)
        parent.pop("name", None)
        raw = _merge(parent, raw)
    raw.setdefault("name", path.stem)
    return raw, str(path)


def _merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ("rewards",):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'trainer.learning_rate=5e-6' -> (['trainer', 'learning_rate'], 5e-06)."""
    if "=" not in text:
        raise WorkbenchError(f"override {text!r} has no '='", "write overrides as section.key=value, e.g. trainer.learning_rate=5e-6")
    key, _, value = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise WorkbenchError(f"override {text!r} names no key", "write overrides as section.key=value")
    try:
        parsed = yaml_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    # YAML reads '5e-6' as a string (no dot in the mantissa); users mean a number.
    if isinstance(parsed, str):
        with contextlib.suppress(ValueError):
            parsed = float(parsed) if any(c in parsed for c in ".eE") else int(parsed)
    return parts, parsed


def apply_overrides(raw: dict, overrides: typing.Iterable[str] | dict | None) -> dict:
    raw = copy.deepcopy(raw)
    if isinstance(overrides, dict):
        items = [(k.split("."), v) for k, v in overrides.items()]
    else:
        items = [parse_override(o) for o in (overrides or [])]
    for parts, value in items:
        node = raw
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return raw


class RecipeProblems(WorkbenchError):
    """Every problem found in a recipe at once: each names its key, the cause and the fix."""

    def __init__(self, problems: list[WorkbenchError], name: str = "") -> None:
        self.problems = problems
        if len(problems) == 1:
            only = problems[0]
            super().__init__(only.cause, only.fix)
        else:
            where = f" in recipe {name!r}" if name else ""
            super().__init__(f"{len(problems)} problems{where}:\n" + "\n".join(f"  - {p}" for p in problems))


def load(source: str | Recipe = "cpu-tiny", overrides: typing.Iterable[str] | dict | None = None) -> Recipe:
    """Read a recipe by name or path, apply overrides, check every key and value, and return it.

    All problems are found in one pass and raised together (RecipeProblems), before anything starts."""
    if isinstance(source, Recipe):
        raw = source.to_dict()
    else:
        raw, _ = _read_yaml(source)
    raw = apply_overrides(raw, overrides)
    problems: list[WorkbenchError] = []
    recipe = _build(Recipe, raw, "", problems)
    problems += check(recipe, raise_first=False)
    if problems:
        raise RecipeProblems(problems, recipe.name)
    return recipe


# ----------------------------------------------------------------------------------------------------------------
# Checking

def _closest(key: str, valid: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"did you mean {match[0]!r}?" if match else f"valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str, problems: list | None = None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, problems)
            except WorkbenchError as exc:
                errors.append(exc)
        raise errors[0]
    if tp is Any:
        return value
    if origin is typing.Literal:  # a knob with fixed choices (schema.py): one of them, of the same type
        allowed = typing.get_args(tp)
        if any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise WorkbenchError(f"{where} is {value!r}", f"use one of: {', '.join(map(str, allowed))}")
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(where, value, tp)
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(where, value, tp)
        _, item = typing.get_args(tp)
        return {str(k): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _type_error(where, value, tp)
        return _build(tp, value, where, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(where, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(where, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(where, value, tp)
    if tp is str:
        # Environment values are strings to the OS; let '1800' and 1800 both through there.
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and ".env." in f".{where}":
            return str(value)
        raise _type_error(where, value, tp)
    return value


def _type_error(where: str, value: Any, tp: Any) -> WorkbenchError:
    return WorkbenchError(f"{where} is {value!r} ({type(value).__name__}), expected {_type_name(tp)}",
                          f"set {where} to a value of type {_type_name(tp)}")


def _build(cls: type, raw: dict, prefix: str, problems: list | None = None) -> Any:
    """The dataclass from its raw mapping. With `problems`, a bad key is noted there and left at its default, so
    that one pass finds every problem; without, the first one raises."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        try:
            if key not in names:
                what = f"unknown recipe section {key!r}" if not prefix else f"unknown recipe key {where!r}"
                raise WorkbenchError(what, _closest(str(key), names))
            kwargs[key] = _coerce(value, hints[key], where, problems)
        except WorkbenchError as exc:
            if problems is None:
                raise
            problems.append(exc)
    return cls(**kwargs)


# Trainer arguments the workbench derives from other sections: setting them in `trainer:` too would put one knob
# in two places, so it is an error that says where the knob lives.
DERIVED_TRAINER_KEYS = {
    "use_vllm": "server.mode",
    "vllm_mode": "server.mode",
    "vllm_server_base_url": "server.url / server.host / server.port",
    "vllm_server_host": "server.host",
    "vllm_server_port": "server.port",
    "vllm_server_timeout": "server.startup_timeout_s",
    "vllm_tensor_parallel_size": "server.tensor_parallel_size",
    "vllm_gpu_memory_utilization": "server.gpu_memory_utilization",
    "vllm_max_model_length": "server.max_model_len",
    "reward_weights": "rewards",
    "use_cpu": "devices.platform",
    "output_dir": "monitor.runs_dir (each run gets its own directory)",
}


def _at_least(where: str, value: Any, low: float, fix: str | None = None, strict: bool = False) -> WorkbenchError | None:
    if value is None or (value > low if strict else value >= low):
        return None
    bound = f"above {low:g}" if strict else f"at least {low:g}"
    return WorkbenchError(f"{where} is {value!r}", fix or f"set {where} to a value {bound}")


def _ranges(recipe: Recipe) -> list[WorkbenchError]:
    """Ranges of the numeric knobs: what no server, trainer or evaluation could use."""
    s, d, e, m, t = recipe.server, recipe.data, recipe.eval, recipe.monitor, recipe.model.tiny
    out = [
        _at_least("server.max_model_len", s.max_model_len, 1),
        _at_least("server.tensor_parallel_size", s.tensor_parallel_size, 1),
        _at_least("server.data_parallel_size", s.data_parallel_size, 1),
        _at_least("server.max_num_seqs", s.max_num_seqs, 1, "set server.max_num_seqs to 1 or more, or null"),
        _at_least("server.max_num_batched_tokens", s.max_num_batched_tokens, 1,
                  "set server.max_num_batched_tokens to 1 or more, or null"),
        _at_least("server.kv_cache_space_gib", s.kv_cache_space_gib, 1),
        _at_least("server.startup_timeout_s", s.startup_timeout_s, 0, strict=True),
        _at_least("server.request_timeout_s", s.request_timeout_s, 0, strict=True),
        _at_least("server.keep_alive_s", s.keep_alive_s, 0, strict=True),
        _at_least("server.max_restarts", s.max_restarts, 0),
        _at_least("data.max_prompt_length", d.max_prompt_length, 1),
        _at_least("data.heldout_size", d.heldout_size, 0),
        _at_least("data.validation_size", d.validation_size, 0,
                  "set data.validation_size to the problems kept for choosing settings, or 0 for none"),
        _at_least("data.train_size", d.train_size, 1, "set data.train_size to 1 or more, or null for every row"),
        _at_least("eval.num_samples", e.num_samples, 1),
        _at_least("eval.repeats", e.repeats, 1, "set eval.repeats to 1 or more (each problem is sampled that often)"),
        _at_least("eval.concurrency", e.concurrency, 1, "set eval.concurrency to 1 or more requests in flight"),
        _at_least("eval.max_tokens", e.max_tokens, 1, "set eval.max_tokens to 1 or more (the answer's token budget)"),
        _at_least("eval.retries", e.retries, 0),
        _at_least("eval.temperature", e.temperature, 0),
        _at_least("eval.every_steps", e.every_steps, 0, "set eval.every_steps to N optimizer steps, or 0 for no curve"),
        _at_least("eval.during_samples", e.during_samples, 1,
                  "set eval.during_samples to the problems scored at each point of the curve"),
        _at_least("monitor.sample_interval_s", m.sample_interval_s, 0, strict=True),
        _at_least("monitor.completions_shown", m.completions_shown, 0),
        _at_least("monitor.canary_every", m.canary_every, 0, "set monitor.canary_every to N steps, or 0 to turn it off"),
        _at_least("monitor.drift_every", m.drift_every, 0, "set monitor.drift_every to N steps, or 0 to turn it off"),
        _at_least("monitor.groups_per_step", m.groups_per_step, 0,
                  "set monitor.groups_per_step to the groups kept per step, or 0 to record none"),
        _at_least("monitor.canary_warn_gap", m.canary_warn_gap, 0, strict=True),
        _at_least("monitor.canary_stop_gap", m.canary_stop_gap, 0, strict=True),
        _at_least("distributed.device_memory_gib", recipe.distributed.device_memory_gib, 0, strict=True),
    ]
    for where, value in (("model.tiny.vocab_size", t.vocab_size), ("model.tiny.hidden_size", t.hidden_size),
                         ("model.tiny.num_layers", t.num_layers), ("model.tiny.num_heads", t.num_heads),
                         ("model.tiny.num_kv_heads", t.num_kv_heads), ("model.tiny.batch_size", t.batch_size),
                         ):
        out.append(_at_least(where, value, 1))
    # 0 pre-training steps: a random-weight model of the same architecture (the benchmark's larger size)
    out.append(_at_least("model.tiny.pretrain_steps", t.pretrain_steps, 0))
    out.append(_at_least("model.tiny.eval_size", t.eval_size, 0))
    out.append(_at_least("model.tiny.learning_rate", t.learning_rate, 0, strict=True))
    if t.num_heads >= 1 and t.hidden_size % t.num_heads:
        out.append(WorkbenchError(f"model.tiny.hidden_size={t.hidden_size} is not divisible by num_heads={t.num_heads}",
                                  "choose sizes where hidden_size is a multiple of num_heads"))
    if t.num_kv_heads >= 1 and t.num_heads % t.num_kv_heads:
        out.append(WorkbenchError(f"model.tiny.num_heads={t.num_heads} is not divisible by num_kv_heads="
                                  f"{t.num_kv_heads}", "choose num_kv_heads dividing num_heads"))
    if not 0 < e.top_p <= 1:
        out.append(WorkbenchError(f"eval.top_p is {e.top_p!r}", "set eval.top_p above 0 and at most 1"))
    if not 0 < s.gpu_memory_utilization <= 1:
        out.append(WorkbenchError(f"server.gpu_memory_utilization is {s.gpu_memory_utilization!r}",
                                  "set it to a fraction above 0 and at most 1, e.g. 0.85"))
    for where, port in (("server.port", s.port), ("distributed.main_port", recipe.distributed.main_port)):
        if not 1 <= port <= 65535:
            out.append(WorkbenchError(f"{where} is {port}", f"set {where} to a port between 1 and 65535"))
    if m.canary_warn_gap and m.canary_stop_gap and m.canary_warn_gap >= m.canary_stop_gap:
        out.append(WorkbenchError(f"monitor.canary_warn_gap={m.canary_warn_gap} is not below canary_stop_gap="
                                  f"{m.canary_stop_gap}", "warn below the gap that stops the run"))
    for role in ("server", "trainer"):
        ids = getattr(recipe.devices, role)
        where = f"devices.{role}"
        if not ids and (role == "trainer" or s.managed):
            out.append(WorkbenchError(f"{where} is empty", f"list the device ids (CPU: cores) the {role} uses"))
        if any(i < 0 for i in ids):
            out.append(WorkbenchError(f"{where} lists negative ids {[i for i in ids if i < 0]}",
                                      "device ids (CPU: core numbers) count from 0"))
        if len(set(ids)) != len(ids):
            out.append(WorkbenchError(f"{where} repeats ids {sorted({i for i in ids if ids.count(i) > 1})}",
                                      "list each device once"))
    return [p for p in out if p is not None]


# peft options an adapter sync cannot use: vLLM's LoRA loader refuses them, or they change the base weights the
# server keeps (PiSSA, OLoRA, CorDA, LoftQ initialise from and modify the base)
UNSERVABLE_PEFT = {
    "use_dora": "vLLM does not serve DoRA adapters",
    "lora_bias": "vLLM does not serve adapter biases",
    "bias": "vLLM does not serve trained biases (bias must be 'none')",
    "modules_to_save": "vLLM serves no fully trained modules beside an adapter",
    "layer_replication": "vLLM does not serve layer replication",
    "use_qalora": "vLLM does not serve QALoRA",
    "alora_invocation_tokens": "vLLM does not serve activated LoRA",
    "target_parameters": "vLLM serves adapters on modules, not on parameters",
    "trainable_token_indices": "vLLM serves no trained token embeddings beside an adapter",
    "init_lora_weights": "this initialisation changes the base weights, which the server keeps as they were",
}


def _peft(recipe: Recipe) -> list[WorkbenchError]:
    """The peft: section against peft.LoraConfig (read from peft's source), and what an adapter sync needs."""
    out, s = [], recipe.server
    if s.weight_sync == "lora" and not recipe.lora:
        out.append(WorkbenchError("server.weight_sync is 'lora' but the recipe has no peft: section",
                                  "add peft: {r: 16, lora_alpha: 32, target_modules: all-linear}, or choose another "
                                  "server.weight_sync"))
    if not recipe.lora:
        return out
    known = trl_fields.lora_names()
    for key, value in recipe.peft.items():
        if key in DERIVED_PEFT_KEYS:
            out.append(WorkbenchError(f"peft.{key} is set by the workbench", f"drop peft.{key}"))
        elif key not in known:
            out.append(WorkbenchError(f"unknown recipe key 'peft.{key}' (not a peft.LoraConfig argument)",
                                      _closest(key, known)))
        elif (why := trl_fields.lora_type_problem(key, value)) is not None:
            out.append(WorkbenchError(f"peft.{key} {why}", f"give peft.{key} a value of that type"))
    if out:
        return out
    rank = recipe.lora_rank
    if rank < 1:
        out.append(WorkbenchError(f"peft.r is {rank}", "set peft.r to 1 or more, e.g. 16"))
    adapter_sync = s.weight_sync in ("auto", "lora") and s.uses_vllm
    if adapter_sync:  # what vLLM's LoRA loader refuses (vllm/lora/peft_helper.py _validate_features), or a base it
        for key, why in UNSERVABLE_PEFT.items():  # would not have: refused here, not at the first push
            value = recipe.peft.get(key)
            if key == "init_lora_weights":
                # the inits vLLM serves (peft_helper._init_is_supported): they set the adapter only, not the base
                bad = isinstance(value, str) and value.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
            elif key == "bias":
                bad = value != "none"
            else:
                bad = value not in (None, False, [], {})
            if key in recipe.peft and bad:
                out.append(WorkbenchError(f"peft.{key}={value!r}: {why}",
                                          f"drop peft.{key}, or push the merged model instead "
                                          "(server.weight_sync reload/nccl/hccl)"))
    if adapter_sync and s.max_lora_rank is not None and s.max_lora_rank not in VLLM_LORA_RANKS:
        out.append(WorkbenchError(f"server.max_lora_rank is {s.max_lora_rank}, which vLLM does not accept",
                                  f"use one of {list(VLLM_LORA_RANKS)}, or null for the smallest that holds peft.r"))
    elif adapter_sync and rank > recipe.served_lora_rank:
        out.append(WorkbenchError(f"peft.r={rank} is above the server's LoRA rank limit (server.max_lora_rank="
                                  f"{recipe.served_lora_rank}): vLLM refuses the adapter at its first push",
                                  f"set server.max_lora_rank to {next((r for r in VLLM_LORA_RANKS if r >= rank), 512)}"
                                  " or more (or null), or lower peft.r"))
    if adapter_sync and s.lora_slots < 2:
        out.append(WorkbenchError(f"server.lora_slots is {s.lora_slots}",
                                  "a run holds two adapters while it swaps versions: set server.lora_slots to 2 or more"))
    dist = recipe.distributed
    if adapter_sync and (dist.strategy == "fsdp" or (dist.strategy == "deepspeed" and dist.zero_stage == 3)):
        out.append(WorkbenchError(f"peft: with distributed.strategy={dist.strategy}"
                                  f"{' zero_stage=3' if dist.strategy == 'deepspeed' else ''}: the adapter sync saves "
                                  "the adapter from the main rank, which holds only a shard of it",
                                  "use distributed.strategy ddp or deepspeed with zero_stage 1 or 2 (the adapter is "
                                  "small), or server.weight_sync reload/nccl/hccl to push the merged weights"))
    out.append(_at_least("server.lora_stale_s", s.lora_stale_s, 0, strict=True))
    return [p for p in out if p is not None]


def _rollout(recipe: Recipe) -> list[WorkbenchError]:
    """What an overlapped (async) rollout needs: a server to overlap with, one generation per optimizer step, and
    TRL's importance-sampling correction for the step-old samples. Dynamic sampling: room for at least one refill."""
    out, t = [], recipe.trainer
    if recipe.rollout.dynamic_sampling:
        out.append(_at_least("rollout.refill_cap", recipe.rollout.refill_cap, 0, strict=True))
        out = [p for p in out if p is not None]
    if not recipe.rollout.overlapped:
        return out
    if not recipe.server.over_http:
        out.append(WorkbenchError(f"rollout.mode is 'async' but server.mode is {recipe.server.mode!r}",
                                  "async rollouts overlap a vLLM server with training: set server.mode to managed "
                                  "or attach, or rollout.mode to sync"))
    if t.get("num_iterations", 1) != 1:
        out.append(WorkbenchError(f"rollout.mode is 'async' with trainer.num_iterations={t['num_iterations']}",
                                  "async rollouts generate one batch per optimizer step: set num_iterations to 1"))
    spg, ga = t.get("steps_per_generation"), t.get("gradient_accumulation_steps", 1)
    if spg is not None and spg != ga:
        out.append(WorkbenchError(f"rollout.mode is 'async' with trainer.steps_per_generation={spg} but "
                                  f"gradient_accumulation_steps={ga}",
                                  "async rollouts generate one batch per optimizer step: drop steps_per_generation "
                                  "or make it equal to gradient_accumulation_steps"))
    if t.get("vllm_importance_sampling_correction") is False:
        out.append(WorkbenchError("rollout.mode is 'async' but trainer.vllm_importance_sampling_correction is false",
                                  "async batches were sampled by the previous step's weights: set "
                                  "trainer.vllm_importance_sampling_correction to true (TRL's default)"))
    return out


def _data(recipe: Recipe) -> list[WorkbenchError]:
    """The data section names a dataset that exists, each split's source readable and none the training rows
    again (workbench/tasks/task.py), with known field names."""
    d, out = recipe.data, []
    if d.name not in KNOWN:
        return [WorkbenchError(f"data.name is {d.name!r}, not a known dataset", f"use one of: {', '.join(KNOWN)}")]
    if d.name == "arithmetic" and d.path:
        out.append(WorkbenchError("data.path is set but dataset 'arithmetic' is generated and reads no file",
                                  "drop data.path, or set data.name=file to train on the file"))
    elif d.name == "file" and not d.path and d.train is None:
        out.append(WorkbenchError("data.name is 'file' but data.path is not set",
                                  "set data.train (or data.path) to a local .jsonl, .json or .parquet file"))
    else:
        out += task.source_problems(d)
    if d.fields:
        unknown = sorted(set(d.fields) - set(FIELD_KEYS))
        if unknown:
            out.append(WorkbenchError(f"data.fields has unknown keys {unknown}",
                                      f"map only {', '.join(FIELD_KEYS)} to the file's columns"))
    if d.split != "train":
        out.append(WorkbenchError(f"data.split is {d.split!r}: GRPO trains on the train split, whose source is "
                                  "data.train (validation and test are kept out of training)",
                                  "set data.split=train, and name the rows to train on in data.train"))
    for where, split in (("eval.split", recipe.eval.split), ("eval.during_split", recipe.eval.during_split)):
        if task.split_name(split) not in ("validation", "test"):
            out.append(WorkbenchError(f"{where} is {split!r}, not a split kept out of training",
                                      f"use validation (for choosing settings) or test (to report; also 'heldout')"))
    if recipe.eval.split == "validation" and d.validation_size == 0 and d.validation is None:
        out.append(WorkbenchError("eval.split is validation but data.validation_size is 0",
                                  "set data.validation_size to the rows to keep for choosing settings"))
    out += _during(recipe)
    return out


def _during(recipe: Recipe) -> list[WorkbenchError]:
    """The learning curve (eval.every_steps) scores the server's weights on a split that is not trained on; keeping
    the best step is choosing a model, which the test split must not do."""
    e, d, out = recipe.eval, recipe.data, []
    if e.every_steps <= 0:
        if e.keep_best:
            out.append(WorkbenchError("eval.keep_best is on but eval.every_steps is 0: no step is scored",
                                      "set eval.every_steps to N, or drop eval.keep_best"))
        return out
    if e.during_split == d.split:
        out.append(WorkbenchError(f"eval.during_split is {e.during_split!r}, the split GRPO trains on",
                                  "score the curve on validation (data.validation_size problems kept out of training)"))
    elif e.during_split == "validation" and d.validation is None and d.validation_size == 0:
        out.append(WorkbenchError("eval.during_split is validation but data.validation_size is 0",
                                  "set data.validation_size to the problems to keep for choosing settings"))
    if e.keep_best and task.split_name(e.during_split) == "test":
        out.append(WorkbenchError("eval.keep_best chooses the step by its score on 'heldout', the test split: a result "
                                  "reported for that model would be its best luck", "set eval.during_split=validation"))
    dist = recipe.distributed
    if e.keep_best and (dist.strategy == "fsdp" or (dist.strategy == "deepspeed" and dist.zero_stage == 3)):
        out.append(WorkbenchError(f"eval.keep_best with distributed.strategy={dist.strategy}"
                                  f"{' zero_stage=3' if dist.strategy == 'deepspeed' else ''}: the main rank saves the "
                                  "best step alone and would hold a shard", "use ddp or deepspeed zero_stage 1 or 2, "
                                  "or drop eval.keep_best (checkpoints keep every trainer.save_steps)"))
    if recipe.server.colocated or recipe.server.mode == "off":
        out.append(WorkbenchError(f"eval.every_steps with server.mode={recipe.server.mode}: the curve scores a "
                                  "server's weights", "use server.mode managed or attach, or set eval.every_steps=0"))
    return out


def _breakdown(recipe: Recipe) -> list[WorkbenchError]:
    """eval.breakdown names each field once; for the arithmetic task, its categories. A dataset's fields are
    columns of its records, checked when the analysis reads them (workbench/evaluation/analysis.py), and may not
    be named like the columns the analysis computes itself (schema.ANALYSIS_COLUMNS)."""
    fields, out = recipe.eval.breakdown, []
    repeated = sorted({f for f in fields if fields.count(f) > 1})
    if repeated:
        out.append(WorkbenchError(f"eval.breakdown repeats {repeated}", "name each field once"))
    if any(not f.strip() for f in fields):
        out.append(WorkbenchError("eval.breakdown has an empty name",
                                  "name fields of the eval rows, or leave it empty"))
    unknown = [f for f in fields if f not in CATEGORIES]
    if recipe.data.name == "arithmetic" and unknown:
        out.append(WorkbenchError(f"eval.breakdown names {unknown}, not categories of the arithmetic task",
                                  f"use some of: {', '.join(CATEGORIES)} (or leave it empty for all three)"))
    reserved = [f for f in fields if f in ANALYSIS_COLUMNS]
    if recipe.data.name != "arithmetic" and reserved:
        out.append(WorkbenchError(f"eval.breakdown names {reserved}, which the analysis computes itself",
                                  "response length is always broken down; name other fields of the records"))
    return out


def _learned_rewards(recipe: Recipe) -> list[WorkbenchError]:
    """Reward models and judges against the rest of the recipe: where they can run, their ports, their memory."""
    try:
        learned = [s.learned for s in rewardspec.parse(recipe.rewards) if s.is_learned]
    except WorkbenchError:  # reported by rewardspec.problems
        return []
    problems: list[WorkbenchError] = []
    if recipe.server.runner != "generate":
        problems.append(WorkbenchError(f"server.runner is {recipe.server.runner!r}: the policy server generates",
                                       "drop server.runner; a reward model is a rewards: entry of kind model"))
    if learned and not recipe.server.over_http:
        problems.append(WorkbenchError(f"rewards.{learned[0].name} is a {learned[0].kind} reward, scored on the "
                                       f"inference service, but server.mode is {recipe.server.mode}",
                                       "use server.mode managed or attach"))
    ports = {recipe.server.port: "server.port"}
    for i, spec in enumerate(x for x in learned if not x.on_policy_server):
        e = spec.engine
        if not e.managed:
            continue
        if recipe.server.attached:
            problems.append(WorkbenchError(
                f"rewards.{spec.name}'s engine is managed, but the policy server is attached: a managed engine starts "
                "beside a managed policy server, on its devices",
                f"serve the reward model on the server node (vllm serve MODEL --runner pooling) and set "
                f"rewards.{spec.name}.engine.mode=attach with its url"))
            continue
        port = e.port if e.port is not None else recipe.server.port + 10 + i
        if port in ports:
            problems.append(WorkbenchError(f"rewards.{spec.name}'s engine would listen on port {port}, as "
                                           f"{ports[port]} does", f"give it another: rewards.{spec.name}.engine.port"))
        ports[port] = f"rewards.{spec.name}'s engine"
        if recipe.devices.platform in ("cuda", "npu") and e.gpu_memory_utilization is None:
            problems.append(WorkbenchError(
                f"rewards.{spec.name}'s engine has no engine.gpu_memory_utilization: it shares the server's cards "
                "with the policy", f"give its share, e.g. rewards.{spec.name}.engine.gpu_memory_utilization=0.3, "
                "and lower server.gpu_memory_utilization so that both fit (workbench plan shows the split)"))
    for spec in learned:
        if spec.on_policy_server and not (recipe.lora and recipe.server.weight_sync in ("auto", "lora")):
            problems.append(WorkbenchError(
                f"rewards.{spec.name}: a {rewardspec.POLICY_BASE} judge is the policy server's frozen base, which "
                "only a LoRA run keeps (a full fine-tuning pushes its weights into that model)",
                f"add a peft: section, or give rewards.{spec.name}.model a judge model of its own"))
    shares = [s.engine.gpu_memory_utilization for s in learned if not s.on_policy_server and s.engine.managed
              and s.engine.gpu_memory_utilization is not None]
    total = recipe.server.gpu_memory_utilization + sum(shares)
    if shares and recipe.server.managed and recipe.devices.platform in ("cuda", "npu") and total > 1.0:
        problems.append(WorkbenchError(
            f"the server cards' memory is over-committed: server.gpu_memory_utilization="
            f"{recipe.server.gpu_memory_utilization} plus the reward engines' {' + '.join(str(x) for x in shares)} "
            f"= {total:.2f} of each card", "lower server.gpu_memory_utilization or the engines' shares so the sum "
            "is at most 1 (less each process's own overhead: workbench plan)"))
    return problems


def check(recipe: Recipe, raise_first: bool = True) -> list[WorkbenchError]:
    """Cross-section and range checks. Returns every problem (raise_first=False) or raises the first one."""
    problems: list[WorkbenchError] = []
    grpo = trl_fields.names()
    for key, value in recipe.trainer.items():
        if key in DERIVED_TRAINER_KEYS:
            problems.append(WorkbenchError(f"trainer.{key} is derived by the workbench",
                                           f"set {DERIVED_TRAINER_KEYS[key]} instead and drop trainer.{key}"))
        elif key not in grpo:
            problems.append(WorkbenchError(f"unknown recipe key 'trainer.{key}' (not a trl.GRPOConfig argument)",
                                           _closest(key, grpo)))
        elif (why := trl_fields.type_problem(key, value)) is not None:
            problems.append(WorkbenchError(f"trainer.{key} {why}", f"give trainer.{key} a value of that type"))
    for key in ("max_completion_length", "num_generations", "per_device_train_batch_size", "max_steps",
                "gradient_accumulation_steps", "steps_per_generation", "save_steps", "logging_steps"):
        value = recipe.trainer.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            low = 2 if key == "num_generations" else (-1 if key == "max_steps" else 1)
            if value < low and not (key == "max_steps" and value == -1):
                problems.append(WorkbenchError(f"trainer.{key} is {value!r}",
                                               f"set trainer.{key} to {low} or more"))
    if isinstance(recipe.trainer.get("learning_rate"), (int, float)) and recipe.trainer["learning_rate"] <= 0:
        problems.append(WorkbenchError(f"trainer.learning_rate is {recipe.trainer['learning_rate']!r}",
                                       "set a positive learning rate, e.g. 1e-6"))
    # one seed in every request would draw the same noise at every step (workbench/training/seeding.py)
    if isinstance(recipe.trainer.get("generation_kwargs"), dict) and "seed" in recipe.trainer["generation_kwargs"]:
        problems.append(WorkbenchError("trainer.generation_kwargs.seed would sample every step with the same noise",
                                       "drop it: each prompt's sampling seed derives from trainer.seed and the step"))

    # each reward's function imported and checked (module:function, TRL's signature, its args) at load
    problems += rewardspec.problems(recipe.rewards)
    problems += _learned_rewards(recipe)
    dist = recipe.distributed
    if dist.processes is not None and dist.processes < 1:
        problems.append(WorkbenchError(f"distributed.processes is {dist.processes}",
                                       "use 1 or more, or null for one per device"))
    if dist.nodes < 1 or not 0 <= dist.node_rank < dist.nodes:
        problems.append(WorkbenchError(f"distributed.node_rank={dist.node_rank} with distributed.nodes={dist.nodes}",
                                       "node_rank counts from 0 to nodes - 1"))
    if recipe.server.attached and not recipe.server.url:
        problems.append(WorkbenchError("server.mode is 'attach' but server.url is not set",
                                       "set server.url to the running server, e.g. http://127.0.0.1:8000"))
    problems += _rollout(recipe)
    problems += _peft(recipe)
    problems += _ranges(recipe)
    problems += _data(recipe)
    problems += _breakdown(recipe)
    try:
        completion = recipe.max_completion_length
    except (TypeError, ValueError):  # already reported as a type problem above
        completion = None
    needed = recipe.data.max_prompt_length + completion if completion is not None else None
    if needed is not None and recipe.server.uses_vllm and recipe.server.max_model_len < needed:
        problems.append(WorkbenchError(
            f"server.max_model_len={recipe.server.max_model_len} is smaller than data.max_prompt_length "
            f"({recipe.data.max_prompt_length}) + trainer.max_completion_length ({completion}) = {needed}",
            f"set server.max_model_len to at least {needed} (the server would reject long requests with HTTP 400)"))
    platform = recipe.devices.platform
    # Server and trainer cards must differ only where both start on one node: checked by `workbench train`
    # (training.launch.placement_problems, in the preflight), not here, so the server node of a two-node recipe can
    # `workbench serve`.
    if recipe.server.managed and platform in ("cuda", "npu"):
        tp_dp = recipe.server.tensor_parallel_size * recipe.server.data_parallel_size
        if tp_dp != len(recipe.devices.server):
            problems.append(WorkbenchError(
                f"server.tensor_parallel_size × data_parallel_size = {tp_dp} but devices.server lists "
                f"{len(recipe.devices.server)} devices",
                "make the server's parallel sizes multiply to the number of server devices"))
    if raise_first and problems:
        raise problems[0]
    return problems


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    recipe = load(argv[0] if argv else "cpu-tiny", argv[1:])
    print(recipe.to_yaml())


if __name__ == "__main__":
    main()
