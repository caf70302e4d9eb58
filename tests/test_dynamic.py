"""Dynamic sampling (workbench/training/dynamic.py): the refill's arithmetic on its own, then a real async training
with `rollout.dynamic_sampling` attached to the session's server, read for what trained. The two-rank path (groups
moving between ranks, a server killed under it) is tests/test_distributed.py's run."""
from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest

from conftest import KEYED, restore_base_weights, workbench_command
from workbench.records import read_jsonl
from workbench.rundir import RunDir
from workbench.training import dynamic
from workbench.training.dynamic import DynamicSampler, Sample, refill_size

G = 4


def _sample(row: dict, reward: float) -> Sample:
    return Sample(row=row | {"reward": reward}, prompt=row["prompt"], prompt_ids=[1], completion_ids=[2, 3],
                  completion="c", logprobs=None)


def _world(rows_rewards: list[tuple[dict, list[float]]]) -> list[Sample]:
    return [_sample(row, r) for row, rewards in rows_rewards for r in rewards]


def test_a_round_asks_for_what_the_signal_share_says_within_the_budget_and_evenly_per_rank():
    assert refill_size(2, 0.5, 100, G, 1) == 4  # two slots at one group in two with spread
    assert refill_size(2, 0.0, 100, G, 1) == 20  # no spread seen yet: assume 1 in 10 at worst
    assert refill_size(2, 0.0, 6, G, 1) == 6  # the cap
    assert refill_size(0, 0.5, 100, G, 1) == 0 and refill_size(3, 0.5, 0, G, 1) == 0
    # three ranks, groups of 4: 12 completions split evenly needs a multiple of 3 prompts
    assert refill_size(1, 1.0, 100, G, 3) == 3
    assert refill_size(1, 1.0, 100, 2, 2) == 1  # 2 completions on 2 ranks: one each (a group across ranks)
    # the cap holds: rounded down to the ranks' multiple, nothing when it holds none
    assert refill_size(5, 1.0, 7, G, 3) == 6 and refill_size(1, 1.0, 2, G, 3) == 0


def test_zero_spread_groups_are_replaced_by_refill_groups_with_spread_on_every_rank():
    """Two ranks, eight completions each (two groups of 4 per rank): group 1 all right and group 2 all wrong are
    exchanged for the refill's groups with spread; every rank gets its slice of the same new batch."""
    rows = [{"prompt": f"p{i}"} for i in range(50)]
    first = _world([(rows[0], [1, 0, 1, 0]), (rows[1], [1, 1, 1, 1]), (rows[2], [0, 0, 0, 0]),
                    (rows[3], [0.2, 1.2, 0.2, 0.2])])
    sampler = DynamicSampler(rows, cap=2.0, seed=7)
    drawn = dynamic.draw(rows, refill_size(2, 0.5, 8, G, 2), 7, 3, 0)
    spread = {drawn[0]["prompt"], drawn[2]["prompt"]}  # the refill's first and third prompts vary, the others not

    def reward_of(row, k):
        return float(k % 2) if row["prompt"] in spread else 0.5

    def run(rank: int) -> tuple[list[Sample], dict, list]:
        mine = first[rank * 8:(rank + 1) * 8]
        asked = []

        def generate(part):
            asked.append(len(part))
            return [_sample(r, reward_of(r, i)) for i, r in enumerate(part)]

        def gather(samples):  # accelerate's gather_object: every rank's part, in rank order
            if samples == mine:
                return list(first)
            every = [r for r in drawn for _ in range(G)]
            return [_sample(r, reward_of(r, i % G)) for i, r in enumerate(every)]

        def score(samples):
            return [[s.row["reward"]] for s in gather(samples)]

        out = sampler.fill(mine, generations=G, processes=2, rank=rank, step=3, generate=generate, score=score,
                           gather=gather, weights=[1.0], aggregation="sum_then_normalize")
        assert asked == [8]  # one round: 4 prompts x 4 completions, half to each rank
        return out

    (kept0, metrics, every), (kept1, _, again) = run(0), run(1)
    batch = kept0 + kept1
    assert every == again == batch  # each rank holds the whole batch, and its slice of it
    assert [s.rewards for s in every] == [[s.row["reward"]] for s in batch]  # what TRL scores the batch with
    groups = [batch[i * G:(i + 1) * G] for i in range(4)]
    assert [g[0].prompt for g in groups] == ["p0", drawn[0]["prompt"], drawn[2]["prompt"], "p3"]
    assert all(len({s.row["reward"] for s in g}) > 1 for g in groups)  # 0.2 vs 1.2 has spread, as it should
    assert metrics == {dynamic.ZERO_SPREAD_GENERATED: 4 / 8, dynamic.PROMPTS_PER_KEPT: 2.0,
                       dynamic.EXTRA_TOKENS: 2.0 * 16, dynamic.EXTRA_PROMPTS: 4.0, dynamic.UNFILLED: 0.0}


