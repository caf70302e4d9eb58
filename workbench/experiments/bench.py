"""`workbench bench`: one GRPO configuration through every rollout path on this machine, measured in one run.

    workbench bench --recipe cpu-tiny --repeats 1              # tiny + ~100M random-weight model, 5 paths (~15 min)
    workbench bench --recipe cpu-tiny --sizes tiny --steps 3 --warmup 1 --paths server,async
    workbench bench --recipe cpu-tiny --sizes 100m --paths server,lora    # the full push against the adapter's
    workbench bench --recipe cpu-tiny --sizes 100m --paths server,async --repeats 3   # ratios with their spread
    notebooks/06_bench.ipynb                                   # the same, with the table and the figure inline

Paths: `in-process` (TRL's own `generate` in the trainer process, server.mode off), `colocate` (TRL's vLLM engine
inside the trainer process), `server` (the managed vLLM server, synchronous) and `async` (the managed server, the
next batch generated while the current step trains: workbench/training/overlap.py) and `lora` (the same as
`server`, training a rank-16 adapter on every projection and pushing the adapter alone: server.weight_sync lora, on a
LoRA server of its own) and `reward-model` (the same as `server`, with the tiny reward model scored beside the rules
on an engine of its own next to the server, as in cpu-tiny-rm: the learned reward's cost per step is its
`time/reward`; the same tiny reward model for every size). On the CPU the paths without a server get the server's
cores too: the trade-off a user faces is "give cards to a server, or keep them all".

Per path: the median over the measured steps (after `--warmup` steps) of the step time and its breakdown
(generation as the server ran it, the trainer's wait for it, weight sync, reward, scoring, optimisation), the
completion tokens per step, the generation's tokens/s, and the rollout efficiency: completion tokens per second of
training ÷ the server's saturated tokens/s for the same request (a concurrency sweep against the same server, in the
same run; for `lora` on its server, both on the base model and under the trained adapter: vLLM's decode cost of an
unmerged adapter), and the megabytes each weight push moved. Sizes: the recipe's model and, for the tiny model, a ~100M-parameter model of the same architecture with
random weights (built locally, no download), at 128-token completions and a smaller batch.

Against the machine (platform/limits.py, CPU): the bench measures memory read and copy bandwidth and float32 GEMM
throughput on the server's cores, the trainer's and both, then says for each path how close its generation came to
the decode ceiling (read bandwidth, GEMM) and its optimisation to the GEMM throughput of the cores it ran on; and
each weight push (megabytes, seconds, our write and the server's reload call) against the machine's copy bandwidth.

Repeats (`--repeats N`, 3 from the command line, so about three times the time): every path is trained N times.
The paths on the shared server take turns (server, async, server, async, ...) so that a drift of the machine's
speed reaches both alike, as do the paths without a server among themselves; the lora path repeats on its own
server. A path's row is its median repeat (by step time); its ratio to the server path is taken per repeat (each
repeat's step against the same repeat's server step: side by side for async, the same ordinal for the others) and
shown as the median with the range over the repeats.

Output: RUN/bench/bench.json (every number, the machine and the versions), bench.md (the table), bench.png, and one
training directory per size and path (bench/<size>-<path>/: metrics.jsonl, devices.jsonl, train.json).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench import tinymodel
from workbench.platform import limits as roofline
from workbench.errors import WorkbenchError
from workbench.platform.compat import dist_version
from workbench.recipe import Resolved, load, resolve
from workbench.recipe.resolve import tiny_reward_model_dir
from workbench.records import read_jsonl
from workbench.rundir import RunDir, StageDir, TrainDir, write_atomic
from workbench.training import launch
from workbench.training.config import preflight
from workbench.training.gauge import decode_context, role_limits

LOCAL = ("in-process", "colocate")  # no server: the trainer gets the server's cores too
SERVED = ("server", "async", "reward-model")  # the paths that share one managed server (and its saturation sweep)
OWN_SERVER = ("lora",)  # a path on a server of its own (started with LoRA slots), measured alone
LORA = ["peft.r=16", "peft.lora_alpha=32", "peft.target_modules=all-linear"]
PATHS = {  # name -> what the recipe says for it
    "in-process": ["server.mode=off", "rollout.mode=sync"],
    "colocate": ["server.mode=colocate", "rollout.mode=sync"],
    "server": ["server.mode=managed", "rollout.mode=sync"],
    "async": ["server.mode=managed", "rollout.mode=async"],
    "lora": ["server.mode=managed", "rollout.mode=sync", *LORA],
    # the rules and a learned reward beside them, scored on its own engine (serving/rewards.py)
    "reward-model": ["server.mode=managed", "rollout.mode=sync",
                     "rewards.preference={kind: model, model: tiny-rm, score: probability, weight: 1.0}"],
}
SIZES = {  # name -> overrides on a tiny-model recipe ("tiny": the recipe as it is)
    "tiny": [],
    # the tiny model's architecture (Qwen2, vocab 512) at ~95M parameters, random weights, 128-token completions,
    # 2 prompts × 4 completions a step: a CPU step stays in the tens of seconds
    "100m": ["model.tiny.hidden_size=1024", "model.tiny.num_layers=10", "model.tiny.num_heads=16",
             "model.tiny.num_kv_heads=8", "model.tiny.pretrain_steps=0", "model.tiny.eval_size=0",
             "trainer.max_completion_length=128", "trainer.per_device_train_batch_size=8",
             "trainer.num_generations=4", "trainer.temperature=1.0"],
}
BREAKDOWN = ["time/generation", "time/rollout_wait", "time/weight_sync", "time/reward", "time/scoring",
             "time/optimisation"]
HEADER = ["size", "path", "step s", "vs server", "generation s", "waited s", "sync s", "reward s", "scoring s",
          "optimisation s", "tokens/step", "generation tok/s", "training tok/s", "rollout efficiency", "sync MB"]


@dataclass
class PathResult:
    size: str
    path: str
    steps: int
    step_seconds: float
    breakdown: dict[str, float]
    tokens_per_step: float
    generation_tokens_per_second: float | None
    training_tokens_per_second: float
    staleness: float
    sampler_cpu_percent: float | None  # the monitor's sampler, % of one core over the training
    train_dir: str
    efficiency: float | None = None  # training tokens/s ÷ the server's saturated tokens/s (server paths)
    sync_megabytes: float = 0.0  # median megabytes a weight push moved (0: no push)
    sync_seconds: float = 0.0  # median seconds of a push
    sync_parts: dict[str, float] = field(default_factory=dict)  # median seconds of each timed part of a push
    repeat: int = 0  # which of the bench's repeats (0-based)


@dataclass
class Bench:
    recipe: str
    steps: int
    warmup: int
    machine: dict
    results: list[PathResult] = field(default_factory=list)
    saturation: dict[str, dict] = field(default_factory=dict)  # size -> {concurrency: tokens/s, ..., "best": ..}
    sizes: dict[str, dict] = field(default_factory=dict)  # size -> parameters, completion tokens, batch
    # size -> {"base": saturation on the LoRA server's base model, "adapter": under the lora path's trained adapter}
    lora_saturation: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    limits: dict | None = None  # platform/limits.py: copy bandwidth and GEMM throughput on each role's cores (CPU)
    repeats: int = 1  # trainings per path, taking turns

    def repeats_of(self, size: str, path: str) -> list[PathResult]:
        return sorted((r for r in self.results if r.size == size and r.path == path), key=lambda r: r.repeat)

    def result(self, size: str, path: str) -> PathResult | None:
        """The path's median repeat by step time (the lower of the two middle ones for an even count)."""
        runs = sorted(self.repeats_of(size, path), key=lambda r: r.step_seconds)
        return runs[(len(runs) - 1) // 2] if runs else None

    def medians(self) -> list[PathResult]:
        """Each (size, path) once, as its median repeat, in the order first measured."""
        return [self.result(size, path) for size, path in dict.fromkeys((r.size, r.path) for r in self.results)]

    def ratios(self, size: str, path: str, against: str = "server") -> list[float]:
        """The path's step time over the `against` path's, repeat by repeat (pairs measured side by side)."""
        base = {r.repeat: r.step_seconds for r in self.repeats_of(size, against)}
        return [r.step_seconds / base[r.repeat] for r in self.repeats_of(size, path) if base.get(r.repeat)]

    def ratio_text(self, size: str, path: str, against: str = "server") -> str:
        """'0.66' for one repeat, '0.66 (0.62-0.70)' for several: the median and the range."""
        values = self.ratios(size, path, against)
        if not values:
            return "—"
        text = f"{statistics.median(values):.2f}"
        # one training per path: the ratio of two single timings, whose spread this run cannot show
        return text + (f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else " (1 repeat)")

    def rows(self) -> list[list[str]]:
        out = []
        for r in self.medians():
            ratio = self.ratio_text(r.size, r.path)
            b = r.breakdown
            out.append([r.size, r.path, f"{r.step_seconds:.2f}", ratio] + [f"{b.get(k, 0.0):.2f}" for k in BREAKDOWN]
                       + [f"{r.tokens_per_step:.0f}",
                          f"{r.generation_tokens_per_second:.0f}" if r.generation_tokens_per_second else "—",
                          f"{r.training_tokens_per_second:.0f}",
                          f"{r.efficiency:.0%}" if r.efficiency is not None else "—",
                          f"{r.sync_megabytes:.2f}"])
        return out

    def markdown(self) -> str:
        m = self.machine
        again = (f"; each path {self.repeats} times, taking turns: its median repeat shown, ratios to the server "
                 "path per repeat as median (range)") if self.repeats > 1 else ""
        lines = [f"Recipe {self.recipe}: {self.steps} measured steps after {self.warmup} warm-up "
                 f"step(s), medians{again}; {m.get('date', '')}; {m.get('summary', '')}", "",
                 "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows()]
        if self.repeats == 1:
            lines.append("\nOne training per path: each ratio is two single timings, and timings of one path differ "
                         "between runs on the same machine by more than most differences between paths. Read no ratio "
                         "as a finding before --repeats 3 (or more) shows its range.")
        sampler = [r.sampler_cpu_percent for r in self.results if r.sampler_cpu_percent is not None]
        if sampler:
            lines.append(f"\nThe monitor's sampler used at most {max(sampler):.2f}% of one core (its thread's CPU time "
                         "over its wall time, per path).")
        for size, sat in self.saturation.items():
            levels = ", ".join(f"{c} in flight {v:.0f}" for c, v in sat.items() if c != "best")
            lines.append(f"\n{size}: server saturated at {sat.get('best', 0):.0f} tokens/s for the training request "
                         f"({levels}); {self.sizes.get(size, {}).get('parameters', 0) / 1e6:.1f}M parameters")
        for size, sat in self.lora_saturation.items():
            base, adapter = sat["base"]["best"], sat["adapter"]["best"]
            lines.append(f"\n{size}: the LoRA server saturated at {base:.0f} tokens/s on the base model and "
                         f"{adapter:.0f} under the trained adapter: decode {base / adapter:.2f}× slower with it")
        for r in self.medians():
            gauge = self.gauge_line(r)
            if gauge:
                lines.append("\n" + gauge)
        copy = self.machine.get("copy_gbps") or {}
        for r in self.medians():
            if r.sync_megabytes and r.sync_seconds:
                lines.append("\n" + sync_line(r, copy))
        for size in dict.fromkeys(r.size for r in self.results):
            full, lora = self.result(size, "server"), self.result(size, "lora")
            if full and lora and full.sync_megabytes and full.breakdown["time/weight_sync"]:
                lines.append(f"\n{size}: a LoRA push moved {lora.sync_megabytes:.2f} MB in "
                             f"{lora.breakdown['time/weight_sync']:.3f} s, {lora.sync_megabytes / full.sync_megabytes:.1%}"
                             f" of the full push's bytes and {lora.breakdown['time/weight_sync'] / full.breakdown['time/weight_sync']:.1%} of its "
                             f"seconds ({full.sync_megabytes:.1f} MB in {full.breakdown['time/weight_sync']:.3f} s)")
        return "\n".join(lines) + "\n"

    def gauge_line(self, r: PathResult) -> str | None:
        """A path against the machine's limits: the server's decode ceiling for the step's batch and the trainer
        cores' GEMM throughput (platform/limits.py); None when the limits or the model's shape were not measured."""
        shape = (self.sizes.get(r.size) or {}).get("shape")
        if not self.limits or not shape:
            return None
        shape = roofline.Shape(**shape)
        parts = []
        # a path without a server generates and trains on both cores (see the module docstring)
        local = r.path in LOCAL
        if r.generation_tokens_per_second and r.path != "in-process":  # in-process: TRL's generate, not vLLM
            where = self.limits["both" if local else "server"]
            ceiling = roofline.decode_ceiling(shape, where)
            whose = roofline.owner("both" if local else "server", where)
            parts.append(f"generation at {r.generation_tokens_per_second / ceiling['ceiling']:.0%} of "
                         f"{whose} decode ceiling ({ceiling['ceiling']:.0f} "
                         f"tokens/s for {shape.in_flight} sequences, {ceiling['bound']}-bound: memory "
                         f"{ceiling['memory']:.0f}, compute {ceiling['compute']:.0f})")
        cores = self.limits["both" if local else "trainer"]
        share = roofline.optimisation_share(shape, r.tokens_per_step, r.breakdown.get("time/optimisation", 0.0), cores)
        if share is not None:
            gemm = cores["gemm"]
            whose = roofline.owner('both' if local else 'trainer', cores)
            if "source" in cores:  # a datasheet's peak: one figure, and where it comes from
                parts.append(f"optimisation at {share:.0%} of {whose} dense bf16 peak ({gemm['median'] / 1e3:.0f} "
                             f"TFLOPS, {cores['source']}; completion tokens only: a lower bound)")
            else:
                parts.append(f"optimisation at {share:.0%} of {whose} float32 GEMM throughput ({gemm['median']:.0f} "
                             f"GFLOP/s, {gemm['min']:.0f}-{gemm['max']:.0f}; completion tokens only: a lower bound)")
        return f"{r.size} {r.path}: " + "; ".join(parts) if parts else None

    def save(self, stage: StageDir) -> Path:
        stage.make()
        write_atomic(stage.table, self.markdown())
        return write_atomic(stage.json, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, stage: StageDir) -> "Bench":
        raw = json.loads(Path(stage.json).read_text())
        raw["results"] = [PathResult(**{k: v for k, v in r.items() if k in PathResult.__dataclass_fields__})
                          for r in raw.get("results", [])]
        return cls(**raw)

    def figure(self, path: Path) -> Path:
        """Stacked step-time breakdown per path, one panel per size."""
        from workbench.plots import plt, save_png  # lazy: matplotlib

        sizes = list(dict.fromkeys(r.size for r in self.results))
        fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.6), squeeze=False)
        parts = ["time/rollout_wait", "time/weight_sync", "time/reward", "time/scoring", "time/optimisation"]
        labels = ["waiting for rollouts", "weight sync", "reward", "scoring", "optimisation"]
        for ax, size in zip(axes[0], sizes):
            mine = [r for r in self.medians() if r.size == size]
            bottom = [0.0] * len(mine)
            for part, label in zip(parts, labels):
                values = [r.breakdown.get(part, 0.0) for r in mine]
                ax.bar([r.path for r in mine], values, bottom=bottom, label=label)
                bottom = [a + b for a, b in zip(bottom, values)]
            for i, r in enumerate(mine):
                ax.text(i, r.step_seconds, f"{r.step_seconds:.2f}s", ha="center", va="bottom", fontsize=8)
            ax.set_title(f"{size}: median step time")
            ax.set_ylabel("seconds per step")
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, fontsize=8, loc="lower center", ncol=len(names), frameon=False)
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        return save_png(fig, path, dpi=110)


