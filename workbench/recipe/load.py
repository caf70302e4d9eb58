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
from workbench.recipe.schema import SECTIONS, Recipe

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


def _read_yaml(source: str) -> tuple[dict, str]:
    path = Path(source)
    if path.suffix not in (".yaml", ".yml"):
        path = RECIPES_DIR / f"{source}.yaml"
    if not path.is_file():
        raise WorkbenchError(f"recipe {source!r} does not exist",
                             f"use one of: {', '.join(available())}, or the path of a YAML file")
    try:
        raw = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise WorkbenchError(f"recipe {path} is not valid YAML ({exc.__class__.__name__}: {exc})".replace("\n", " "),
                             "fix the YAML syntax at the line named") from None
    if not isinstance(raw, dict):
        raise WorkbenchError(f"recipe {path} holds a {type(raw).__name__}, not a mapping of sections",
                             f"write it as sections: {', '.join(SECTIONS)}")
    base = raw.pop("extends", None)
    if base:
        parent, _ = _read_yaml(str(base))
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


def load(source: str | Recipe = "cpu-tiny", overrides: typing.Iterable[str] | dict | None = None) -> Recipe:
    """Read a recipe by name or path, apply overrides, check every key and value, and return it."""
    if isinstance(source, Recipe):
        raw = source.to_dict()
    else:
        raw, _ = _read_yaml(source)
    raw = apply_overrides(raw, overrides)
    recipe = _build(Recipe, raw, "")
    check(recipe)
    return recipe


# ----------------------------------------------------------------------------------------------------------------
# Checking

def _closest(key: str, valid: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"did you mean {match[0]!r}?" if match else f"valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
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
                return _coerce(value, arg, where)
            except WorkbenchError as exc:
                errors.append(exc)
        raise errors[0]
    if tp is Any:
        return value
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
        return _build(tp, value, where)
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


def _build(cls: type, raw: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            what = f"unknown recipe section {key!r}" if not prefix else f"unknown recipe key {where!r}"
            raise WorkbenchError(what, _closest(str(key), names))
        kwargs[key] = _coerce(value, hints[key], where)
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
    "seed": "data.seed",
}


def check(recipe: Recipe) -> None:
    """Cross-section checks; each failure is one WorkbenchError line."""
    grpo = trl_fields.names()
    for key in recipe.trainer:
        if key in DERIVED_TRAINER_KEYS:
            raise WorkbenchError(f"trainer.{key} is derived by the workbench",
                                 f"set {DERIVED_TRAINER_KEYS[key]} instead and drop trainer.{key}")
        if key not in grpo:
            raise WorkbenchError(f"unknown recipe key 'trainer.{key}' (not a trl.GRPOConfig argument)",
                                 _closest(key, grpo))
    from workbench.tasks import rewards

    for name, weight in recipe.rewards.items():
        rewards.get(name)
    choices = {
        "server.mode": (recipe.server.mode, ("managed", "attach", "off")),
        "server.weight_sync": (recipe.server.weight_sync, ("auto", "nccl", "hccl", "reload", "none")),
        "devices.platform": (recipe.devices.platform, ("auto", "cpu", "cuda", "npu")),
        "eval.endpoint": (recipe.eval.endpoint, ("chat", "completions")),
        "model.dtype": (recipe.model.dtype, ("auto", "float32", "bfloat16", "float16")),
        "distributed.strategy": (recipe.distributed.strategy, ("ddp", "deepspeed", "fsdp")),
        "distributed.mixed_precision": (recipe.distributed.mixed_precision, ("auto", "no", "bf16", "fp16")),
        "distributed.zero_stage": (recipe.distributed.zero_stage, (1, 2, 3)),
    }
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise WorkbenchError(f"{where} is {value!r}", f"use one of: {', '.join(allowed)}")
    dist = recipe.distributed
    if dist.processes is not None and dist.processes < 1:
        raise WorkbenchError(f"distributed.processes is {dist.processes}", "use 1 or more, or null for one per device")
    if dist.nodes < 1 or not 0 <= dist.node_rank < dist.nodes:
        raise WorkbenchError(f"distributed.node_rank={dist.node_rank} with distributed.nodes={dist.nodes}",
                             "node_rank counts from 0 to nodes - 1")
    if recipe.server.mode == "attach" and not recipe.server.url:
        raise WorkbenchError("server.mode is 'attach' but server.url is not set",
                             "set server.url to the running server, e.g. http://127.0.0.1:8000")
    needed = recipe.data.max_prompt_length + recipe.max_completion_length
    if recipe.server.mode != "off" and recipe.server.max_model_len < needed:
        raise WorkbenchError(
            f"server.max_model_len={recipe.server.max_model_len} is smaller than data.max_prompt_length "
            f"({recipe.data.max_prompt_length}) + trainer.max_completion_length ({recipe.max_completion_length}) = {needed}",
            f"set server.max_model_len to at least {needed} (the server would reject long requests with HTTP 400)")
    platform = recipe.devices.platform
    # Server and trainer cards must differ only where both start on one node: checked by `workbench train`
    # (training.train.check_device_split), not here, so the server node of a two-node recipe can `workbench serve`.
    if recipe.server.mode == "managed" and platform in ("cuda", "npu"):
        tp_dp = recipe.server.tensor_parallel_size * recipe.server.data_parallel_size
        if tp_dp != len(recipe.devices.server):
            raise WorkbenchError(
                f"server.tensor_parallel_size × data_parallel_size = {tp_dp} but devices.server lists "
                f"{len(recipe.devices.server)} devices",
                "make the server's parallel sizes multiply to the number of server devices")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    recipe = load(argv[0] if argv else "cpu-tiny", argv[1:])
    print(recipe.to_yaml())


if __name__ == "__main__":
    main()
