"""`workbench plan`: what each node of a recipe runs, with which devices and environment, and whether it fits.

    workbench plan --recipe ascend-910b-8card
    workbench plan --recipe ascend-910b-2node

For every node: the commands (the server's `vllm serve ...`, the trainer's `accelerate launch ...` or the
single-process `workbench train`), each process's environment (the recipe's devices.env, the role's visible devices,
what the weight sync needs), the main address and the ports to open (server, trainer rendezvous, weight-transfer
group), and a per-device memory estimate: the trainer's weights, gradients, optimizer state and activations (with
and without gradient checkpointing, sharded as the strategy shards them), the server's weights and KV cache at its
max_model_len × max_num_seqs, against the card's memory, with a warning where it does not fit.

The estimate needs the model's shape: config.json from a local model directory or the Hugging Face cache, else
a shipped table of common architectures (workbench/platform/models.yaml). It is an estimate (framework overheads,
fragmentation and the allocator's reserve are not modelled), printed with its assumptions.

Launch scripts, written from the plan (`--emit shell` or `--emit slurm`, the end of this module):

    workbench plan --recipe ascend-910b-2node --emit shell > launch.sh    # then on each machine: bash launch.sh NODE
    workbench plan --recipe ascend-910b-2node --emit slurm > job.sbatch   # then: sbatch job.sbatch

Each node runs exactly the `start` command the plan prints for it: the recipe as given
and every override, so what a scheduler starts is what the plan says. A value (an address, an interface, a port)
is changed by emitting again with an override (docs/multi-node.md names them), never by editing the script.

- shell: one script with a section per node (`server`, `0`, `1`, ...), the recipe's addresses as they are. A
  training node that attaches to a server node waits for its /health first.
- slurm: nodes come from the allocation (the first serves when the recipe has a server node, the next train), so
  the addresses are looked up at run time: each node's IPv4 address on the interface the recipe's collectives use
  (devices.env *_SOCKET_IFNAME), else its host name, passed as `server.url=...` and `distributed.main_address=...`
  after the other overrides. Whole nodes are asked for (`--exclusive`): the recipe names physical cards.
Every step activates the workbench's virtual environment (WORKBENCH_VENV, default .venv in the submit directory)
and, on Ascend, sources CANN's set_env.sh first (ASCEND_SET_ENV overrides its path).
"""
from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.serving import launch as serving_launch
from workbench.training import launch as training_launch

MODELS_FILE = Path(__file__).parent / "platform" / "models.yaml"
CARD_GIB = {"npu": 64.0, "cuda": 80.0}  # 910B2/B3 and A100/H100-80G; distributed.device_memory_gib overrides
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
GIB = 2**30
ASCEND_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
ATB_SET_ENV = "/usr/local/Ascend/nnal/atb/set_env.sh"
HEALTH_WAIT_EXTRA_S = 60  # beyond server.startup_timeout_s: the server node's own start (imports, venv)


@dataclass
class ModelShape:
    params: float  # parameters, all of them
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    source: str  # where the shape came from

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _shape_from_config(cfg: dict, source: str) -> ModelShape:
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    vocab, inter = cfg["vocab_size"], cfg.get("intermediate_size", 4 * hidden)
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return ModelShape(layers * per_layer + embeddings + hidden, hidden, layers, heads, kv, vocab, inter, source)


def model_shape(rr: Resolved) -> ModelShape:
    """The policy's shape from its config.json (local directory, then the Hugging Face cache), else the table."""
    path = Path(rr.model_path)
    candidates = [path / "config.json"]
    if not path.exists() and rr.model_path.count("/") == 1:
        hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
        candidates += sorted(hub.glob(f"models--{rr.model_path.replace('/', '--')}/snapshots/*/config.json"))
    for candidate in candidates:
        if candidate.is_file():
            return _shape_from_config(json.loads(candidate.read_text()), str(candidate))
    table = yaml.safe_load(MODELS_FILE.read_text())
    if rr.model_path in table:
        return _shape_from_config(table[rr.model_path], f"{MODELS_FILE.name} ({rr.model_path})")
    raise WorkbenchError(f"the shape of {rr.model_path} is unknown here (no config.json found, not in {MODELS_FILE.name})",
                         "point model.path at a local model directory, or download its config.json to the HF cache")