def sync_line(r: PathResult, copy: dict) -> str:
    """A path's weight push against the machine's copy bandwidth: how far the sync is from moving bytes at memory
    speed, and which part (ours: gathering and writing; the server's: its reload call) holds it back."""
    rate = r.sync_megabytes / 1e3 / r.sync_seconds
    text = f"{r.size} {r.path}: a weight push moved {r.sync_megabytes:.1f} MB in {r.sync_seconds:.3f} s ({rate:.2f} GB/s"
    if copy.get("median"):
        text += (f", {rate / copy['median']:.0%} of the machine's copy bandwidth, {copy['median']:.1f} GB/s: median of "
                 f"{copy['repeats']} copies of {copy['megabytes']} MB, {copy['min']:.1f}-{copy['max']:.1f}")
    text += ")"
    parts = r.sync_parts
    if parts.get("write") and "server" in parts:
        text += (f"; our write {parts['write']:.3f} s ({r.sync_megabytes / 1e3 / parts['write']:.2f} GB/s), the "
                 f"server's reload call {parts['server']:.3f} s ({parts['server'] / r.sync_seconds:.0%} of the push)")
    return text


def _limits(rr: Resolved) -> dict | None:
    """The limits of the server's cores or cards, the trainer's and both (where a path without a server trains):
    measured on the CPU, an accelerator's datasheet peaks (training/gauge.py role_limits)."""
    server, trainer = list(rr.server.devices), list(rr.trainer.devices)
    # a path without a server runs in the trainer process: on the CPU it may use both roles' cores, on an
    # accelerator it sees the trainer's cards only
    both = sorted(set(server) | set(trainer)) if rr.platform == "cpu" else trainer
    return role_limits(rr, {"server": server, "trainer": trainer, "both": both}, megabytes=256)