def test_what_the_cap_leaves_unfilled_trains_as_it_was():
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    first = _world([(rows[0], [1, 1, 1, 1]), (rows[1], [0, 1, 0, 0])])

    def generate(part):
        return [_sample(r, 0.0) for r in part]  # nothing the refill brings has spread

    out, metrics, _ = DynamicSampler(rows, cap=1.0).fill(
        first, generations=G, processes=1, rank=0, step=0, generate=generate,
        score=lambda samples: [[s.row["reward"]] for s in samples], gather=list, weights=[1.0],
        aggregation="sum_then_normalize")
    assert out == first
    assert metrics[dynamic.UNFILLED] == 0.5 and metrics[dynamic.PROMPTS_PER_KEPT] == 2.0  # 2 + 2 prompts for 2


def test_refill_cap_must_leave_room(tmp_path):
    from workbench import recipe
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match="rollout.refill_cap is 0"):
        recipe.load("smoke", ["rollout.dynamic_sampling=true", "rollout.refill_cap=0"])


# --- a real training ------------------------------------------------------------------------------------------

STEPS = 4
# a reward of the user's project that scores nothing but counts the completions it is asked to score
COUNTING = """
def counted(prompts, completions, log_path="", trainer_state=None, **kwargs):
    if trainer_state is not None:  # TRL's calls (the workbench's probe before training passes None)
        with open(log_path, "a") as f:
            f.write(f"{len(completions)}\\n")
    return [0.0] * len(completions)
"""