@dataclass
class Memory:
    """Bytes per device, by part; `budget` is what the role may use on one card."""
    role: str
    parts: dict[str, float]
    budget: float
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def lines(self) -> list[str]:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items())
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out = [f"{self.role}: {self.total / GIB:.1f} GiB per device of {self.budget / GIB:.1f} GiB ({verdict}): {parts}"]
        return out + [f"    {n}" for n in self.notes]


def trainer_memory(rr: Resolved, shape: ModelShape, card: float, checkpointing: bool | None = None) -> Memory:
    t, d = rr.recipe.trainer, rr.recipe.distributed
    w = DTYPE_BYTES.get(rr.recipe.model.dtype, 2)
    ranks = rr.trainer_processes * d.nodes
    checkpointing = bool(t.get("gradient_checkpointing", False)) if checkpointing is None else checkpointing
    p = shape.params
    shard_opt = ranks if (d.strategy == "deepspeed" or d.strategy == "fsdp") else 1
    shard_grad = ranks if (d.strategy == "fsdp" or (d.strategy == "deepspeed" and d.zero_stage >= 2)) else 1
    shard_w = ranks if (d.strategy == "fsdp" or (d.strategy == "deepspeed" and d.zero_stage == 3)) else 1
    master = 4 if d.strategy == "deepspeed" and w == 2 else 0  # DeepSpeed keeps fp32 master weights
    optimizer_bytes = (8 if master else 2 * w) + master  # AdamW's two moments (+ master copy)
    parts = {"weights": p * w / shard_w, "gradients": p * w / shard_grad, "optimizer": p * optimizer_bytes / shard_opt}
    if float(t.get("beta", 0.0)) > 0:
        parts["reference model"] = p * w / shard_w
    adapter = lora_params(rr, shape) if rr.recipe.lora else 0.0
    if adapter:
        # frozen base weights; peft keeps the adapter in float32, whose gradients and AdamW moments are all that
        # trains; no reference model: TRL scores the reference with the adapter disabled
        parts = {"weights (frozen)": p * w / shard_w, "adapter": adapter * 4, "gradients": adapter * 4 / shard_grad,
                 "optimizer": adapter * 8 / shard_opt}
    prompt = rr.recipe.data.max_prompt_length
    tokens = int(t.get("per_device_train_batch_size", 8)) * (prompt + rr.recipe.max_completion_length)
    full_layer = tokens * shape.hidden * 34  # per layer, bf16, flash attention (no seq² term)
    if checkpointing:
        parts["activations"] = tokens * shape.hidden * 2 * shape.layers + full_layer
    else:
        parts["activations"] = full_layer * shape.layers
    parts["logits"] = tokens * shape.vocab * 4 * 2  # fp32 logits and log-softmax for the completion log-probs
    if adapter:
        notes = [f"LoRA rank {rr.recipe.lora_rank}: {adapter / 1e6:.2f}M adapter parameters ({adapter / p:.2%} of the "
                 "model) train; each weight push moves the adapter alone"]
    else:
        notes = []
    notes += [f"{rr.trainer_processes} rank(s)/node × {d.nodes} node(s), strategy {d.strategy}"
             + (f" ZeRO-{d.zero_stage}" if d.strategy == "deepspeed" else "")
             + f", micro-batch {tokens} tokens, gradient checkpointing {'on' if checkpointing else 'off'}"]
    return Memory("trainer", parts, card, notes)


LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Qwen2 and Llama when target_modules is unset


