"""TRL's GRPOTrainer with the workbench's weight sync and a per-step time breakdown.

    trainer = build_trainer(rr, model_path, output_dir, sync.make(rr))     # the server must already answer
    trainer.train()

The training entry (server, monitor, run directory, summary) is workbench/training/train.py.

How the sync plugs in (TRL 1.16 has no extension point for it): `GRPOTrainer.__init__` builds its vLLM backend,
and with it TRL's client, whose NCCL-only `init_communicator` fails on CPU and Ascend. `WorkbenchGRPOTrainer`
lets the parent constructor run without vLLM, then builds TRL's backend itself as `_SyncingVLLMGeneration`, whose
only change is the client class (`workbench.serving.sync.SyncingVLLMClient`). Everything else — when to sync, how
parameters are gathered, generation, importance-sampling correction — is TRL's. tests/test_trl_hooks.py fails
when the TRL internals this relies on change.

With `rollout.mode: async` the same trainer asks the server for the next step's batch right after this step's
push and scores/trains while it is generated (workbench/training/overlap.py): `get_batch_samples` pulls one
optimizer step ahead, `_generate_single_turn` submits, `_SyncingVLLMGeneration.generate` hands the early batch over.

Every request carries one sampling seed per prompt, from `trainer.seed`, the step it trains and the prompt's place
(workbench/training/seeding.py): the same seeds sample the same completions whichever path asked and whatever else
the server serves, so a training repeats itself.
"""
from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from workbench.recipe import Resolved
from workbench.rundir import TrainDir
from workbench.serving import client, sync
from workbench.serving.rewards import Scorer
from workbench.tasks import rewards
from workbench.training.canary import Canary
from workbench.training.evalcurve import EvalCurve
from workbench.training.config import grpo_config
from workbench.training.drift import KEY as DRIFT_KEY, Drift
from workbench.training.dynamic import EXTRA_PROMPTS, DynamicSampler, Sample
from workbench.training.gauge import Gauge
from workbench.training.groups import GroupRecorder, group_signal
from workbench.training.overlap import Ahead
from workbench.training.recovery import Recovery
from workbench.training.scoring import FailureLedger, drop_unscored
from workbench.training.seeding import prompt_seeds


# what TRL 1.16's _generate logs of each generation's completions (tests/test_trl_hooks.py)
COMPLETION_METRICS = ("completions/mean_length", "completions/min_length", "completions/max_length",
                      "completions/clipped_ratio", "completions/mean_terminated_length",
                      "completions/min_terminated_length", "completions/max_terminated_length")


def completion_metrics(completion_ids: list[list[int]], stops: set[int]) -> dict[str, float]:
    """TRL's completion metrics of a batch (every rank's completions), computed as its `_generate` does."""
    lengths = [len(ids) for ids in completion_ids]
    clipped = [bool(ids) and ids[-1] not in stops for ids in completion_ids]
    ended = [n for n, c in zip(lengths, clipped) if not c] or [0]
    values = (sum(lengths) / len(lengths), min(lengths), max(lengths), sum(clipped) / len(clipped),
              sum(ended) / len(ended), min(ended), max(ended))
    return {key: float(value) for key, value in zip(COMPLETION_METRICS, values)}