def machine(rr: Resolved) -> dict:
    """Cores, memory, accelerator and the versions the numbers were measured with."""
    import psutil

    cores = len(os.sched_getaffinity(0))
    memory = psutil.virtual_memory().total / 2**30
    accelerator = rr.platform
    if rr.platform == "cuda":
        import torch
        accelerator = torch.cuda.get_device_name(0)
    versions = {name: dist_version(name, f"{name}-cpu") or "-"
                for name in ("torch", "vllm", "trl", "transformers", "accelerate")}
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": cores, "memory_gib": round(memory, 1),
            "accelerator": accelerator, "cpu": platform.processor() or platform.machine(), "versions": versions,
            "split": {"server": list(rr.server.devices), "trainer": list(rr.trainer.devices)},
            "copy_gbps": roofline.copy_bandwidth(),  # the whole machine's: the ceiling of a weight push
            "summary": f"{platform.machine()}, {cores} cores, {memory:.0f} GiB, {accelerator}; "
                       + ", ".join(f"{k} {v}" for k, v in versions.items())}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarise(size: str, path: str, train_dir: TrainDir, warmup: int, repeat: int = 0) -> PathResult:
    """Medians over the logged steps after the warm-up (metrics.jsonl, one line per step)."""
    lines = [m for m in read_jsonl(train_dir.metrics, normalised=False) if "time/step" in m]
    measured = [m for m in lines if m.get("step", 0) > warmup] or lines
    if not measured:
        raise WorkbenchError(f"the {size} {path} training logged no step", f"read {train_dir.log}")
    step = _median([m["time/step"] for m in measured])
    tokens = _median([m.get("rollout/completion_tokens", 0.0) for m in measured])
    generation = [m["rollout/tokens_per_second"] for m in measured if m.get("rollout/tokens_per_second")]
    summary = json.loads(train_dir.summary.read_text()) if train_dir.summary.exists() else {}
    monitor = summary.get("monitor") or {}
    return PathResult(
        size=size, path=path, steps=len(measured), step_seconds=step,
        breakdown={k: _median([m.get(k, 0.0) for m in measured]) for k in BREAKDOWN},
        tokens_per_step=tokens, generation_tokens_per_second=_median(generation) if generation else None,
        training_tokens_per_second=tokens / step if step else 0.0,
        staleness=_median([m.get("rollout/staleness", 0.0) for m in measured]),
        sampler_cpu_percent=100 * monitor["core_share"] if "core_share" in monitor else None,
        train_dir=str(train_dir.path),
        sync_megabytes=_median([m["sync/megabytes"] for m in measured if m.get("sync/megabytes")]),
        sync_seconds=_median([m["sync/seconds"] for m in measured if m.get("sync/seconds")]),
        sync_parts={part: _median([m[f"sync/{part}_seconds"] for m in measured if f"sync/{part}_seconds" in m])
                    for part in ("write", "server") if any(f"sync/{part}_seconds" in m for m in measured)},
        repeat=repeat)