def lora_params(rr: Resolved, shape: ModelShape) -> float:
    """Adapter parameters of the recipe's peft: section: rank × (in + out) for each targeted projection of each
    layer (a decoder of the Qwen2 / Llama layout; other names count nothing)."""
    import re

    h, hd, inter = shape.hidden, shape.head_dim, shape.intermediate
    dims = {"q_proj": (h, shape.heads * hd), "k_proj": (h, shape.kv_heads * hd), "v_proj": (h, shape.kv_heads * hd),
            "o_proj": (shape.heads * hd, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    targets = rr.recipe.peft.get("target_modules")
    if targets == "all-linear":
        names = list(dims)
    elif targets is None:
        names = list(LORA_DEFAULT_TARGETS)
    elif isinstance(targets, str):  # peft: a regular expression matched against the full module name
        names = [n for n in dims if re.fullmatch(targets, f"model.layers.0.{'mlp' if 'proj' in n and n[0] in 'gud' else 'self_attn'}.{n}")]
    else:
        names = [n for n in dims if any(n == t or n.endswith(f".{t}") or t.endswith(n) for t in targets)]
    return float(shape.layers * sum(rr.recipe.lora_rank * sum(dims[n]) for n in names))


def server_memory(rr: Resolved, shape: ModelShape, card: float) -> Memory:
    s = rr.recipe.server
    w = DTYPE_BYTES.get(s.dtype, 2)
    tp = s.tensor_parallel_size
    seqs = s.max_num_seqs or 256  # vLLM's default
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * w
    parts = {"weights": shape.params * w / tp, "KV cache (all sequences at max_model_len)":
             kv_per_token * s.max_model_len * seqs / tp}
    notes = [f"TP {tp} × DP {s.data_parallel_size}; {seqs} sequences × {s.max_model_len} tokens; vLLM takes "
             f"gpu_memory_utilization={s.gpu_memory_utilization} of the card and pages the KV cache within it "
             "(fewer sequences run at once when it is short)"]
    return Memory("server", parts, card * s.gpu_memory_utilization, notes)


ENGINE_OVERHEAD_GIB = 1.0  # per engine process and card: the runtime's context and workspace outside its share


def reward_engine_memory(rr: Resolved, card: float) -> list[Memory]:
    """Each managed reward engine on the server cards (serving/rewards.py): its weights and KV cache against its own
    gpu_memory_utilization share of each card."""
    from workbench.serving.rewards import engine_resolved, engine_specs

    out = []
    for spec in engine_specs(rr):
        if not spec.learned.engine.managed:
            continue
        err = engine_resolved(rr, spec)
        shape = model_shape(err)
        m = server_memory(err, shape, card)
        m.role = f"reward engine {spec.name!r} ({spec.learned.kind}: {spec.learned.model})"
        if spec.learned.kind == "model":  # a pooling engine keeps no KV cache beyond one forward pass
            m.parts = {"weights": m.parts["weights"], "activations (one scoring pass)":
                       (err.recipe.server.max_num_seqs or 256) * err.recipe.server.max_model_len * shape.hidden * 2 * 4
                       / err.recipe.server.tensor_parallel_size}
        m.notes = [f"on the server's devices {list(rr.server.devices)}, gpu_memory_utilization="
                   f"{err.recipe.server.gpu_memory_utilization} of each card, port {err.recipe.server.port}"]
        out.append(m)
    return out


@dataclass
class Node:
    name: str
    address: str
    processes: list[dict] = field(default_factory=list)  # {role, command, env, devices}
    ports: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)  # the one workbench command that starts this node's part
    role: str = "train"  # serve (a server node of its own) | train (a training node)
    rank: int = 0  # the training node's distributed.node_rank


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items()))