def train_dynamic(tmp_path_factory, tiny_server, server_rr, tiny_model_dir):
    project = tmp_path_factory.mktemp("dynamic")
    (project / "counting.py").write_text(COUNTING)
    runs = project / "runs"
    cmd = workbench_command() + [
        "train", "--recipe", "smoke", "server.mode=attach", f"server.url={tiny_server.url}",
        f"monitor.runs_dir={runs}", *KEYED, "rollout.mode=async", "rollout.dynamic_sampling=true",
        "trainer.per_device_train_batch_size=16", f"trainer.num_generations={G}", f"trainer.max_steps={STEPS}",
        "monitor.groups_per_step=4",
        f"rewards.counted={{function: counting:counted, weight: 1.0, args: {{log_path: {project / 'scored.txt'}}}}}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=project)
    finally:
        restore_base_weights(tiny_server, server_rr, tiny_model_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (path,) = runs.glob("*-smoke-train")
    return RunDir.open(path), project / "scored.txt"


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory, tiny_server, server_rr, tiny_model_dir):
    """`workbench train --recipe smoke` with dynamic sampling in async mode, attached to the session's server:
    4 prompts x 4 completions a step, 4 steps, every group recorded."""
    return train_dynamic(tmp_path_factory, tiny_server, server_rr, tiny_model_dir)


def test_the_batch_that_trains_has_spread_where_the_generated_one_had_none(dynamic_run):
    run, scored = dynamic_run
    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the tiny model gives some groups equal rewards (all right or all wrong): the refill had work to do
    assert sum(r[dynamic.ZERO_SPREAD_GENERATED] for r in rows) > 0
    for r in rows:
        assert r["signal/zero_spread"] == pytest.approx(r[dynamic.UNFILLED])  # TRL's scoring saw the new batch
        assert r[dynamic.PROMPTS_PER_KEPT] <= 1 + 2.0  # the default cap
        assert (r[dynamic.PROMPTS_PER_KEPT] > 1) == (r[dynamic.EXTRA_TOKENS] > 0) == (r["time/refill"] > 0)
        # the refills' tokens are generation the step paid for
        assert r["rollout/completion_tokens"] >= r[dynamic.EXTRA_TOKENS]
    # every recorded group of a filled step has reward spread and non-zero advantages: they train
    for step in (r["step"] for r in rows if r[dynamic.UNFILLED] == 0):
        df = pd.read_parquet(run.train.group_file(step))
        spread = df.groupby("group")["reward"].agg(lambda v: v.max() - v.min())
        assert (spread > 1e-6).all(), (step, spread)
        assert (df["advantage"].abs() > 1e-3).any()
    # every generated completion scored once: the batch that trains is not scored again (its groups were judged
    # by these rewards), and each refill's completions once each
    generated = sum(round(r[dynamic.PROMPTS_PER_KEPT] * 4) * G for r in rows)
    assert sum(int(n) for n in scored.read_text().split()) == generated


def test_refills_do_not_take_the_early_batch_in_async_mode(dynamic_run, tiny_model_dir):
    from workbench.training import smoke

    run = dynamic_run[0]
    rows = [r for r in read_jsonl(run.train.metrics) if "loss" in r]
    assert any(r[dynamic.PROMPTS_PER_KEPT] > 1 for r in rows[:-1])  # refills while early batches were in flight
    # from step 2 on each step trained the batch asked for during the step before (one step stale), not a
    # synchronous one: the refill's requests went beside it
    assert [r["rollout/staleness"] for r in rows[1:]] == [1.0] * (STEPS - 1)
    # and the server generated exactly the steps' batches plus the refills: no early batch asked twice or dropped
    summary = json.loads(run.train.summary.read_text())
    assert summary["refill_prompts"] == sum(r[dynamic.EXTRA_PROMPTS] for r in rows) > 0
    served = next(c for c in smoke.verify(run.train, tiny_model_dir).checks if c.name == "server served the rollouts")
    assert served.ok, served.detail


def test_the_same_seeds_train_the_same_batches_again(dynamic_run, tmp_path_factory, tiny_server, server_rr,
                                                     tiny_model_dir):
    """The same training again, on the same server after whatever it served since: every generation path (the
    first batch at its step, the early batches, the refills' rounds) samples the same completions, so every step
    records the same groups and trains to the same loss (workbench/training/seeding.py)."""
    first = dynamic_run[0]
    again = train_dynamic(tmp_path_factory, tiny_server, server_rr, tiny_model_dir)[0]
    rows = [[r for r in read_jsonl(run.train.metrics) if "loss" in r] for run in (first, again)]
    assert [r["step"] for r in rows[1]] == list(range(1, STEPS + 1))
    assert sum(r[dynamic.EXTRA_PROMPTS] for r in rows[0]) > 0  # the refills' seeds were among those compared
    for key in ("loss", "reward", "grad_norm", dynamic.EXTRA_PROMPTS, "rollout/completion_tokens"):
        assert [r[key] for r in rows[1]] == [r[key] for r in rows[0]], key
    for step in range(1, STEPS + 1):
        recorded = [pd.read_parquet(run.train.group_file(step)) for run in (first, again)]
        pd.testing.assert_frame_equal(recorded[1], recorded[0], check_exact=True)