def saturation(rr: Resolved, url: str, concurrencies: list[int], rounds: int = 2, adapter: str | None = None) -> dict:
    """The server's completion tokens/s for the training's own request (its prompts, n, max tokens, temperature)
    with 1, 2, 4... such requests in flight at once; with `adapter` (a LoRA directory), under that adapter."""
    from transformers import AutoTokenizer

    from workbench.serving import sync  # lazy: torch

    args = rr.recipe.trainer
    n = int(args.get("num_generations", 8))
    prompts_per_step = max(1, int(args.get("per_device_train_batch_size", n)) // n)
    tokenizer = AutoTokenizer.from_pretrained(rr.model_path)
    rows = rr.task.train_rows(tokenizer)[:prompts_per_step]
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    client = sync.SyncingVLLMClient(base_url=url, weight_sync=sync.NoSync(), headers=rr.headers,
                                    request_timeout=rr.recipe.server.request_timeout_s)
    client.model = rr.recipe.server.served_model_name
    if adapter is not None:  # loaded under a name of its own, unloaded at the end
        name = sync.adapter_name("bench", 0)
        response = client.session.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapter},
                                       headers=rr.headers, timeout=120)
        if response.status_code != 200:
            raise WorkbenchError(f"the bench's LoRA server refused the adapter {adapter}: {response.text[:200]}",
                                 "read the server log in the bench's run directory")
        client.model = name
    params = {"n": n, "temperature": float(args.get("temperature", 1.0)), "max_tokens": rr.recipe.max_completion_length}
    try:
        return _saturate(client, prompts, params, concurrencies, rounds)
    finally:
        if adapter is not None:
            try:
                client.session.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": client.model},
                                    headers=rr.headers, timeout=120)
            except Exception:  # the server's own failure is the error that matters
                pass