def nodes(rr: Resolved, recipe_arg: str | None = None, overrides: tuple[str, ...] = ()) -> list[Node]:
    """Who runs what: the server's node (its own when the server is attached from another machine) and each
    training node. Each node's `start` is the command typed there (or run there by a scheduler,
    the launch scripts below): the recipe as given (`recipe_arg`, default its name) and every override."""
    r = rr.recipe
    given = ["--recipe", recipe_arg or r.name, *overrides]
    d = r.distributed
    model = rr.model_path
    server_cmd = " ".join(serving_launch.command(rr, model))
    server_env = {**rr.server.env, "VLLM_SERVER_DEV_MODE": "1"}  # the training server's dev and weight routes
    if rr.api_key or r.server.api_key_env:
        server_env["VLLM_API_KEY"] = f"${r.server.api_key_env}"
    out: list[Node] = []
    remote_server = r.server.attached
    if remote_server:
        host = rr.server_url.split("//", 1)[1].rsplit(":", 1)[0]
        node = Node("server node", host, role="serve",
                    start=["workbench", "serve", "--for-training", *given, "server.mode=managed"])
        node.processes.append({"role": "server", "devices": list(rr.server.devices), "env": server_env,
                               "command": server_cmd + "   # what the start command runs here"})
        node.ports.append(f"{r.server.port}/tcp: the OpenAI API and weight-update endpoints (the trainer node only)")
        out.append(node)
    for rank in range(d.nodes):
        address = d.main_address if rank == 0 else f"<node {rank} address>"
        node = Node(f"training node {rank}" if d.nodes > 1 else "training node", address, rank=rank,
                    start=["workbench", "train", *given] + ([f"distributed.node_rank={rank}"] if d.nodes > 1 else []))
        if rank == 0 and not remote_server and not r.server.in_process:
            node.processes.append({"role": "server", "devices": list(rr.server.devices), "env": server_env,
                                   "command": server_cmd + "   # started by `workbench train`, stopped with it"})
            node.processes += _reward_engines(rr)
        trainer_env = dict(rr.trainer.env)
        if rr.trainer_processes * d.nodes > 1:
            train_dir = "runs/<id>/train"
            command = " ".join(["accelerate", "launch"] + training_launch.rank_command(rr, _Dir(train_dir))[2:])
            if rank == 0:
                note = "   # what `workbench train` runs here once the server is up"
            else:  # no server here: only node 0's main rank talks to it
                # the same recipe and overrides as node 0 (or node 0's run recipe, runs/<id>/recipe.yaml)
                command = shlex.join(node.start)
                note = f"   # = accelerate launch with machine_rank {rank}; starts no server"
            node.processes.append({"role": f"trainer ×{rr.trainer_processes}", "devices": list(rr.trainer.devices),
                                   "env": trainer_env, "command": command + note})
        else:
            engine = (f"; vLLM inside it (colocate), gpu_memory_utilization={r.server.gpu_memory_utilization} of the "
                      "card" if r.server.colocated else "")
            placed = ("   # the trainer runs as a child process with this environment" + engine
                      if training_launch.trainer_placement(rr) == "process" else "")
            node.processes.append({"role": "trainer", "devices": list(rr.trainer.devices), "env": trainer_env,
                                   "command": shlex.join(node.start) + placed})
        if rank == 0:
            if d.nodes > 1:
                node.ports.append(f"{d.main_port}/tcp: trainer rendezvous (from the other training nodes)")
            if rr.weight_sync in ("nccl", "hccl"):
                group = int(r.trainer.get("vllm_group_port", 51216))
                node.ports.append(f"{group}/tcp: weight-transfer group, trainer rank 0 with the server's workers"
                                  + (" (from the server node)" if remote_server else ""))
        out.append(node)
    return out


def _reward_engines(rr: Resolved) -> list[dict]:
    """The managed reward engines `workbench train` starts beside the policy server (serving/rewards.py)."""
    from workbench.serving.rewards import engine_resolved, engine_specs

    out = []
    for spec in engine_specs(rr):
        if not spec.learned.engine.managed:
            continue
        err = engine_resolved(rr, spec)
        env = dict(err.server.env)
        if err.api_key or err.recipe.server.api_key_env:  # the engine is keyed with the policy server's key
            env["VLLM_API_KEY"] = f"${err.recipe.server.api_key_env}"
        out.append({"role": f"reward engine {spec.name!r}", "devices": list(err.server.devices), "env": env,
                    "command": " ".join(serving_launch.command(err, err.model_path))
                    + "   # started by `workbench train` beside the server, stopped with it"})
    return out


class _Dir:
    """A stand-in training directory for printing the rank command of a run that does not exist yet."""

    def __init__(self, path: str):
        self.accelerate_config = f"{path}/accelerate.yaml"
        self.path = path


