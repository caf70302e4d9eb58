"""Evaluation through the server: grading, preflight against a real server, repeats, comparison outputs."""
import json
from pathlib import Path

import psutil
import pytest
import requests
from PIL import Image

from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.evaluation import evaluate
from workbench.evaluation.evaluate import Evaluation
from workbench.tasks.grading import grade


@pytest.mark.parametrize("gold,response,expected", [
    ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", True),  # GSM8K style
    ("1234", "so the total is\n#### 1,234", True),
    ("18", "#### 19", False),
    ("\\frac{1}{2}", "Thus the probability is $\\boxed{\\frac{1}{2}}$.", True),  # MATH style
    ("\\frac{1}{2}", "$\\boxed{0.5}$", True),
    ("\\frac{3}{4}", "$\\boxed{\\frac{4}{3}}$", False),
    ("5", "The side is $\\boxed{5\\text{ cm}}$.", True),  # units
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", True),
    ("3", "I am not sure.", False),  # no final answer at all
    ("82", "47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer>", True),  # the synthetic task
])
def test_grading_hand_written_cases(gold, response, expected):
    (extracted, correct), = grade([gold], [response])
    assert correct is expected, extracted


def test_grading_off_the_main_thread_keeps_working():
    import threading

    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", grade(["\\frac{1}{2}", "7"], ["\\boxed{\\frac{2}{4}}", "#### 8"])))
    thread.start()
    thread.join()
    assert [c for _, c in box["r"]] == [True, False]


def _eval_recipe(server_recipe, url, **overrides):
    """The server recipe attached to `url`, resolved."""
    return recipe.resolve(recipe.load(server_recipe, {"server.mode": "attach", "server.url": url, "eval.num_samples": 64,
                                                      **overrides}))


def test_preflight_checks_lengths_and_name_against_the_real_server(tiny_server, server_recipe):
    r = _eval_recipe(server_recipe, tiny_server.url, **{"eval.max_tokens": 250})
    rows = evaluate.eval_rows(r)
    with pytest.raises(WorkbenchError, match=r"longest prompt is \d+ tokens and eval.max_tokens is 250: \d+ > the server's "
                                             r"max_model_len 256.*lower eval.max_tokens to \d+"):
        evaluate.preflight(r, rows, tiny_server.url)
    wrong = _eval_recipe(server_recipe, tiny_server.url, **{"server.served_model_name": "policy-7b"})
    with pytest.raises(WorkbenchError, match=r"does not serve 'policy-7b'; it serves \['tiny-policy'\]"):
        evaluate.preflight(wrong, rows, tiny_server.url)
    ok = evaluate.preflight(_eval_recipe(server_recipe, tiny_server.url), rows, tiny_server.url)
    assert ok["max_model_len"] == 256 and 10 < ok["longest_prompt_tokens"] <= 64


def test_temperature_zero_repeats_agree_and_sampling_reports_spread(tiny_server, server_recipe, tiny_model_dir):

    greedy = _eval_recipe(server_recipe, tiny_server.url, **{"eval.repeats": 2})
    rows = evaluate.eval_rows(greedy)
    summary, samples = evaluate.evaluate_server(greedy, "base", rows, tiny_server.url, quiet=True, concurrency=16)
    assert len(samples) == 128 and summary.errors == 0 and summary.unscored == 0
    assert summary.accuracy_per_repeat[0] == summary.accuracy_per_repeat[1] and summary.accuracy_std == 0
    first = {s.id: s.response for s in samples if s.repeat == 0}
    assert all(first[s.id] == s.response for s in samples if s.repeat == 1)
    assert 0.1 < summary.accuracy_mean < 0.7 and summary.truncation_rate == 0 and summary.mean_output_tokens > 20
    sampled = _eval_recipe(server_recipe, tiny_server.url, **{"eval.repeats": 3, "eval.temperature": 1.0})
    spread, _ = evaluate.evaluate_server(sampled, "base", rows, tiny_server.url, quiet=True)
    assert len(spread.accuracy_per_repeat) == 3 and spread.accuracy_std > 0
    assert "± " in evaluate.comparison_table([summary, spread])
    completions = _eval_recipe(server_recipe, tiny_server.url, **{"eval.endpoint": "completions"})
    plain, plain_samples = evaluate.evaluate_server(completions, "base", rows, tiny_server.url, quiet=True)
    assert plain.accuracy_mean == summary.accuracy_mean  # same greedy answers through /v1/completions
    assert "<answer>" in plain_samples[0].response


def test_base_vs_trained_comparison_outputs(two_model_eval):
    """conftest's `two_model_eval` (two models, 48 problems, two repeats each): what the evaluation leaves."""
    run, _ = two_model_eval
    stage = run.eval
    result = Evaluation.load(stage)
    assert [s.model for s in result.summaries] == ["base", "trained"]
    table = stage.table.read_text()
    assert "| base | 48 × 2 |" in table and "| trained | 48 × 2 |" in table
    records = [json.loads(line) for line in stage.samples.read_text().splitlines()]
    assert len(records) == len(result.samples) == 2 * 48 * 2
    assert {"prompt", "response", "extracted", "gold", "correct", "completion_tokens", "latency_s"} <= set(records[0])
    assert len(json.loads(stage.summary.read_text())) == 2
    with Image.open(stage.figure) as image:
        assert image.size[0] > 300 and image.size[1] > 200


