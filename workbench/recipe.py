"""Recipes: one YAML file, one config object, read by every stage.

A recipe has eight sections: model, data, server, trainer, rewards, devices, monitor, eval. Each knob lives in
exactly one of them; the trainer arguments TRL needs for the server, the rewards and the device come from the
other sections (see `trainer_arguments`), never from a second copy. Recipes ship in workbench/recipes/; one may
`extends:` another and override only what differs. Overrides use dotted keys and YAML values, on the command line
and as papermill parameters alike:

    workbench recipe show cpu-tiny trainer.learning_rate=5e-6 server.port=8011
    python -m workbench.recipe smoke

Unknown keys, wrong types and lengths that cannot fit get one clear line (cause and fix) before anything starts.
"""
from __future__ import annotations

import contextlib
import copy
import re
import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workbench.errors import WorkbenchError

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
SECTIONS = ("model", "data", "server", "trainer", "rewards", "devices", "monitor", "eval")


# ----------------------------------------------------------------------------------------------------------------
# Sections

@dataclass
class TinyModelConfig:
    """Size and pre-training of the model `workbench tiny-model` builds (used when model.path is 'tiny')."""
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    pretrain_steps: int = 200  # stop early on purpose: the model follows the format but is often wrong
    batch_size: int = 32
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"  # cosine (to 10%) | constant (a noisier, higher-entropy policy)
    eval_size: int = 300  # held-out problems scored after pre-training


@dataclass
class ModelConfig:
    path: str = "tiny"  # 'tiny' (built by the workbench), a local Hugging Face directory, or a hub id
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | math500 | aime2024 | file
    path: str | None = None  # local .jsonl/.json/.parquet instead of the hub
    fields: dict[str, str] | None = None  # our column -> file column: question, answer, id
    split: str = "train"
    eval_split: str = "heldout"
    seed: int = 0
    heldout_size: int = 300  # arithmetic only: problems kept out of training
    train_size: int | None = None  # first N training rows; None = all
    system_prompt: str | None = None
    instruction: str | None = None  # appended to each question, e.g. where to put the final answer
    max_prompt_length: int = 64  # tokens, chat template included; longer prompts are an error, not a silent cut


@dataclass
class ServerConfig:
    mode: str = "managed"  # managed (the workbench starts vLLM) | attach (someone else's, at url) | off (no vLLM)
    url: str | None = None  # for attach, e.g. http://10.0.0.5:8001
    host: str = "127.0.0.1"  # loopback unless you mean it: weight-update endpoints are open on this address
    port: int = 8000
    served_model_name: str = "policy"
    max_model_len: int = 256  # must hold the longest prompt plus max_completion_length
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # chunked prefill: caps the long-tail prefill spikes
    enforce_eager: bool = False
    kv_cache_space_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    api_key_env: str | None = None  # name of the environment variable holding the API key, never the key
    startup_timeout_s: float = 300.0
    weight_sync: str = "auto"  # auto | nccl | hccl | reload | none
    sync_dir: str | None = None  # reload adapter's directory; default under /dev/shm
    extra_args: list[str] = field(default_factory=list)  # more vLLM flags, passed as they are
    env: dict[str, str] = field(default_factory=dict)  # more environment variables for the server only


@dataclass
class DevicesConfig:
    platform: str = "auto"  # auto | cpu | cuda | npu
    server: list[int] = field(default_factory=lambda: [0])  # device ids (CPU: cores) that serve
    trainer: list[int] = field(default_factory=lambda: [1])  # device ids (CPU: cores) that train
    env: dict[str, str] = field(default_factory=dict)  # for every process (HCCL timeouts, log levels)


@dataclass
class MonitorConfig:
    runs_dir: str = "runs"
    sample_interval_s: float = 1.0  # device and server sampling period
    dashboard: bool = True
    completions_shown: int = 4


@dataclass
class EvalConfig:
    split: str = "heldout"
    num_samples: int = 300
    repeats: int = 1
    concurrency: int = 8
    endpoint: str = "chat"  # chat | completions
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 1234
    max_tokens: int = 48
    stop: list[str] = field(default_factory=list)
    retries: int = 3  # per request, on connection errors, timeouts and 5xx


@dataclass
class Recipe:
    name: str = "custom"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: dict[str, Any] = field(default_factory=dict)  # trl.GRPOConfig arguments, checked against it
    rewards: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0, "format": 0.2})
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=110)

    @property
    def max_completion_length(self) -> int:
        return int(self.trainer.get("max_completion_length", _grpo_default("max_completion_length")))


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