@dataclass
class Plan:
    nodes: list[Node]
    shape: ModelShape | None
    memory: list[Memory]
    warnings: list[str]
    resolved: Resolved | None = field(default=None, repr=False)  # what it was planned from (the launch scripts read it)
    recipe_args: list[str] = field(default_factory=list)  # ["--recipe", R] as given to `workbench plan`
    overrides: tuple[str, ...] = ()  # ...and its overrides, which every node's start command carries

    def text(self) -> str:
        lines = []
        for node in self.nodes:
            lines.append(f"== {node.name} ({node.address})")
            lines.append(f"  start: {shlex.join(node.start)}")
            for proc in node.processes:
                lines.append(f"  {proc['role']} on devices {proc['devices']}")
                lines.append(f"    env: {_env_text(proc['env']) or '(none)'}")
                lines.append(f"    $ {proc['command']}")
            for port in node.ports:
                lines.append(f"  open port {port}")
        if self.shape:
            lines.append(f"== memory per device ({self.shape.params / 1e9:.2f}B parameters, shape from "
                         f"{self.shape.source})")
            for m in self.memory:
                lines += ["  " + line for line in m.lines()]
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def plan(rr: Resolved, recipe_arg: str | None = None, overrides: tuple[str, ...] = ()) -> Plan:
    """The recipe's plan; two roles given one card are refused (training.launch.shared_cards), as training refuses
    them, not planned as if each had the card to itself. `recipe_arg` and `overrides`: how the recipe was given,
    so each node's start command carries them."""
    shared = training_launch.shared_cards(rr)
    if shared is not None:
        raise shared
    card_gib = rr.recipe.distributed.device_memory_gib or CARD_GIB.get(rr.platform)
    warnings: list[str] = []
    shape, memory = None, []
    if card_gib:
        shape = model_shape(rr)
        card = card_gib * GIB
        trainer = trainer_memory(rr, shape, card)
        other = trainer_memory(rr, shape, card, checkpointing=not bool(rr.recipe.trainer.get("gradient_checkpointing")))
        trainer.notes.append(f"with gradient checkpointing {'off' if other.notes[0].endswith('off') else 'on'}: "
                             f"{other.total / GIB:.1f} GiB")
        memory = [trainer, server_memory(rr, shape, card)]
        engines = reward_engine_memory(rr, card) if rr.recipe.server.managed else []
        if engines:  # the server cards are split between the policy and the reward engines
            shares = [rr.recipe.server.gpu_memory_utilization] + [m.budget / card for m in engines]
            overhead = ENGINE_OVERHEAD_GIB * GIB * len(shares)
            used = sum(shares) * card + overhead
            verdict = "fits" if used <= card else "DOES NOT FIT"
            memory[1].notes.append(f"server cards split: policy {shares[0]} + " + " + ".join(
                f"{x:.2f}" for x in shares[1:]) + f" = {sum(shares):.2f} of each card, plus about "
                f"{ENGINE_OVERHEAD_GIB:g} GiB per engine outside its share: {used / GIB:.1f} of {card / GIB:.0f} GiB "
                f"({verdict})")
            if used > card:
                raise WorkbenchError(
                    f"the server cards do not hold both engines: shares {' + '.join(f'{x:.2f}' for x in shares)} of "
                    f"{card / GIB:.0f} GiB plus about {ENGINE_OVERHEAD_GIB:g} GiB per engine = {used / GIB:.1f} GiB",
                    "lower server.gpu_memory_utilization or the reward engines' engine.gpu_memory_utilization")
            memory += engines
        if rr.recipe.server.colocated:  # one card for both: the engine takes its share, training the rest
            trainer.budget = card * (1 - rr.recipe.server.gpu_memory_utilization)
            trainer.notes.append(f"vLLM colocated: the trainer has the card less the engine's "
                                 f"gpu_memory_utilization={rr.recipe.server.gpu_memory_utilization}")
        for m in memory:
            if not m.fits:
                fix = ("shard it: distributed.strategy=deepspeed distributed.zero_stage=3 (or fsdp), turn on "
                       "trainer.gradient_checkpointing, or lower trainer.per_device_train_batch_size"
                       if m.role == "trainer" else
                       "raise server.tensor_parallel_size, lower server.max_num_seqs / max_model_len"
                       if m.role == "server" else "raise that engine's engine.gpu_memory_utilization (and lower "
                       "server.gpu_memory_utilization), or lower its engine.max_model_len")
                warnings.append(f"the {m.role} needs about {m.total / GIB:.0f} GiB per device, over the "
                                f"{m.budget / GIB:.0f} GiB it may use: {fix}")
    else:
        warnings.append("no memory estimate on the CPU (the roles share this machine's RAM)")
    if math.prod([rr.recipe.server.tensor_parallel_size, rr.recipe.server.data_parallel_size]) != \
            len(rr.server.devices) and rr.platform != "cpu":
        warnings.append("server.tensor_parallel_size × data_parallel_size differs from the server's device count")
    if rr.recipe.server.attached:
        url_port = rr.server_url.rstrip("/").rsplit(":", 1)[-1]
        if url_port.isdigit() and int(url_port) != rr.recipe.server.port:
            warnings.append(f"server.url names port {url_port} but the server node listens on server.port="
                            f"{rr.recipe.server.port}: override both together")
    return Plan(nodes(rr, recipe_arg, tuple(overrides)), shape, memory, warnings, rr,
                ["--recipe", recipe_arg or rr.recipe.name], tuple(overrides))


# ----------------------------------------------------------------------------------------------------------------
# Launch scripts: each node runs its `start` command, nothing else




def script(plan: Plan, kind: str) -> str:
    """The launch script of `kind` ("shell" or "slurm") for the plan's nodes."""
    if kind == "shell":
        return _shell(plan)
    if kind == "slurm":
        return _slurm(plan)
    raise ValueError(f"no launch script of kind {kind!r}")


