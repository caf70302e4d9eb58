"""The recipe's sections as dataclasses: every knob, its type, its default and (in a comment) what it does.

A knob with a fixed set of values says so in its type (`Literal[...]`): the loader refuses anything else with the
list, so the choices live here and nowhere else. Code asks the sections named questions about them
(`recipe.server.managed`, `.attached`, `.over_http`, `recipe.rollout.overlapped`, ...) rather than comparing strings.

A recipe has ten sections: model, data, server, rollout, trainer, rewards, devices, distributed, monitor, eval. Each
knob lives in
exactly one of them; the trainer arguments TRL needs for the server, the rewards and the device come from the
other sections (workbench.training.config), never from a second copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from workbench.recipe.trl_fields import default

SECTIONS = ("model", "data", "server", "rollout", "trainer", "peft", "rewards", "devices", "distributed", "monitor",
            "eval")



# Bump when the tiny model's build changes in a way its settings do not show, so stale caches are not reused.
TINY_BUILD_VERSION = 3  # 3: built under tinymodel.PINNED_ENV, the same weights on every x86-64 CPU with AVX2


@dataclass
class TinyModelConfig:
    """Size and pre-training of the model `workbench tiny-model` builds (used when model.path is 'tiny')."""
    seed: int = 0  # the pre-training's seed (`workbench protocol --data-seeds` sets it with data.seed)
    vocab_size: int = 512  # byte-level BPE vocabulary the tokenizer is trained to (at most)
    hidden_size: int = 256  # Qwen2 width
    num_layers: int = 2  # Qwen2 decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    pretrain_steps: int = 200  # stop early on purpose: the model follows the format but is often wrong
    batch_size: int = 32  # pre-training examples per step
    learning_rate: float = 2e-3  # pre-training's peak learning rate
    warmup_steps: int = 20  # pre-training's linear warm-up
    lr_schedule: Literal["cosine", "constant"] = "cosine"  # cosine (to 10%) | constant (noisier, higher entropy)
    eval_size: int = 300  # held-out problems scored after pre-training


@dataclass
class ModelConfig:
    path: str = "tiny"  # 'tiny' (built by the workbench), a local Hugging Face directory, or a hub id
    # the trainer's weights as loaded; auto: the checkpoint's own (float32 for the tiny model)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataConfig:
    # a preset that names its own sources (arithmetic | gsm8k | math500 | aime2024), or file: the sources below
    name: str = "arithmetic"
    # each split's source (workbench/tasks/task.py), replacing the preset's: a local .jsonl/.json/.parquet path, or
    # {path: FILE} / {hub: org/name, config: CONFIG, split: SPLIT}, each with optional fields. A validation or test
    # split without one is carved from the training source by data.seed (validation_size / heldout_size rows)
    train: Any = None  # the rows GRPO trains on (None: the preset's)
    validation: Any = None  # the rows settings are chosen on (None: the preset's, else carved from data.train)
    test: Any = None  # the rows results are reported on (None: the preset's, else carved from data.train)
    path: str | None = None  # the training file (shorthand for data.train: FILE)
    fields: dict[str, str] | None = None  # our column -> the sources' columns: question, answer, id
    split: str = "train"  # the split GRPO trains on: always train (its source is data.train)
    seed: int = 0  # the data: arithmetic's splits and the tiny model built on them (trainer.seed: the training's)
    heldout_size: int = 300  # the test split's size where it is drawn: arithmetic, or carved from data.train
    # problems kept out of training for choosing settings (eval.split: validation; `workbench protocol`):
    # arithmetic draws them, gsm8k takes its train split's last rows
    validation_size: int = 300
    train_size: int | None = None  # first N training rows; None = all
    system_prompt: str | None = None  # a system message before each question (None: none)
    instruction: str | None = None  # appended to each question, e.g. where to put the final answer
    max_prompt_length: int = 64  # tokens, chat template included; longer prompts are an error, not a silent cut


@dataclass
class ServerConfig:
    # managed (the workbench starts vLLM) | attach (someone else's, at url) | colocate (a vLLM engine inside the
    # trainer process, TRL's colocate mode; `workbench train` and `bench` only) | off (TRL's in-process generate)
    mode: Literal["managed", "attach", "colocate", "off"] = "managed"
    url: str | None = None  # for attach, e.g. http://10.0.0.5:8001
    host: str = "127.0.0.1"  # loopback unless you mean it: weight-update endpoints are open on this address
    port: int = 8000  # the managed server's port (loopback by default)
    served_model_name: str = "policy"  # the name the server answers to (vLLM's --served-model-name)
    max_model_len: int = 256  # must hold the longest prompt plus max_completion_length
    dtype: str = "auto"  # vLLM's --dtype
    tensor_parallel_size: int = 1  # vLLM's --tensor-parallel-size: cards one replica spans
    data_parallel_size: int = 1  # vLLM's --data-parallel-size: replicas behind one endpoint
    gpu_memory_utilization: float = 0.85  # vLLM's share of each card's memory (accelerators)
    max_num_seqs: int | None = None  # vLLM's --max-num-seqs: sequences in one batch (None: vLLM's default)
    max_num_batched_tokens: int | None = None  # tokens per engine step; chunked prefill (not on CPU) caps spikes
    enforce_eager: bool = False  # vLLM's --enforce-eager: no graph capture (faster start, slower decode)
    kv_cache_space_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    api_key_env: str | None = None  # name of the environment variable holding the API key, never the key
    startup_timeout_s: float = 300.0  # a server not healthy this long after its start fails with its log's tail
    # auto: lora when the recipe has a peft: section, else nccl on CUDA, hccl on Ascend, reload elsewhere
    weight_sync: Literal["auto", "nccl", "hccl", "reload", "lora", "none"] = "auto"
    sync_dir: str | None = None  # reload adapter's directory (only the workbench's files in it); default /dev/shm
    allow_remote_weight_updates: bool = False  # a non-loopback host that takes weight pushes: opt in, with a key
    max_restarts: int = 2  # a server that dies or hangs during training is restarted this often, then the run stops
    request_timeout_s: float = 600.0  # a generation request unanswered this long counts as a hung server
    # seconds a started server keeps an idle connection open (VLLM_HTTP_TIMEOUT_KEEP_ALIVE; vLLM's own default, 5,
    # is shorter than a step's scoring and optimisation): past the longest gap between two calls on one connection
    keep_alive_s: int = 600
    # more vLLM flags, passed as they are; refused when vLLM's own parser (a --config file, a prefix included) reads
    # them as changing what the workbench sets or checks (serving/launch.check_extra_args)
    extra_args: list[str] = field(default_factory=list)
    # LoRA serving (weight_sync lora, or `workbench serve --for-training` with a peft: section): vLLM's runtime
    # adapters. Each training run holds one adapter, two for a moment while it swaps versions; several runs may
    # share the server (--max-loras and --max-cpu-loras are both lora_slots)
    lora_slots: int = 4
    max_lora_rank: int | None = None  # None: the smallest rank vLLM accepts that holds peft.r
    lora_stale_s: float = 1800.0  # an adapter of a shared server not re-pushed this long is a dead run's: unloaded
    env: dict[str, str] = field(default_factory=dict)  # more environment variables for the server only
    # vLLM's --runner: generate for the policy (the only value a recipe may give); a reward model's engine is a
    # pooling one, which the workbench sets on that engine's own section (serving/rewards.py)
    runner: Literal["generate", "pooling"] = "generate"

    # The questions code asks about the mode, by name.
    @property
    def managed(self) -> bool:
        """The workbench starts (and stops) the server."""
        return self.mode == "managed"

    @property
    def attached(self) -> bool:
        """Someone else's server, at server.url."""
        return self.mode == "attach"

    @property
    def colocated(self) -> bool:
        """TRL's vLLM engine inside the trainer process."""
        return self.mode == "colocate"

    @property
    def over_http(self) -> bool:
        """Rollouts come from a server process over HTTP (managed or attached)."""
        return self.mode in ("managed", "attach")

    @property
    def in_process(self) -> bool:
        """No server process: TRL's in-process generate (off) or its in-process engine (colocate)."""
        return self.mode in ("off", "colocate")

    @property
    def uses_vllm(self) -> bool:
        """vLLM generates the rollouts (every mode but off)."""
        return self.mode != "off"


