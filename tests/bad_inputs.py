"""Bad inputs and the message each must get: driven through the CLI by tests/test_bad_input.py, printed as the
table in docs/reliability.md by `python scripts/bad_input_table.py`.

Each case: (what a user types after `workbench`, a fragment the one-line message must contain). `{tmp}` is a
scratch directory holding the files some cases need (see `write_files`), `{port}` a port nobody listens on.

`run_all` runs every case through the console script's own entry point (`workbench.cli.main`, what `workbench`
calls) in one fresh process of its own, one case after the other, each with its output and exit status captured
as the shell would see them (an exception that escapes is printed as Python would print it, status 1): the CLI's
real code path without paying Python's, torch's and TRL's imports sixty times.

    python tests/bad_inputs.py TMP PORT < cases.json     # what run_all starts: JSON results on stdout
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRAIN = ["train", "--recipe", "smoke"]

CASES: list[tuple[list[str], str]] = [
    (TRAIN + ["trainer.max_completion_length=abc"], "trainer.max_completion_length is 'abc' (str), trl.GRPOConfig declares int"),
    (TRAIN + ["trainer.max_steps=1.5"], "trainer.max_steps is 1.5 (float)"),
    (TRAIN + ["trainer.bf16=maybe"], "trainer.bf16 is 'maybe'"),
    (TRAIN + ["trainer.num_generations=1"], "trainer.num_generations is 1"),
    (TRAIN + ["trainer.learning_rate=-1e-5"], "trainer.learning_rate is -1e-05"),
    (TRAIN + ["trainer.learnin_rate=1e-5"], "did you mean 'learning_rate'"),
    (TRAIN + ["trainer.generation_kwargs={seed: 3}"], "trainer.generation_kwargs.seed would sample every step"),
    (TRAIN + ["trainer.use_vllm=true"], "trainer.use_vllm is derived by the workbench"),
    (TRAIN + ["trainer.per_device_train_batch_size=3"], "divisible by num_generations"),
    (TRAIN + ["trainer.generation_batch_size=5", "trainer.per_device_train_batch_size=2"], "generation_batch_size"),
    (TRAIN + ["eval.repeats=0"], "eval.repeats is 0"),
    (TRAIN + ["eval.max_tokens=0"], "eval.max_tokens is 0"),
    (TRAIN + ["eval.top_p=0"], "eval.top_p is 0"),
    (TRAIN + ["eval.concurrency=0"], "eval.concurrency is 0"),
    (TRAIN + ["server.port=70000"], "server.port is 70000"),
    (TRAIN + ["server.port=abc"], "server.port is 'abc' (str), expected int"),
    (TRAIN + ["peft.r=8", "peft.lora_alph=16"], "unknown recipe key 'peft.lora_alph' (not a peft.LoraConfig argument)"),
    (TRAIN + ["peft.r=64", "server.max_lora_rank=32"], "peft.r=64 is above the server's LoRA rank limit"),
    (TRAIN + ["server.weight_sync=lora"], "server.weight_sync is 'lora' but the recipe has no peft: section"),
    (TRAIN + ["server.max_model_len=16"], "server.max_model_len=16 is smaller than"),
    (TRAIN + ["server.gpu_memory_utilization=1.5"], "server.gpu_memory_utilization is 1.5"),
    (TRAIN + ["server.weight_sync=magic"], "server.weight_sync is 'magic'"),
    (TRAIN + ["server.extra_args=[--host,0.0.0.0]"], "--host"),
    (TRAIN + ["server.extra_args=[--enable-chunked-prefill]"], "runs CPU servers without chunked prefill"),
    # judged as vLLM's own parser reads them (serving/vllm_args): a prefix, a --config file, a checked knob, a typo
    (TRAIN + ["server.extra_args=[--enable-chunked]"], "set --enable-chunked-prefill to True as vLLM reads them"),
    (TRAIN + ["server.extra_args=[--config,{tmp}/vllm.yaml]"], "set --max-num-batched-tokens to 16 as vLLM reads them"),
    (["plan", "--recipe", "cpu-tiny", "server.extra_args=[--max-num-batched-tokens,'16']"],
     "set server.max_num_batched_tokens instead"),
    (["serve", "--recipe", "cpu-tiny", "server.extra_args=[--max-num-sequences,'4']"],
     "vLLM's parser refuses server.extra_args ['--max-num-sequences', '4']: vllm: error: unrecognized arguments"),
    # every command that reads the server section checks them, not only serve and train
    (["plan", "--recipe", "cpu-tiny", "server.extra_args=[--port,'9']"], "set server.port instead"),
    (["recipe", "show", "cpu-tiny", "server.extra_args=[--port,'9']", "--check"], "set server.port instead"),
    (TRAIN + ["server.max_num_batched_tokens=64"], "one engine step must hold a whole prompt"),
    (TRAIN + ["server.host=0.0.0.0"], "server.host=0.0.0.0"),
    (TRAIN + ["server.sync_dir={tmp}/model-dir"], "server.sync_dir"),
    (TRAIN + ["devices.trainer=[]"], "devices.trainer is empty"),
    (TRAIN + ["devices.server=[0,0]"], "devices.server repeats ids [0]"),
    (TRAIN + ["devices.trainer=[64]"], "CPU cores [64]"),
    (TRAIN + ["distributed.processes=0"], "distributed.processes is 0"),
    (TRAIN + ["distributed.strategy=fsdp"], "distributed.strategy=fsdp with one trainer process"),
    (TRAIN + ["distributed.nodes=2", "distributed.node_rank=2"], "distributed.node_rank=2 with distributed.nodes=2"),
    (TRAIN + ["devices.platform=cuda", "devices.trainer=[0]"], "devices.server [0] and devices.trainer [0] share card(s) [0]"),
    (["plan", "--recipe", "cuda-2gpu", "devices.trainer=[0]"], "devices.server [0] and devices.trainer [0] share card(s) [0]"),
    (["plan", "--recipe", "ascend-910b-8card", "devices.trainer=[3,4,5,6]"],
     "devices.server [0, 1, 2, 3] and devices.trainer [3, 4, 5, 6] share card(s) [3]"),
    (TRAIN + ["server.keep_alive_s=0"], "server.keep_alive_s is 0"),
    (TRAIN + ["server.api_key_env=WORKBENCH_NO_SUCH_KEY"], "server.api_key_env names $WORKBENCH_NO_SUCH_KEY, which is not set"),
    (TRAIN + ["server.mode=attach", "server.url=http://127.0.0.1:{port}"], "no server answers at http://127.0.0.1:"),
    (TRAIN + ["rollout.mode=overlap"], "rollout.mode is 'overlap'"),
    (TRAIN + ["rollout.dynamic_sampling=true", "rollout.refill_cap=0"], "rollout.refill_cap is 0"),
    (TRAIN + ["rollout.mode=async", "server.mode=off"], "rollout.mode is 'async' but server.mode is 'off'"),
    (["train", "--recipe", "cpu-tiny", "rollout.mode=async"], "vllm_importance_sampling_correction is false"),
    (TRAIN + ["rollout.mode=async", "trainer.steps_per_generation=2"], "steps_per_generation=2"),
    (["bench", "--recipe", "smoke", "--paths", "server,turbo"], "--paths names 'turbo'"),
    (["bench", "--recipe", "smoke", "--repeats", "0"], "--repeats 0"),
    (TRAIN + ["data.name=gsm9k"], "data.name is 'gsm9k', not a known dataset"),
    (TRAIN + ["data.name=file"], "data.path is not set"),
    (TRAIN + ["data.name=file", "data.path={tmp}/missing.jsonl"], "does not exist"),
    (TRAIN + ["data.name=file", "data.path={tmp}/rows.csv"], "has format '.csv'"),
    (TRAIN + ["data.name=file", "data.path={tmp}/rows.jsonl", "data.fields.question=q"], "has no 'q' field"),
    (TRAIN + ["data.path={tmp}/rows.jsonl"], "'arithmetic' is generated and reads no file"),
    (TRAIN + ["data.train={tmp}/rows.jsonl"], "data.train set, but dataset 'arithmetic' is generated"),
    (TRAIN + ["data.name=file", "data.train={tmp}/rows.jsonl", "data.test={tmp}/rows.jsonl"],
     "the test split's source is the train split's"),
    (TRAIN + ["data.name=gsm8k", "data.test={hub: openai/gsm8k, config: main, split: train}"],
     "the test split's source is the train split's (hub openai/gsm8k (main), split train)"),
    (TRAIN + ["data.name=file", "data.train={tmp}/rows.jsonl"], "leaving none to train on"),
    (TRAIN + ["data.name=file", "data.train={path: {tmp}/rows.jsonl, split: test}"], "a file is one split"),
    (TRAIN + ["rewards.brevity=1.0"], "unknown reward 'brevity'"),
    (TRAIN + ["rewards={}"], "rewards is empty"),
    (TRAIN + ["rewards.no_such_module:brevity=0.1"], "cannot import module 'no_such_module'"),
    (TRAIN + ["rewards.my_rewards:two_args=0.1"], "does not have TRL's reward signature"),
    (TRAIN + ["rewards.my_rewards:words=0.1"], "returned 'short' (str) as a score"),
    (TRAIN + ["rewards.cap={function: my_rewards:capped, args: {limt: 4}}"], "rewards.cap.args has ['limt']"),
    (TRAIN + ["rewards.rm={kind: model, model: tiny-rm}"], "rewards.rm.score is not set"),
    (TRAIN + ["rewards.j={kind: judge, model: policy-base, template: '{completion}'}"],
     "only a LoRA run keeps"),
    (TRAIN + ["rewards.j={kind: judge, model: a/b, template: '{completion} {level}'}"],
     "rewards.j.template asks for {level}"),
    (TRAIN + ["rewards.rm={kind: model, model: {tmp}/no-rm, score: logit}"], "no-rm does not exist; fix: set rewards.rm.model to"),
    (["plan", "--recipe", "ascend-910b-8card-rm", "server.gpu_memory_utilization=0.8"],
     "the server cards' memory is over-committed"),
    (TRAIN + ["model.path={tmp}/no-model"], "does not exist"),
    (TRAIN + ["model.tiny.num_heads=3"], "hidden_size=256 is not divisible by num_heads=3"),
    (TRAIN + ["monitor.canary_every=-1"], "monitor.canary_every is -1"),
    (TRAIN + ["monitor.canary_warn_gap=0.5", "monitor.canary_stop_gap=0.1"], "is not below canary_stop_gap"),
    (TRAIN + ["optimizer.lr=1"], "unknown recipe section 'optimizer'"),
    (TRAIN + ["trainer.max_steps"], "has no '='"),
    (["train", "--recipe", "no-such-recipe"], "recipe 'no-such-recipe' does not exist"),
    (["train", "--recipe", "{tmp}/a.yaml"], "forms a cycle"),
    (["train", "--recipe", "{tmp}/broken.yaml"], "is not valid YAML"),
    (["train", "--resume", "{tmp}/no-run"], "no run directory"),
    (["eval", "--sweep", "1,x"], "--sweep '1,x' is not a list of positive whole numbers"),
    (["eval", "--model", "trained={tmp}/no-model"], "no model directory at trained="),
    (["run", "--stages", "env,deploy"], "unknown stage(s) ['deploy']"),
    (["compare", "{tmp}/no-run"], "no run directory"),
    (["compare", "{tmp}/model-dir"], "is not a run directory"),
    (["compare", "{tmp}/model-dir", "--metrics", ","], "--metrics ',' names no metric"),
    (["tag", "{tmp}/no-run", "lr-high"], "no run directory"),
    (TRAIN + ["eval.split=train"], "eval.split is 'train', not a split kept out of training"),
    (TRAIN + ["data.split=validation"], "GRPO trains on the train split, whose source is data.train"),
    (["protocol", "--choose-seed", "1", "--seeds", "1,2"], "the choice's seed 1 is also a test seed"),
    (["protocol", "--data-seeds", "1,1"], "--data-seeds [1, 1] must be distinct"),
    (["protocol", "--data-seeds", "0,1", "data.seed=3"], "sets what --data-seeds varies"),
    (["protocol", "--candidate", "more data: data.validation_size=100"], "candidate 'more data' changes data.validation_size"),
]


def write_files(tmp: Path) -> None:
    """The files the cases point at."""
    (tmp / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp / "b.yaml").write_text("extends: a.yaml\n")
    (tmp / "broken.yaml").write_text("trainer:\n  max_steps: [1,\n")
    (tmp / "rows.csv").write_text("question,answer\n1+1,2\n")
    (tmp / "rows.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    # reward functions of a user's project (the cases run with this directory as their working directory)
    (tmp / "my_rewards.py").write_text(
        "def two_args(prompts, completions):\n    return [0.0] * len(completions)\n\n"
        "def words(prompts, completions, **kwargs):\n    return ['short' for _ in completions]\n\n"
        "def capped(prompts, completions, limit=10, **kwargs):\n    return [0.0] * len(completions)\n")
    # a vLLM config file (`vllm serve --config`): the port is overridden by the workbench's own flag, the batch cap not
    (tmp / "vllm.yaml").write_text("port: 9\nmax-num-batched-tokens: 16\n")
    (tmp / "model-dir").mkdir(exist_ok=True)
    (tmp / "model-dir" / "config.json").write_text("{}")


def expand(args: list[str], tmp: Path, port: int) -> list[str]:
    return [a.replace("{tmp}", str(tmp)).replace("{port}", str(port)) for a in args]


def command_args(args: list[str], tmp: Path, port: int) -> list[str]:
    """A case's words as run: paths and port filled in, and every run written under tmp/runs."""
    args = expand(args, tmp, port)
    if args[0] in ("train", "eval", "run", "protocol") and "--resume" not in args:
        args = args + [f"monitor.runs_dir={tmp / 'runs'}"]
    return args


def run_all(cases: list[tuple[list[str], str]], tmp: Path, port: int, timeout: float = 600) -> list[dict]:
    """Every case in one new process, in tmp as its working directory and with tmp/data as WORKBENCH_DATA:
    [{"args", "code", "stdout", "stderr"}] in the cases' order."""
    write_files(tmp)
    env = {**os.environ, "WORKBENCH_DATA": str(tmp / "data")}
    argv = [command_args(args, tmp, port) for args, _ in cases]
    done = subprocess.run([sys.executable, __file__], input=json.dumps(argv), capture_output=True, text=True,
                          env=env, cwd=tmp, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the bad-input driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _drive(argv: list[list[str]]) -> list[dict]:
    """In the driver process: each case through workbench.cli.main, as `workbench ARGS` runs it."""
    import contextlib
    import io
    import traceback

    from workbench.cli import main

    results = []
    for args in argv:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:  # argparse's errors, as the console script's sys.exit would end
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # what the interpreter prints for an uncaught exception
                traceback.print_exc()
                code = 1
        results.append({"args": args, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    return results


if __name__ == "__main__":
    print(json.dumps(_drive(json.loads(sys.stdin.read()))))