def _interface(plan: Plan) -> str | None:
    """The network interface the recipe's collectives are bound to: the nodes' addresses are taken on it."""
    env = plan.resolved.recipe.devices.env
    for name in ("HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = str(env.get(name) or "")
        if value and not value.startswith("^"):  # "^docker0" excludes: no interface to take an address on
            return value.split(",")[0].lstrip("=")
    return None


def _preamble(plan: Plan) -> str:
    """What every step runs before its command: the venv, and CANN's environment on Ascend."""
    lines = ['source "${WORKBENCH_VENV:-.venv}/bin/activate"']
    if plan.resolved.platform == "npu":
        lines.append(f'source "${{ASCEND_SET_ENV:-{ASCEND_SET_ENV}}}"')
        lines.append(f'if [ -f {ATB_SET_ENV} ]; then source {ATB_SET_ENV}; fi')
    return "; ".join(lines) + ";"


def _server_wait(plan: Plan) -> int:
    return int(plan.resolved.recipe.server.startup_timeout_s) + HEALTH_WAIT_EXTRA_S


def _header(plan: Plan, kind: str) -> list[str]:
    return ["#!/bin/bash",
            f"# {plan.resolved.recipe.name}: launch lines for {len(plan.nodes)} node(s), written by `workbench plan "
            f"--emit {kind} {shlex.join([*plan.recipe_args, *plan.overrides])}`.",
            "# To change an address, interface or port, emit it again with an override (docs/multi-node.md)."]


def _key_check(key: str | None) -> list[str]:
    if not key:
        return []
    return [f': "${{{key}:?export the server key in {key} first (server.api_key_env; never written here)}}"']


def _nonempty(var: str, node: str, interface: str | None) -> str:
    fix = f"no IPv4 address on {interface}: emit again with the interface the nodes share" if interface else \
        "no address"
    return f'[ -n "${var}" ] || {{ echo "node {node} has {fix} (devices.env.HCCL_SOCKET_IFNAME=...)" >&2; exit 1; }}'


def _wait_lines(url: str, seconds: int, alive: str | None = None) -> list[str]:
    """Wait for the server's /health, at most `seconds`; with `alive`, stop early when that process has ended."""
    lines = [f"deadline=$((SECONDS + {seconds}))",
             f'until curl -sf --max-time 5 "{url}/health" >/dev/null; do']
    if alive:
        lines.append(f'  kill -0 "{alive}" 2>/dev/null || {{ echo "the server ended before it answered at {url}: '
                     'see its output above" >&2; exit 1; }')
    lines += [f'  (( SECONDS < deadline )) || {{ echo "no answer from {url}/health in {seconds} s" >&2; exit 1; }}',
              "  sleep 5",
              "done"]
    return lines


def _shell(plan: Plan) -> str:
    lines = _header(plan, "shell")
    key = plan.resolved.recipe.server.api_key_env
    names = ["server" if n.role == "serve" else str(n.rank) for n in plan.nodes]
    lines += [f"# Run on each machine: bash THIS_FILE NODE, NODE one of: {' '.join(names)} (the server first).",
              f'node=${{1:?"which node this machine is: {" | ".join(names)}"}}',
              *_key_check(key),
              _preamble(plan) + "  # before set -u: CANN's set_env.sh reads unset variables",
              "set -euo pipefail",
              'case "$node" in']
    server_url = plan.resolved.server_url
    for name, node in zip(names, plan.nodes):
        what = "serves until stopped (Ctrl-C stops vLLM with it)" if node.role == "serve" else "trains"
        lines.append(f"  {name})  # {node.name} ({node.address}): {what}")
        if node.role == "train" and plan.nodes[0].role == "serve":
            lines += ["    " + line for line in _wait_lines(server_url, _server_wait(plan))]
        lines += [f"    exec {shlex.join(node.start)}", "    ;;"]
    lines += [f'  *) echo "unknown node $node: use one of: {" ".join(names)}" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


def _slurm(plan: Plan) -> str:
    rr = plan.resolved
    r = rr.recipe
    lines = _header(plan, "slurm")
    served = plan.nodes[0].role == "serve"
    trainers = [n for n in plan.nodes if n.role == "train"]
    cards = max([len({d for p in n.processes for d in p["devices"]}) for n in plan.nodes] or [0])
    lines += ["# Submit from the workbench checkout, on a filesystem every node sees: sbatch THIS_FILE",
              f"#SBATCH --job-name=grpo-{r.name}",
              f"#SBATCH --nodes={len(plan.nodes)}",
              "#SBATCH --ntasks-per-node=1",
              "#SBATCH --exclusive"]
    if rr.platform == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={cards}")
    elif rr.platform == "npu":
        lines.append(f"##SBATCH --gres=npu:{cards}   # where the cluster's Slurm counts NPUs; --exclusive gives the "
                     "whole node either way")
    interface = _interface(plan)
    recipe_args, overrides = plan.recipe_args, list(plan.overrides)
    ranked = r.distributed.nodes > 1  # each training node is given its rank: its task's index in the step
    address = (f"srun --nodes=1 --ntasks=1 --nodelist=\"$1\" ip -4 -o addr show dev {shlex.quote(interface)} "
               "| awk '{split($4, a, \"/\"); print a[1]; exit}'" if interface else 'echo "$1"')
    lines += ["set -euo pipefail",
              'cd "${SLURM_SUBMIT_DIR:-$PWD}"',
              *_key_check(r.server.api_key_env),
              f"PREAMBLE={shlex.quote(_preamble(plan))}",
              "on() {  # on() NODES CMD...: CMD on each of NODES (a comma list), one task a node, after the preamble"
              + ("; with distributed.node_rank, its task's index in the step" if ranked else ""),
              '  local where=$1; shift',
              '  local n; n=$(tr , "\\n" <<<"$where" | wc -l)',
              '  srun --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --nodelist="$where" \\',
              '    bash -c "$PREAMBLE"\' exec "$@"' + (' "distributed.node_rank=$SLURM_PROCID"' if ranked else "")
              + '\' _ "$@"',
              "}",
              ("address() {  # a node's IPv4 address on " + (f"{interface}, the interface the recipe's collectives "
                                                              "use (devices.env)" if interface else
                                                              "the network: its host name (devices.env names no "
                                                              "interface)")),
              f"  {address}",
              "}",
              'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              f'[ "${{#NODES[@]}}" -ge {len(plan.nodes)} ] || {{ echo "the allocation has ${{#NODES[@]}} node(s); '
              f'this recipe runs on {len(plan.nodes)}: sbatch --nodes={len(plan.nodes)}" >&2; exit 1; }}']
    first_trainer = 1 if served else 0
    lines += ["SERVER_NODE=${NODES[0]}"] * served
    lines += [f'TRAIN_NODES=$(IFS=,; echo "${{NODES[*]:{first_trainer}:{len(trainers)}}}")',
              f'MAIN_ADDR=$(address "${{NODES[{first_trainer}]}}") || MAIN_ADDR=""',
              _nonempty("MAIN_ADDR", f"${{NODES[{first_trainer}]}}", interface)]
    late = ['"distributed.main_address=$MAIN_ADDR"'] if ranked or served else []
    if served:
        scheme = rr.server_url.split("://", 1)[0]
        url = f"{scheme}://$SERVER_ADDR:{r.server.port}"
        lines += ['SERVER_ADDR=$(address "$SERVER_NODE") || SERVER_ADDR=""', _nonempty("SERVER_ADDR", "$SERVER_NODE", interface)]
        late = [f'"server.url={url}"', *late]
    lines.append("OVERRIDES=(" + " ".join([shlex.join(overrides)] * bool(overrides) + late) + ")")
    train = f'{shlex.join(["workbench", "train", *recipe_args])} "${{OVERRIDES[@]}}"'
    if served:
        lines += ["# the server node: serves until the training ends",
                  # srun itself in the background, so that $! is the step srun stops (and signals) when killed
                  'srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE" bash -c "$PREAMBLE"\' exec "$@"\' _ '
                  f'{shlex.join(["workbench", "serve", "--for-training", *recipe_args])} '
                  '"${OVERRIDES[@]}" server.mode=managed &',
                  "SERVER_STEP=$!",
                  "trap 'kill \"$SERVER_STEP\" 2>/dev/null || true; wait \"$SERVER_STEP\" 2>/dev/null || true' EXIT",
                  *_wait_lines(url, _server_wait(plan), alive="$SERVER_STEP")]
    lines += [f"# the training node(s): {len(trainers)}", f'on "$TRAIN_NODES" {train}']
    return "\n".join(lines) + "\n"