@dataclass
class RolloutConfig:
    # sync: ask the server for a batch, wait, train on it (TRL's loop as shipped).
    # async: while a step trains, the server already generates the next step's batch with the weights pushed at
    # that step's start: one step stale, corrected by TRL's importance sampling (trainer.vllm_importance_sampling_*)
    mode: Literal["sync", "async"] = "sync"
    # dynamic sampling (DAPO): a group whose completions all scored the same has zero advantage and teaches nothing;
    # such groups are replaced by groups of further training prompts, generated in extra requests before TRL scores
    dynamic_sampling: bool = False
    # extra prompts allowed per generation batch, as a multiple of its prompts (2.0: up to three times the generation);
    # slots still without signal when it is spent keep their groups, which train with zero advantage
    refill_cap: float = 2.0

    @property
    def overlapped(self) -> bool:
        """async: the next step's rollouts are generated while this step trains."""
        return self.mode == "async"


@dataclass
class DevicesConfig:
    # auto: npu where /dev/davinci* works, else cuda where /dev/nvidia* works, else cpu (WORKBENCH_PLATFORM forces one)
    platform: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    server: list[int] = field(default_factory=lambda: [0])  # device ids (CPU: cores) that serve
    trainer: list[int] = field(default_factory=lambda: [1])  # device ids (CPU: cores) that train
    env: dict[str, str] = field(default_factory=dict)  # for every process (HCCL timeouts, log levels)
    # an accelerator's peaks per card for the roofline gauge (training/gauge.py); None: platform/datasheets.yaml's
    # figures for the card's name. Not on the CPU, whose limits are measured.
    peak_memory_gb_s: float | None = None  # one card's memory bandwidth in GB/s, for the gauge (None: the datasheet's)
    peak_tflops: float | None = None  # one card's dense bf16 TFLOPS, for the gauge (None: the datasheet's)


