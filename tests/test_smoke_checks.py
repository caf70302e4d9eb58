"""The smoke checks on recorded runs: a run whose weights did not move says why when the cause is a run without
learning signal (every group's rewards alike), and not otherwise."""
from __future__ import annotations

import json

import pytest


def _run(tmp_path, zero_spread: float, moved: bool):
    import torch
    from safetensors.torch import save_file

    from workbench.records import append_jsonl
    from workbench.rundir import TrainDir, write_atomic

    train = TrainDir(tmp_path / "smoke").make()
    for step in (1, 2, 3):
        append_jsonl(train.metrics, {"step": step, "loss": 0.0, "frac_reward_zero_std": zero_spread})
    write_atomic(train.summary, json.dumps({"steps": 3, "train_seconds": 1.0}))
    base, final = tmp_path / "base", train.final
    base.mkdir()
    final.mkdir()
    weight = torch.zeros(4, 4)
    save_file({"w": weight}, str(base / "model.safetensors"))
    save_file({"w": weight + (0.1 if moved else 0.0)}, str(final / "model.safetensors"))
    return train, base


@pytest.mark.parametrize("zero_spread, says_why", [(1.0, True), (0.5, False)])
def test_unmoved_weights_name_a_missing_learning_signal(tmp_path, zero_spread, says_why):
    from workbench.training import smoke

    train, base = _run(tmp_path, zero_spread, moved=False)
    (check,) = [c for c in smoke.verify(train, base).checks if c.name == "weights changed"]
    assert not check.ok
    assert ("zero reward spread" in check.detail) is says_why


def test_moved_weights_pass(tmp_path):
    from workbench.training import smoke

    train, base = _run(tmp_path, 1.0, moved=True)
    (check,) = [c for c in smoke.verify(train, base).checks if c.name == "weights changed"]
    assert check.ok and "zero reward spread" not in check.detail


@pytest.mark.parametrize("trainer, processes, steps, asked", [
    ({"per_device_train_batch_size": 2, "num_generations": 2}, 1, 3, (3, 6)),  # the smoke recipe
    ({"per_device_train_batch_size": 8, "num_generations": 4, "gradient_accumulation_steps": 2}, 1, 3, (12, 48)),
    ({"per_device_train_batch_size": 8, "num_generations": 4}, 2, 3, (12, 48)),  # two ranks
    ({"per_device_train_batch_size": 8, "num_generations": 4, "num_iterations": 2}, 1, 4, (4, 16)),  # reused twice
    ({"per_device_train_batch_size": 8, "num_generations": 4, "generation_batch_size": 32}, 1, 4, (8, 32)),
    ({}, 1, 1, (1, 8)),  # TRL's defaults: 8 completions a device, 8 generations
])
def test_the_rollouts_the_steps_asked_for(trainer, processes, steps, asked):
    from workbench.training import smoke

    assert smoke.rollouts_asked(trainer, processes, steps) == asked


def _metrics_page(prompts: int, sequences: int, probes: int) -> str:
    """What vLLM's /metrics shows after `prompts` requests for 48 tokens (their samples: `sequences`) and `probes`
    one-token requests, in its histograms of the requested tokens."""
    def histogram(name, first, total):
        return (f"# TYPE {name} histogram\n{name}_bucket{{le=\"1.0\"}} {first}\n{name}_bucket{{le=\"+Inf\"}} {total}\n"
                f"{name}_count {total}\n")

    return ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
            + histogram("vllm:request_max_num_generation_tokens", probes, prompts + probes)
            + histogram("vllm:request_params_max_tokens", probes, sequences + probes))


@pytest.mark.parametrize("generated, ok", [((3, 6), True), ((2, 4), False), ((4, 8), False)])
def test_the_server_must_have_generated_exactly_what_the_steps_asked_for(tmp_path, generated, ok):
    """Three smoke steps of one prompt × 2 (the smoke recipe) on a shared server that had served 5 prompts before:
    the check passes on exactly 3 prompts and 6 completions since the training began, whatever the canary's
    one-token probes add; one batch too few or too many fails it."""
    from workbench.rundir import write_atomic
    from workbench.training import smoke

    train, base = _run(tmp_path, 0.5, moved=True)
    write_atomic(train.path / "recipe.yaml", "trainer:\n  per_device_train_batch_size: 2\n  num_generations: 2\n")
    write_atomic(train.server_metrics_start, _metrics_page(5, 10, 4))
    write_atomic(train.server_metrics, _metrics_page(5 + generated[0], 10 + generated[1], 4 + 12))
    (check,) = [c for c in smoke.verify(train, base).checks if c.name == "server served the rollouts"]
    assert check.ok is ok, check.detail
    assert f"{generated[0]} prompts, {generated[1]} completions generated (and 12 one-token probes)" in check.detail


def test_the_learning_curves_requests_are_not_counted_as_rollouts(tmp_path):
    """A run with eval.every_steps: the server also answered the curve's greedy requests (one prompt and one
    completion per problem at each point, eval_curve.jsonl's n). Taken away, the rollouts must still be exact."""
    from workbench.records import append_jsonl
    from workbench.rundir import write_atomic
    from workbench.training import smoke

    train, base = _run(tmp_path, 0.5, moved=True)
    write_atomic(train.path / "recipe.yaml", "trainer:\n  per_device_train_batch_size: 2\n  num_generations: 2\n")
    for step in (0, 2):
        append_jsonl(train.eval_curve, {"step": step, "n": 100, "accuracy": 0.5})
    write_atomic(train.server_metrics_start, _metrics_page(5, 10, 4))
    for extra, ok in ((200, True), (199, False), (0, False)):
        write_atomic(train.server_metrics, _metrics_page(5 + 3 + extra, 10 + 6 + extra, 4))
        (check,) = [c for c in smoke.verify(train, base).checks if c.name == "server served the rollouts"]
        assert check.ok is ok, (extra, check.detail)
    assert "200 learning-curve requests" in check.detail
