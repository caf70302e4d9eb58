"""Async rollouts: the server generates the next step's batch while the current step trains.

    rollout:
      mode: async          # recipe switch (cpu-tiny-async extends cpu-tiny with it)
    workbench train --recipe cpu-tiny-async
    workbench bench --recipe cpu-tiny            # the same configuration sync, async, colocated and in-process

Step t, synchronous (TRL as shipped): push W_t, generate batch t with W_t (the trainer waits), score, update → W_t+1.
Step t, async: wait for batch t (asked for during step t-1, sampled with W_t-1), push W_t, ask the server for batch
t+1 (it samples with W_t while this step scores and trains), score batch t, update. Every batch is one step stale;
TRL's own importance-sampling correction (`vllm_importance_sampling_correction`, on by default and required here)
reweights it by trainer / sampler log-probabilities, which TRL computes anyway. The trainer waits only for the part
of the generation that its own step did not cover: `time/rollout_wait`.

Why not TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer`: its loss forward runs every model through the
`tree_fa3` attention (trl/experimental/async_grpo/packing.py), a FlashAttention-3 kernel fetched at run time from
the Hub (`kernels-community/flash-attn3`), which exists for CUDA only — not for the CPU or Ascend, and not without
internet. Its weight transfer is pluggable (`weight_transfer=`), the attention is not. So the overlap is a thin
extension of the synchronous trainer: the same loop, loss, importance sampling, weight sync adapters, canary,
recovery, metrics and checkpoints; only *when* the server is asked changes.

`Ahead` owns the one request in flight. The lookahead of prompts comes from the trainer's data iterator
(`WorkbenchGRPOTrainer.get_batch_samples` pulls one optimizer step ahead); every collective (prompt gather, result
broadcast) stays on the main thread of every rank, only the HTTP request runs on a thread of the main rank. A
request that fails in the background is not retried there: the batch is generated again synchronously through the
client's recovery (restart, re-push, canary), so a server fault is handled exactly as in sync mode.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from accelerate.utils import broadcast_object_list, gather_object


@dataclass
class _Request:
    prompts: list[list[int]]  # this rank's prompt ids, one per completion (each prompt num_generations times)
    num_generations: int
    step: int  # the optimizer step whose weights the server held when asked
    future: Future | None  # main rank only
    seconds: float = 0.0  # the request's own duration (set when it ends)
    waited: float = 0.0  # how long the trainer blocked on it


class Ahead:
    """The next batch's generation, started early. `generation` is the trainer's VLLMGeneration (server mode)."""

    def __init__(self, generation) -> None:
        self.generation = generation
        self.request: _Request | None = None
        self.batches: list[dict] = []  # per batch used: staleness, server seconds, seconds waited; drained per log
        self.failures: list[str] = []

    @property
    def main(self) -> bool:
        return self.generation.accelerator.is_main_process

    def sampling(self, num_generations: int, step: int, count: int) -> dict:
        """The request TRL's VLLMGeneration.generate sends in server mode (TRL 1.16; tests/test_trl_hooks.py), for
        `count` prompts of the batch that trains optimizer `step`, seeded as if generated at that step."""
        g = self.generation
        return {"n": num_generations, "repetition_penalty": g.repetition_penalty, "temperature": g.temperature,
                "top_p": g.top_p, "top_k": g.top_k, "min_p": 0.0 if g.min_p is None else g.min_p,
                "max_tokens": g.max_completion_length, "logprobs": g.logprobs,
                "structured_outputs_regex": g.structured_outputs_regex,
                "generation_kwargs": g.seeded(step, 0, count)}

    def submit(self, prompts: list[list[int]], num_generations: int, step: int) -> None:
        """Ask for the next batch now (every rank calls this: the prompts are gathered to the main rank)."""
        self.discard()
        everyone = gather_object(prompts)
        future = None
        if self.main:
            unique = everyone[::num_generations]
            # asked for during step `step` + 1, for the one after it: the seeds it would get generated there
            params = self.sampling(num_generations, step + 2, len(unique))
            client = self.generation.vllm_client
            future = Future()

            def run() -> None:
                started = time.perf_counter()
                try:
                    # no recovery here: a failure is generated again on the main thread, through the recovery
                    out = client.generate_once(prompts=unique, **params)
                    request.seconds = time.perf_counter() - started
                    future.set_result((out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                       out.get("logprob_token_ids")))
                except BaseException as exc:
                    request.seconds = time.perf_counter() - started
                    future.set_exception(exc)

            request = _Request(prompts, num_generations, step, future)
            threading.Thread(target=run, name="workbench-rollout-ahead", daemon=True).start()
        else:
            request = _Request(prompts, num_generations, step, None)
        self.request = request

    @staticmethod
    def _wait(request: _Request | None) -> None:
        if request is None or request.future is None:
            return
        started = time.perf_counter()
        try:
            request.future.exception()  # waits; the client session's request timeout bounds it
        except BaseException:  # noqa: BLE001  (a cancelled future: nothing to wait for)
            pass
        request.waited += time.perf_counter() - started

    def settle(self) -> None:
        """Wait until the request in flight has ended: called before a weight push, since the server must not
        change weights under a running batch."""
        self._wait(self.request)

    def take(self, prompts: list[list[int]], num_generations: int):
        """The early batch for these prompts as TRL's generate returns it on this rank, or None when there is
        none, it was for other prompts, or it failed (then the caller generates synchronously). Collective."""
        request, self.request = self.request, None
        mine = request is not None and request.prompts == prompts and request.num_generations == num_generations
        if not all(gather_object([mine])):
            self._wait(request)  # not used, but it must end before the next push
            return None
        self._wait(request)
        payload = failure = None
        if self.main:
            try:
                payload = request.future.result()
            except BaseException as exc:  # noqa: BLE001
                failure = f"{type(exc).__name__}: {exc}"
        box = [payload, failure]
        broadcast_object_list(box, from_process=0)
        payload, failure = box
        if failure is not None:
            self.failures.append(failure)
            if self.main:
                print(f"async rollout: the early request failed ({failure[:300]}); generating this batch "
                      "synchronously", flush=True)
            return None
        self.batches.append({"staleness": max(0, self.generation.step() - request.step), "seconds": request.seconds,
                             "waited": request.waited})
        return _slice(self.generation.accelerator, payload, len(prompts), num_generations)

    def record_sync(self, seconds: float) -> None:
        """A batch generated synchronously (the first, after an epoch ends, after a failure): on-policy."""
        self.batches.append({"staleness": 0, "seconds": seconds, "waited": seconds})

    def discard(self) -> None:
        """Drop the request in flight (end of training, evaluation prompts): wait for it, ignore its result."""
        request, self.request = self.request, None
        self._wait(request)

    def drain(self) -> dict[str, float]:
        """Sums over the batches used since the last call: server seconds, seconds waited, mean staleness."""
        batches, self.batches = self.batches, []
        if not batches:
            return {}
        return {"seconds": sum(b["seconds"] for b in batches), "waited": sum(b["waited"] for b in batches),
                "staleness": sum(b["staleness"] for b in batches) / len(batches), "batches": len(batches)}


def _slice(accelerator, payload, local: int, num_generations: int):
    """This rank's part of a server answer, shaped as TRL's VLLMGeneration.generate returns it."""
    all_prompt_ids, all_completion_ids, all_logprobs, all_logprob_token_ids = payload
    all_prompt_ids = [ids for ids in all_prompt_ids for _ in range(num_generations)]
    part = slice(accelerator.process_index * local, (accelerator.process_index + 1) * local)
    return (all_prompt_ids[part], all_completion_ids[part],
            all_logprobs[part] if all_logprobs is not None else None,
            all_logprob_token_ids[part] if all_logprob_token_ids is not None else None)
