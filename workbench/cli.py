"""The `workbench` command: one subcommand per stage, each driven by a recipe.

    workbench --help
    workbench recipe list
    workbench recipe show cpu-tiny trainer.learning_rate=5e-6
    workbench tiny-model --recipe cpu-tiny
    python -m workbench ...            # the same

Overrides are `section.key=value` words after the options; bad input ends with one line naming the cause and
the fix, and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from workbench.errors import WorkbenchError

STAGES_TODO = {  # name: (issue, one-line help, description)
    "bench": (None, "compare rollout paths on this machine",
              "Compare rollout paths (in-process, colocated, server) on this machine, as ratios from one run."),
}


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", "-r", default="cpu-tiny",
                   help="recipe name (see `workbench recipe list`) or path of a YAML file (default: cpu-tiny)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override recipe values, e.g. trainer.learning_rate=5e-6 server.port=8011")


def cmd_recipe(args: argparse.Namespace) -> int:
    from workbench import recipe

    if args.action == "list":
        for name in recipe.available():
            r = recipe.load(name)
            print(f"{name:22s} {r.description}")
        return 0
    if not args.name:
        raise WorkbenchError("`workbench recipe show` needs a recipe name", f"use one of: {', '.join(recipe.available())}")
    r = recipe.load(args.name, args.overrides)
    print(r.to_yaml(), end="")
    platform = recipe.resolve_platform(r)
    config = recipe.grpo_config(r, output_dir=f"{r.monitor.runs_dir}/<run-id>", platform=platform)
    print(f"# trainer section builds trl.GRPOConfig for platform {platform!r}: "
          f"{config.per_device_train_batch_size} completions/device/step, {config.num_generations} generations, "
          f"lr {config.learning_rate:g}, beta {config.beta:g}, use_vllm={config.use_vllm}")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from workbench import recipe, tinymodel

    r = recipe.load(args.recipe, args.overrides)
    path = tinymodel.ensure(r, force=args.force)
    print(path)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from workbench import pipeline, recipe

    r = recipe.load(args.recipe, args.overrides)
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    pipeline.run(r, stages)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from workbench import report

    print(report.build(args.run_dir))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from workbench import recipe, server, tinymodel
    from workbench.rundir import new_run_dir

    r = recipe.load(args.recipe, args.overrides)
    if r.server.mode == "attach":
        entry = server.VLLMServer(r).start().model_entry
        print(f"attached: {server.server_url(r)} serves {r.server.served_model_name!r} "
              f"(max_model_len {entry['max_model_len']})")
        return 0
    model_path = args.model or tinymodel.resolve_model_path(r)
    if args.print_command:
        print(" ".join(server.launch_command(r, model_path)))
        return 0
    server.serve_forever(r, model_path, new_run_dir(r, "serve"))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from workbench import recipe, trainer

    r = recipe.load(args.recipe, args.overrides)
    run_dir = None
    if args.run_dir:
        from pathlib import Path
        from workbench.rundir import write_atomic

        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "recipe.yaml", r.to_yaml())
    result = trainer.train(r, run_dir=run_dir)
    print(f"run directory: {result.run_dir}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from workbench.metrics import request_stop

    flag = request_stop(args.run_dir, "workbench stop")
    print(f"wrote {flag}: the run checkpoints and ends after its current step")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from pathlib import Path
    from workbench import advisor, rundata

    if not Path(args.run_dir, "metrics.jsonl").exists():
        raise WorkbenchError(f"no metrics.jsonl in {args.run_dir}", "pass a training run directory (runs/<id>)")
    findings = advisor.advise(rundata.load(args.run_dir))
    for finding in findings:
        print(finding.text())
    if not findings:
        print(f"no problem found by the {len(advisor.RULES)} rules ({', '.join(advisor.RULES)})")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from workbench import env, recipe
    from workbench.rundir import new_run_dir

    r = recipe.load(args.recipe, args.overrides)
    report = env.check(r, collective=not args.no_collective)
    print(report.to_text())
    path = report.save(new_run_dir(r, "env") / "env.json")
    print(f"saved: {path}")
    return 0 if report.ok else 1


def cmd_eval(args: argparse.Namespace) -> int:
    from workbench import evaluate, recipe

    r = recipe.load(args.recipe, args.overrides)
    if args.bench:
        return _eval_bench(r, [int(c) for c in args.bench.split(",")])
    models = {}
    for item in args.model or []:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = path or label, label
        models[label] = path
    evaluate.evaluate(r, models or None)
    return 0


def _eval_bench(r, concurrencies: list[int]) -> int:
    import json
    import os
    import platform

    from workbench import evaluate, server, tinymodel
    from workbench.rundir import new_run_dir

    out_dir = new_run_dir(r, "evalbench")
    rows = evaluate.eval_rows(r)
    with server.VLLMServer(r, tinymodel.resolve_model_path(r), out_dir) as srv:
        evaluate.preflight(r, srv.url, rows)
        result = evaluate.benchmark(r, srv.url, rows, concurrencies)
    result["machine"] = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, server on {r.devices.server}"
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
    print(f"saved: {out_dir / 'bench.json'}")
    return 0


def _todo(name: str) -> Callable[[argparse.Namespace], int]:
    issue = STAGES_TODO[name][0]
    which = f"issue {issue}" if issue else "planned"

    def run(args: argparse.Namespace) -> int:
        raise WorkbenchError(f"`workbench {name}` is not built yet ({which})",
                             "use the stages that exist: recipe, tiny-model, serve, train, run")

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="GRPO Workbench: vLLM samples, TRL trains, one recipe drives every stage.",
        epilog="Every subcommand takes --recipe NAME and section.key=value overrides; `workbench SUBCOMMAND --help`.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("recipe", help="list recipes or print one, resolved, with overrides applied",
                       description="List the shipped recipes, or print one resolved (extends and overrides applied) "
                                   "and check that its trainer section builds a real trl.GRPOConfig.")
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("name", nargs="?", help="recipe name or YAML path (for show)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=cmd_recipe)

    p = sub.add_parser("tiny-model", help="build (or reuse) the tiny arithmetic model and print its accuracy",
                       description="Build a byte-level BPE tokenizer and a ~1.3M-parameter Qwen2 model from scratch, "
                                   "pre-train it briefly on synthetic arithmetic (seeded, about a minute on 2 cores), "
                                   "and save it under data/tiny-model/. Same settings: the cached model is reused.")
    _add_recipe_args(p)
    p.add_argument("--force", action="store_true", help="rebuild even when a cached model matches")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("run", help="run the staged notebooks with papermill: env, offline, serving, smoke, train, eval",
                       description="Execute the staged notebooks in order with papermill on the project's kernel, "
                                   "into one run directory (runs/<stamp>-<recipe>-run/): environment check, offline "
                                   "generation, serving and its concurrency sweep, the smoke GRPO run with its "
                                   "checks, the full GRPO run with the live dashboard, and base vs trained "
                                   "evaluation through the server. Each executed notebook is kept and exported to "
                                   "HTML; the first failing stage stops the run and names its notebook and log; "
                                   "report.html is written either way.")
    _add_recipe_args(p)
    p.add_argument("--stages", help="comma-separated subset of env,offline,serving,smoke,train,eval (default: all)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="(re)build a run's self-contained HTML report",
                       description="Write RUN_DIR/report.html from what the run directory holds: outcome, stages, "
                                   "evaluation before vs after, training curves, step-time breakdown, advisor "
                                   "findings, sample completions, smoke checks, serving sweep, environment and the "
                                   "resolved recipe. Works for a crashed or stopped run too; no external URLs.")
    p.add_argument("run_dir", help="a run directory (from `workbench run` or `workbench train`)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("serve", help="start (or check) the recipe's vLLM server and keep it running",
                       description="Start the recipe's vLLM server (vllm serve on CUDA/Ascend, the workbench's "
                                   "launcher on the CPU build) with its served name, lengths, parallel sizes and "
                                   "device split; wait for /health, verify /v1/models, and hold until Ctrl-C, which "
                                   "stops the whole process group. With server.mode=attach, check a running server.")
    _add_recipe_args(p)
    p.add_argument("--model", help="model directory to serve (default: the recipe's model)")
    p.add_argument("--print-command", action="store_true", help="print the launch command and exit")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("train", help="GRPO training through the recipe's vLLM server",
                       description="Start (or attach to) the recipe's vLLM server, run TRL's GRPOTrainer against it "
                                   "with the recipe's data and rewards, sync the weights after every optimizer step "
                                   "(server.weight_sync), and save checkpoints and the final model (Hugging Face "
                                   "format) in a new run directory under monitor.runs_dir.")
    _add_recipe_args(p)
    p.add_argument("--run-dir", help="write into this directory (created if missing) instead of a new one")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("stop", help="ask a training run to checkpoint and stop after its current step",
                       description="Write RUN_DIR/STOP. The trainer checks for it after every optimizer step, saves a "
                                   "checkpoint, and ends as a finished run would (final model, train.json).")
    p.add_argument("run_dir", help="the run directory (runs/<id>)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("advise", help="name the bottleneck of a run from what it recorded",
                       description="Run the advisor's rules over a run directory's metrics.jsonl, devices.jsonl and "
                                   "rollout.jsonl: idle inference devices, low server concurrency, long-tail "
                                   "completions, KL spikes, groups without learning signal, falling or flat reward, "
                                   "weight sync share. Each finding comes with its evidence and a suggested change.")
    p.add_argument("run_dir", help="the run directory (runs/<id>)")
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("env", help="check platform, version chain, Ascend setup, collectives, resources",
                       description="Check, with a fix for each finding: the platform and the recipe's device split; "
                                   "installed torch/torch_npu/vLLM/TRL/transformers against the Ascend compatibility "
                                   "matrix (closest row, what to change) and TRL's vLLM window; pip check; on Ascend "
                                   "CANN loaded, npu-smi devices and HCCL settings; an all-reduce self-test across "
                                   "processes (gloo/nccl/hccl); disk, memory and the CPU server's KV cache. Prints a "
                                   "table and saves env.json in a new run directory; exit 1 if a check failed.")
    _add_recipe_args(p)
    p.add_argument("--no-collective", action="store_true", help="skip the all-reduce self-test")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("eval", help="score models through the OpenAI-compatible server, repeated and concurrent",
                       description="Serve each model in turn (or attach to server.url), check before any request "
                                   "that the served name is right and the longest prompt plus eval.max_tokens fits "
                                   "max_model_len, send the eval split with bounded concurrency, score (exact match; "
                                   "math-verify for LaTeX answers), repeat eval.repeats times, and write "
                                   "samples.jsonl, summary.json, comparison.md and comparison.png. Prints the "
                                   "equivalent lm-evaluation-harness command.")
    _add_recipe_args(p)
    p.add_argument("--bench", metavar="C1,C2,...",
                   help="measure evaluator throughput at these concurrencies against a sequential loop, then exit")
    p.add_argument("--model", action="append", metavar="LABEL=PATH",
                   help="a model directory to evaluate, repeatable (default: the recipe's model as 'base')")
    p.set_defaults(func=cmd_eval)

    for name, (issue, short, text) in STAGES_TODO.items():
        which = f"issue {issue}" if issue else "planned"
        p = sub.add_parser(name, help=f"{short} (not built yet: {which})",
                           description=f"{text} Not built yet: {which}.")
        _add_recipe_args(p)
        p.set_defaults(func=_todo(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WorkbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
