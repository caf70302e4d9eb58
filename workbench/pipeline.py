"""The stages of a recipe, run in order in one run directory: env check, model, GRPO, evaluation.

    workbench run --recipe cpu-tiny                    # what `make demo` runs
    workbench run --recipe smoke --stages env,model,train

Each stage writes into the run directory (env.json, the server logs, metrics.jsonl, final/, eval/) and the first
failing stage stops the run with its message. The staged notebooks drive the same functions.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.recipe import Recipe

STAGES = ("env", "model", "train", "eval")


def run(recipe: Recipe, stages: list[str] | None = None, log=print) -> Path:
    from workbench import env, evaluate, tinymodel, trainer
    from workbench.rundir import new_run_dir

    stages = list(stages or STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise WorkbenchError(f"unknown stage(s) {unknown}", f"choose from {', '.join(STAGES)}")
    if "train" in stages and "model" not in stages:
        stages.insert(stages.index("train"), "model")
    run_dir = new_run_dir(recipe, "run")
    timings: dict[str, float] = {}
    log(f"run directory: {run_dir}")
    model_path = None
    final = None
    for stage in stages:
        started = time.time()
        log(f"== {stage}")
        if stage == "env":
            report = env.check(recipe)
            report.save(run_dir / "env.json")
            log(report.to_text())
            if not report.ok:
                raise WorkbenchError("the environment check failed: " + "; ".join(c.name for c in report.failures()),
                                     "apply the fixes it lists, then run again")
        elif stage == "model":
            model_path = tinymodel.resolve_model_path(recipe, log=log)
            log(f"model: {model_path}")
            if recipe.model.path == "tiny":
                held = tinymodel.info(Path(model_path))["heldout"]
                log(f"baseline held-out exact-match {held['accuracy']:.1%} on {held['n']} problems "
                    f"(format followed {held['format_rate']:.1%}), greedy, in-process")
        elif stage == "train":
            final = trainer.train(recipe, run_dir=run_dir, log=log).final_model
        elif stage == "eval":
            models = {"base": model_path or tinymodel.resolve_model_path(recipe, log=log)}
            if final is not None:
                models["trained"] = str(final)
            summaries = evaluate.evaluate(recipe, models, out_dir=run_dir / "eval", log=log)
            if len(summaries) == 2:
                gain = summaries[1].accuracy_mean - summaries[0].accuracy_mean
                log(f"accuracy {summaries[0].accuracy_mean:.1%} -> {summaries[1].accuracy_mean:.1%} "
                    f"({gain * 100:+.1f} points) on {summaries[0].n} held-out problems")
        timings[stage] = round(time.time() - started, 1)
    (run_dir / "run.json").write_text(json.dumps({"stages": stages, "seconds": timings}, indent=2))
    log(f"stage times (s): {timings}")
    log(f"run directory: {run_dir}")
    return run_dir
