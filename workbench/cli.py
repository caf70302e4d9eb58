"""The `workbench` command: one subcommand per stage, each driven by a recipe.

    workbench --help
    workbench recipe list
    workbench recipe show cpu-tiny trainer.learning_rate=5e-6
    workbench tiny-model --recipe cpu-tiny
    python -m workbench ...            # the same

This is an entry point: it loads the recipe, resolves it once (workbench.recipe.resolve) and hands the result to
the stage. Overrides are `section.key=value` words after the options; bad input ends with one line naming the
cause and the fix, and exit status 2. Each subcommand's description is the docstring of the module that does the
work (read from the file, so `--help` imports nothing heavy).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Callable

from workbench.errors import WorkbenchError, exit_on_sigterm
from workbench.experiments import protocol
from workbench.rundir import RunDir

PACKAGE = Path(__file__).resolve().parent


def _doc(module: str) -> str:
    """The first paragraph of a module's docstring, read without importing it."""
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _recipe_args(p: argparse.ArgumentParser, default: str | None = "cpu-tiny") -> None:
    p.add_argument("--recipe", "-r", default=default,
                   help="recipe name (see `workbench recipe list`) or path of a YAML file"
                        + (f" (default: {default})" if default else ""))
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override recipe values, e.g. trainer.learning_rate=5e-6 server.port=8011")


def _resolved(args: argparse.Namespace, server: bool = True):
    """The command's recipe, resolved; with `server`, its server.extra_args checked as vLLM reads them (every
    command that reads the server section: plan, serve, train, run, eval, env...), before anything starts."""
    from workbench import recipe  # lazy: yaml

    rr = recipe.resolve(recipe.load(args.recipe or "cpu-tiny", args.overrides))
    if server:
        from workbench.serving import launch  # lazy: requests

        launch.check_extra_args(rr)
    return rr


# ----------------------------------------------------------------------------------------------------------------
# Commands

def cmd_recipe(args: argparse.Namespace) -> int:
    from workbench import recipe  # lazy: yaml

    if args.action == "list":
        for name in recipe.available():
            print(f"{name:22s} {recipe.load(name).description}")
        return 0
    if not args.name:
        raise WorkbenchError("`workbench recipe show` needs a recipe name", f"use one of: {', '.join(recipe.available())}")
    rr = recipe.resolve(recipe.load(args.name, args.overrides))
    from workbench.serving import launch as serving_launch  # lazy: requests

    serving_launch.check_extra_args(rr)  # before printing: a recipe vLLM would read otherwise is not shown as valid
    print(rr.recipe.to_yaml(), end="")
    d = rr.describe()
    print(f"# resolved: platform {d['platform']}, model {d['model_path']}, weight sync {d['weight_sync']}, "
          f"server {d['server_url']} on {d['server']['devices']}, trainer on {d['trainer']['devices']}")
    print(f"# trainer keys checked against trl.GRPOConfig's {len(recipe.trl_fields.names())} arguments")
    for split, where in d["data"].items():  # where each split's rows come from (a carve says by what)
        print(f"# data.{split}: {where}")
    from workbench.serving import rewards as served_rewards  # lazy: requests

    for line in served_rewards.describe(rr):  # each reward's kind, where it runs, its memory
        print(f"# {line}")
    if args.check:
        from workbench.training.config import grpo_config  # lazy: yaml

        config = grpo_config(rr, output_dir=f"{rr.recipe.monitor.runs_dir}/<run-id>")
        print(f"# built trl.GRPOConfig for platform {rr.platform!r}: {config.per_device_train_batch_size} "
              f"completions/device/step, {config.num_generations} generations, lr {config.learning_rate:g}, "
              f"beta {config.beta:g}, use_vllm={config.use_vllm}")
        from workbench.training import launch  # lazy: yaml

        problems = launch.placement_problems(rr)
        if problems:
            raise problems[0]
        where = {"accelerate": f"{rr.trainer_processes} rank(s)/node × {rr.recipe.distributed.nodes} node(s) through "
                               f"accelerate ({rr.recipe.distributed.strategy})",
                 "process": "one process started with the trainer role's environment",
                 "here": "in the `workbench train` process"}[launch.trainer_placement(rr)]
        print(f"# placement: trainer on {list(rr.trainer.devices)}, {where}")
    return 0


