"""Reward models and judges on the inference service (serving/rewards.py, training/rewardmodel.py).

Without a server: the recipe's learned-reward entries are checked at load (one line each), `workbench plan` puts a
reward engine beside the policy on the server cards and refuses a split that does not fit, judge answers parse as
documented, and the group drop picks the groups of the failed completions.

With servers, for real:
- the tiny reward model is built (the tiny base with a one-label head, on the base's completions labelled by the
  rule) and its held-out agreement is recorded; served by vLLM with --runner pooling, its /pooling score of chat
  messages equals the head's own logit on the chat template's text;
- a judge attached to the session's tiny server: answers that do not parse and requests that time out are counted
  failures, and each failure policy (drop the group, stop the run) is applied;
- `learned_run`: `workbench train` on cpu-tiny-rm with LoRA, a reward model on its own managed engine and a judge
  that is the policy server's frozen base; the reward engine is SIGKILLed after the first step. The run finishes,
  the engine was restarted (an event and the summary's count), and both rewards have per-step columns.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import KEYED, SERVER_KEY_ENV, free_port, wait_for, workbench_command
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.records import read_jsonl
from workbench.tasks.rewards import RewardFailure
from workbench.tasks.rewardspec import parse

MODEL_RM = "rewards.preference={kind: model, model: tiny-rm, score: logit}"


# ----------------------------------------------------------------------------------------------------------------
# Without a server

@pytest.mark.parametrize("overrides, message", [
    (["rewards.rm={kind: model, model: tiny-rm}"], "rewards.rm.score is not set"),
    (["rewards.rm={kind: model, model: tiny-rm, score: sigmoid}"], "rewards.rm.score is 'sigmoid'"),
    (["rewards.j={kind: judge, model: policy-base, template: 'Grade {question}'}"],
     "rewards.j.template must be a prompt that contains {completion}"),
    (["rewards.j={kind: judge, model: policy-base, template: '{completion}'}"],
     "a policy-base judge is the policy server's frozen base, which only a LoRA run keeps"),
    (["rewards.j={kind: judge, model: x/y, template: '{completion}', parser: regex:(a)(b)}"],
     "rewards.j.parser's pattern has 2 groups"),
    (["rewards.j={kind: judge, model: x/y, template: '{completion}', scale: [10, 0]}"], "rewards.j.scale is [10, 0]"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, engine: {mode: attach}}"],
     "rewards.rm.engine.mode is attach without a url"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, engine: {port: 8000}}"],
     "rewards.rm's engine would listen on port 8000, as server.port does"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, engine: {gpus: 1}}"],
     "rewards.rm.engine has unknown key(s) ['gpus']"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, colour: red}"],
     "rewards.rm has unknown key(s) ['colour'] for kind model"),
    (["server.mode=attach", "server.url=http://10.0.0.5:8000", MODEL_RM],
     "rewards.preference's engine is managed, but the policy server is attached"),
    (["server.mode=off", MODEL_RM], "scored on the inference service, but server.mode is off"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, engine: {env: [1]}}"],
     "rewards.rm.engine.env is [1] (list)"),
    (["rewards.j={kind: judge, model: a/b, template: '{completion}', parser: 'regex:('}"],
     "rewards.j.parser's pattern does not compile"),
    (["rewards.rm={kind: model, model: tiny-rm, score: logit, weight: .nan}"], "rewards.rm has weight nan"),
])
def test_bad_learned_rewards_are_refused_at_load(overrides, message):
    with pytest.raises(WorkbenchError, match=re.escape(message)):
        recipe.load("cpu-tiny", overrides)


def test_a_reward_engine_on_accelerator_cards_needs_its_share_and_the_shares_must_fit():
    with pytest.raises(WorkbenchError, match=re.escape("has no engine.gpu_memory_utilization")):
        recipe.load("ascend-910b-8card", ["rewards.rm={kind: model, model: a/b, score: logit}"])
    with pytest.raises(WorkbenchError, match=re.escape("server.gpu_memory_utilization=0.8 plus the reward engines' "
                                                       "0.25 = 1.05 of each card")):
        recipe.load("ascend-910b-8card-rm", ["server.gpu_memory_utilization=0.8"])


def _plan(name: str, overrides: list[str]):
    from workbench.plan import plan

    rr = recipe.resolve(recipe.load(name, overrides), platform="npu" if "ascend" in name else "cuda",
                        versions={"vllm": "0.23.0", "vllm_ascend": "0.23.0"} if "ascend" in name else {"vllm": "0.23.0"})
    return plan(rr, name, tuple(overrides))


def test_plan_shows_both_engines_on_the_server_cards_and_refuses_a_split_that_does_not_fit():
    text = _plan("ascend-910b-8card-rm", []).text()
    node = text.split("== memory")[0]
    assert re.search(r"  server on devices \[0, 1, 2, 3\]\n.*\n    \$ vllm serve Qwen/Qwen2.5-7B-Instruct .*"
                     r"--gpu-memory-utilization 0\.6 ", node)
    engine = re.search(r"  reward engine 'preference' on devices \[0, 1, 2, 3\]\n.*\n    \$ (vllm serve .*)", node)
    assert engine, node
    argv = engine.group(1).split()
    assert argv[2] == "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
    assert argv[argv.index("--runner") + 1] == "pooling" and argv[argv.index("--port") + 1] == "8011"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.25"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"  # spread over the same four cards
    assert "VLLM_SERVER_DEV_MODE" not in node.split("reward engine")[1].split("\n")[1]  # nothing is pushed to it
    assert "server cards split: policy 0.6 + 0.25 = 0.85 of each card" in text
    assert re.search(r"reward engine 'preference' \(model: Skywork/Skywork-Reward-V2-Qwen3-0\.6B\): [\d.]+ GiB per "
                     r"device of 16\.0 GiB \(fits\)", text)
    assert "reward engine 'preference'" in _plan("cuda-2gpu-rm", []).text()
    keyed = _plan("ascend-910b-8card-rm", ["server.api_key_env=WB_KEY"]).text().split("== memory")[0]
    env = re.search(r"  reward engine 'preference' on devices .*\n(.*)\n", keyed).group(1)
    assert "VLLM_API_KEY='$WB_KEY'" in env  # keyed like the policy server: the plan's lines start it as train does
    # 0.73 + 0.25 is under 1, but not with each engine's own context beside its share
    with pytest.raises(WorkbenchError, match=re.escape("the server cards do not hold both engines: shares 0.73 + 0.25 "
                                                       "of 64 GiB plus about 1 GiB per engine = 64.7 GiB")):
        _plan("ascend-910b-8card-rm", ["server.gpu_memory_utilization=0.73"])


def test_a_reward_engine_that_could_not_start_is_refused_before_any_server(tmp_path):
    """The training's preflight finds what would stop a reward engine, one line each, before a model is built or
    the policy server starts: a reward model that is not there, tiny-rm on a model that is not tiny, a port taken."""
    import socket

    from workbench.recipe.load import RecipeProblems
    from workbench.training.config import preflight

    port = free_port()
    rr = recipe.resolve(recipe.load("cpu-tiny-rm", [f"server.port={port}",
                                                    f"rewards.preference.model={tmp_path / 'nowhere'}"]))
    with pytest.raises(RecipeProblems, match=re.escape(f"rewards.preference.model {tmp_path / 'nowhere'} does not "
                                                       "exist")):
        preflight(rr)
    engine = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", engine))
        taken.listen()
        with pytest.raises(RecipeProblems, match=rf"rewards\.preference: port {engine} on 127\.0\.0\.1 is already in "
                                                 rf"use.*rewards\.preference\.engine\.port=<port>"):
            preflight(recipe.resolve(recipe.load("cpu-tiny-rm", [f"server.port={port}",
                                                                 f"rewards.preference.engine.port={engine}"])))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rr = recipe.resolve(recipe.load("cpu-tiny-rm", [f"server.port={port}", f"model.path={model}"]))
    with pytest.raises(RecipeProblems, match=r"rewards\.preference\.model is tiny-rm, which is built on the tiny "
                                             r"base model"):
        preflight(rr)


def test_concurrent_protocol_trainings_with_their_own_reward_engines_are_refused():
    from workbench.experiments.protocol import Candidate, concurrent_overrides

    candidates = [Candidate("a", ["trainer.learning_rate=1e-5"]), Candidate("b", ["trainer.learning_rate=2e-5"])]
    with pytest.raises(WorkbenchError, match=r"--concurrent 2: every training would start its own engine for "
                                             r"rewards\.preference on the same port"):
        concurrent_overrides("cpu-tiny-rm", candidates, ["peft.r=8"], 2)


def test_recipe_show_says_each_rewards_kind_where_it_runs_and_its_memory():
    out = subprocess.run([*workbench_command(), "recipe", "show", "ascend-910b-8card-rm"], capture_output=True,
                         text=True, check=True).stdout
    assert "# rewards.correctness: weight 1, rule correctness, in the trainer process" in out
    assert ("# rewards.preference: weight 0.5, reward model Skywork/Skywork-Reward-V2-Qwen3-0.6B (logit, "
            "batch-normalised), its own engine at http://127.0.0.1:8011 on the server's devices [0, 1, 2, 3]; "
            "gpu_memory_utilization 0.25 of each server card") in out
    lora = subprocess.run([*workbench_command(), "recipe", "show", "cpu-tiny", "peft.r=8",
                           "rewards.j={kind: judge, model: policy-base, template: '{question} {completion}'}"],
                          capture_output=True, text=True, check=True).stdout
    assert ("# rewards.j: weight 1, judge: the policy server's frozen base ('tiny-policy' without an adapter at "
            "http://127.0.0.1:8000), no memory of its own") in lora


def test_judge_answers_parse_as_documented():
    from workbench.serving.rewards import JudgementError, parse_judgement

    def judge(**extra):
        spec = {"kind": "judge", "model": "a/b", "template": "{completion}", **extra}
        return parse({"j": spec})[0].learned

    assert parse_judgement(judge(), "Score: 7 out of 10") == 7.0
    assert parse_judgement(judge(scale=[0, 10]), "7/10") == 0.7
    assert parse_judgement(judge(parser="yes_no"), " Yes, it is right") == 1.0
    assert parse_judgement(judge(parser="yes_no"), "no.") == 0.0
    assert parse_judgement(judge(parser=r"regex:<score>(\d+)</score>"), "3 <score>9</score>") == 9.0
    for learned, answer in [(judge(), "none"), (judge(scale=[0, 10]), "12"), (judge(parser="yes_no"), "maybe yes"),
                            (judge(parser=r"regex:<score>(\d+)</score>"), "9")]:
        with pytest.raises(JudgementError):
            parse_judgement(learned, answer)


def test_a_failed_completion_drops_its_whole_group_across_ranks():
    from workbench.training.scoring import unscored_groups

    # two ranks of 8 rows each, groups of 4: rank 0's row 5 (group 1), rank 1's rows 0 and 3 (group 2, once)
    assert unscored_groups([(0, [5], [1]), (8, [0, 3], [2])], 4) == [1, 2]
    assert unscored_groups([(0, [], [0])], 4) == []


def test_two_ranks_drop_the_same_groups_and_normalise_over_the_gathered_batch():
    """drop_unscored on two ranks at once (threads meeting in a gather, as accelerate's gather_object returns every
    rank's list in rank order): each rank knows only its own failed rows, both drop the same groups, count the
    same failures, and standardise a `normalize: batch` column over every rank's scored rows."""
    import threading
    from types import SimpleNamespace

    import torch

    from workbench.training.scoring import drop_unscored

    barrier, slots = threading.Barrier(2), [None, None]

    def gather(rank):
        def gather_object(items):
            slots[rank] = items[0]
            barrier.wait()
            return list(slots)
        return gather_object

    torch.manual_seed(0)
    gathered = torch.rand(16, 3) * 5 + 2  # 2 ranks x 8 rows, groups of 4; columns: rule, model (batch), judge
    failed = {0: ([], [5]), 1: ([3], [0, 3])}  # rank: (the model's failed rows, the judge's), the rank's own indices
    results = {}

    def rank(r: int) -> None:
        model = SimpleNamespace(failed_now=list(failed[r][0]), batch_normalised=True)
        judge = SimpleNamespace(failed_now=list(failed[r][1]), batch_normalised=False)
        rewards = gathered.clone()
        groups, counts = drop_unscored(rewards, [(1, model), (2, judge)], rank=r, processes=2, size=4,
                                       gather=gather(r))
        results[r] = (groups, counts, rewards, model.failed_now + judge.failed_now)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    (g0, c0, r0, left0), (g1, c1, r1, left1) = results[0], results[1]
    assert g0 == g1 == [1, 2] and c0 == c1 == [1, 3] and left0 == left1 == []
    assert torch.equal(r0.nan_to_num(-1), r1.nan_to_num(-1))  # every rank trains the same batch
    assert r0[4:12].isnan().all() and r0[:4].isfinite().all() and r0[12:].isfinite().all()
    kept = torch.cat([r0[:4], r0[12:]])
    assert float(kept[:, 1].mean()) == pytest.approx(0.0, abs=1e-5)  # over both ranks' kept rows, not one's share
    assert float(kept[:, 1].std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert torch.equal(kept[:, [0, 2]], torch.cat([gathered[:4], gathered[12:]])[:, [0, 2]])  # others untouched


def test_the_failure_counts_survive_a_resume(tmp_path):
    """FailureLedger writes each learned reward's totals into the checkpoint transformers just saved, and a run
    resumed from that checkpoint counts on from them (max_failures is the whole run's)."""
    from types import SimpleNamespace

    from workbench.rundir import LEARNED_REWARDS
    from workbench.serving.rewards import Scorer
    from workbench.training.scoring import FailureLedger

    rr = recipe.resolve(recipe.load("cpu-tiny-rm"))
    scorer = Scorer(rr, next(s for s in rr.task.reward_specs if s.is_learned))
    scorer.requests_total, scorer.restarts, scorer.seconds = 96, 1, 3.25
    scorer.account(5)
    args = SimpleNamespace(output_dir=str(tmp_path))
    (tmp_path / "checkpoint-4").mkdir()
    FailureLedger([scorer]).on_save(args, SimpleNamespace(global_step=4, is_world_process_zero=True), None)
    assert (tmp_path / "checkpoint-4" / LEARNED_REWARDS).is_file()
    again = Scorer(rr, scorer.spec)
    FailureLedger([again]).on_train_begin(args, SimpleNamespace(global_step=4, is_world_process_zero=True), None)
    assert again.totals() == {"requests": 96, "failed": 5, "restarts": 1, "seconds": 3.25}
    fresh = Scorer(rr, scorer.spec)  # a step without that checkpoint's file: from zero
    FailureLedger([fresh]).on_train_begin(args, SimpleNamespace(global_step=8, is_world_process_zero=True), None)
    assert fresh.totals()["failed"] == 0


def test_the_reward_models_auc_counts_pairs():
    from workbench.training.rewardmodel import auc

    scores, labels = [0.1, 0.4, 0.35, 0.8, 0.4], [0, 0, 1, 1, 1]
    pairs = [(p > n) + 0.5 * (p == n) for p, y in zip(scores, labels) if y for n, z in zip(scores, labels) if not z]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert auc([1.0, 2.0], [1, 1]) is None


# ----------------------------------------------------------------------------------------------------------------
# The tiny reward model, served

@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_model_dir):
    """The tiny reward model, built for real on the cpu-tiny base (about 90 s on 2 cores, reused after)."""
    from workbench.training import rewardmodel

    rr = recipe.resolve(recipe.load("cpu-tiny-rm"))
    return rewardmodel.ensure(rr, log=lambda *_: None)


@pytest.mark.heavy
def test_the_tiny_reward_model_agrees_with_the_rule_on_held_out_completions(tiny_rm_dir):
    info = json.loads((tiny_rm_dir / "reward-model.json").read_text())
    held = info["heldout"]
    assert info["architecture"] == "Qwen2ForSequenceClassification"
    assert held["completions"] >= 900 and 0.1 < held["positive_share"] < 0.9  # both labels, on unseen prompts
    # better than the majority label and than chance ordering: it learned something of the rule
    assert held["accuracy"] > max(held["positive_share"], 1 - held["positive_share"])
    assert held["auc"] > 0.6


@pytest.mark.heavy
def test_the_reward_lab_scores_with_the_served_reward_model_as_its_head_does(tiny_rm_dir):
    """The reward lab starts the reward model's engine (--runner pooling) and scores completions through vLLM's
    /pooling on prompt + completion messages (what training's Scorer sends); each score equals the head's own logit
    on the chat template's text (what the reward model was trained on). Where it and the rule disagree most comes
    first in lab.disagreements."""
    import pandas as pd
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from workbench.experiments import rewardlab

    rr = recipe.resolve(recipe.load("cpu-tiny-rm", [f"server.port={free_port()}"]))
    rows = rr.task.rows("validation", 6)
    samples = pd.DataFrame([{"step": 0, "group": i, "prompt": r["prompt"][-1]["content"], "answer": r["answer"],
                             "completion": text, "length": len(text)}
                            for i, r in enumerate(rows)
                            for text in (f"<answer>{r['answer']}</answer>", f"<answer>{int(r['answer']) + 1}</answer>")])
    rewards = {"correctness": 0.0, "preference": {"kind": "model", "model": "tiny-rm", "score": "logit",
                                                  "engine": {"port": free_port()}}}
    lab = rewardlab.score(samples, rewards, rr.recipe, rr=rr, log=lambda *_: None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_rm_dir)
    head = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                           tokenize=False) for p, c in zip(samples["prompt"], samples["completion"])]
    with torch.no_grad():
        logits = head(**tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                  add_special_tokens=False)).logits[:, 0].tolist()
    served = lab.scores["preference"].tolist()
    assert max(abs(a - b) for a, b in zip(served, logits)) < 1e-4, (served, logits)
    assert lab.scores["correct"].tolist() == [1.0, 0.0] * 6
    worst = lab.disagreements("preference", n=3)
    assert len(worst) == 3 and worst["rank_gap"].is_monotonic_decreasing and worst["rank_gap"].iloc[0] > 0
    from workbench.serving.launch import listening_pid

    assert listening_pid(rewards["preference"]["engine"]["port"]) is None  # stopped with the lab