def _saturate(client, prompts: list, params: dict, concurrencies: list[int], rounds: int) -> dict:
    client.generate(prompts=prompts, **params)  # warm-up
    out: dict = {}
    for c in concurrencies:
        tokens = [0] * c

        def worker(i: int) -> None:
            for _ in range(rounds):
                answer = client.generate(prompts=prompts, **params)
                tokens[i] += sum(len(ids) for ids in answer["completion_ids"])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(c)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[str(c)] = sum(tokens) / (time.perf_counter() - started)
    out["best"] = max(v for k, v in out.items())
    return out


def _recipe(base, size: str, path: str, steps: int, warmup: int, extra: list[str]):
    common = [f"trainer.max_steps={steps + warmup}", "trainer.logging_steps=1", "trainer.save_strategy=no",
              "trainer.log_completions=false", "trainer.vllm_importance_sampling_correction=true",
              "monitor.canary_every=0", "monitor.drift_every=0"]  # no probe pass inside a timed step
    own = PATHS[path]
    if path == "reward-model" and size != "tiny":  # the tiny size's reward model: its scoring cost beside a bigger policy
        own = [o.replace("model: tiny-rm", f"model: {tiny_reward_model_dir(load(base))}") for o in own]
    recipe = load(base, SIZES[size] + common + own + extra)
    needed = recipe.data.max_prompt_length + recipe.max_completion_length
    if recipe.server.max_model_len < needed:
        recipe = load(recipe, [f"server.max_model_len={needed}"])
    return resolve(recipe)