def cmd_reward_model(args: argparse.Namespace) -> int:
    from workbench.training import rewardmodel  # lazy: transformers (in the build's own process)

    rr = _resolved(args, server=False)
    print(rewardmodel.ensure(rr, force=args.force))
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from workbench import tinymodel  # lazy: yaml

    rr = _resolved(args, server=False)
    print(tinymodel.ensure(rr.recipe, force=args.force))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from workbench import pipeline  # lazy: yaml

    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    if args.resume:
        from workbench import recipe  # lazy: yaml

        if args.overrides or args.recipe:
            raise WorkbenchError("--resume continues a run with its own recipe",
                                 "drop --recipe and the overrides: workbench run --resume RUN")
        run = RunDir.open(args.resume)
        pipeline.run(recipe.resolve(recipe.load(str(run.recipe))), stages, resume=run)
        return 0
    pipeline.run(_resolved(args), stages)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from workbench.observe import report  # lazy: matplotlib

    print(report.build(RunDir.open(args.run_dir)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from workbench import tinymodel  # lazy: yaml
    from workbench.serving import launch, server  # lazy: requests

    rr = _resolved(args)
    if rr.recipe.server.attached:
        entry = server.VLLMServer(rr).start().model_entry
        print(f"attached: {rr.server_url} serves {rr.recipe.server.served_model_name!r} "
              f"(max_model_len {entry['max_model_len']})")
        return 0
    model_path = args.model or tinymodel.ensure_model(rr)
    if args.print_command:
        print(" ".join(launch.command(rr, model_path)))
        return 0
    server.serve_forever(rr, model_path, RunDir.create(rr.recipe, "serve").serving.make().path, args.for_training)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from workbench import recipe  # lazy: yaml

    if args.resume:
        if args.recipe or args.overrides or args.run_dir:
            raise WorkbenchError("--resume continues a run with its own recipe",
                                 "drop --recipe, --run-dir and overrides: workbench train --resume RUN")
        run = RunDir.open(args.resume)
        if not run.train.recipe.exists():
            raise WorkbenchError(f"{args.resume} has no recipe.yaml", "pass the run directory of a training (runs/<id>)")
        r = recipe.load(str(run.train.recipe))
    elif args.run_dir and RunDir(args.run_dir).recipe.exists():
        if args.recipe or args.overrides:
            raise WorkbenchError(f"{args.run_dir} already has its recipe.yaml; --recipe and overrides would make the "
                                 "run differ from it", "drop them, or train into a new run directory")
        run = RunDir.open(args.run_dir)
        r = recipe.load(str(run.recipe))
    else:
        r = recipe.load(args.recipe or "cpu-tiny", args.overrides)
        run = None
    rr = recipe.resolve(r)
    from workbench.training.config import preflight  # late: a bad recipe is refused before torch and TRL load
    from workbench.training.train import train

    preflight(rr)  # devices, nodes, strategy, key, the GRPOConfig, data, rewards: before the run directory exists
    if run is None:
        node = r.distributed.node_rank  # another node's ranks only: its run directory says so
        run = RunDir.at(args.run_dir, r) if args.run_dir else RunDir.create(r, f"train-node{node}" if node else "train")
    train(rr, run.train, resume=bool(args.resume), checked=True)
    print(f"run directory: {run.path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from workbench.training import export  # lazy: peft, transformers

    export.export(RunDir.open(args.run_dir), args.out, merge=args.merge)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from workbench import plan  # lazy: yaml

    the_plan = plan.plan(_resolved(args), args.recipe, tuple(args.overrides))
    if args.emit == "text":
        print(the_plan.text())
    else:
        print(plan.script(the_plan, args.emit), end="")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    flag = RunDir.open(args.run_dir).train.request_stop("workbench stop")
    print(f"wrote {flag}: the run checkpoints and ends after its current step")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from workbench.observe import advisor, rundata  # lazy: yaml

    run = RunDir.open(args.run_dir)
    if not run.train.metrics.exists():
        raise WorkbenchError(f"no training metrics in {args.run_dir} ({run.train.metrics} is missing)",
                             "pass a run directory that trained (runs/<id>)")
    findings = advisor.advise(rundata.load(run.train))
    for finding in findings:
        print(finding.text())
    if not findings:
        print(f"no problem found by the {len(advisor.RULES)} rules ({', '.join(advisor.RULES)})")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from workbench import envcheck  # lazy: yaml

    rr = _resolved(args)
    report = envcheck.check(rr, collective=not args.no_collective)
    print(report.to_text())
    print(f"saved: {report.save(RunDir.create(rr.recipe, 'env'))}")
    return 0 if report.ok else 1


def _whole_numbers(text: str, flag: str, least: int, what: str, example: str) -> list[int]:
    """A comma-separated option of whole numbers, each `least` or more; else one error line with the fix."""
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        values = []
    if not values or any(v < least for v in values):
        kind = "positive whole numbers" if least == 1 else f"whole numbers of {least} or more"
        raise WorkbenchError(f"{flag} {text!r} is not a list of {kind}",
                             f"write {what}, e.g. {flag} {example}")
    return values


def _concurrencies(text: str, flag: str = "--sweep") -> list[int]:
    return _whole_numbers(text, flag, 1, "it as comma-separated requests in flight", "1,4,16")


def cmd_eval(args: argparse.Namespace) -> int:
    from workbench.evaluation import evaluate  # lazy: requests

    rr = _resolved(args)
    if args.sweep:
        concurrencies = _concurrencies(args.sweep)
        evaluate.check_inputs(rr)  # the key: before the run directory and the server
        return _sweep(rr, concurrencies)
    models = {}
    for item in args.model or []:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = path or label, label
        models[label] = path
    evaluate.check_inputs(rr, models)  # refused before the run directory is written
    stage = RunDir.create(rr.recipe, "eval").eval
    result = evaluate.evaluate(rr, models or None, stage=stage)
    if len(result.summaries) > 1:  # what notebook 05 shows: fixed, broken and the breakdowns (eval/analysis.json)
        from workbench.evaluation import analysis  # lazy: yaml

        try:
            print(analysis.analyse(result, rr, stage=stage).markdown(k=2))
            print(f"analysis: {stage.analysis}")
        except Exception as exc:  # the evaluation itself is saved and sound: its breakdown must not fail it
            print(f"warning: no problem-by-problem analysis ({type(exc).__name__}: {exc}); the report computes it "
                  "again from the samples", file=sys.stderr)
    return 0


def _sweep(rr, concurrencies: list[int]) -> int:
    from workbench.evaluation import sweep  # lazy: requests

    result, saved = sweep.measure(rr, concurrencies)
    print(f"saved: {saved}")
    print(result.markdown())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from workbench import recipe  # lazy: yaml
    from workbench.experiments import bench  # lazy: yaml

    def names(text: str | None) -> list[str] | None:
        return [n.strip() for n in text.split(",") if n.strip()] if text else None

    base = recipe.load(args.recipe or "cpu-tiny", args.overrides)  # the run directory follows monitor.runs_dir
    bench.run(base, steps=args.steps, warmup=args.warmup, sizes=names(args.sizes), paths=names(args.paths),
              concurrencies=_concurrencies(args.concurrency, "--concurrency"), overrides=args.overrides,
              repeats=args.repeats)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from workbench.observe import compare  # lazy: matplotlib

    compare.metric_keys(args.metrics)  # a bad --metrics is refused before any run is read
    runs = compare.load_runs(args.runs)
    saved = compare.save(runs, args.out, args.metrics)
    for run in runs.runs:
        note = f" ({run.tag['note']})" if run.tag.get("note") else ""
        print(f"{run.label}: {run.path}{note}")
    if len(runs) > 1 and compare.differing_keys(runs).empty:
        print("the recipes are the same apart from " + ", ".join(compare.IGNORED_KEYS))
    print()
    print(compare.markdown_table(compare.side_by_side(runs, readable=True), "key / outcome"))
    print(f"saved: {saved['table']}, {saved['figure'].name}, {saved['json'].name}")
    return 0


def _seed_list(text: str, flag: str) -> list[int]:
    return _whole_numbers(text, flag, 0, "the training seeds comma-separated", "1,2,3")


def cmd_protocol(args: argparse.Namespace) -> int:
    seeds = _seed_list(args.seeds, "--seeds") if args.seeds is not None else None
    choose = _seed_list(args.choose_seed, "--choose-seed") if args.choose_seed is not None else None
    if choose is not None and len(choose) != 1:
        raise WorkbenchError(f"--choose-seed {args.choose_seed!r} names {len(choose)} seeds", "give one, e.g. --choose-seed 0")
    candidates = [protocol.parse_candidate(text) for text in args.candidate or []]
    data_seeds = _seed_list(args.data_seeds, "--data-seeds") if args.data_seeds is not None else []
    if args.resume:
        if (candidates or args.overrides or choose is not None or args.recipe or args.concurrent != 1 or data_seeds
                or args.report_all):
            raise WorkbenchError("--resume continues a protocol with its own recipe, candidates and choice seed",
                                 "pass only --resume RUN (and --seeds to add test seeds)")
        protocol.run("", [], 0, seeds or [], resume=args.resume)
    else:
        protocol.run(args.recipe or "cpu-tiny", candidates, choose[0] if choose else 0, seeds or [1, 2, 3],
                     args.overrides, concurrent=args.concurrent, data_seeds=data_seeds, report_all=args.report_all)
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    from workbench.observe import compare  # lazy: matplotlib

    path = compare.write_tag(args.run_dir, args.name, args.note)
    print(f"tagged {args.run_dir} as {compare.read_tag(args.run_dir)['name']!r}: {path}")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    import os

    from workbench.notebook import kernel_name, lab_command, register_kernel  # lazy: yaml

    if kernel_name() != "grpo-workbench":  # an install route that did not register it (pip install by hand)
        print(f"registered the grpo-workbench kernel: {register_kernel()}", flush=True)
    extra = [a for a in args.extra if a != "--"]
    cmd = lab_command(args.port, args.root, open_browser=not args.no_browser, extra=extra)
    print(f"JupyterLab on http://127.0.0.1:{args.port}/ (loopback only); the notebooks are in notebooks/", flush=True)
    os.execv(cmd[0], cmd)  # Lab in this process: Ctrl-C and a kill reach it, and its kernels, directly
    return 0


def cmd_kernel(args: argparse.Namespace) -> int:
    from workbench.notebook import register_kernel  # lazy: ipykernel

    print(f"the grpo-workbench kernel runs {sys.executable}: {register_kernel(args.prefix)}")
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench", description="GRPO Workbench: vLLM samples, TRL trains, one recipe drives every stage.",
        epilog="Every stage takes --recipe NAME and section.key=value overrides; `workbench SUBCOMMAND --help`.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    def add(name: str, help: str, module: str | None, func, recipe: str | None = "cpu-tiny", run_dir: bool = False,
            description: str | None = None):
        # the module's first paragraph when the module is the command; a command of its own says what it does
        p = sub.add_parser(name, help=help, description=description or (_doc(module) if module else "") or help)
        if run_dir:
            p.add_argument("run_dir", help="a run directory (runs/<id>)")
        elif recipe is not False:
            _recipe_args(p, recipe)
        p.set_defaults(func=func)
        return p

    p = sub.add_parser("recipe", help="list recipes or print one, resolved, with overrides applied",
                       description=_doc("workbench.recipe.load"))
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("name", nargs="?", help="recipe name or YAML path (for show)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument("--check", action="store_true", help="also build the real trl.GRPOConfig (imports TRL)")
    p.set_defaults(func=cmd_recipe)

    p = add("tiny-model", "build (or reuse) the tiny arithmetic model and print its accuracy",
            "workbench.tinymodel", cmd_tiny_model)
    p.add_argument("--force", action="store_true",
                   help="build on this machine even when a cached or shipped model matches (a shipped one is "
                        "rebuilt into <key>-rebuilt/ and compared; the recipe keeps the shipped one)")
    p = add("reward-model", "build (or reuse) the tiny reward model (tiny-rm) and print its held-out agreement",
            "workbench.training.rewardmodel", cmd_reward_model)
    p.add_argument("--force", action="store_true", help="build it again even when one is cached")
    p = add("run", "run the staged notebooks with papermill: env, offline, serving, smoke, train, eval",
            "workbench.pipeline", cmd_run, recipe=None)  # None: --resume must see whether one was given
    p.add_argument("--stages", help="comma-separated subset of env,offline,serving,smoke,train,eval (default: all)")
    p.add_argument("--resume", metavar="RUN", help="continue an interrupted run: keep the stages that passed, run the "
                                                   "rest, the training from its newest checkpoint")
    add("report", "(re)build a run's self-contained HTML report", "workbench.observe.report", cmd_report, run_dir=True)
    p = add("serve", "start (or check) the recipe's vLLM server and keep it running", "workbench.serving.server",
            cmd_serve)
    p.add_argument("--model", help="model directory to serve (default: the recipe's model)")
    p.add_argument("--print-command", action="store_true", help="print the launch command and exit")
    p.add_argument("--for-training", action="store_true", help="a server a trainer attaches to: weight-update endpoints on")
    p = add("train", "GRPO training through the recipe's vLLM server", "workbench.training.train", cmd_train,
            recipe=None)
    p.add_argument("--run-dir", help="train into this run directory (its recipe.yaml when it has one)")
    p.add_argument("--resume", metavar="RUN", help="continue the run's training from its newest checkpoint")
    p = add("export", "write a run's trained model as a Hugging Face directory with its recipe and results (--merge: a LoRA adapter merged in)",
            "workbench.training.export", cmd_export, run_dir=True)
    p.add_argument("--merge", action="store_true", help="merge the run's LoRA adapter into its base model")
    p.add_argument("--out", metavar="DIR", help="where the model goes (default: RUN/train/merged, or RUN/train/export for a full model)")
    p = add("plan", "what each node runs: commands, environment, devices, ports, memory per device",
            "workbench.plan", cmd_plan)
    p.add_argument("--emit", choices=["text", "shell", "slurm"], default="text",
                   help="text: the plan; shell: one script for every node (bash SCRIPT NODE); slurm: an sbatch "
                        "script for the recipe's nodes")
    add("stop", "ask a training run to checkpoint and stop after its current step", None, cmd_stop, run_dir=True,
        description="Ask a running training to stop cleanly: writes the run's STOP file; the trainer saves a "
                    "checkpoint at the end of its current step and ends (resume it with `workbench train --resume "
                    "RUN`). The dashboard's Stop button does the same.")
    add("advise", "name the bottleneck of a run from what it recorded", "workbench.observe.advisor", cmd_advise,
        run_dir=True)
    p = add("env", "check platform, version chain, Ascend setup, collectives, resources",
            "workbench.envcheck", cmd_env)
    p.add_argument("--no-collective", action="store_true", help="skip the all-reduce self-test")
    p = add("eval", "score models through the OpenAI-compatible server, repeated and concurrent",
            "workbench.evaluation.evaluate", cmd_eval)
    p.add_argument("--sweep", metavar="C1,C2,...",
                   help="measure the server's throughput at these concurrencies against a sequential loop, then exit")
    p.add_argument("--model", action="append", metavar="LABEL=PATH",
                   help="a model directory to evaluate, repeatable (default: the recipe's model as 'base')")
    p = add("bench", "every rollout path (in-process, colocate, server, async) timed on this machine",
            "workbench.experiments.bench", cmd_bench)
    p.add_argument("--steps", type=int, default=4, help="measured steps per path (default: 4)")
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured ones (default: 1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="trainings per path, taking turns; ratios get their spread over them (default: 3)")
    p.add_argument("--sizes", help="comma-separated: tiny,100m (default: both for a tiny-model recipe)")
    p.add_argument("--paths", help="comma-separated: in-process,colocate,server,async,lora (default: all)")
    p.add_argument("--concurrency", default="1,2,4", metavar="C1,C2,...",
                   help="training requests in flight for the server's saturated throughput (default: 1,2,4)")
    p = add("compare", "runs side by side: recipe keys that differ, outcomes, overlaid curves",
            "workbench.observe.compare", cmd_compare, recipe=False)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (runs/<id>) or training directories")
    p.add_argument("--out", metavar="DIR", help="where compare.md, compare.png and compare.json go (default: a new "
                                                "<stamp>-compare/ beside the first run)")
    p.add_argument("--metrics", metavar="M1,M2,...",
                   help="curves to overlay: reward, kl, loss, entropy, length, clipped, reward_std, lr, step_time, "
                        "tokens_per_second or any metrics.jsonl key (default: reward,kl,loss,entropy,length,step_time)")
    p = add("protocol", "choose settings on the validation split, report the test split over seeds",
            "workbench.experiments.protocol", cmd_protocol, recipe=None)
    p.add_argument("--candidate", action="append", metavar="'NAME: k=v ...'",
                   help="a setting to try against the recipe as it is (repeatable)")
    p.add_argument("--choose-seed", help="the training seed (trainer.seed) of the choice on validation (default: 0)")
    p.add_argument("--seeds", help="the test seeds, comma-separated, none of them the choice's (default: 1,2,3)")
    p.add_argument("--resume", metavar="RUN", help="continue this protocol directory (its recorded trainings kept); "
                                                   "with --seeds, add test seeds")
    p.add_argument("--concurrent", type=int, default=1, metavar="N",
                   help="train N at a time on the shared server (LoRA recipes: each run pushes its own adapter)")
    p.add_argument("--data-seeds", metavar="D1,D2,...",
                   help="base models: each data seed's splits and the tiny model built on them; the gain is reported "
                        "over every (base, seed) pair (default: the recipe's one)")
    p.add_argument("--report-all", action="store_true",
                   help="train and report every candidate on the test split, not only the one chosen")
    p = add("tag", "name a run (and note why) for comparisons", None, cmd_tag, run_dir=True,
            description="Name a run, with an optional note on why it was run: writes RUN/tag.json; `workbench "
                        "compare` labels the run with the name and shows the note.")
    p.add_argument("name", help="a short name, e.g. lr-high: comparisons label the run with it")
    p.add_argument("--note", help="a sentence kept with the tag and shown in comparisons")
    p = sub.add_parser("lab", help="JupyterLab on loopback for the notebooks, with the project's kernel (make lab)",
                       description="JupyterLab for the staged notebooks (notebooks/), bound to 127.0.0.1, with the "
                                   "grpo-workbench kernel; on a remote node reach it with ssh -L PORT:127.0.0.1:PORT. "
                                   "Ctrl-C or a kill ends Lab and its kernels.")
    p.add_argument("--port", type=int, default=8888, help="loopback port (default: 8888)")
    p.add_argument("--root", default=".", help="the directory Lab opens (default: here; the notebooks are in notebooks/)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser (print the URL only)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more jupyter lab options")
    p.set_defaults(func=cmd_lab)
    p = sub.add_parser("kernel", help="register this environment as the grpo-workbench Jupyter kernel",
                       description="Register this Python (the environment with the accelerator's stack, after a pip "
                                   "install of the cuda or ascend extras) as the grpo-workbench kernel that the "
                                   "notebooks, `workbench run` and papermill -k grpo-workbench use. make install does "
                                   "it for the CPU stack.")
    p.add_argument("--prefix", help="the environment to register it in (default: this one, sys.prefix)")
    p.set_defaults(func=cmd_kernel)
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # `kill`, a scheduler's stop: the command's cleanup runs (its server, trainings, RAM disk)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["recipe"] and "--check" in argv:
        # `recipe show --check NAME`, as users type it: argparse fills the positionals before the flag and would
        # call NAME unrecognised; the flag means the same anywhere
        argv = [a for a in argv if a != "--check"] + ["--check"]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except WorkbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
