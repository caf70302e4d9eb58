"""The resolved recipe: everything the stages would otherwise work out for themselves, worked out once.

    from workbench import recipe
    rr = recipe.resolve(recipe.load("cpu-tiny"))
    rr.platform, rr.model_path, rr.weight_sync, rr.server_url, rr.server.devices, rr.trainer.env

Entry points (the CLI, `workbench run`, the notebooks) resolve a recipe once and pass the result down; the modules
below never detect the platform, look up the API key or guess a model path themselves. This is the only caller of
the platform detection. The resolved recipe holds no secret in a printable field: the API key is read from the
variable `server.api_key_env` names and kept out of `repr` and `describe()`.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench import paths
from workbench.errors import WorkbenchError
from workbench.platform import compat
from workbench.platform.detect import detect_platform
from workbench.recipe.schema import TINY_BUILD_VERSION, Recipe, TinyModelConfig
from workbench.secrets import REDACTED
from workbench.tasks.task import Task

VISIBLE_DEVICES = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class Role:
    """One side of the device split: its device ids (cores on the CPU) and the variables its processes get."""
    name: str
    devices: tuple[int, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    platform: str  # cpu | cuda | npu: what this run uses
    model_path: str  # a directory, a hub id, or the tiny model's cache directory (built on first use)
    weight_sync: str  # nccl | hccl | reload | none
    server_url: str  # where the trainer and the evaluator reach the server
    server: Role
    trainer: Role
    api_key: str | None = field(default=None, repr=False)
    # the recipe as loaded, before the platform's adjustments (what a run directory's recipe.yaml holds)
    source: Recipe | None = field(default=None, repr=False, compare=False)
    trainer_processes: int = 1  # trainer processes per node (more than one: `accelerate launch`)
    server_versions: dict = field(default_factory=dict)  # vllm / vllm_ascend the server runs (or is planned with)
    versions_source: str = "installed"  # installed | recommended row (planning for a machine that is not this one)

    @property
    def is_tiny(self) -> bool:
        return self.recipe.model.path == "tiny"

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers every request to the server carries (the bearer key when there is one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def describe(self) -> dict:
        """What was resolved, without secrets: for `workbench recipe show`, env.json and the report."""
        return {"platform": self.platform, "model_path": self.model_path, "weight_sync": self.weight_sync,
                "server_url": self.server_url, "api_key": "set" if self.api_key else "none",
                "server_versions": {k: v for k, v in self.server_versions.items() if v},
                "versions_source": self.versions_source,
                "server": {"devices": list(self.server.devices), "env": sorted(self.server.env)},
                "trainer": {"devices": list(self.trainer.devices), "env": sorted(self.trainer.env),
                            "processes": self.trainer_processes, "nodes": self.recipe.distributed.nodes},
                "data": self.task.describe()}

    @functools.cached_property
    def host_platform(self) -> str:
        """What this machine offers (the environment check compares it with the recipe's platform)."""
        if self.recipe.devices.platform == "auto":
            return self.platform

        return detect_platform()

    @functools.cached_property
    def task(self) -> Task:
        """The run's one Task: each split's source, its rows once read, its rewards (workbench/tasks/task.py)."""
        return Task.build(self.recipe)

    def with_recipe(self, recipe: Recipe) -> "Resolved":
        """The same resolution for a variant of the recipe (the smoke run's three steps, the eval's sample count)."""
        return resolve(recipe, platform=self.platform)


def server_url(recipe: Recipe) -> str:
    if recipe.server.attached and recipe.server.url:
        return recipe.server.url.rstrip("/")
    host = "127.0.0.1" if recipe.server.host in ("0.0.0.0", "::", "") else recipe.server.host
    return f"http://{host}:{recipe.server.port}"


def server_versions(platform: str) -> tuple[dict, str]:
    """What the server runs: the installed vLLM / vllm-ascend, or, for an Ascend recipe resolved on a machine without
    vllm-ascend (a plan made on a laptop), the recommended row of the matrix."""
    installed = compat.installed_server_versions()
    if platform == "npu" and not installed.get("vllm_ascend"):
        row = compat.recommended()
        return {"vllm": row["vllm"], "vllm_ascend": row["vllm_ascend"]}, "recommended row"
    return installed, "installed"


def weight_sync(recipe: Recipe, platform: str, versions: dict | None = None) -> str:
    """The recipe's weight sync, 'auto' resolved for the server's versions (NCCL on CUDA; on Ascend the HCCL engine
    where the row has it; file reload elsewhere), refused up front when the row cannot do it."""
    versions = versions if versions is not None else server_versions(platform)[0]
    method = recipe.server.weight_sync
    if method == "auto":
        # an adapter run pushes the adapter alone (about 1% of the bytes) where the server loads adapters at run time
        method = "lora" if recipe.lora else compat.auto_sync(platform, versions)
    if method in ("reload", "lora") and recipe.server.attached and not recipe.server.sync_dir:
        from urllib.parse import urlparse

        host = urlparse(recipe.server.url or "").hostname or ""
        if host not in ("localhost", "127.0.0.1", "::1") and not host.startswith("127."):
            raise WorkbenchError(f"server.weight_sync={method} with a server on another machine ({host}): the "
                                 "trainer writes the weights to a directory the server reads, which must be one both "
                                 "machines see", "set server.sync_dir to a shared directory (NFS) mounted at the same "
                                 "path on both, or use the nccl / hccl weight sync, which crosses nodes")
    ok, why = compat.sync_support(platform, method, versions)
    if not ok and recipe.server.uses_vllm:
        raise WorkbenchError(why, "install a row that has it (workbench/platform/compat.yaml), or choose another "
                                  "server.weight_sync")
    return method


# What builds the tiny model's weights (workbench/tinymodel.py's builders, the arithmetic data): part of its cache key,
# so a change to how it is built is another model, never the old one handed back. Read as syntax trees without
# docstrings (not imported: this module sits below them), so a comment or a docstring keeps the key.
BUILDER = {"tinymodel.py": ("_chat_text", "build_tokenizer", "build_model", "_encode_examples", "_ids", "pretrain",
                            "_build", "PINNED_ENV"),
           "tasks/arithmetic.py": None}  # None: the whole module


def _without_docstrings(tree):
    import ast

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def builder_digest(sources: dict[str, str] | None = None) -> str:
    """sha256 of the tiny model's builders (BUILDER) as syntax trees without docstrings; `sources`: file texts by
    BUILDER name instead of the installed files (what the tests change)."""
    import ast

    h = hashlib.sha256()
    for name, wanted in BUILDER.items():
        text = (sources or {}).get(name) or (paths.PACKAGE / name).read_text()
        tree = _without_docstrings(ast.parse(text))
        for node in tree.body:
            names = {node.name} if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
            if wanted is None or names & set(wanted):
                h.update(ast.dump(node).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _installed_builder_digest() -> str:
    return builder_digest()


def settings_key(tiny: TinyModelConfig, data_seed: int, heldout_size: int, validation_size: int = 0) -> str:
    """The tiny model's cache key: its settings, the data splits it is trained and scored on, the build version and
    the builders' code (builder_digest)."""
    settings = asdict(tiny)
    if settings.get("lr_schedule") == "cosine":
        del settings["lr_schedule"]  # the default before the option existed: keeps earlier caches valid
    splits = {"data_seed": data_seed, "heldout_size": heldout_size}
    if validation_size:  # pre-trained without the validation problems: another model (no key: the one before)
        splits["validation_size"] = validation_size
    payload = json.dumps({"tiny": settings, **splits, "build": TINY_BUILD_VERSION,
                          "builder": _installed_builder_digest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def model_dir(recipe: Recipe, root: Path | None = None) -> Path:
    """Where the tiny model for this recipe lives, built or not (under workbench.paths.data_dir())."""
    key = settings_key(recipe.model.tiny, recipe.data.seed, recipe.data.heldout_size, recipe.data.validation_size)
    return Path(root or paths.data_dir() / "tiny-model") / key


def looks_like_hub_id(name: str) -> bool:
    """org/name, not a path."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _located(given: str, key: str, options: str) -> str:
    """A model directory (resolved, with its config.json) or a hub id, as `key` gave it; else one error."""
    path = Path(given).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise WorkbenchError(f"{key} {path} has no config.json",
                                 f"point {key} at a Hugging Face model directory (config.json, weights, tokenizer)")
        return str(path.resolve())
    if not looks_like_hub_id(given):
        raise WorkbenchError(f"{key} {given} does not exist", f"set {key} to {options}")
    return given


def model_path(recipe: Recipe) -> str:
    """The directory or hub id the recipe's model lives at (the tiny model's cache directory when 'tiny')."""
    if recipe.model.path == "tiny":
        return str(model_dir(recipe))
    return _located(recipe.model.path, "model.path",
                    "an existing model directory, a hub id such as Qwen/Qwen2.5-0.5B, or 'tiny'")


REWARD_MODEL_BUILD = 2  # 2: keeps heldout.jsonl. Bump when `workbench reward-model` builds the tiny reward model differently


def tiny_reward_model_dir(recipe: Recipe, root: Path | None = None) -> Path:
    """Where `workbench reward-model` keeps the tiny reward model built on this recipe's tiny base."""
    return Path(root or paths.data_dir() / "tiny-rm") / f"{model_dir(recipe).name}-rm{REWARD_MODEL_BUILD}"


def reward_model_path(recipe: Recipe, learned) -> str:
    """A learned reward's model: the tiny reward model's directory (tiny-rm, built or not), a directory, or a hub
    id. A policy-base judge's is the policy's own (it runs on the policy server)."""
    if learned.model == "tiny-rm":
        return str(tiny_reward_model_dir(recipe))
    if learned.model == "policy-base":
        return model_path(recipe)
    return _located(learned.model, f"rewards.{learned.name}.model", "a model directory, a hub id (org/name), or tiny-rm")


def _roles(recipe: Recipe, platform: str, sync: str) -> tuple[Role, Role]:
    d = recipe.devices
    peaks = {name: value for name in ("peak_memory_gb_s", "peak_tflops")
             if (value := getattr(d, name)) is not None}
    for name, value in peaks.items():
        if platform == "cpu":
            raise WorkbenchError(f"devices.{name}={value} on the CPU: the datasheet peaks are an accelerator's, and "
                                 "the gauge measures the CPU's cores itself", f"drop devices.{name}")
        if not value > 0:
            raise WorkbenchError(f"devices.{name}={value}: a card's peak must be above 0",
                                 f"give the card's figure (GB/s or dense bf16 TFLOPS), or drop devices.{name}")
    # a run directory's recipe copy has secrets redacted: those variables come from the inherited environment
    server_env, trainer_env = ({k: v for k, v in d.env.items() if v != REDACTED},) * 2
    trainer_env = dict(trainer_env)
    if platform == "npu" and sync == "hccl":
        needed = compat.capability_env("hccl_engine")
        clash = {k: v for k, v in needed.items() if k in {**d.env, **recipe.server.env}
                 and {**d.env, **recipe.server.env}[k] != v}
        if clash:
            name, value = next(iter(clash.items()))
            raise WorkbenchError(f"the recipe sets {name}={ {**d.env, **recipe.server.env}[name]!r} for the server, but the "
                                 f"HCCL weight sync needs {name}={value} (vllm-ascend refuses weight updates otherwise)",
                                 f"drop {name} from devices.env / server.env")
        server_env.update(needed)
    server_env.update({k: v for k, v in recipe.server.env.items() if v != REDACTED})
    if platform == "cpu":
        cores = ",".join(str(c) for c in d.server)
        server_env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        server_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(recipe.server.kv_cache_space_gib))
        server_env.setdefault("OMP_NUM_THREADS", str(len(d.server)))
        # glibc raises its mmap threshold each time a large block is freed, after which the weights that every reload
        # re-creates come from the heap and its fragments stay resident: the CPU worker's RSS crept up by ~0.2 GB per
        # 1000 reloads (scripts/soak.py). A fixed threshold keeps large tensors mmapped, returned to the OS on free.
        server_env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    elif platform in VISIBLE_DEVICES:
        server_env[VISIBLE_DEVICES[platform]] = ",".join(str(x) for x in d.server)
        trainer_env[VISIBLE_DEVICES[platform]] = ",".join(str(x) for x in d.trainer)
        if platform == "cuda":  # ids as nvidia-smi and NVML number GPUs (PCI bus order), not CUDA's fastest-first
            for env in (server_env, trainer_env):  # a recipe's own value wins (the device probe then warns)
                env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return Role("server", tuple(d.server), server_env), Role("trainer", tuple(d.trainer), trainer_env)


FULL_PRECISION = ("auto", "float32")


def _for_platform(recipe: Recipe, platform: str) -> Recipe:
    """The recipe as this platform runs it: on an Ascend card the tiny model (built in float32; the CPU recipes
    say float32) is served and trained in bfloat16, because vllm-ascend's attention kernels take 16-bit inputs
    only; trainer and server keep one dtype so the canary's 16-bit thresholds apply to both. `workbench recipe show`
    and `workbench plan` print the dtype that runs."""
    if platform != "npu" or recipe.model.path != "tiny":
        return recipe
    if recipe.server.dtype not in FULL_PRECISION and recipe.model.dtype not in FULL_PRECISION:
        return recipe
    recipe = copy.deepcopy(recipe)
    if recipe.server.dtype in FULL_PRECISION:
        recipe.server.dtype = "bfloat16"
    if recipe.model.dtype in FULL_PRECISION:
        recipe.model.dtype = "bfloat16"
    return recipe


def resolve(recipe: Recipe, platform: str | None = None, versions: dict | None = None) -> Resolved:
    """Resolve a loaded recipe; `platform` skips detection and `versions` ({'vllm': ..., 'vllm_ascend': ...}) the
    lookup of the installed server stack (tests, or a plan for another machine)."""
    if platform is None:
        if recipe.devices.platform != "auto":
            platform = recipe.devices.platform
        else:
            platform = detect_platform()
    loaded, recipe = recipe, _for_platform(recipe, platform)
    key = None
    if recipe.server.api_key_env:
        key = os.environ.get(recipe.server.api_key_env)
    versions, source = (dict(versions), "given") if versions is not None else server_versions(platform)
    sync = weight_sync(recipe, platform, versions)
    processes = recipe.distributed.processes or (len(recipe.devices.trainer) if platform in VISIBLE_DEVICES else 1)
    if platform in VISIBLE_DEVICES and processes > len(recipe.devices.trainer):
        raise WorkbenchError(f"distributed.processes={processes} but devices.trainer lists {len(recipe.devices.trainer)} "
                             "device(s): one trainer process per card", "list more trainer devices or lower the count")
    server_role, trainer_role = _roles(recipe, platform, sync)
    return Resolved(recipe=recipe, platform=platform, model_path=model_path(recipe), weight_sync=sync,
                    server_url=server_url(recipe), server=server_role, trainer=trainer_role, api_key=key,
                    trainer_processes=processes, server_versions=versions, versions_source=source, source=loaded)
