"""The async rollout's bookkeeping (workbench/training/overlap.py) against a scripted client: which batch is handed
over, what is waited for, what a failure turns into. The real thing, through a real server, is tests/test_bench.py."""
from __future__ import annotations

import time
import types

from workbench.training.overlap import Ahead
from workbench.training.seeding import prompt_seeds
from workbench.training.trainer import _SyncingVLLMGeneration


class Client:
    """Answers like TRL's VLLMClient.generate: n completions per prompt, after `delay` seconds, or raises."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None):
        self.delay, self.error, self.calls = delay, error, []

    def generate_once(self, prompts, n, **params):
        self.calls.append((prompts, n, params))
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        completions = [[100 + i, 7] for i, _ in enumerate(prompts) for _ in range(n)]
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-0.5], [-0.1]] for _ in completions]}


def generation(client: Client, step: list[int]):
    accelerator = types.SimpleNamespace(is_main_process=True, process_index=0)
    fake = types.SimpleNamespace(
        accelerator=accelerator, vllm_client=client, step=lambda: step[0], repetition_penalty=1.0, temperature=1.0,
        top_p=1.0, top_k=0, min_p=None, max_completion_length=8, logprobs=0, structured_outputs_regex=None,
        generation_kwargs={"frequency_penalty": 0.5}, seed=7, mode="server")
    fake.seeded = types.MethodType(_SyncingVLLMGeneration.seeded, fake)  # the trainer's own seeding
    return fake


PROMPTS = [[1, 2], [1, 2], [3, 4], [3, 4]]  # two prompts, two completions each, as TRL repeats them


def test_the_early_batch_is_handed_over_for_its_own_prompts_one_step_stale():
    step, client = [4], Client(delay=0.2)
    ahead = Ahead(generation(client, step))
    ahead.submit(PROMPTS, 2, step=4)
    step[0] = 5  # the trainer finished step 4 meanwhile
    ahead.settle()  # before the push: the request has ended
    prompt_ids, completion_ids, logprobs, _ = ahead.take(PROMPTS, 2)
    assert prompt_ids == PROMPTS and completion_ids == [[100, 7], [100, 7], [101, 7], [101, 7]]
    assert client.calls[0][0] == [[1, 2], [3, 4]]  # each prompt once, n completions of it
    assert client.calls[0][1] == 2 and client.calls[0][2]["max_tokens"] == 8 and client.calls[0][2]["min_p"] == 0.0
    # asked for during step 5 (4 done), it trains step 6: seeded as step 6's batch would be, the user's kwargs kept
    assert client.calls[0][2]["generation_kwargs"] == {"frequency_penalty": 0.5, "seed": prompt_seeds(7, 6, 0, 2)}
    (batch,) = ahead.batches
    assert batch["staleness"] == 1 and batch["waited"] >= 0.15 and batch["seconds"] >= 0.2
    assert ahead.request is None


def test_a_batch_asked_for_other_prompts_is_not_used_but_finished():
    step, client = [0], Client(delay=0.1)
    ahead = Ahead(generation(client, step))
    ahead.submit(PROMPTS, 2, step=0)
    assert ahead.take([[9, 9], [9, 9]], 2) is None
    assert ahead.request is None and ahead.batches == [] and len(client.calls) == 1


def test_a_failed_early_request_means_a_synchronous_batch():
    step, client = [0], Client(error=ConnectionError("server gone"))
    ahead = Ahead(generation(client, step))
    ahead.submit(PROMPTS, 2, step=0)
    assert ahead.take(PROMPTS, 2) is None
    assert ahead.failures and "server gone" in ahead.failures[0] and ahead.batches == []
    ahead.record_sync(0.3)
    assert ahead.drain() == {"seconds": 0.3, "waited": 0.3, "staleness": 0.0, "batches": 1}
    assert ahead.drain() == {}


def test_a_new_request_or_the_end_of_training_waits_for_the_one_in_flight():
    step, client = [0], Client(delay=0.2)
    ahead = Ahead(generation(client, step))
    ahead.submit(PROMPTS, 2, step=0)
    started = time.perf_counter()
    ahead.discard()
    assert time.perf_counter() - started >= 0.15 and ahead.request is None
