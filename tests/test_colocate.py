"""TRL's colocate mode on the CPU: the engine in the trainer's process must generate from the weights each step
loads (serving/offline.keep_live_weights). vLLM's CPU build otherwise computes its linear layers from copies packed
at start-up where the CPU supports it (AVX-512 Xeons): there TRL's per-step `load_weights` failed outright, and
the tied lm_head kept answering from its start-up copy. Zeroing the tied embedding the way TRL's sync loads a
weight must make every logit 0, so greedy decoding emits token 0 only."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from workbench import recipe
    from workbench.serving import offline
    rr = recipe.resolve(recipe.load("cpu-tiny"))
    offline.prepare_engine_environment(rr)
    offline.keep_live_weights()
    llm, _ = offline.engine(rr, sys.argv[1], log=lambda *_: None)
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6)
    def ids():
        return list(llm.generate(["What is 12 + 30?"], params, use_tqdm=False)[0].outputs[0].token_ids)
    before = ids()
    cfg = llm.llm_engine.model_config.hf_config
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    model.load_weights([("model.embed_tokens.weight", torch.zeros(cfg.vocab_size, cfg.hidden_size))])
    print("RESULT " + json.dumps({"before": before, "after": ids()}), flush=True)
""")


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_colocated_engine_generates_from_the_loaded_weights(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["before"] != [0] * 6  # the model answers something before
    assert result["after"] == [0] * 6  # all-zero logits: the lm_head reads the loaded (zero) weight
