"""The learning curve (eval.every_steps): the served weights scored on the validation split right after each push,
for real in conftest's smoke run (3 steps, a point at every push, the best step kept), read by the dashboard's
summary, the figure and the report; and its settings refused at load where the curve would mislead."""
from __future__ import annotations

import json

import pytest

from conftest import CURVE_SAMPLES
from workbench import recipe
from workbench.errors import WorkbenchError


def test_each_push_is_scored_and_the_best_step_is_kept(smoke_run, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench import tinymodel
    from workbench.tasks.task import Task

    run, _ = smoke_run
    points = [json.loads(line) for line in run.train.eval_curve.read_text().splitlines()]
    # max_steps 3: the pushes before steps 1, 2 and 3, and the one after the last step (no rollout follows it)
    assert [p["step"] for p in points] == [0, 1, 2, 3]
    assert {p["split"] for p in points} == {"validation"} and {p["n"] for p in points} == {CURVE_SAMPLES}
    assert all(p["unanswered"] == 0 and p["seconds"] > 0 for p in points)
    assert points[0]["generated_tokens"] == 0 < points[1]["generated_tokens"] < points[2]["generated_tokens"]

    # the first point scored the starting model: the same problems, greedy, in process
    r = recipe.load("smoke")  # the run's data section (its recipe file names a reward module of its project)
    rows = Task.build(r).rows("validation", limit=CURVE_SAMPLES)
    base = tinymodel.greedy_accuracy(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                     AutoTokenizer.from_pretrained(tiny_model_dir), rows)
    assert points[0]["accuracy"] == base["accuracy"]
    # ... and the last point the model the run ended with (train/final), so keep_best can choose it
    final = tinymodel.greedy_accuracy(AutoModelForCausalLM.from_pretrained(run.train.final),
                                      AutoTokenizer.from_pretrained(run.train.final), rows)
    assert points[-1]["accuracy"] == final["accuracy"]

    # train/best: the earliest best-scoring step, whole, with its tokenizer
    best = max(points, key=lambda p: (p["accuracy"], -p["step"]))
    assert json.loads((run.train.best / "best_step.json").read_text()) == {"step": best["step"]}
    assert [p["step"] for p in points if p.get("best")][-1] == best["step"]
    kept = load_file(str(run.train.best / "model.safetensors"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = any(not (kept[k] == start[k]).all() for k in start if k in kept)
    assert moved == (best["step"] > 0)  # step 0's weights are the starting model's; any later step's are not
    AutoTokenizer.from_pretrained(run.train.best)
    assert not list(run.train.path.glob(".best.*"))  # nothing half-written left beside it

    metrics = [json.loads(line) for line in run.train.metrics.read_text().splitlines() if '"loss"' in line]
    assert sum(m["time/eval_curve"] for m in metrics) > 0


def test_the_curve_is_on_the_dashboard_figure_and_report(smoke_run):
    from workbench import plots
    from workbench.observe import figures, report, rundata, views

    run, _ = smoke_run
    data = rundata.load(run.train)
    rows = dict(views.summary_rows(data))
    points = data.eval_curve
    best = max(points, key=lambda p: (p["accuracy"], -p["step"]))
    assert rows["validation accuracy during training (start → best → last)"].startswith(
        f"{points[0]['accuracy']:.1%} (step 0) → {best['accuracy']:.1%} (step {best['step']})")
    assert "% of the step time" in rows["learning curve's cost"]
    fig = figures.training_figure(data)
    assert any(ax.get_ylabel() == "accuracy (learning curve)" for ax in fig.axes)
    assert plots.png_bytes(fig).startswith(b"\x89PNG")
    html = report._curve(data)
    assert f"Best at step {best['step']}" in html and "kept in train/best" in html


@pytest.mark.parametrize("overrides, message", [
    (["eval.every_steps=-1"], "eval.every_steps is -1"),
    (["eval.keep_best=true"], "eval.keep_best is on but eval.every_steps is 0"),
    (["eval.every_steps=10", "eval.during_split=train"], "the split GRPO trains on"),
    (["eval.every_steps=10", "eval.keep_best=true", "eval.during_split=heldout"], "'heldout', the test split"),
    (["eval.every_steps=10", "data.validation_size=0"], "data.validation_size is 0"),
    (["eval.every_steps=10", "server.mode=colocate"], "the curve scores a server's weights"),
    (["eval.every_steps=10", "eval.during_samples=0"], "eval.during_samples is 0"),
])
def test_curve_settings_that_would_mislead_are_refused_at_load(overrides, message):
    with pytest.raises(WorkbenchError, match=message):
        recipe.load("cpu-tiny", overrides)


def test_the_demo_recipe_with_its_curve_goes_through_the_protocols_choice():
    """The protocol trains each candidate with eval.split=validation: the demo's keep_best (chosen on validation,
    never on the test split) must not refuse it."""
    from workbench.experiments.protocol import Candidate, check

    check("cpu-tiny-async", [Candidate("recipe", []), Candidate("lr", ["trainer.learning_rate=1e-4"])], 0, [1, 2, 3], [])


def test_a_resumed_curve_goes_on_from_its_kept_points(tmp_path):
    """A resumed run (its eval_curve.jsonl cut back to the checkpoint by prepare_resume) scores its next point after
    the last kept one; the best to beat is the kept points' only while train/best holds one of them."""
    from workbench.records import append_jsonl
    from workbench.rundir import TrainDir
    from workbench.training.evalcurve import EvalCurve

    rr = recipe.resolve(recipe.load("cpu-tiny", ["eval.every_steps=10", "eval.during_samples=5", "eval.keep_best=true"]))
    train = TrainDir(tmp_path / "train").make()
    for step, accuracy in ((0, 0.5), (10, 0.7), (20, 0.6)):
        append_jsonl(train.eval_curve, {"step": step, "n": 5, "accuracy": accuracy})
    curve = EvalCurve.for_recipe(rr, train, tokens=lambda: 0, save=lambda path: None)
    assert curve.last == 20 and curve.best is None  # no train/best (removed with a discarded step): keep the next
    assert not curve.due(29) and curve.due(30) and len(curve.rows) == 5
    (train.best).mkdir()
    (train.best / "best_step.json").write_text('{"step": 10}')
    assert EvalCurve.for_recipe(rr, train, tokens=lambda: 0, save=lambda path: None).best == 0.7


@pytest.mark.heavy
def test_a_curve_point_scores_the_weights_the_server_holds(restored_server, server_rr, tiny_model_dir, tmp_path):
    """A known perturbation of the base weights, pushed into the session's server the way a trainer pushes: the
    curve's point is the perturbed model's greedy accuracy (in process, on the same rows), which differs from the
    base model's, so a curve that scored other weights than the server's (the base, a push behind) fails here. (The
    smoke run's 3 steps move the weights too little for its own curve to tell.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench import tinymodel
    from workbench.rundir import TrainDir
    from workbench.serving import sync
    from workbench.tasks.task import Task
    from workbench.training.evalcurve import EvalCurve

    rr = recipe.resolve(recipe.load("smoke", [f"server.port={server_rr.recipe.server.port}", "eval.every_steps=1",
                                              f"eval.during_samples={CURVE_SAMPLES}",
                                              f"server.api_key_env={server_rr.recipe.server.api_key_env}"]))
    rows = rr.task.rows("validation", limit=CURVE_SAMPLES)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = tinymodel.greedy_accuracy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer, rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1 * float(p.std() if p.numel() > 1 else 0.0))
    perturbed = tinymodel.greedy_accuracy(model, tokenizer, rows)
    assert perturbed["accuracy"] != base["accuracy"], "the perturbation changed no answer: the test shows nothing"
    client = sync.SyncingVLLMClient(base_url=restored_server.url, weight_sync=sync.ReloadSync(
        aliases=sync.tied_aliases(model)), headers=server_rr.headers)
    client.init_communicator()
    try:
        client.update_named_params([], iter(model.named_parameters()))
        client.reset_prefix_cache()
    finally:
        client.close_communicator()
    (tmp_path / "train").mkdir()
    point = EvalCurve(rr, TrainDir(tmp_path / "train"), rows).score(1, restored_server.url,
                                                                    rr.recipe.server.served_model_name)
    assert point["accuracy"] == perturbed["accuracy"], (point, perturbed["accuracy"], base["accuracy"])
