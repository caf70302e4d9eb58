"""TRL's arguments from the resolved recipe: the `trainer:` section plus what the other sections imply.

    from workbench.training import config
    args = config.grpo_config(rr, output_dir=str(run.train.checkpoints))   # a real trl.GRPOConfig

The server URL, the reward weights, the seed, CPU-ness and vLLM's server mode come from their own sections
(recipe.load refuses them in `trainer:`), so each knob lives in one place. Building the real GRPOConfig applies
TRL's own cross-field rules; its errors come back as one line.
"""
from __future__ import annotations

import contextlib
from typing import Any

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved


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
    args["seed"] = recipe.data.seed
    args["reward_weights"] = list(recipe.rewards.values())
    if platform == "cpu":
        args["use_cpu"] = True
        args["bf16"] = False
    server = recipe.server
    args["use_vllm"] = server.mode != "off"
    if args["use_vllm"]:
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