def _grpo_fields() -> dict[str, dataclasses.Field]:
    from trl import GRPOConfig

    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _grpo_default(name: str) -> Any:
    f = _grpo_fields()[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


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
    grpo = _grpo_fields()
    for key in recipe.trainer:
        if key in DERIVED_TRAINER_KEYS:
            raise WorkbenchError(f"trainer.{key} is derived by the workbench",
                                 f"set {DERIVED_TRAINER_KEYS[key]} instead and drop trainer.{key}")
        if key not in grpo:
            raise WorkbenchError(f"unknown recipe key 'trainer.{key}' (not a trl.GRPOConfig argument)",
                                 _closest(key, grpo))
    from workbench import rewards

    for name, weight in recipe.rewards.items():
        rewards.get(name)
    choices = {
        "server.mode": (recipe.server.mode, ("managed", "attach", "off")),
        "server.weight_sync": (recipe.server.weight_sync, ("auto", "nccl", "hccl", "reload", "none")),
        "devices.platform": (recipe.devices.platform, ("auto", "cpu", "cuda", "npu")),
        "eval.endpoint": (recipe.eval.endpoint, ("chat", "completions")),
        "model.dtype": (recipe.model.dtype, ("auto", "float32", "bfloat16", "float16")),
    }
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise WorkbenchError(f"{where} is {value!r}", f"use one of: {', '.join(allowed)}")
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
    overlap = set(recipe.devices.server) & set(recipe.devices.trainer)
    if platform in ("cuda", "npu") and recipe.server.mode == "managed" and overlap:
        raise WorkbenchError(f"devices {sorted(overlap)} are given to both server and trainer",
                             "give devices.server and devices.trainer disjoint device ids")
    if recipe.server.mode == "managed" and platform in ("cuda", "npu"):
        tp_dp = recipe.server.tensor_parallel_size * recipe.server.data_parallel_size
        if tp_dp != len(recipe.devices.server):
            raise WorkbenchError(
                f"server.tensor_parallel_size × data_parallel_size = {tp_dp} but devices.server lists "
                f"{len(recipe.devices.server)} devices",
                "make the server's parallel sizes multiply to the number of server devices")


# ----------------------------------------------------------------------------------------------------------------
# Trainer arguments

@contextlib.contextmanager
def _as_if_on(platform: str):
    """Let transformers' bf16 hardware check answer for the recipe's platform, not this host.

    Only used to validate a recipe for a device this machine does not have (an Ascend recipe checked on a laptop).
    """
    import transformers.training_args as ta

    if platform not in ("cuda", "npu"):
        yield
        return
    saved = ta.is_torch_bf16_gpu_available
    ta.is_torch_bf16_gpu_available = lambda *a, **k: True
    try:
        yield
    finally:
        ta.is_torch_bf16_gpu_available = saved


def resolve_platform(recipe: Recipe) -> str:
    if recipe.devices.platform != "auto":
        return recipe.devices.platform
    from workbench.device import detect_platform

    return detect_platform()


def trainer_arguments(recipe: Recipe, output_dir: str, platform: str | None = None) -> dict[str, Any]:
    """The keyword arguments for trl.GRPOConfig: the trainer section plus what other sections imply."""
    platform = platform or resolve_platform(recipe)
    args = dict(recipe.trainer)
    args["output_dir"] = output_dir
    args["seed"] = recipe.data.seed
    args["reward_weights"] = list(recipe.rewards.values())
    if platform == "cpu":
        args["use_cpu"] = True
        args["bf16"] = False
    server = recipe.server
    args["use_vllm"] = server.mode != "off"
    if args["use_vllm"]:
        args["vllm_mode"] = "server"
        args["vllm_server_base_url"] = server_url(recipe)
        args["vllm_server_timeout"] = server.startup_timeout_s
    return args


def server_url(recipe: Recipe) -> str:
    if recipe.server.mode == "attach" and recipe.server.url:
        return recipe.server.url.rstrip("/")
    host = "127.0.0.1" if recipe.server.host in ("0.0.0.0", "::", "") else recipe.server.host
    return f"http://{host}:{recipe.server.port}"


def grpo_config(recipe: Recipe, output_dir: str, platform: str | None = None):
    """A real trl.GRPOConfig for the recipe; TRL's own errors are re-raised as one clear line."""
    from trl import GRPOConfig

    platform = platform or resolve_platform(recipe)
    with _as_if_on(platform):
        try:
            return GRPOConfig(**trainer_arguments(recipe, output_dir, platform))
        except (ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WorkbenchError(f"trl.GRPOConfig rejects the trainer section: {first}",
                                 "change the trainer keys it names (see `workbench recipe show`)") from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    recipe = load(argv[0] if argv else "cpu-tiny", argv[1:])
    print(recipe.to_yaml())


if __name__ == "__main__":
    main()