def run(recipe, steps: int = 4, warmup: int = 1, sizes: list[str] | None = None, paths: list[str] | None = None,
        concurrencies: list[int] | None = None, overrides: list[str] | None = None, run_dir: RunDir | None = None,
        log=print, repeats: int = 1) -> tuple[Bench, RunDir]:
    """Every size × path, one after the other (never two at once: they would share cores), `repeats` times taking
    turns. `recipe` is a loaded Recipe; `overrides` apply to every path last (e.g. monitor.canary_every=1);
    `run_dir`: write there (a notebook's run) instead of a new `<time>-<recipe>-bench` directory."""
    from workbench.serving.rewards import RewardEngines  # lazy: requests
    from workbench.serving.server import VLLMServer  # lazy: requests
    from workbench.training.train import run_trainer  # lazy: torch

    sizes = sizes or (list(SIZES) if recipe.model.path == "tiny" else ["tiny"])
    paths = paths or list(PATHS)
    overrides = list(overrides or [])
    for name in sizes:
        if name not in SIZES:
            raise WorkbenchError(f"--sizes names {name!r}", f"use some of: {', '.join(SIZES)}")
        if name != "tiny" and recipe.model.path != "tiny":
            raise WorkbenchError(f"size {name!r} builds a random-weight copy of the tiny model, but model.path is "
                                 f"{recipe.model.path!r}", "bench this recipe with --sizes tiny (its own model)")
    for name in paths:
        if name not in PATHS:
            raise WorkbenchError(f"--paths names {name!r}", f"use some of: {', '.join(PATHS)}")
    if steps < 1 or warmup < 0:
        raise WorkbenchError(f"--steps {steps} --warmup {warmup}", "measure 1 or more steps after 0 or more warm-up steps")
    if repeats < 1:
        raise WorkbenchError(f"--repeats {repeats}", "train each path 1 or more times (3 for a ratio's spread)")
    if "reward-model" in paths:  # built (or reused) before the recipes that name it are checked
        from workbench.training import rewardmodel

        rewardmodel.ensure(resolve(load(recipe, SIZES["tiny"])), log=log)
    # every recipe is checked before anything starts
    plans = {(s, p): _recipe(recipe, s, p, steps, warmup, overrides) for s in sizes for p in paths}
    first = next(iter(plans.values()))

    for rr in plans.values():
        preflight(rr)
        # the bench trains in this process: on an accelerator it must already be the trainer role's (its visible
        # devices set before the device runtime started), or every path would train on the server's first card
        missing = launch.role_env_missing(rr)
        if rr.platform != "cpu" and missing:
            exports = " ".join(f"{k}={v}" for k, v in sorted(missing.items()))
            raise WorkbenchError(f"workbench bench trains in its own process, which lacks the trainer role's "
                                 f"environment ({exports})", f"run it as: {exports} workbench bench ...")
    run_dir = run_dir or RunDir.create(recipe, "bench")
    stage = run_dir.bench.make()
    bench = Bench(recipe=recipe.name, steps=steps, warmup=warmup, machine=machine(first),
                  limits=_limits(first), repeats=repeats)

    def again(k: int) -> str:
        return f" (repeat {k + 1}/{repeats})" if repeats > 1 else ""

    def train(train_dir, *args, **kwargs) -> None:
        """One training of the bench, its TRL and transformers output (log dicts, progress bars, warnings) in its
        own train.log: the terminal keeps the bench's progress lines and its table."""
        kwargs["log"] = log
        began = time.time()
        with open(train_dir.log, "a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            run_trainer(*args, **kwargs)
        log(f"bench:   done in {time.time() - began:.0f}s (its output: {train_dir.log})")

    started = time.time()
    for size in sizes:
        sized = plans[(size, paths[0])]
        model_path = tinymodel.ensure_model(sized, log=log)
        bench.sizes[size] = {"parameters": tinymodel.info(model_path)["parameters"] if sized.is_tiny else None,
                             "completion_tokens": sized.recipe.max_completion_length,
                             "completions_per_step": sized.recipe.trainer.get("per_device_train_batch_size")}
        if sized.is_tiny:  # float32 weights, served and trained as such
            config = json.loads((Path(model_path) / "config.json").read_text())
            shape = roofline.Shape.from_config(config, bench.sizes[size]["parameters"], 4,
                                               int(bench.sizes[size]["completions_per_step"] or 1),
                                               decode_context(sized.recipe))
            bench.sizes[size]["shape"] = asdict(shape)
        local = [p for p in paths if p not in SERVED and p not in OWN_SERVER]
        served = [p for p in paths if p in SERVED]
        alone = [p for p in paths if p in OWN_SERVER]
        for k, path in ((k, p) for k in range(repeats) for p in local):
            rr = plans[(size, path)]
            train_dir = run_dir.bench_training(size, path, k).make()
            log(f"bench: {size} {path}: {steps + warmup} steps{again(k)}")
            train(train_dir, rr, train_dir, model_path)
            bench.results.append(summarise(size, path, train_dir, warmup, k))
        if served:
            rr = plans[(size, served[0])]
            logs = run_dir.bench_server_logs(size)
            logs.mkdir(exist_ok=True)
            with VLLMServer(rr, model_path, logs, for_training=True) as srv:
                log(f"bench: {size} server up in {srv.startup_seconds or 0:.0f}s at {srv.url}")
                for k, path in ((k, p) for k in range(repeats) for p in served):
                    train_dir = run_dir.bench_training(size, path, k).make()
                    log(f"bench: {size} {path}: {steps + warmup} steps{again(k)}")
                    with RewardEngines(plans[(size, path)], logs, log=log) as engines:  # none but reward-model's
                        train(train_dir, plans[(size, path)], train_dir, model_path, srv.pid, srv.url,
                              restart=srv.restart,
                              reward_restart={name: engines.restarter(name) for name in engines.servers})
                    bench.results.append(summarise(size, path, train_dir, warmup, k))
                bench.saturation[size] = saturation(rr, srv.url, concurrencies or [1, 2, 4])
                log(f"bench: {size} server saturated at {bench.saturation[size]['best']:.0f} tokens/s")
            for r in bench.results:
                if r.size == size and r.path in served:
                    r.efficiency = r.training_tokens_per_second / bench.saturation[size]["best"]
        for path in alone:
            rr = plans[(size, path)]
            logs = run_dir.bench_server_logs(size)
            logs.mkdir(exist_ok=True)
            with VLLMServer(rr, model_path, logs, for_training=True) as srv:
                for k in range(repeats):
                    train_dir = run_dir.bench_training(size, path, k).make()
                    log(f"bench: {size} {path}: its own server up in {srv.startup_seconds or 0:.0f}s; "
                        f"{steps + warmup} steps{again(k)}")
                    train(train_dir, rr, train_dir, model_path, srv.pid, srv.url, restart=srv.restart)
                    bench.results.append(summarise(size, path, train_dir, warmup, k))
                levels = concurrencies or [1, 2, 4]
                bench.lora_saturation[size] = {"base": saturation(rr, srv.url, levels),
                                               "adapter": saturation(rr, srv.url, levels, adapter=str(train_dir.final))}
                for result in bench.repeats_of(size, path):
                    result.efficiency = (result.training_tokens_per_second
                                         / bench.lora_saturation[size]["adapter"]["best"])
        bench.seconds = round(time.time() - started, 1)
        bench.save(stage)  # after each size: an interrupted bench keeps what it measured
    bench.figure(stage.figure)
    log(bench.markdown())
    log(f"bench: {bench.seconds / 60:.1f} min; {stage.json}")
    return bench, run_dir
