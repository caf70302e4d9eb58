"""GRPO through the vLLM server: TRL's GRPOTrainer, with the workbench's weight sync and a run directory.

    workbench train --recipe smoke                 # starts the server, trains, saves, stops the server
    workbench train --recipe cpu-tiny trainer.max_steps=50

    from workbench import trainer
    result = trainer.train(recipe.load("smoke"))   # -> TrainResult(run_dir, final_model, ...)

How the sync plugs in (TRL 1.16 has no extension point for it): `GRPOTrainer.__init__` builds its vLLM backend,
and with it TRL's client, whose NCCL-only `init_communicator` fails on CPU and Ascend. `WorkbenchGRPOTrainer`
lets the parent constructor run without vLLM, then builds TRL's backend itself as `_SyncingVLLMGeneration`, whose
only change is the client class (`workbench.sync.SyncingVLLMClient`). Everything else — when to sync, how
parameters are gathered, generation, importance-sampling correction — is TRL's. tests/test_trl_hooks.py fails
when the TRL internals this relies on change.

On the CPU the server is pinned to devices.server cores and this process to devices.trainer cores: the CPU
analogue of "four cards serve, four cards train".
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from workbench import dataset, rewards, server, sync, tinymodel
from workbench.metrics import JsonlMetrics, StopFlag
from workbench.monitor import Monitor
from workbench.rundir import new_run_dir, write_atomic
from workbench.errors import WorkbenchError
from workbench.recipe import Recipe, grpo_config, resolve_platform


class _SyncingVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend with the workbench client in server mode."""

    def __init__(self, *args, weight_sync: sync.WeightSync, api_key: str | None = None, **kwargs):
        self.weight_sync = weight_sync
        self.api_key = api_key
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "server":
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = sync.SyncingVLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout,
                weight_sync=self.weight_sync, api_key=self.api_key)
            self.vllm_client.init_communicator(device=self.accelerator.device)
        self.accelerator.wait_for_everyone()


def vllm_generation_kwargs(trainer: GRPOTrainer, args: GRPOConfig) -> dict:
    """The arguments GRPOTrainer.__init__ gives VLLMGeneration in TRL 1.16 (guarded by tests/test_trl_hooks.py)."""
    return dict(
        model=trainer.model, accelerator=trainer.accelerator, processing_class=trainer.processing_class,
        mode=args.vllm_mode, structured_outputs_regex=args.vllm_structured_outputs_regex,
        server_base_url=args.vllm_server_base_url, server_host=args.vllm_server_host,
        server_port=args.vllm_server_port, group_port=args.vllm_group_port, server_timeout=args.vllm_server_timeout,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code, repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length, logprobs=0, generation_kwargs=args.generation_kwargs,
    )


class WorkbenchGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose server-mode weight sync goes through a `workbench.sync.WeightSync` adapter."""

    def __init__(self, *args, weight_sync: sync.WeightSync, api_key: str | None = None, **kwargs):
        training_args: GRPOConfig = kwargs["args"]
        wants_server = training_args.use_vllm and training_args.vllm_mode == "server"
        self.weight_sync = weight_sync
        self._phase_seconds: dict[str, float] = {}
        self._completion_tokens = 0
        self._last_log_clock = time.perf_counter()
        self._steps_at_last_log = 0
        if wants_server:
            training_args.use_vllm = False  # read once, in GRPOTrainer.__init__: skip TRL's NCCL-only client
        try:
            super().__init__(*args, **kwargs)
        finally:
            training_args.use_vllm = wants_server or training_args.use_vllm
        if isinstance(weight_sync, sync.ReloadSync):
            weight_sync.aliases.update(sync.tied_aliases(self.accelerator.unwrap_model(self.model)))
        if wants_server:
            self.use_vllm = True
            self.vllm_generation = _SyncingVLLMGeneration(
                **vllm_generation_kwargs(self, training_args), weight_sync=weight_sync, api_key=api_key)
            self._last_loaded_step = -1

    # --- the per-step time breakdown: each phase summed between two logs, reported per optimizer step ---------

    def _timed(self, phase: str, started: float) -> None:
        self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + time.perf_counter() - started

    def _prepare_inputs(self, generation_batch):
        started = time.perf_counter()
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            self._timed("rollout", started)

    def _generate_single_turn(self, *args, **kwargs):
        started = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        self._timed("generation", started)  # includes the weight sync, which is subtracted at log time
        self._completion_tokens += sum(len(ids) for ids in completion_ids)
        return completion_ids, logprobs

    def _calculate_rewards(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            self._timed("reward", started)

    def _step_breakdown(self, pushes: list[tuple[float, int]]) -> dict[str, float]:
        now, steps = time.perf_counter(), self.state.global_step - self._steps_at_last_log
        phases, self._phase_seconds = self._phase_seconds, {}
        tokens, self._completion_tokens = self._completion_tokens, 0
        wall, self._last_log_clock, self._steps_at_last_log = now - self._last_log_clock, now, self.state.global_step
        if steps <= 0:
            return {}
        sync_s = sum(s for s, _ in pushes)
        generation = max(0.0, phases.get("generation", 0.0) - sync_s)
        rollout = phases.get("rollout", 0.0)
        reward = phases.get("reward", 0.0)
        out = {
            "time/step": wall / steps,
            "time/generation": generation / steps,
            "time/weight_sync": sync_s / steps,
            "time/reward": reward / steps,
            "time/scoring": max(0.0, rollout - generation - sync_s - reward) / steps,
            "time/optimisation": max(0.0, wall - rollout) / steps,
            "rollout/completion_tokens": tokens / steps,
        }
        if generation > 0:
            out["rollout/tokens_per_second"] = tokens / generation
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        pushes = self.weight_sync.drain()
        if "loss" in logs:  # a training log line (not the end-of-training summary)
            logs.update(self._step_breakdown(pushes))
            if pushes:
                logs["sync/seconds"] = sum(s for s, _ in pushes) / len(pushes)
                logs["sync/megabytes"] = sum(b for _, b in pushes) / len(pushes) / 1e6
                logs["sync/count"] = float(len(pushes))
        elif pushes:  # not a training log line: keep the pushes for the next one
            self.weight_sync.records = pushes + self.weight_sync.records
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        self._last_log_clock = time.perf_counter()  # model loading is not a training step
        self._steps_at_last_log = self.state.global_step
        return super().train(*args, **kwargs)


@dataclass
class TrainResult:
    run_dir: Path
    final_model: Path
    metrics_path: Path
    server_start_seconds: float | None
    train_seconds: float
    steps: int


@contextlib.contextmanager
def _pinned_to_trainer_cores(recipe: Recipe, platform: str):
    """On the CPU, train on devices.trainer cores only; afterwards give this process its cores back (a later stage
    in the same process, such as the evaluation's server, must be able to use the server's cores again)."""
    if platform != "cpu":
        yield
        return
    import torch

    saved_cores, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, set(recipe.devices.trainer))
    torch.set_num_threads(len(recipe.devices.trainer))
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_cores)
        torch.set_num_threads(saved_threads)


def build_trainer(recipe: Recipe, model_path: str, output_dir: Path, weight_sync: sync.WeightSync,
                  platform: str | None = None) -> WorkbenchGRPOTrainer:
    """A ready trainer for the recipe (the server must already answer at the recipe's URL)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    platform = platform or resolve_platform(recipe)
    args = grpo_config(recipe, str(output_dir), platform)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    rows = dataset.recipe_rows(recipe, tokenizer=tokenizer)
    dtype = "auto" if recipe.model.dtype == "auto" else getattr(torch, recipe.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return WorkbenchGRPOTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=dataset.to_hf_dataset(rows),
        reward_funcs=[rewards.get(name) for name in recipe.rewards],
        weight_sync=weight_sync, api_key=server.api_key(recipe))


def train(recipe: Recipe, run_dir: Path | None = None, log=print) -> TrainResult:
    """Start (or attach to) the server, run GRPO, save the final model in Hugging Face format, stop the server."""
    platform = resolve_platform(recipe)
    if recipe.server.mode == "off":
        raise WorkbenchError("server.mode is 'off'", "`workbench train` trains through a vLLM server: set it to managed or attach")
    model_path = tinymodel.resolve_model_path(recipe, log=log)
    tinymodel.check_tokenizer(model_path)
    run_dir = run_dir or new_run_dir(recipe)
    method = server.weight_sync_method(recipe, platform)
    weight_sync = sync.make(method, recipe.server.sync_dir, recipe.trainer.get("vllm_group_port", 51216))
    metrics_path = run_dir / "metrics.jsonl"
    with server.VLLMServer(recipe, model_path, run_dir) as srv:
        log(f"server: {srv.url} serving {recipe.server.served_model_name!r}"
            + (f", started in {srv.startup_seconds:.0f}s" if srv.startup_seconds else " (attached)"))
        with _pinned_to_trainer_cores(recipe, platform):
            trainer = build_trainer(recipe, model_path, run_dir / "checkpoints", weight_sync, platform)
            trainer.add_callback(JsonlMetrics(metrics_path))
            stop_flag = StopFlag(run_dir, log=log)
            trainer.add_callback(stop_flag)
            log(f"training: {trainer.args.max_steps} steps, weight sync {method!r}, metrics -> {metrics_path}")
            # started inside the pinned block: the sampler thread shares the trainer's cores, so its cost shows
            # in the step time it is measured against
            # one sampler per run, not per rank: under `accelerate launch` only the main process samples
            sampler = Monitor(recipe, run_dir, server_pid=srv.process.pid if srv.process else None,
                              server_url=srv.url, api_key=srv.key, platform=platform,
                              enabled=trainer.accelerator.is_main_process)
            started = time.time()
            with sampler:
                trainer.train()
            train_seconds = time.time() - started
        final = run_dir / "final"
        trainer.save_model(str(final))
        trainer.processing_class.save_pretrained(str(final))
        try:
            write_atomic(run_dir / "server_metrics.prom", srv.metrics())
        except Exception as exc:  # the run is saved; a missing snapshot only costs the rollout summary
            log(f"warning: could not read the server's /metrics ({exc})")
        result = TrainResult(run_dir, final, metrics_path, srv.startup_seconds, train_seconds,
                             trainer.state.global_step)
    summary = {"steps": result.steps, "train_seconds": round(train_seconds, 2),
               "server_start_seconds": srv.startup_seconds, "weight_sync": method, "platform": platform,
               "final_model": str(final), "stopped_early_at": stop_flag.stopped_at,
               "monitor": sampler.overhead()}
    write_atomic(run_dir / "train.json", json.dumps(summary, indent=2))
    overhead = sampler.overhead()
    log(f"done: {result.steps} steps in {train_seconds:.0f}s; final model {final}"
        + (f"; sampler used {overhead['cpu_seconds']:.2f} CPU-s ({overhead['samples']} samples)"
           if sampler.enabled else ""))
    return result