def test_a_model_loaded_into_the_server_answers_as_on_a_server_of_its_own(two_model_eval, tiny_server):
    """`two_model_eval` served its second model ("trained": the tiny model) by loading its weights into the server
    the first one started with. The session's tiny_server serves the tiny model from its own start: the same
    requests (sampled at temperature 1 with the recipe's seed) get the same answers, every one of them."""
    run, r = two_model_eval
    ev = Evaluation.load(run.eval)
    attached = recipe.resolve(recipe.load(r, {"server.mode": "attach", "server.url": tiny_server.url}))
    _, fresh = evaluate.evaluate_server(attached, "trained", evaluate.eval_rows(attached), tiny_server.url, quiet=True)
    loaded = {(s.id, s.repeat): s.response for s in ev.samples if s.model == "trained"}
    assert len(loaded) == len(fresh) == 96
    assert sum(loaded[s.id, s.repeat] == s.response for s in fresh) == 96
    assert [p.name.rsplit("-", 1)[1] for p in run.eval.path.glob("vllm-server-*.log")] == ["base.log"]  # one server
    # and the evaluation stopped it: nothing answers on its port, none of its processes runs
    port = r.server.port
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert not [p for p in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])]


def test_only_checkpoints_of_one_model_share_a_server(tiny_model_dir, smoke_run, tmp_path):
    """A training's final model is a checkpoint of its base (its tokenizer files are written differently, and it
    encodes the same); a changed config, generation default or chat template is another model."""
    import shutil

    trained = smoke_run[0].train.final
    assert evaluate.weights_apart(str(tiny_model_dir), str(trained)) is None
    for name, change, why in (("config.json", lambda c: {**c, "num_hidden_layers": 3}, "config.json differs"),
                              ("generation_config.json", lambda c: {**c, "temperature": 0.5},
                               "generation_config.json differs")):
        other = Path(shutil.copytree(tiny_model_dir, tmp_path / name))
        (other / name).write_text(json.dumps(change(json.loads((other / name).read_text()))))
        assert evaluate.weights_apart(str(tiny_model_dir), str(other)) == why
    other = Path(shutil.copytree(tiny_model_dir, tmp_path / "template"))
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert evaluate.weights_apart(str(tiny_model_dir), str(other)) == "the chat templates differ"


def test_lm_eval_command_matches_the_recipe():
    rr = recipe.resolve(recipe.load("ascend-910b-8card"), platform="npu")
    command = evaluate.lm_eval_command(rr, "http://127.0.0.1:8001")
    assert command.startswith("lm_eval --model local-chat-completions --model_args model=policy-7b,"
                              "base_url=http://127.0.0.1:8001/v1/chat/completions,num_concurrent=48")
    assert "--tasks gsm8k --apply_chat_template" in command and "temperature=0.0" in command and "seed=1234" in command
    completions = evaluate.lm_eval_command(recipe.resolve(recipe.load("cpu-tiny", ["eval.endpoint=completions"]),
                                                          platform="cpu"), "http://h:1")
    assert "local-completions" in completions and "/v1/completions" in completions and "cross-check on gsm8k" in completions


def test_run_async_works_inside_a_running_loop_and_raises_there():
    import asyncio

    async def five():
        return 5

    async def fails():
        raise ValueError("boom")

    async def notebook_cell():  # a Jupyter kernel already runs an event loop
        assert evaluate._run_async(five()) == 5
        with pytest.raises(ValueError, match="boom"):
            evaluate._run_async(fails())

    asyncio.run(notebook_cell())


def test_other_models_get_servers_of_their_own_the_next_starting_while_one_is_scored(monkeypatch, tmp_path):
    """The path for models that are not checkpoints of one model: each on a server of its own, on two lanes (the
    server's core, then the trainer's, under the next port), the next model's server started while the current one
    is scored; every server stopped, also when scoring fails. The servers here record what the evaluation asks of
    them; what a real server does with a model is the rest of this file."""
    import contextlib
    import threading
    import time

    from conftest import free_port

    events = []

    class Recorder:
        def __init__(self, rr, path, log_dir=None, quiet=False, name=None, **kwargs):
            self.rr, self.name = rr, name

        def start(self):
            events.append(("start", self.name, tuple(self.rr.server.devices), threading.current_thread().name))
            time.sleep(0.3)
            return self

        def stop(self):
            events.append(("stop", self.name))

    monkeypatch.setattr(evaluate, "VLLMServer", Recorder)
    rr = recipe.resolve(recipe.load("cpu-tiny", [f"server.port={free_port()}"]))
    lanes = evaluate._lanes(rr, 3)
    assert [lane.server.devices for lane in lanes] == [(0,), (1,)]
    assert lanes[1].recipe.server.port == rr.recipe.server.port + 1
    items = [("a", "/models/a"), ("b", "/models/b"), ("c", "/models/c")]
    with contextlib.closing(evaluate._servers(items, lanes, tmp_path, True)) as started:
        for label, _, srv in started:
            events.append(("score", label))
    starts = {e[1]: (e[2], e[3], events.index(e)) for e in events if e[0] == "start"}
    assert {label: lane for label, (lane, _, _) in starts.items()} == {"a": (0,), "b": (1,), "c": (0,)}
    assert starts["b"][1] != threading.current_thread().name  # b started in the background,
    assert starts["b"][2] < events.index(("score", "a"))  # begun before a is scored
    assert starts["c"][2] > events.index(("stop", "a"))  # c on a's lane once a's server is stopped
    assert [e for e in events if e[0] == "stop"] == [("stop", "a"), ("stop", "b"), ("stop", "c")]

    events.clear()
    with pytest.raises(RuntimeError, match="scoring failed"):
        with contextlib.closing(evaluate._servers(items, lanes, tmp_path, True)) as started:
            for label, _, srv in started:
                raise RuntimeError("scoring failed")
    assert sorted(e[1] for e in events if e[0] == "stop") == ["a", "b"]  # the one scored and the one started ahead
