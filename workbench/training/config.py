"""TRL's arguments from the resolved recipe: the `trainer:` section plus what the other sections imply.

    from workbench.training import config
    args = config.grpo_config(rr, output_dir=str(run.train.checkpoints))   # a real trl.GRPOConfig

The server URL, the reward weights, CPU-ness and vLLM's server mode come from their own sections (recipe.load
refuses them in `trainer:`), so each knob lives in one place; the seed is `trainer.seed`, data.seed when unset. Building the real GRPOConfig applies
TRL's own cross-field rules; its errors come back as one line.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.recipe.load import RecipeProblems
from workbench.serving import client, launch
from workbench.tasks import rewardspec
from workbench.training import launch as placement


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


def trainer_arguments(rr: Resolved, output_dir: str) -> dict[str, Any]:
    """The keyword arguments for trl.GRPOConfig: the trainer section plus what other sections imply."""
    recipe, platform = rr.recipe, rr.platform
    args = dict(recipe.trainer)
    args["output_dir"] = output_dir
    args.setdefault("seed", recipe.data.seed)  # trainer.seed: training seeds over the same data and base model
    args["reward_weights"] = [spec.weight for spec in rewardspec.parse(recipe.rewards)]
    if platform == "cpu":
        args["use_cpu"] = True
        args["bf16"] = False
    server = recipe.server
    args["use_vllm"] = server.uses_vllm
    if server.colocated:  # TRL's in-process engine, sized by the server section's knobs
        args["vllm_mode"] = "colocate"
        args["vllm_max_model_length"] = server.max_model_len
        args["vllm_gpu_memory_utilization"] = server.gpu_memory_utilization
        args["vllm_tensor_parallel_size"] = server.tensor_parallel_size
    elif args["use_vllm"]:
        args["vllm_mode"] = "server"
        args["vllm_server_base_url"] = rr.server_url
        args["vllm_server_timeout"] = server.startup_timeout_s
    return args


def grpo_config(rr: Resolved, output_dir: str):
    """A real trl.GRPOConfig for the recipe; TRL's own errors are re-raised as one clear line."""
    from trl import GRPOConfig

    with _as_if_on(rr.platform):
        try:
            return GRPOConfig(**trainer_arguments(rr, output_dir))
        except (ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WorkbenchError(f"trl.GRPOConfig rejects the trainer section: {first}",
                                 "change the trainer keys it names (see `workbench recipe show`)") from None


def preflight(rr: Resolved) -> None:
    """Everything about the training that can be checked before a model is built or a server starts: the real
    GRPOConfig, TRL's batch divisibility rules for the run's real number of trainer processes (the config built
    here sees one), the training rows and the reward functions. Every problem at once, as one error."""
    problems: list[WorkbenchError] = []
    args = None
    try:
        args = grpo_config(rr, f"{rr.recipe.monitor.runs_dir}/<run-id>")
    except WorkbenchError as exc:
        problems.append(exc)
    if args is not None:
        world = rr.trainer_processes * rr.recipe.distributed.nodes
        per_step = args.per_device_train_batch_size * world
        explicit = rr.recipe.trainer.get("generation_batch_size")
        if explicit is not None and explicit % per_step:
            problems.append(WorkbenchError(
                f"trainer.generation_batch_size={explicit} is not divisible by per_device_train_batch_size "
                f"({args.per_device_train_batch_size}) × {world} trainer process(es) = {per_step}",
                f"make it a multiple of {per_step}"))
        generation = explicit or per_step * args.steps_per_generation
        if generation % args.num_generations:
            problems.append(WorkbenchError(
                f"each generation batch holds {generation} completions (per_device_train_batch_size "
                f"{args.per_device_train_batch_size} × {world} process(es) × steps_per_generation "
                f"{args.steps_per_generation}), not divisible by num_generations={args.num_generations}",
                "make the batch a multiple of num_generations (change per_device_train_batch_size, "
                "steps_per_generation or num_generations)"))
    rows: list[dict] = []
    try:
        rows = rr.task.rows("train")
    except WorkbenchError as exc:
        problems.append(exc)
    reward_problems = rewardspec.problems(rr.recipe.rewards)
    problems += reward_problems
    if not reward_problems and rows:  # each reward called on a few training rows: a bad return stops it here
        for spec in rr.task.reward_specs:
            try:
                rewardspec.probe(spec, rows)
            except WorkbenchError as exc:
                problems.append(exc)
    problems += placement.placement_problems(rr)
    if rr.recipe.server.over_http and rr.recipe.distributed.node_rank == 0:
        try:  # the key the recipe names: set, and accepted by an attached server
            client.check_key(rr)
        except WorkbenchError as exc:
            problems.append(exc)
    if rr.weight_sync == "lora" and rr.recipe.server.attached and rr.recipe.distributed.node_rank == 0 and not problems:
        try:  # a shared LoRA server: it loads adapters at run time, of this rank, and has a slot for this run
            client.check_lora_room(rr)
        except WorkbenchError as exc:
            problems.append(exc)
    sync_dir = rr.recipe.server.sync_dir
    if rr.weight_sync == "reload" and sync_dir and Path(sync_dir).is_dir():
        from workbench.serving.sync import ReloadSync  # lazy: torch

        try:
            ReloadSync(sync_dir).check_given(Path(sync_dir))
        except WorkbenchError as exc:
            problems.append(exc)
    if rr.recipe.server.managed and rr.recipe.distributed.node_rank == 0:
        # the server's own checks, made again when it starts: here they cost nothing yet

        from workbench.serving.server import shared_server  # lazy: requests

        server = rr.recipe.server
        # a server `workbench run` shares with this stage holds the port: that one is this run's own
        shared = (shared_server() or {}).get("url")
        for check in (lambda: launch.check_extra_args(rr), lambda: launch.check_exposure(rr, for_training=True),
                      lambda: launch.check_port_free(server.host, server.port) if rr.server_url != shared else None,
                      lambda: launch.check_cpu_cores(rr) if rr.platform == "cpu" else None):
            try:
                check()
            except WorkbenchError as exc:
                problems.append(exc)
    if rr.recipe.distributed.node_rank == 0:  # the reward engines run beside node 0's server
        from workbench.serving.rewards import engine_problems  # lazy: requests

        problems += engine_problems(rr)
    if problems:
        raise RecipeProblems(problems, rr.recipe.name)
