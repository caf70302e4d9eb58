"""Seeded sampling (workbench/training/seeding.py, the client's per-prompt requests in serving/sync.py): the same
seeds give the same completions from a real server whatever else it is serving, and no two prompts share a stream.
Two whole trainings with the same seeds are compared in tests/test_dynamic.py."""
from __future__ import annotations

import threading

import pytest

from conftest import EXACT
from workbench.training.seeding import SEED_BITS, prompt_seeds


def test_a_prompts_seed_is_its_training_seed_step_round_and_place():
    seeds = prompt_seeds(1, 12, 0, 8)
    assert seeds == prompt_seeds(1, 12, 0, 8)  # a pure function of its key: a resume draws them again
    assert len(set(seeds)) == 8 and all(0 <= s < 2 ** SEED_BITS for s in seeds)
    # another training seed, step or refill round: other streams for every prompt
    others = {*prompt_seeds(2, 12, 0, 8), *prompt_seeds(1, 13, 0, 8), *prompt_seeds(1, 12, 1, 8)}
    assert len(others) == 24 and not others & set(seeds)
    assert prompt_seeds(1, 12, 0, 3) == seeds[:3]  # a prompt's seed does not depend on how many follow it


def test_the_same_seeds_sample_the_same_completions_whatever_else_the_server_serves(tiny_server, server_rr,
                                                                                    tiny_model_dir):
    from transformers import AutoTokenizer

    from workbench.serving import sync

    client = sync.SyncingVLLMClient(base_url=tiny_server.url, weight_sync=sync.NoSync(), headers=server_rr.headers)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in ("What is 12 + 30?", "What is 45 - 21?")]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] * 2  # token ids, as TRL sends
    params = dict(n=4, temperature=2.0, max_tokens=12, logprobs=0)
    seeds = prompt_seeds(5, 3, 0, len(prompts))
    alone = client.generate(prompts=prompts, generation_kwargs={"seed": seeds}, **params)
    assert len(alone["completion_ids"]) == 16 and alone["prompt_ids"] == prompts

    # the same request again while unseeded requests keep the server batching other work beside it
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            client.generate_once(prompts=prompts[:2], n=4, temperature=2.0, max_tokens=12)

    others = [threading.Thread(target=traffic) for _ in range(2)]
    for t in others:
        t.start()
    try:
        busy = client.generate(prompts=prompts, generation_kwargs={"seed": seeds}, **params)
    finally:
        stop.set()
        for t in others:
            t.join()
    assert busy["completion_ids"] == alone["completion_ids"]
    flat = [[lp for seq in out["logprobs"] for token in seq for lp in token] for out in (busy, alone)]
    assert flat[0] == pytest.approx(flat[1], abs=EXACT)  # batched with other work, the same log-probs
    # a prompt's second place has a seed of its own: its completions are not a copy of the first place's
    assert alone["completion_ids"][8:12] != alone["completion_ids"][0:4]
    # unseeded, the server's own generator answers: the same request twice samples differently
    free = [client.generate(prompts=prompts, **params)["completion_ids"] for _ in range(2)]
    assert free[0] != free[1]
    with pytest.raises(ValueError, match="3 sampling seeds for 4 prompts"):
        client.generate(prompts=prompts, generation_kwargs={"seed": seeds[:3]}, **params)


def test_seeded_prompts_beyond_one_steps_token_budget_leave_the_cpu_server_serving(tiny_server, server_rr):
    """vLLM 0.32's CPU build cannot rewind a seeded request's generator after a partial (chunked) prefill: the
    engine core dies with "CPU Generator does not use offset" (gpu_model_runner._bookkeeping_sync), and with it
    the training (it happened 2026-12-04 to dynamic sampling's refills beside async ask-ahead, 104 requests in
    flight). So the workbench launches CPU servers without chunked prefill (serving/launch.py). Here: seeded
    prompts whose prefills together exceed one engine step's token budget, in one request."""
    import requests

    from workbench.serving import launch

    assert "--no-enable-chunked-prefill" in launch.command(server_rr, "/m")
    s = server_rr.recipe.server
    budget = s.max_num_batched_tokens or max(s.max_model_len, 2048)  # vLLM's default (engine/arg_utils.py)
    length = 60
    # distinct first tokens, so the prefix cache cannot shrink a prefill (ids of the tiny model's 358 tokens)
    prompts = [[10 + i % 300] + [(7 * i + j) % 300 + 10 for j in range(length - 1)]
               for i in range(budget // length * 2)]
    body = {"model": s.served_model_name, "prompt": prompts, "max_tokens": 2,
            "temperature": 1.0, "seed": 7}
    done = requests.post(f"{tiny_server.url}/v1/completions", json=body, headers=server_rr.headers, timeout=240)
    assert done.status_code == 200, done.text[-500:]
    assert len(done.json()["choices"]) == len(prompts)
    assert requests.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
