"""Offline generation with vLLM's `LLM` class: the policy loads and samples in this process, no server.

    result = offline.generate(rr, num_prompts=8)         # -> OfflineResult(rows, tokens_per_second, ...)
    result.save(run.offline); OfflineResult.load(run.offline)
    result.check()                                       # raises if the stack produced nothing usable

The first sanity check of a stack: if `LLM.generate` cannot load the policy and produce answers in the expected
format, nothing later (server, GRPO) will work, and the error here is nearer its cause. Settings come from the
recipe's server section (dtype, max_model_len, parallel sizes) so the offline engine is the served one.
On the CPU build the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: half the start-up time, and
no `__main__` guard needed in a notebook) on the devices.server cores.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.rundir import StageDir, write_atomic
from workbench.serving import launch, vllm_cpu
from workbench.tasks import rewards
from workbench.tasks.grading import grade
from workbench.tinymodel import ensure_model


@dataclass
class OfflineResult:
    model_path: str
    rows: list[dict] = field(default_factory=list)  # prompt, completion, answer, correct, format, tokens
    init_seconds: float = 0.0
    generate_seconds: float = 0.0
    completion_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def accuracy(self) -> float:
        return sum(bool(r["correct"]) for r in self.rows) / len(self.rows) if self.rows else 0.0

    @property
    def format_rate(self) -> float:
        return sum(r["format"] > 0 for r in self.rows) / len(self.rows) if self.rows else 0.0

    def check(self, min_format_rate: float = 0.5) -> None:
        if not self.rows or self.completion_tokens == 0:
            raise WorkbenchError("offline generation produced no tokens",
                                 "check the model directory and the vLLM install (`workbench env`)")
        if self.format_rate < min_format_rate:
            raise WorkbenchError(f"only {self.format_rate:.0%} of offline completions follow the answer format",
                                 "check the tokenizer's chat template and the data's system prompt")

    def save(self, stage: StageDir) -> Path:
        stage.make()
        record = {**asdict(self), "accuracy": self.accuracy, "format_rate": self.format_rate,
                  "tokens_per_second": round(self.tokens_per_second, 1)}
        return write_atomic(stage.json, json.dumps(record, indent=2))

    @classmethod
    def load(cls, stage: StageDir) -> "OfflineResult | None":
        try:
            raw = json.loads(Path(stage.json).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return cls(**{k: raw[k] for k in ("model_path", "rows", "init_seconds", "generate_seconds",
                                           "completion_tokens") if k in raw})

    def table(self, n: int = 8) -> str:
        lines = ["| question | completion | gold | correct |", "|---|---|---|---|"]
        for r in self.rows[:n]:
            completion = r["completion"].replace("|", "\\|").replace("\n", " ")[:90]
            lines.append(f"| {r['question'][:60]} | `{completion}` | {r['answer']} | {'yes' if r['correct'] else 'no'} |")
        return "\n".join(lines)


def prepare_engine_environment(rr: Resolved, cores: list[int] | None = None) -> None:
    """The served engine's environment (device split, KV cache, thread binding), set in this process before vLLM is
    imported: an in-process engine (offline generation, TRL's colocate mode) runs as the server would. `cores`: on
    the CPU, bind the engine's threads to these instead of the server role's."""
    os.environ.update(launch.environment(rr))
    if rr.platform == "cpu":
        vllm_cpu.answer_version_lookup()  # vLLM asks for its own version: the vllm-cpu build's, in this process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cores:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
            os.environ["OMP_NUM_THREADS"] = str(len(cores))


def keep_live_weights() -> None:
    """For TRL's colocate mode on the CPU: the in-process engine computes its linear layers from the layers' own
    weights. vLLM's CPU build otherwise packs each weight for oneDNN (or zentorch, or AMX kernels) after loading and
    drops the original: where the CPU supports it (AVX-512 Xeons; not the AMD EPYC this was first run on), TRL's
    per-step `load_weights` then fails ('Parameter' object has no attribute 'weight_loader'), and an engine that
    kept a packed copy would sample from stale weights. Plain `torch.nn.functional.linear` reads the live weight
    that each sync writes. Call before the engine is built."""
    import torch
    from vllm.model_executor.layers import utils

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)

    def live(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # conv / expert weights: their own kernels, not reloaded per step here
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    live.__wrapped__ = original
    # linear.py imports it from this module at call time, so the module attribute is what it gets
    utils.dispatch_cpu_unquantized_gemm = live


def engine(rr: Resolved, model_path: str | None = None, log=print):
    """vLLM's `LLM` in this process with the served engine's settings: (llm, seconds it took to start)."""
    recipe, platform = rr.recipe, rr.platform
    model_path = model_path or ensure_model(rr, log=log)
    prepare_engine_environment(rr)
    from vllm import LLM

    s = recipe.server
    kwargs = dict(model=model_path, dtype=s.dtype, max_model_len=s.max_model_len,
                  tensor_parallel_size=s.tensor_parallel_size, seed=recipe.data.seed)
    if platform != "cpu":
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.enforce_eager:
        kwargs["enforce_eager"] = True
    started = time.time()
    llm = LLM(**kwargs)
    seconds = time.time() - started
    log(f"vLLM engine up in {seconds:.0f}s ({platform})")
    return llm, seconds


def generate(rr: Resolved, model_path: str | None = None, num_prompts: int = 8, max_tokens: int | None = None,
             temperature: float = 0.0, log=print) -> OfflineResult:
    recipe = rr.recipe
    model_path = model_path or ensure_model(rr, log=log)
    rows = rr.task.eval_rows(recipe.eval)[:num_prompts]
    if not rows:
        raise WorkbenchError("the evaluation split has no rows", "check the recipe's data and eval sections")
    llm, seconds = engine(rr, model_path, log=log)
    from vllm import SamplingParams

    result = OfflineResult(model_path=model_path, init_seconds=seconds)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens or recipe.eval.max_tokens,
                            seed=recipe.data.seed)
    started = time.time()
    outputs = llm.chat([row["prompt"] for row in rows], params, use_tqdm=False)
    result.generate_seconds = time.time() - started
    texts = [o.outputs[0].text for o in outputs]
    graded = grade([row["answer"] for row in rows], texts)
    formats = rewards.score("format", [[{"role": "assistant", "content": t}] for t in texts])
    for row, output, text, (extracted, correct), fmt in zip(rows, outputs, texts, graded, formats):
        tokens = len(output.outputs[0].token_ids)
        result.completion_tokens += tokens
        result.rows.append({"question": row["prompt"][-1]["content"], "completion": text, "answer": row["answer"],
                            "extracted": extracted, "correct": bool(correct), "format": fmt or 0.0,
                            "tokens": tokens})
    del llm
    return result