class _SyncingVLLMGeneration(VLLMGeneration):
    """TRL's vLLM backend with the workbench client in server mode, the weight-parity canary after a push, and
    the server recovery (restart + re-push) wired to the client."""

    def __init__(self, *args, weight_sync: sync.WeightSync, headers: dict[str, str] | None = None,
                 request_timeout: float | None = None, canary: Canary | None = None,
                 recovery: Recovery | None = None, step=lambda: -1, server_logprobs=None, overlap: bool = False,
                 seed: int | None = None, **kwargs):
        self.weight_sync = weight_sync
        self.seed = seed  # trainer.seed: every prompt's sampling seed derives from it (training/seeding.py)
        self.round = 0  # the generation round of the current batch: 0, then one more per dynamic-sampling refill
        self.headers = headers
        self.request_timeout = request_timeout
        self.canary = canary
        self.recovery = recovery
        self.step = step
        self.server_logprobs = server_logprobs
        # sharded parameters with recovery on: the main rank's host copy of the weights it last pushed, whole, so that
        # it can push them to a restarted server alone (the other ranks are waiting in a collective by then);
        # set by _init_vllm, which TRL's __init__ calls
        self.kept: dict[str, torch.Tensor] | None = None
        self.reference: tuple[dict, int, list[list[float]]] | None = None  # (that copy, step, the server's probe log-probs)
        super().__init__(*args, **kwargs)
        self.ahead = Ahead(self) if overlap and self.mode == "server" else None
        self.refilling = False  # a dynamic-sampling refill: asked for now, never an early batch (training/dynamic.py)
        self.curve: EvalCurve | None = None  # the learning curve (training/evalcurve.py), attached after the trainer

    def _init_vllm(self) -> None:
        if self.mode != "server":
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = sync.SyncingVLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout,
                weight_sync=self.weight_sync, headers=self.headers, request_timeout=self.request_timeout)
            self.vllm_client.init_communicator(device=self.accelerator.device)
            if self.recovery is not None:
                self.vllm_client.recovery = self.recovery
                self.recovery.step = self.step
                if not self.sharded:  # the main rank holds every parameter whole: it pushes them again alone
                    self.recovery.repush = self._push_from_main
                    self.recovery.after = self._run_canary if self.canary else None
                elif self.recovery.max_restarts > 0:  # it pushes its copy of the last push (see _keeping)
                    self.kept = {}
                    self.recovery.repush = self._push_kept
                    self.recovery.after = self._check_restored if self.canary else None
        self.accelerator.wait_for_everyone()

    @property
    def sharded(self) -> bool:
        return bool(self._dist.is_zero3 or self._dist.is_fsdp)

    @property
    def adapter_only(self) -> bool:
        """The adapter alone goes to the server (server.weight_sync lora), TRL's merged full push never runs."""
        return isinstance(self.weight_sync, sync.LoraSync)

    def _push_from_main(self) -> None:
        # TRL's own push (metadata, parameters, prefix-cache reset), without this class's canary: the recovery runs
        # its own check afterwards. Only the main rank calls it, so only unsharded parameters get here.
        if self.adapter_only:  # a restarted server holds no adapter: load the run's current version again
            self.weight_sync.reload_current(self.vllm_client)
            return
        VLLMGeneration.sync_weights(self)

    def _iter_named_params(self):
        # TRL's stream of whole parameters (gathered collectively when sharded); on a main rank that keeps a copy,
        # the push's stream goes through the keeper (not the first, metadata-only walk: no metadata yet)
        stream = super()._iter_named_params()
        if self.kept is None or self._weight_metadata is None:
            return stream
        return self._keeping(stream)

    def _keeping(self, stream):
        """Pass the stream on, copying each tensor to host memory; the copy replaces the kept one once the stream
        ended (a push cut off by a fault is read to its end by the client, so that every rank's gathers complete).
        Costs one copy of the model in the main rank's host memory (about 15 GB for a 7B model in bfloat16)."""
        fresh = {}
        for name, tensor in stream:
            fresh[name] = tensor.detach().to("cpu", copy=True)
            yield name, tensor
        self.kept = fresh

    def _push_kept(self) -> None:
        """A restarted server gets the weights the lost one held last, from the main rank's copy: no collective, so
        the other ranks may go on waiting where they are. Before the first push there is nothing to send: the new
        server loads the model the run started from, which the trainer still holds (a resumed run pushes before it
        generates anything)."""
        if self.kept:
            self.weight_sync.push(self.vllm_client, self._weight_metadata, iter(self.kept.items()))

    def _check_restored(self, reason: str) -> None:
        """The proof after a sharded restart: the new server's probe log-probs against the lost server's, recorded
        right after the push whose weights were sent again (the trainer's side needs every rank's forward, and they
        are elsewhere). A fault inside a push sends newer weights than the lost server had answered for: the
        next scheduled canary proves those."""
        if self.reference is None or self.reference[0] is not self.kept:
            self.recovery.log("the restarted server holds weights of a push which no server answered for yet: "
                              "the next scheduled canary checks them")
            return
        _, step, before = self.reference
        started = time.perf_counter()
        now = [self._server_logprobs(ids) for ids in self.canary.sequences]
        self.canary.compare(self.step(), before, now, time.perf_counter() - started,
                            f"{reason}, against the lost server's answers after the step-{step} push")

    def _push_adapter(self) -> None:
        """The main rank saves the adapter's weights and loads them into the server as a new version (replicated
        under DDP and ZeRO 1/2; sharded strategies are refused with LoRA sync at recipe load)."""
        if self.mode != "server" or not self.accelerator.is_main_process:
            return
        from peft import get_peft_model_state_dict

        model = self.accelerator.unwrap_model(self.model)
        # the adapter only, named as peft saves it (not the embeddings: they are not trained, and "auto" would read
        # the base model's config again, from the Hub for a hub id, at every push)
        tensors = get_peft_model_state_dict(model, save_embedding_layers=False)
        config = model.peft_config[model.active_adapter].to_dict()
        self.vllm_client._recovering(
            "adapter push", lambda: self.weight_sync.push_adapter(self.vllm_client, tensors, config, self.step()))

    def _server_logprobs(self, ids: list[int]) -> list[float]:
        # under the run's current adapter on a LoRA server (client.model), else the served base model
        return self.vllm_client._recovering("canary", lambda: self.server_logprobs(ids, self.vllm_client.model))

    def _run_canary(self, reason: str = "scheduled") -> None:
        """Score the probes on both sides. Sharded parameters: every rank runs the forward (it gathers them) and
        the main rank compares; otherwise the main rank alone does both."""
        started = time.perf_counter()
        trainer = self.canary.trainer_logprobs(self.model)
        if self.accelerator.is_main_process:
            server = [self._server_logprobs(ids) for ids in self.canary.sequences]
            self.canary.compare(self.step(), trainer, server, time.perf_counter() - started, reason)

    def seeded(self, step: int, round_: int, count: int) -> dict | None:
        """TRL's `generation_kwargs` with one sampling seed for each of the `count` prompts of the batch that trains
        optimizer `step` (1-based), generation round `round_`; unchanged when unseeded or not in server mode."""
        if self.seed is None or self.mode != "server":
            return self.generation_kwargs
        return {**(self.generation_kwargs or {}), "seed": prompt_seeds(self.seed, step, round_, count)}

    def generate(self, prompts, images, num_generations, profiler=None):
        self.round = self.round + 1 if self.refilling else 0
        if self.ahead is None or self.refilling:
            return self._seeded_generate(prompts, images, num_generations, profiler)
        # the batch asked for during the previous step, when these are its prompts (text only)
        taken = self.ahead.take(prompts if images is None else None, num_generations)
        if taken is not None:
            return taken
        started = time.perf_counter()
        out = self._seeded_generate(prompts, images, num_generations, profiler)
        self.ahead.record_sync(time.perf_counter() - started)
        return out

    def _seeded_generate(self, prompts, images, num_generations, profiler):
        # TRL's generate sends self.generation_kwargs with the request of the main rank, which holds every rank's
        # prompts: those of this step's batch (global_step counts the steps done), one seed per distinct prompt
        everyone = len(prompts) * self.accelerator.num_processes
        saved = self.generation_kwargs
        self.generation_kwargs = self.seeded(self.step() + 1, self.round, -(-everyone // num_generations))
        try:
            return super().generate(prompts, images, num_generations, profiler)
        finally:
            self.generation_kwargs = saved

    def sync_weights(self, final: bool = False):
        """TRL's push, through the workbench's weight sync, then the canary and the curve when due (`final`: the
        push after the last step, whose point is always scored)."""
        if self.ahead is not None:
            self.ahead.settle()  # never change the server's weights under a running batch
        if self.adapter_only:
            self._push_adapter()
        else:
            super().sync_weights()
        if self.mode != "server":
            return
        if self.kept is not None and self.canary is not None and not final:  # the lost server's answers, for a restart
            self.reference = (self.kept, self.step(), [self._server_logprobs(ids) for ids in self.canary.sequences])
        # not after the last step: the canary checked the run's pushes, and an alarm there would only be swallowed
        if not final and self.canary is not None and self.canary.due(self.step()) and (
                self.sharded or self.accelerator.is_main_process):
            self._run_canary()
        # the server holds the trainer's weights of this step and nothing is in flight: a point of the curve
        if self.curve is not None and self.accelerator.is_main_process and (final or self.curve.due(self.step())):
            try:
                self.curve.score(self.step(), self.vllm_client.base_url, self.vllm_client.model)
            except Exception as exc:  # a measuring aid must never end a training run: say so once and stop it
                print(f"warning: the learning curve stopped ({type(exc).__name__}: {exc})", flush=True)
                self.curve = None


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
    """GRPOTrainer whose server-mode weight sync goes through a `workbench.serving.sync.WeightSync` adapter."""

    def __init__(self, *args, weight_sync: sync.WeightSync, headers: dict[str, str] | None = None,
                 request_timeout: float | None = None, canary: Canary | None = None,
                 recovery: Recovery | None = None, server_logprobs=None, overlap: bool = False,
                 groups: GroupRecorder | None = None, drift: Drift | None = None,
                 dynamic: DynamicSampler | None = None, **kwargs):
        training_args: GRPOConfig = kwargs["args"]
        self.groups = groups
        self.drift = drift
        self.dynamic = dynamic
        self._refilling = False  # inside a dynamic-sampling refill: its generation and scoring are not the batch's
        self._inputs_now: list[dict] | None = None  # the generation batch's rows, while TRL generates for them
        self._kept_rewards = None  # the refilled batch's rewards (gathered), for TRL's scoring of it
        self._unscored_now: dict[str, float] = {}  # the generation batch's learned-reward failures (scoring.py)
        self.refill_prompts = 0  # extra prompts dynamic sampling generated (every rank counts the same)
        self._batch_completion_ids: list[list[int]] = []
        wants_server = training_args.use_vllm and training_args.vllm_mode == "server"
        self.weight_sync = weight_sync
        self.canary = canary if wants_server else None
        self._phase_seconds: dict[str, float] = {}
        self._completion_tokens = 0
        self._generated_total = 0  # completion tokens sampled for training so far (the curve's x axis)
        self.curve: EvalCurve | None = None
        self._began_at: int | None = None  # the step training began at (a resume's checkpoint), set at train begin
        self.gauge: Gauge | None = None  # the share of the cores' limits each step used (training/gauge.py)
        self._last_log_clock = time.perf_counter()
        self._steps_at_last_log = 0
        if wants_server:
            training_args.use_vllm = False  # read once, in GRPOTrainer.__init__: skip TRL's NCCL-only client
        try:
            super().__init__(*args, **kwargs)
        finally:
            training_args.use_vllm = wants_server or training_args.use_vllm
        if isinstance(weight_sync, (sync.ReloadSync, sync.HcclSync)):  # both load through vLLM's layerwise reload
            weight_sync.aliases.update(sync.tied_aliases(self.accelerator.unwrap_model(self.model)))
        if wants_server:
            self.use_vllm = True
            self.vllm_generation = _SyncingVLLMGeneration(
                **vllm_generation_kwargs(self, training_args), weight_sync=weight_sync, headers=headers,
                request_timeout=request_timeout, canary=canary, recovery=recovery,
                step=lambda: self.state.global_step, server_logprobs=server_logprobs, overlap=overlap,
                seed=training_args.seed)
            self._last_loaded_step = -1
        self._next_batches: tuple | None = None  # (data iterator, the next optimizer step's batches): async only
        self.add_callback(_TrainBegin(self))

    # --- the policy's KL from its starting weights (training/drift.py) ----------------------------------------

    @property
    def _sharded_params(self) -> bool:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return bool(self.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3))

    def _drift_start(self) -> None:
        """Before the first step (the model prepared, a resume's checkpoint loaded): the starting distributions,
        recorded or read back. The main rank decides from its own run directory and every rank follows: under
        sharded parameters each rank must join every probe forward, and another node may not see that directory."""
        from accelerate.utils import broadcast_object_list

        if self.drift is None:
            return
        main = self.accelerator.is_main_process
        plan = [self.drift.plan(self.state.global_step) if main else None]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(plan)
        if plan[0] == "off":
            if main:
                print("warning: no usable drift reference in this run (it started without one, or with other "
                      "probes): no drift/kl_start curve", flush=True)
            self.drift = None
        elif not (self._sharded_params or main):
            self.drift = None  # the main rank runs the probes alone
        elif plan[0] == "record":
            self.drift.record(self.model, main=main)

    def _drift_log(self, logs: dict[str, float]) -> None:
        if self.drift is None:
            return
        step = self.state.global_step
        if self.drift.due(step, last=step >= self.state.max_steps):
            value = self.drift.measure(self.model, step)  # every forward rank, at the same steps
            if value is not None:
                logs[DRIFT_KEY] = value

    @property
    def ahead(self) -> Ahead | None:
        return getattr(getattr(self, "vllm_generation", None), "ahead", None)

    # --- async rollouts (workbench/training/overlap.py): one optimizer step of lookahead on the data ----------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.ahead is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        kept, self._next_batches = self._next_batches, None
        if kept is not None and kept[0] is epoch_iterator:
            current = kept[1]
        else:
            current = super().get_batch_samples(epoch_iterator, num_batches, device)
        following = super().get_batch_samples(epoch_iterator, self.args.gradient_accumulation_steps, device)
        if following[0]:  # nothing left in this epoch: the next epoch's first batch is generated synchronously
            self._next_batches = (epoch_iterator, following)
        return current

    def _ask_ahead(self) -> None:
        """After this step's push: ask the server for the next step's batch (its first micro-batch holds the whole
        generation batch, steps_per_generation = gradient_accumulation_steps being required for async)."""
        if self._next_batches is None or not self.model.training:
            return
        # this batch trains step global_step + 2 (global_step counts the steps done, and this is step
        # global_step + 1's generation): after the last step there is nothing to generate for (the server would
        # sample a batch nobody uses, and its counters would disagree with the steps: training/smoke.py)
        if self.state.max_steps > 0 and self.state.global_step + 2 > self.state.max_steps:
            return
        rows = self._next_batches[1][0][0]
        prompt_ids, _, _ = self._tokenize_prompts(copy.deepcopy([row["prompt"] for row in rows]))
        self.ahead.submit(prompt_ids, self.num_generations, self.state.global_step)

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
        self._generated_total += sum(len(ids) for ids in completion_ids)
        if self.ahead is not None and not self._refilling:
            self._ask_ahead()
        return completion_ids, logprobs

    # --- the group record (workbench/training/groups.py): each step's groups with their rewards and advantages --

    def _generate(self, prompts):
        refill = self.dynamic is not None and self.model.training and not self._refilling
        logged = {key: len(self._metrics["train"][key]) for key in COMPLETION_METRICS} if refill else {}
        out = super()._generate(prompts)
        if self._refilling:
            return out
        if refill:
            out = self._refill(prompts, out, logged)
        self._batch_completion_ids = out[1]  # this rank's completions, as TRL measures lengths and truncation
        return out

    # --- dynamic sampling (workbench/training/dynamic.py): groups without spread replaced before TRL scores ---

    def _refill(self, prompts: list, out: tuple, logged: dict[str, int]) -> tuple:
        """Between TRL's generation and its scoring: the batch's groups without reward spread exchanged for groups of
        further prompts. `prompts` and the batch's rows are TRL's own lists, changed in place, so that everything TRL
        computes afterwards is the batch that trains."""
        from accelerate.utils import gather_object

        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = out
        if tool_mask is not None or extra or images is not None or self.tools or self.rollout_func is not None:
            raise RuntimeError("dynamic sampling handles text prompts without tools, images or a rollout_func")
        inputs = self._inputs_now

        def samples(rows, texts, got) -> list[Sample]:
            lps = got[4] if got[4] is not None else [None] * len(rows)
            return [Sample(*fields) for fields in zip(rows, texts, got[0], got[1], got[3], lps, strict=True)]

        def generate(rows: list[dict]) -> list[Sample]:
            texts = [row["prompt"] for row in rows]
            started = time.perf_counter()
            try:
                with self._refill_mode():
                    return samples(rows, texts, self._generate(texts))
            finally:
                self._timed("refill", started)

        def score(batch: list[Sample]):
            with self._refill_mode():  # the refill's and the first look's rewards: not the batch's signal metric
                return self._calculate_rewards([s.row for s in batch], [s.prompt for s in batch],
                                               [s.completion for s in batch], [s.completion_ids for s in batch])

        import torch

        kept, metrics, batch = self.dynamic.fill(
            samples(inputs, prompts, out), generations=self.num_generations,
            processes=self.accelerator.num_processes, rank=self.accelerator.process_index,
            step=self._step, generate=generate, score=score, gather=gather_object,  # _step: one per generation
            weights=self.reward_weights.tolist(), aggregation=self.multi_objective_aggregation)
        self.refill_prompts += int(metrics.get(EXTRA_PROMPTS, 0))
        train = self._metrics["train"]
        for key, value in metrics.items():
            train[key].append(value)
        # TRL logged completion lengths for each generation round: the batch that trains is what they describe
        for key, count in logged.items():
            del train[key][count:]
        stops = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        for key, value in completion_metrics([s.completion_ids for s in batch], stops).items():
            train[key].append(value)
        # the reward functions' per-completion columns were logged for the completions judged, some of them dropped
        self._pending_extra_logs.clear()
        self._kept_rewards = torch.tensor([s.rewards for s in batch], dtype=torch.float32,
                                          device=self.accelerator.device)
        prompts[:] = [s.prompt for s in kept]
        inputs[:] = [s.row for s in kept]
        return ([s.prompt_ids for s in kept], [s.completion_ids for s in kept], None, [s.completion for s in kept],
                None if logprobs is None else [s.logprobs for s in kept], {}, None, tool_images)

    @contextlib.contextmanager
    def _refill_mode(self):
        """Generation and scoring for dynamic sampling's judgement: not the batch's own (no early batch taken or
        asked for, no signal metric logged, no kept rewards used)."""
        backend = getattr(self, "vllm_generation", None)
        ours = isinstance(backend, _SyncingVLLMGeneration)
        self._refilling = True
        if ours:
            backend.refilling = True
        try:
            yield
        finally:
            self._refilling = False
            if ours:
                backend.refilling = False

    def _generate_and_score_completions(self, inputs):
        self._inputs_now = inputs
        self._unscored_now = {}
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._inputs_now = self._kept_rewards = None
        mode = "train" if self.model.training else "eval"
        for key, value in self._unscored_now.items():  # the learned rewards' failures over every rank, this batch
            self._metrics[mode][key].append(float(value))
        if self.groups is not None and self.model.training:
            try:
                self.groups.record(self, self._batch_completion_ids)
            except Exception as exc:  # an inspection aid must never end a training run; say so once and stop
                print(f"warning: the group record stopped ({type(exc).__name__}: {exc})", flush=True)
                self.groups = None
        return output

    def _calculate_rewards(self, *args, **kwargs):
        started = time.perf_counter()
        kept = None
        if not self._refilling:  # the batch's own scoring: taken once
            kept, self._kept_rewards = self._kept_rewards, None
        try:  # every rank's, gathered; a refilled batch's were scored when it was judged (training/dynamic.py)
            if kept is not None:
                rewards = kept
            else:
                rewards = self._drop_unscored(super()._calculate_rewards(*args, **kwargs))
        finally:
            self._timed("reward", started)
        if self.model.training and not self._refilling:  # the workbench's own count of groups without signal
            signal = group_signal(rewards.float().cpu().numpy(), self.reward_weights.tolist(), self.num_generations,
                                  self.multi_objective_aggregation)
            for key, value in signal.items():
                self._metrics["train"][key].append(value)
        return rewards

    def _drop_unscored(self, rewards):
        """Completions a learned reward could not score (every rank's): their groups dropped, `normalize: batch`
        applied over the gathered batch, the counts kept for the step's metrics, and each reward's failure policy
        applied on the same gathered counts on every rank (all stop together). training/scoring.py."""
        scorers = [(j, f) for j, f in enumerate(self.reward_funcs) if isinstance(f, Scorer)]
        if not scorers:
            return rewards
        from accelerate.utils import gather_object

        groups, failed = drop_unscored(
            rewards, scorers, rank=self.accelerator.process_index, processes=self.accelerator.num_processes,
            size=self.num_generations if self.model.training else self.num_generations_eval, gather=gather_object)
        # summed over the generation batch's scorings (dynamic sampling's first look and refills included) and
        # logged once for it in _generate_and_score_completions
        counts = self._unscored_now
        counts["reward/dropped_groups"] = counts.get("reward/dropped_groups", 0.0) + len(groups)
        for (_, scorer), n in zip(scorers, failed):
            key = f"reward/{scorer.spec.name}/failed"
            counts[key] = counts.get(key, 0.0) + n
        for (_, scorer), n in zip(scorers, failed):
            scorer.account(n)
        return rewards

    def _step_breakdown(self, pushes: list[tuple[float, int]]) -> dict[str, float]:
        now, steps = time.perf_counter(), self.state.global_step - self._steps_at_last_log
        phases, self._phase_seconds = self._phase_seconds, {}
        tokens, self._completion_tokens = self._completion_tokens, 0
        wall, self._last_log_clock, self._steps_at_last_log = now - self._last_log_clock, now, self.state.global_step
        if steps <= 0:
            return {}
        sync_s = sum(s for s, _ in pushes)
        canary_s = self.canary.drain_seconds() if self.canary is not None else 0.0
        curve_s = self.curve.drain_seconds() if self.curve is not None else 0.0
        # the generation on the trainer's path: the whole request (sync), or the wait for an early batch (async)
        waited = max(0.0, phases.get("generation", 0.0) - sync_s - canary_s - curve_s)
        generation, staleness = waited, 0.0
        refill = phases.get("refill", 0.0)  # dynamic sampling's extra requests, inside the generation above
        if self.ahead is not None and (batches := self.ahead.drain()):
            # the server's own time for the early batches, plus the refills asked for while the trainer waited
            generation, staleness = batches["seconds"] + refill, batches["staleness"]
        rollout = phases.get("rollout", 0.0)
        reward = phases.get("reward", 0.0)
        out = {
            "time/step": wall / steps,
            "time/generation": generation / steps,
            "time/rollout_wait": waited / steps,  # = time/generation when synchronous
            "time/weight_sync": sync_s / steps,
            "time/reward": reward / steps,
            "time/scoring": max(0.0, rollout - waited - sync_s - reward) / steps,
            "time/optimisation": max(0.0, wall - rollout) / steps,
            "time/canary": canary_s / steps,  # inside the rollout, counted in time/scoring's remainder
            "time/eval_curve": curve_s / steps,  # likewise: the learning curve's points (training/evalcurve.py)
            "time/refill": refill / steps,  # dynamic sampling's extra requests (in time/generation; training/dynamic.py)
            "rollout/completion_tokens": tokens / steps,
            "rollout/staleness": staleness,  # optimizer steps between the sampling weights and the trained ones
        }
        if generation > 0:
            out["rollout/tokens_per_second"] = tokens / generation
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        pushes = self.weight_sync.drain()
        if "loss" in logs:  # a training log line (not the end-of-training summary)
            logs.update(self._step_breakdown(pushes))
            if self.gauge is not None:
                logs.update(self.gauge.metrics(logs))
            self._drift_log(logs)
            if pushes:
                logs["sync/seconds"] = sum(s for s, _ in pushes) / len(pushes)
                logs["sync/megabytes"] = sum(b for _, b in pushes) / len(pushes) / 1e6
                logs["sync/count"] = float(len(pushes))
                for part, seconds in self.weight_sync.drain_parts().items():  # e.g. reload: write, server
                    logs[f"sync/{part}_seconds"] = seconds
        elif pushes:  # not a training log line: keep the pushes for the next one
            self.weight_sync.records = pushes + self.weight_sync.records
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        self._last_log_clock = time.perf_counter()  # model loading is not a training step
        self._steps_at_last_log = self.state.global_step
        try:
            output = super().train(*args, **kwargs)
        finally:
            if self.ahead is not None:  # the batch asked for a step that will not come
                self.ahead.discard()
                self._next_batches = None
        self._score_final()
        return output

    def _score_final(self) -> None:
        """The learning curve's last point on the model the run ends with. A push comes before a rollout and no
        rollout follows the last step, so without this the curve stops one interval short of the end, and
        eval.keep_best would choose among earlier steps only. Only with a curve (eval.every_steps > 0). The main
        rank pushes and scores; no canary, and no server restart (a server lost after the last rollout costs this
        point, not minutes of the run). Its seconds are in the point and the run's train_seconds, not in the
        per-step time/eval_curve (no log line follows).

        Left out: sharded parameters (ZeRO-3, FSDP), whose push is collective (a fault on the main rank would leave
        the ranks in different collectives before the final save), and a resumed run that trained no step (its
        final point was recorded before it stopped)."""
        generation = getattr(self, "vllm_generation", None)
        if self.curve is None or generation is None or generation.mode != "server" or generation.sharded:
            return
        if self.state.global_step == self._began_at:
            return
        if not self.accelerator.is_main_process:  # an unsharded push is the main rank's alone
            return
        client = generation.vllm_client
        recovery, client.recovery = getattr(client, "recovery", None), None
        try:
            generation.sync_weights(final=True)
        except Exception as exc:  # the training is done and is saved next: a measuring aid must not lose it
            print(f"warning: the learning curve's final point was not scored ({type(exc).__name__}: {exc})",
                  flush=True)
        finally:
            client.recovery = recovery


class _TrainBegin(TrainerCallback):
    """on_train_begin runs after the model is prepared and a resume's checkpoint loaded, before the first step."""

    def __init__(self, trainer: WorkbenchGRPOTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._began_at = state.global_step
        self.trainer._drift_start()


def reward_functions(rr: Resolved, reward_restart: dict | None = None) -> list:
    """The recipe's rewards as TRL reward functions, in the recipe's order: a rule checked on every call
    (tasks/rewards.guarded), a reward model or judge scored through its engine (serving/rewards.Scorer, with the
    restart of its engine where this process may ask for one)."""
    restarts = reward_restart or {}
    return [Scorer(rr, spec, restarts.get(spec.name)) if spec.is_learned else rewards.guarded(spec)
            for spec in rr.task.reward_specs]


def build_trainer(rr: Resolved, model_path: str, output_dir: Path, weight_sync: sync.WeightSync,
                  train_dir: TrainDir | None = None, recovery: Recovery | None = None, log=print,
                  reward_restart: dict | None = None) -> WorkbenchGRPOTrainer:
    """A ready trainer for the recipe (the server must already answer at the recipe's URL). With `train_dir`, the
    weight-parity canary writes there; with `recovery`, a dead or hung server is restarted mid-run;
    `reward_restart`: a restart for each learned reward's engine, by name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = rr.recipe
    args = grpo_config(rr, str(output_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    dtype = "auto" if recipe.model.dtype == "auto" else getattr(torch, recipe.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    canary = Canary.for_recipe(rr, train_dir, tokenizer, log=log) if train_dir is not None else None
    drift = Drift.for_recipe(rr, train_dir, tokenizer) if train_dir is not None else None
    train_dataset = rr.task.train_dataset(tokenizer)
    # refills draw from the training split with the training seed: another seed, other refill prompts
    dynamic = (DynamicSampler(train_dataset, recipe.rollout.refill_cap, seed=args.seed)
               if recipe.rollout.dynamic_sampling else None)
    trainer = WorkbenchGRPOTrainer(
        model=model, args=args, processing_class=tokenizer, train_dataset=train_dataset, dynamic=dynamic,
        peft_config=lora_config(rr) if recipe.lora else None,
        reward_funcs=reward_functions(rr, reward_restart),
        weight_sync=weight_sync, headers=rr.headers, request_timeout=recipe.server.request_timeout_s,
        canary=canary, recovery=recovery,
        server_logprobs=lambda ids, model=None: client.sequence_logprobs(rr, ids, model=model),
        overlap=recipe.rollout.overlapped, drift=drift,
        groups=(GroupRecorder(train_dir, recipe.monitor.groups_per_step, seed=recipe.data.seed)
                if train_dir is not None and recipe.monitor.groups_per_step > 0 else None))
    if train_dir is not None and getattr(trainer, "vllm_generation", None) is not None:
        curve = EvalCurve.for_recipe(rr, train_dir, tokens=lambda: trainer._generated_total,
                                     # _internal_call: a best step is not pushed to the Hub (push_to_hub)
                                     save=lambda path: trainer.save_model(str(path), _internal_call=True))
        trainer.curve = trainer.vllm_generation.curve = curve
    learned = [f for f in trainer.reward_funcs if isinstance(f, Scorer)]
    if learned:  # max_failures and train.json's totals count the whole run across a resume
        trainer.add_callback(FailureLedger(learned))
    if train_dir is not None:  # completions generated at once: every rank's batch of one generation
        trainer.gauge = Gauge.for_recipe(rr, train_dir, model, in_flight=int(args.generation_batch_size))
    return trainer


def lora_config(rr: Resolved):
    """peft's LoraConfig from the recipe's peft: section (keys checked against it at load); TRL wraps the model."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **rr.recipe.peft)