@dataclass
class DistributedConfig:
    """How the trainer runs on several processes and nodes: through `accelerate launch`, never a launcher of ours."""
    processes: int | None = None  # trainer processes per node; None: one per devices.trainer id (CPU: 1)
    nodes: int = 1  # machines that train
    node_rank: int = 0  # this machine's index among them (0 = the main node)
    main_address: str = "127.0.0.1"  # the main node's address as the other nodes reach it
    main_port: int = 29500  # the trainers' rendezvous port on the main node
    strategy: Literal["ddp", "deepspeed", "fsdp"] = "ddp"  # accelerate's: ddp, deepspeed (zero_stage) or fsdp
    zero_stage: Literal[1, 2, 3] = 2  # deepspeed only (3 shards the weights too)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 when trainer.bf16 on an accelerator
    device_memory_gib: float | None = None  # per card, for `workbench plan` (None: 64 on a 910B, 80 on CUDA)


@dataclass
class MonitorConfig:
    runs_dir: str = "runs"  # where run directories are made (relative to the working directory)
    sample_interval_s: float = 1.0  # device and server sampling period
    dashboard: bool = True  # the live dashboard in the training notebook
    completions_shown: int = 4  # recent completions the dashboard and report show
    # GRPO groups recorded per training step for the group inspector (train/groups/), drawn at random; 0 = none
    groups_per_step: int = 16
    # weight-parity canary: every N optimizer steps (0 = off) a fixed probe set is scored by the server and by the
    # trainer right after a weight push; the gap is mean |log p_server - log p_trainer| per token
    canary_every: int = 10
    canary_warn_gap: float | None = None  # None: 2e-3 nats/token in float32, 0.05 in 16-bit
    canary_stop_gap: float | None = None  # None: 0.02 in float32, 0.5 in 16-bit; above it the run stops
    # the policy's KL from its starting weights on the canary's probes (logged as drift/kl_start), whatever
    # trainer.beta is: at the first log line, every N optimizer steps and at the last (0 = off)
    drift_every: int = 10