# ----------------------------------------------------------------------------------------------------------------
# A judge attached to the session's tiny server: failures counted, policies applied

def _judge(tiny_server, server_rr, **extra):
    from workbench.serving.rewards import Scorer

    judge = {"kind": "judge", "model": "tiny", "template": "Is this right? {question} {completion}",
             "engine": {"mode": "attach", "url": tiny_server.url, "api_key_env": SERVER_KEY_ENV,
                        "served_model_name": server_rr.recipe.server.served_model_name}, **extra}
    spec = parse({"grader": judge})[0]
    return Scorer(server_rr, spec, restart=lambda: pytest.fail("a healthy engine must not be restarted"))


def _batch(server_rr, n: int = 4):
    rows = server_rr.task.rows("validation", n)
    prompts = [r["prompt"] for r in rows for _ in range(2)]
    completions = [[{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}] for r in rows for _ in range(2)]
    return prompts, completions, [r["answer"] for r in rows for _ in range(2)]


@pytest.mark.heavy
def test_judge_answers_that_do_not_parse_are_counted_and_drop_their_groups(tiny_server, server_rr):
    from workbench.serving.rewards import JudgementError, parse_judgement
    from workbench.training.scoring import unscored_groups

    scorer = _judge(tiny_server, server_rr, parser="yes_no", on_failure="drop_group", max_failures=12)
    prompts, completions, answers = _batch(server_rr)
    seen, post = {}, scorer._post

    def recorded(path, body):  # the judge's own answers to the scorer's own requests (batched as they were sent)
        out = post(path, body)
        seen[body["messages"][-1]["content"]] = out["choices"][0]["message"]["content"] or ""
        return out

    scorer._post = recorded
    scores = scorer(prompts, completions, answer=answers)
    # those without a yes/no are the failures, none scored zero
    expected = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        text = scorer.learned.template.format(question=p[-1]["content"], completion=c[-1]["content"], answer=answers[i])
        try:
            parse_judgement(scorer.learned, seen[text])
        except JudgementError:
            expected.append(i)
    assert expected, "the tiny base never says yes or no: every answer here should fail to parse"
    assert scorer.failed_now == expected
    assert all(scores[i] is None for i in expected)
    assert all(isinstance(scores[i], float) for i in range(len(scores)) if i not in expected)
    assert scorer.last_errors[0].startswith("JudgementError: no yes/no in")
    groups = unscored_groups([(0, scorer.failed_now, [len(expected)])], 2)
    assert groups == sorted({i // 2 for i in expected})
    scorer.account(len(expected))  # within max_failures: the run goes on without those groups
    with pytest.raises(RewardFailure, match=r"rewards\.grader: \d+ completions could not be scored in this run, over "
                                            r"max_failures=12 \(last: JudgementError: no yes/no"):
        scorer.account(len(expected) + 12 - scorer.failed_total + 1)


@pytest.mark.heavy
def test_a_judge_request_past_its_timeout_is_a_counted_failure_and_stop_ends_the_run(tiny_server, server_rr):
    scorer = _judge(tiny_server, server_rr, parser="number", timeout_s=0.001, on_failure="stop")
    prompts, completions, answers = _batch(server_rr, 2)
    scores = scorer(prompts, completions, answer=answers)
    assert scores == [None] * 4 and scorer.failed_now == [0, 1, 2, 3] and scorer.restarts == 0
    assert all("Timeout" in e for e in scorer.last_errors), scorer.last_errors
    with pytest.raises(RewardFailure, match=r"rewards\.grader: 4 completion\(s\) could not be scored this step "
                                            r"\(.*Timeout.*\) and on_failure is stop"):
        scorer.account(4)
    # the same judge with a bound it can meet scores every completion
    patient = _judge(tiny_server, server_rr, parser="number", timeout_s=60, on_failure="stop")
    scored = patient(prompts, completions, answer=answers)
    assert any(s is not None for s in scored), patient.last_errors
    assert all(e.startswith("JudgementError") for e in patient.last_errors)  # answered: only parsing can fail


# ----------------------------------------------------------------------------------------------------------------
# The acceptance run: a reward model and a judge through `workbench train`, the reward engine killed mid-run

LEARNED_RECIPE = """\
extends: cpu-tiny-rm
rewards:
  correctness: 0.0
  format: 0.2
  preference:
    kind: model
    model: tiny-rm
    weight: 1.0
    score: probability
    engine: {{port: {rm_port}}}
    timeout_s: 60
    on_failure: drop_group
    max_failures: 64
  grader:
    kind: judge
    model: policy-base
    weight: 0.1
    template: "{{question}} {{completion}}"
    parser: number        # the tiny base grades nothing; it answers with a number, which is what this checks
    scale: [-1000, 1000]
    max_tokens: 16
    on_failure: drop_group
    max_failures: 10000
"""


@pytest.fixture(scope="session")
def learned_run(tmp_path_factory, tiny_rm_dir):
    runs = tmp_path_factory.mktemp("learned-runs")
    rm_port = free_port()
    path = runs / "learned.yaml"
    path.write_text(LEARNED_RECIPE.format(rm_port=rm_port))
    args = ["train", "--recipe", str(path), f"server.port={free_port()}", f"monitor.runs_dir={runs}",
            "peft.r=8", "peft.lora_alpha=16", "peft.target_modules=all-linear", "trainer.max_steps=4",
            "trainer.logging_steps=1", "trainer.per_device_train_batch_size=8", "trainer.num_generations=4",
            "trainer.save_steps=2", "trainer.warmup_steps=0", "data.train_size=64", "monitor.canary_every=0",
            "monitor.drift_every=0"]
    log = runs / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*workbench_command(), *args], stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    killed = {}
    try:
        def first_step() -> bool:
            metrics = list(runs.glob("*/train/metrics.jsonl"))
            return bool(metrics) and any("loss" in r for r in read_jsonl(metrics[0]))

        wait_for(first_step, 600, proc, "the first training step", log)
        from workbench.serving.launch import listening_pid

        pid = listening_pid(rm_port)
        assert pid is not None, "no reward engine listening"
        killed["pgid"] = os.getpgid(pid)
        os.killpg(killed["pgid"], signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    train = next(runs.glob("*/train"))
    return {"code": proc.returncode, "log": log.read_text(), "train": train, "killed": killed, "rm_port": rm_port}


@pytest.mark.heavy
def test_training_with_a_reward_model_and_a_judge_survives_the_reward_engines_death(learned_run):
    assert learned_run["code"] == 0, learned_run["log"][-3000:]
    train = learned_run["train"]
    metrics = [r for r in read_jsonl(train / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    for row in metrics:  # both learned rewards have a per-step column, beside the watched rule and the failures
        for key in ("rewards/preference/mean", "rewards/grader/mean", "rewards/correctness/mean",
                    "reward/preference/failed", "reward/grader/failed", "time/reward"):
            assert key in row, (key, sorted(row))
        assert row["reward/preference/failed"] == 0.0  # the restart came before any request was given up
        # a group with a completion the judge could not score trains nothing (and is not in the means)
        assert 0 <= row["reward/dropped_groups"] <= 2 and row["reward/grader/failed"] <= 8
    means = [r["rewards/preference/mean"] for r in metrics if r["reward/dropped_groups"] < 2]
    assert len(means) >= 2 and all(0.0 <= m <= 1.0 for m in means), metrics  # score: probability
    summary = json.loads((train / "train.json").read_text())
    learned = summary["learned_rewards"]
    assert learned["preference"]["restarts"] == 1 and learned["preference"]["failed"] == 0
    assert learned["preference"]["requests"] == 4 * 8
    assert learned["grader"]["restarts"] == 0 and learned["grader"]["requests"] == 4 * 8
    assert learned["grader"]["failed"] == sum(r["reward/grader/failed"] for r in metrics) < 16
    # each checkpoint keeps the totals so far, for a resume to count on from (training/scoring.FailureLedger)
    ledger = json.loads((train / "checkpoints" / "checkpoint-2" / "learned-rewards.json").read_text())
    assert ledger["grader"]["requests"] == ledger["preference"]["requests"] == 2 * 8
    assert ledger["grader"]["failed"] == sum(r["reward/grader/failed"] for r in metrics if r["step"] <= 2)
    events = [e for e in read_jsonl(train / "events.jsonl") if e.get("kind") == "reward_engine_restart"]
    assert len(events) == 1 and events[0]["reward"] == "preference"
    # the old engine's log kept beside the new one's; nothing of either left running
    logs = sorted(p.name for p in train.glob(f"vllm-server-{learned_run['rm_port']}-reward-preference*.log"))
    assert len(logs) == 2 and any("before-restart-1" in n for n in logs), logs
    from workbench.serving.launch import listening_pid

    assert listening_pid(learned_run["rm_port"]) is None
