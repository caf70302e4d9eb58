"""The sampling seed of every prompt the trainer sends the server: the same training seed samples the same batches.

    seeds = prompt_seeds(trainer_seed=1, step=12, round_=0, count=8)   # one per prompt of step 12's batch
    client.generate(prompts, n=8, generation_kwargs={"seed": seeds})   # serving/sync.py: one request per prompt

Without a seed, vLLM samples from its global generator, whose state depends on every request the server served
before and on how the requests were batched together: the learning curve's points, the canary, a second run on a
shared server and the async lookahead's timing all move it. Two trainings with the same seeds sampled different
completions from their first step (49 of 64 differed), and their test gains differed by up to 2.7 points.

So each prompt of a training batch gets its own seed, a hash of the training seed (`trainer.seed`), the optimizer
step the batch trains (the same whether the batch was asked for early by the async lookahead or generated at its
step), the generation round (0: the batch; r: dynamic sampling's r-th refill of it) and the prompt's place in the
request. vLLM seeds a request's generator with it and gives the request's n completions seed, seed + 1, ...
(vllm/v1/engine/parallel_sampling.py); the hashes are 62 bits wide, so two prompts' streams never meet in practice.
One seed per prompt, not one per request: a shared seed would draw the same noise for the first completion of every
prompt, tying completions of different prompts together. A resumed run samples what the uninterrupted run sampled
from its checkpoint's step on, since the key holds no count of earlier requests.
"""
from __future__ import annotations

import hashlib

SEED_BITS = 62  # vLLM takes a signed 64-bit seed and adds the completion's index: room left for any n


def prompt_seeds(trainer_seed: int, step: int, round_: int, count: int) -> list[int]:
    """The seeds of a request's `count` prompts: prompt i of the batch that trains optimizer step `step`, in
    generation round `round_` (0 for the batch itself, r for dynamic sampling's r-th refill)."""
    out = []
    for index in range(count):
        key = f"{trainer_seed}:{step}:{round_}:{index}".encode()
        out.append(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> (64 - SEED_BITS))
    return out
