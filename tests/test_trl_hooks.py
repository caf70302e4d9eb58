"""Fails when the TRL 1.16 internals the weight-sync integration relies on change (see workbench/training/trainer.py)."""
import inspect
import re
import types

import trl
from trl import GRPOConfig
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer import grpo_trainer

from workbench.training.trainer import vllm_generation_kwargs


def test_trl_is_the_pinned_version():
    assert trl.__version__ == "1.16.0"


def _our_kwargs(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, vllm_mode="server",
                      per_device_train_batch_size=4, num_generations=4)
    fake = types.SimpleNamespace(model=None, accelerator=None, processing_class=None, repetition_penalty=1.0,
                                 temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=8)
    return vllm_generation_kwargs(fake, args)


def test_we_pass_exactly_the_arguments_vllm_generation_takes(tmp_path):
    ours = set(_our_kwargs(tmp_path))
    theirs = set(inspect.signature(VLLMGeneration.__init__).parameters) - {"self"}
    assert ours == theirs


def test_grpo_trainer_builds_vllm_generation_the_way_we_mirror(tmp_path):
    source = inspect.getsource(grpo_trainer.GRPOTrainer)
    call = source[source.index("self.vllm_generation = VLLMGeneration("):]
    call = call[:call.index("\n            )\n")]
    for key in _our_kwargs(tmp_path):
        assert re.search(rf"\b{key}=", call), f"GRPOTrainer no longer passes {key}= to VLLMGeneration"
    # We switch server mode off for the parent constructor through args.use_vllm: it must be read exactly once.
    assert source.count("args.use_vllm") == 1
    assert "self.use_vllm = args.use_vllm" in source
    assert "self._last_loaded_step = -1" in source
    assert "self.vllm_generation.sync_weights()" in source
    assert "self.state.global_step != self._last_loaded_step" in source


def test_vllm_generation_creates_and_uses_the_client_as_we_assume():
    init = inspect.getsource(VLLMGeneration._init_vllm)
    assert "VLLMClient(" in init and "init_communicator(device=accelerator.device)" in init
    assert "base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout" in init
    sync = inspect.getsource(VLLMGeneration.sync_weights)
    assert "self.vllm_client.update_named_params(" in sync and "self.vllm_client.reset_prefix_cache()" in sync
    for attr in ("server_base_url", "server_host", "server_port", "group_port", "server_timeout", "mode"):
        assert f"self.{attr} = " in inspect.getsource(VLLMGeneration.__init__)


def test_vllm_client_methods_we_override_keep_their_signatures():
    sig = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert sig(VLLMClient.init_communicator) == ["self", "device"]
    assert sig(VLLMClient.update_named_params) == ["self", "metadata", "named_params"]
    assert sig(VLLMClient.close_communicator) == ["self"]
    assert sig(VLLMClient.reset_prefix_cache) == ["self"]
    assert sig(VLLMClient._get) == ["self", "url", "kwargs"] and sig(VLLMClient._post) == ["self", "url", "kwargs"]
    assert {"base_url", "group_port", "connection_timeout"} <= set(sig(VLLMClient.__init__))


def test_vllm_reload_weights_takes_a_path():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "weights_path" in inspect.signature(GPUModelRunner.reload_weights).parameters


# --- async rollouts (workbench/training/overlap.py) -------------------------------------------------------------

def test_the_async_extension_mirrors_trls_server_request_and_hooks():
    """The early request repeats what VLLMGeneration.generate sends in server mode; the trainer hooks it relies on
    (one-step data lookahead, prompt tokenisation, sync-before-generate) are where it expects them."""
    from transformers import Trainer

    from workbench.training.overlap import Ahead

    generate = inspect.getsource(VLLMGeneration.generate)
    sent = re.search(r"sampling_params = \{(.*?)\n\s*\}", generate, re.S).group(1)
    keys = set(re.findall(r'"(\w+)":', sent))
    fake = types.SimpleNamespace(repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                 max_completion_length=8, logprobs=0, structured_outputs_regex=None,
                                 generation_kwargs=None)
    assert set(Ahead(fake).sampling(4)) == keys
    assert "all_prompts[::num_generations]" in generate and "broadcast_object_list(obj_list, from_process=0)" in generate
    assert list(inspect.signature(VLLMGeneration.generate).parameters) == [
        "self", "prompts", "images", "num_generations", "profiler"]
    assert list(inspect.signature(Trainer.get_batch_samples).parameters) == [
        "self", "epoch_iterator", "num_batches", "device"]
    import transformers.trainer

    assert "self.get_batch_samples(epoch_iterator, num_batches" in inspect.getsource(transformers.trainer)
    single = inspect.getsource(grpo_trainer.GRPOTrainer._generate_single_turn)
    assert single.index("self.vllm_generation.sync_weights()") < single.index("self.vllm_generation.generate(")
    assert "prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)" in inspect.getsource(
        grpo_trainer.GRPOTrainer._generate)


def test_trls_async_grpo_trainer_still_needs_the_cuda_only_kernel():
    """Why async mode extends the synchronous trainer instead of using AsyncGRPOTrainer (overlap.py's docstring):
    its loss forward runs on a FlashAttention-3 kernel fetched from the Hub. When this fails, TRL has changed that
    and the decision should be revisited."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    assert packing.TREE_ATTENTION == "tree_fa3"
    assert "kernels-community/flash-attn3" in inspect.getsource(packing._flash_attn)
    assert "attn_implementation=TREE_ATTENTION" in inspect.getsource(async_grpo_trainer.AsyncGRPOTrainer.__init__)