# The base-vs-trained analysis's per-problem table (workbench/evaluation/analysis.py builds it with these columns,
# the dataset's breakdown fields inserted before response_length): a dataset field named like one of them cannot be
# an eval.breakdown, which the recipe check refuses at load, before any work.
ANALYSIS_OUTCOMES = ("fixed", "broken", "both_right", "both_wrong")
ANALYSIS_COLUMNS = ("id", "base", "trained", *ANALYSIS_OUTCOMES, "outcome", "base_tokens", "trained_tokens",
                    "trained_truncated", "response_length", "prompt", "gold", "base_response", "trained_response")


@dataclass
class EvalConfig:
    split: str = "heldout"  # heldout (the test split) to report; validation while choosing settings
    num_samples: int = 300  # problems scored (the first N of the split)
    repeats: int = 1  # times each problem is asked: accuracy's mean and spread over them
    concurrency: int = 8  # requests in flight at once
    endpoint: Literal["chat", "completions"] = "chat"  # chat (the chat template) or completions (the raw prompt)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    seed: int = 1234  # the requests' sampling seed (plus the repeat's index)
    max_tokens: int = 48  # tokens per answer; a longer answer is cut and counts as truncated
    stop: list[str] = field(default_factory=list)  # stop strings (empty: none but the end of sequence)
    retries: int = 3  # per request, on connection errors, timeouts and 5xx
    # dataset fields the base-vs-trained analysis breaks its counts down by (workbench/evaluation/analysis.py):
    # arithmetic: operation, carry, phrasing (empty: all three); a dataset: any column of its records
    breakdown: list[str] = field(default_factory=list)
    # the learning curve: every N optimizer steps, right after a push, the weights the server now holds (the
    # trainer's own) are scored on the first during_samples problems of during_split, greedily, with this section's
    # request settings (training/evalcurve.py; 0: off), and once more after the last step. keep_best keeps the
    # best-scoring step's model in train/best
    every_steps: int = 0
    during_split: str = "validation"  # the learning curve's split
    during_samples: int = 100  # the learning curve's problems (the first N of during_split)
    keep_best: bool = False  # keep the learning curve's best step's model in train/best


# --max-lora-rank values vLLM accepts (vllm/config/lora.py MaxLoRARanks, 0.23.0 to 0.32.0)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoraConfig arguments the workbench sets itself (the task and the base model are the recipe's)
DERIVED_PEFT_KEYS = ("task_type", "peft_type", "base_model_name_or_path", "revision", "inference_mode",
                     "peft_version", "auto_mapping")


@dataclass
class Recipe:
    name: str = "custom"  # the recipe's name: run directories and reports carry it
    description: str = ""  # one line for `workbench recipe list`
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: dict[str, Any] = field(default_factory=dict)  # trl.GRPOConfig arguments, checked against it
    # peft.LoraConfig arguments (r, lora_alpha, lora_dropout, target_modules, ...), checked against it; empty: full
    # fine-tuning. With it the trainer trains an adapter and the server samples under it (server.weight_sync lora)
    peft: dict[str, Any] = field(default_factory=dict)
    # name: weight, or name: {function: module:function, weight, args} (workbench/tasks/rewardspec.py)
    rewards: dict[str, Any] = field(default_factory=lambda: {"correctness": 1.0, "format": 0.2})
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=110)

    @property
    def lora(self) -> bool:
        """The trainer trains a LoRA adapter (a peft: section)."""
        return bool(self.peft)

    @property
    def lora_rank(self) -> int:
        """The largest adapter rank the recipe trains (peft.r and any rank_pattern entry)."""
        pattern = self.peft.get("rank_pattern") or {}
        ranks = [self.peft.get("r", 8), *(pattern.values() if isinstance(pattern, dict) else [])]
        return max(int(r) for r in ranks if isinstance(r, int) and not isinstance(r, bool)) if ranks else 8

    @property
    def served_lora_rank(self) -> int:
        """--max-lora-rank of a server this recipe starts: server.max_lora_rank, else vLLM's smallest that fits."""
        if self.server.max_lora_rank is not None:
            return self.server.max_lora_rank
        return next((r for r in VLLM_LORA_RANKS if r >= self.lora_rank), VLLM_LORA_RANKS[-1])

    @property
    def max_completion_length(self) -> int:
        return int(self.trainer.get("max_completion_length", default("max_completion_length")))
