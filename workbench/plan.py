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


@dataclass
class Node:
    name: str
    address: str
    processes: list[dict] = field(default_factory=list)  # {role, command, env, devices}
    ports: list[str] = field(default_factory=list)


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items()))


def nodes(rr: Resolved) -> list[Node]:
    """Who runs what: the server's node (its own when the server is attached from another machine) and each
    training node."""
    r = rr.recipe
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
        node = Node("server node", host)
        node.processes.append({"role": "server", "devices": list(rr.server.devices), "env": server_env,
                               "command": f"workbench serve --for-training --recipe {r.name} server.mode=managed"
                                          f"   # = {server_cmd}"})
        node.ports.append(f"{r.server.port}/tcp: the OpenAI API and weight-update endpoints (the trainer node only)")
        out.append(node)
    for rank in range(d.nodes):
        address = d.main_address if rank == 0 else f"<node {rank} address>"
        node = Node(f"training node {rank}" if d.nodes > 1 else "training node", address)
        if rank == 0 and not remote_server and not r.server.in_process:
            node.processes.append({"role": "server", "devices": list(rr.server.devices), "env": server_env,
                                   "command": server_cmd + "   # started by `workbench train`, stopped with it"})
        trainer_env = dict(rr.trainer.env)
        if rr.trainer_processes * d.nodes > 1:
            train_dir = "runs/<id>/train"
            command = " ".join(["accelerate", "launch"] + training_launch.rank_command(rr, _Dir(train_dir))[2:])
            if rank == 0:
                note = "   # what `workbench train` runs here once the server is up"
            else:  # no server here: only node 0's main rank talks to it
                # node 0's run recipe: every override included (the recipe's name alone would lose them)
                command = f"workbench train --recipe runs/<id>/recipe.yaml distributed.node_rank={rank}"
                note = (f"   # node 0's run recipe copied here; = accelerate launch with machine_rank {rank}; "
                        "starts no server")
            node.processes.append({"role": f"trainer ×{rr.trainer_processes}", "devices": list(rr.trainer.devices),
                                   "env": trainer_env, "command": command + note})
        else:
            engine = (f"; vLLM inside it (colocate), gpu_memory_utilization={r.server.gpu_memory_utilization} of the "
                      "card" if r.server.colocated else "")
            placed = ("   # the trainer runs as a child process with this environment" + engine
                      if training_launch.trainer_placement(rr) == "process" else "")
            node.processes.append({"role": "trainer", "devices": list(rr.trainer.devices), "env": trainer_env,
                                   "command": f"workbench train --recipe {r.name}" + placed})
        if rank == 0:
            if d.nodes > 1:
                node.ports.append(f"{d.main_port}/tcp: trainer rendezvous (from the other training nodes)")
            if rr.weight_sync in ("nccl", "hccl"):
                group = int(r.trainer.get("vllm_group_port", 51216))
                node.ports.append(f"{group}/tcp: weight-transfer group, trainer rank 0 with the server's workers"
                                  + (" (from the server node)" if remote_server else ""))
        out.append(node)
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

    def text(self) -> str:
        lines = []
        for node in self.nodes:
            lines.append(f"== {node.name} ({node.address})")
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


def plan(rr: Resolved) -> Plan:
    """The recipe's plan; two roles given one card are refused (training.launch.shared_cards), as training refuses
    them, not planned as if each had the card to itself."""
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
        if rr.recipe.server.colocated:  # one card for both: the engine takes its share, training the rest
            trainer.budget = card * (1 - rr.recipe.server.gpu_memory_utilization)
            trainer.notes.append(f"vLLM colocated: the trainer has the card less the engine's "
                                 f"gpu_memory_utilization={rr.recipe.server.gpu_memory_utilization}")
        for m in memory:
            if not m.fits:
                fix = ("shard it: distributed.strategy=deepspeed distributed.zero_stage=3 (or fsdp), turn on "
                       "trainer.gradient_checkpointing, or lower trainer.per_device_train_batch_size"
                       if m.role == "trainer" else
                       "raise server.tensor_parallel_size, lower server.max_num_seqs / max_model_len")
                warnings.append(f"the {m.role} needs about {m.total / GIB:.0f} GiB per device, over the "
                                f"{m.budget / GIB:.0f} GiB it may use: {fix}")
    else:
        warnings.append("no memory estimate on the CPU (the roles share this machine's RAM)")
    if math.prod([rr.recipe.server.tensor_parallel_size, rr.recipe.server.data_parallel_size]) != \
            len(rr.server.devices) and rr.platform != "cpu":
        warnings.append("server.tensor_parallel_size × data_parallel_size differs from the server's device count")
    return Plan(nodes(rr), shape, memory, warnings)
