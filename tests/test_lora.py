"""LoRA GRPO with adapter-only weight sync (serving/sync.py LoraSync) and several runs on one server.

The recipe checks, launch flags and memory plan need no server. The acceptance runs for real, once (`lora_pair`):
one `workbench serve --for-training` with LoRA slots and an API key, two `workbench train` runs attached to it at
the same time, each pushing and sampling its own adapter; run B is SIGKILLed mid-run, run A goes on to its last
step. Then: every request in the server's log names one run's adapter, each run's canary held at every step, the
pushes moved the adapter's bytes and nothing else (the base model still serves its initial weights), the dead run's
adapter is freed by the stale rule, a server without a free slot is refused in one line before a model is built,
and `workbench export --merge` writes a model that scores exactly as the adapter does on the server.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests

from conftest import KEYED, LAB_REWARDS, free_port, wait_for, workbench_command
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.records import read_jsonl
from workbench.rundir import RunDir

PEFT = ["peft.r=8", "peft.lora_alpha=16", "peft.target_modules=all-linear"]


# ----------------------------------------------------------------------------------------------------------------
# Without a server

@pytest.mark.parametrize("overrides, message", [
    (["peft.r=8", "peft.bias=some"], "peft.bias is 'some', peft.LoraConfig accepts one of"),
    (["peft.r=eight"], "peft.r is 'eight' (str), peft.LoraConfig declares int"),
    (["peft.r=8", "peft.task_type=SEQ_CLS"], "peft.task_type is set by the workbench"),
    (["peft.r=8", "distributed.strategy=deepspeed", "distributed.zero_stage=3"], "holds only a shard of it"),
    (["peft.r=8", "server.lora_slots=1"], "server.lora_slots is 1"),
    (["peft.r=600"], "peft.r=600 is above the server's LoRA rank limit (server.max_lora_rank=512)"),
])
def test_bad_peft_sections_are_refused_at_load(overrides, message):
    with pytest.raises(WorkbenchError, match=re.escape(message)):
        recipe.load("smoke", overrides)


def test_auto_sync_is_lora_with_peft_and_a_row_without_runtime_lora_is_refused():
    from workbench.recipe.resolve import weight_sync

    r = recipe.load("smoke", PEFT)
    assert weight_sync(r, "cpu", {"vllm": "0.32.0+cpu"}) == "lora"
    assert weight_sync(recipe.load("smoke"), "cpu", {"vllm": "0.32.0+cpu"}) == "reload"
    assert weight_sync(r, "npu", {"vllm": "0.23.0", "vllm_ascend": "0.23.0"}) == "lora"
    for old in ("0.7.1rc1", "0.10.2rc1"):  # before the NPU punica wrapper; the release whose LoRA is broken
        with pytest.raises(WorkbenchError, match="needs vllm-ascend >= 0.7.3.*the row vllm-ascend 0.23.0"):
            weight_sync(r, "npu", {"vllm": old.split("rc")[0], "vllm_ascend": old})
    # a full push of the merged model stays possible (TRL's own PEFT path), chosen explicitly
    assert weight_sync(recipe.load("smoke", PEFT + ["server.weight_sync=reload"]), "cpu", {"vllm": "0.32.0"}) == "reload"


def test_lora_server_flags_and_runtime_updates_only_for_training(monkeypatch):
    from workbench.serving import launch

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    rr = recipe.resolve(recipe.load("smoke", PEFT + ["peft.r=12", "server.lora_slots=6"]))
    cmd = launch.command(rr, "/m")
    at = cmd.index("--enable-lora")
    assert cmd[at:at + 7] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "6", "--max-cpu-loras", "6"]
    assert launch.environment(rr, for_training=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")  # never inherited by a server no trainer uses
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch.environment(rr)
    plain = recipe.resolve(recipe.load("smoke"))
    assert "--enable-lora" not in launch.command(plain, "/m")
    with pytest.raises(WorkbenchError, match="would override --enable-lora"):
        launch.check_extra_args(recipe.resolve(recipe.load("smoke", ["server.extra_args=[--enable-lora]"])))


def test_plan_counts_the_adapter_as_peft_does_and_no_reference_model(tiny_model_dir):
    """The plan's adapter size against peft's own count on the tiny model, for three target choices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from workbench.plan import lora_params, model_shape, trainer_memory

    for targets in ("all-linear", None, ["q_proj", "down_proj"]):
        extra = [] if targets is None else [f"peft.target_modules={json.dumps(targets)}"]
        rr = recipe.resolve(recipe.load("smoke", ["peft.r=8", *extra, "trainer.beta=0.04"]))
        shape = model_shape(rr)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                               LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
        trainable, _ = model.get_nb_trainable_parameters()
        assert lora_params(rr, shape) == trainable, targets
        memory = trainer_memory(rr, shape, 64 * 2**30)
        assert "reference model" not in memory.parts and memory.parts["gradients"] == trainable * 4


def test_adapter_names_carry_the_run_and_when_it_pushed():
    from workbench.serving.client import adapter_pushed_at
    from workbench.serving.sync import adapter_name

    name = adapter_name("20261202-0800 smoke/train-41", 7, when=1796000000.9)
    assert name == "wbl.20261202-0800-smoke-train-41.s7.t1796000000"
    assert adapter_pushed_at(name) == 1796000000 and adapter_pushed_at("policy") is None


# ----------------------------------------------------------------------------------------------------------------
# Two runs on one LoRA server, for real

def _steps(train_dir) -> list[int]:
    return sorted({m["step"] for m in read_jsonl(train_dir / "metrics.jsonl", normalised=False) if "loss" in m})


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory, tiny_model_dir):
    """The shared server, run A (finished), run B (killed mid-run), the server's log; the server stays up for the
    module's tests and is stopped at the end."""
    project = tmp_path_factory.mktemp("lora")
    (project / "lab_rewards.py").write_text(LAB_REWARDS)
    runs, port = project / "runs", free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--recipe", "smoke", *PEFT, f"monitor.runs_dir={runs}", *KEYED]
    serve = subprocess.Popen(workbench_command() + ["serve", "--for-training", *common, f"server.port={port}",
                                                    "server.lora_slots=4", "server.extra_args=[--enable-log-requests]"],
                             cwd=project, stdout=open(project / "serve.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True,
                             # the request log is INFO; importing TRL here set vLLM's level to ERROR for children
                             env={k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"})
    headers = {"Authorization": f"Bearer {os.environ[KEYED[0].split('=')[1]]}"}
    trainers = []
    try:
        def up() -> bool:
            try:
                return requests.get(f"{url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(up, 300, serve, "the LoRA server", log=project / "serve.log")
        train = ["train", *common, "server.mode=attach", f"server.url={url}", "monitor.canary_every=1",
                 "trainer.learning_rate=5e-3", "trainer.beta=0.0", "rewards.short.function=lab_rewards:brevity",
                 "rewards.short.args.limit=60", "trainer.per_device_train_batch_size=4",
                 "trainer.num_generations=4"]
        for name, steps in (("a", 4), ("b", 12)):
            trainers.append(subprocess.Popen(
                workbench_command() + train + [f"trainer.max_steps={steps}", f"trainer.save_steps={steps}",
                                               f"monitor.runs_dir={runs / name}"],
                cwd=project, stdout=open(project / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                start_new_session=True))
        a, b = trainers

        def b_at_step_2() -> bool:
            found = list((runs / "b").glob("*/train/metrics.jsonl"))
            return bool(found) and len(_steps(found[0].parent)) >= 2

        wait_for(b_at_step_2, 600, b, "run B's second step", log=project / "b.log")
        os.killpg(b.pid, signal.SIGKILL)  # mid-run: its adapter stays on the server, its run gone
        b.wait()
        # its RAM-disk adapter versions outlive a SIGKILL; the next workbench process to push removes them
        from pathlib import Path

        from workbench.serving.sync import SYNC_PREFIX, remove_stale_sync_dirs

        left = list(Path("/dev/shm").glob(f"{SYNC_PREFIX}{b.pid}-*"))
        removed = remove_stale_sync_dirs(Path("/dev/shm"))
        assert left and set(left) <= set(removed), (left, removed)
        assert a.wait(timeout=600) == 0, (project / "a.log").read_text()[-3000:]
        (run_a,) = (RunDir.open(p) for p in (runs / "a").glob("*-smoke-train"))
        (run_b,) = (RunDir.open(p) for p in (runs / "b").glob("*-smoke-train"))
        yield {"url": url, "headers": headers, "a": run_a, "b": run_b, "project": project, "runs": runs,
               "server_log": next(runs.glob("*-serve/serving/vllm-server-*.log"))}
    finally:
        for proc in [*trainers, serve]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [*trainers, serve]:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _adapters(pair) -> list[str]:
    models = requests.get(f"{pair['url']}/v1/models", headers=pair["headers"], timeout=10).json()["data"]
    return [m["id"] for m in models if m.get("parent")]


def _tag(run: RunDir) -> str:
    """The run's adapter-name prefix, as the run recorded it when it connected."""
    (event,) = [e for e in read_jsonl(run.train.events, normalised=False) if e["kind"] == "lora_adapters"]
    return event["prefix"]


@pytest.mark.heavy
def test_two_runs_share_one_server_each_sampling_its_own_adapter(lora_pair):
    a, b = lora_pair["a"], lora_pair["b"]
    assert _steps(a.train.path) == [1, 2, 3, 4]
    assert 2 <= len(_steps(b.train.path)) < 12  # killed mid-run
    log = lora_pair["server_log"].read_text()
    requested = re.findall(r"Received request \S+: .*?lora_request: (.*?)\.\s*$", log, re.M)
    assert requested, log[-2000:]
    names = [re.search(r"lora_name='([^']+)'", r).group(1) if "lora_name" in r else None for r in requested]
    # every request of either run names an adapter of that run: none went to the base model or to another's
    assert all(n is not None and n.startswith((_tag(a), _tag(b))) for n in names), set(names)
    per_run = {run: [n for n in names if n.startswith(_tag(lora_pair[run]))] for run in ("a", "b")}
    assert len({n.rsplit(".s", 1)[1].split(".")[0] for n in per_run["a"]}) >= 4  # a version per step
    assert per_run["b"]
    # run A finished: its adapter unloaded, its slot free; run B died: its last version is still held
    held = _adapters(lora_pair)
    assert not [n for n in held if n.startswith(_tag(a))] and [n for n in held if n.startswith(_tag(b))], held
    # which runs shared the server: in run A's summary, its events, the report's rows and `workbench compare`
    from workbench.observe import compare, rundata, views

    summary = json.loads(a.train.summary.read_text())
    assert summary["adapter"]["prefix"] == _tag(a) and summary["adapter"]["shared_with"] == [_tag(b)]
    assert summary["adapter"]["rank"] == 8 and summary["adapter"]["bytes"] > 0
    rows = dict(views.summary_rows(rundata.load(a.train)))
    assert rows["server shared with"] == f"{_tag(b)}*" and rows["LoRA adapter"].startswith("rank 8, ")
    out = compare.outcomes(compare.load_runs([a.path, b.path], ["a", "b"]))
    assert out.loc["a", "shared_server_with"] == "b" and out.loc["b", "shared_server_with"] == "a"


@pytest.mark.heavy
def test_each_push_moves_the_adapter_alone_and_the_canary_holds(lora_pair, tiny_model_dir):
    from safetensors.torch import load_file

    from conftest import model_logprobs
    from workbench.training.export import adapter_bytes

    a = lora_pair["a"]
    metrics = [m for m in read_jsonl(a.train.metrics, normalised=False) if "loss" in m]
    adapter = load_file(str(a.train.final / "adapter_model.safetensors"))
    size = sum(t.numel() * t.element_size() for t in adapter.values())
    assert adapter_bytes(a.train.final) >= size
    model_bytes = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    assert all(abs(m["sync/megabytes"] * 1e6 - size) < 1e3 for m in metrics), (size, metrics[0])
    assert size < 0.06 * model_bytes  # rank 8 on every projection of a 1.3M-parameter model: ~5% of its bytes
    # it learned: the B matrices (zero at the start) moved, and the smoke check's "weights changed" sees it
    from workbench.training.smoke import _max_weight_change

    assert max(t.abs().max().item() for name, t in adapter.items() if "lora_B" in name) > 0
    assert _max_weight_change(tiny_model_dir, a.train.final) > 0
    canary = read_jsonl(a.train.path / "canary.jsonl", normalised=False)
    assert len(canary) >= 4 and all(c["level"] == "ok" and c["gap_mean"] < 2e-3 for c in canary), canary
    # the base weights never moved on the server: its base model scores as the initial model does
    from transformers import AutoModelForCausalLM

    from workbench.serving import client

    rr = recipe.resolve(recipe.load("smoke", [f"server.url={lora_pair['url']}", "server.mode=attach", *KEYED]))
    ids = list(range(3, 40))
    served = client.sequence_logprobs(rr, ids)
    initial = model_logprobs(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), ids)
    assert max(abs(x - y) for x, y in zip(served, initial)) < 1e-4


@pytest.mark.heavy
def test_a_dead_runs_adapter_is_freed_and_a_full_server_is_refused_in_one_line(lora_pair):
    from workbench.serving.sync import LoraSync, SyncingVLLMClient

    url, headers, b = lora_pair["url"], lora_pair["headers"], lora_pair["b"]
    assert [n for n in _adapters(lora_pair) if n.startswith(_tag(b))]
    # another run connecting with a short stale limit frees the dead run's slot (its name says when it was pushed)
    time.sleep(1.1)
    mine = LoraSync(tag="probe", slots=4, stale_s=1.0, rank=8)
    vc = SyncingVLLMClient(base_url=url, weight_sync=mine, headers=headers)
    vc.init_communicator("cpu")
    assert mine.unloaded and all(n.startswith(_tag(b)) for n in mine.unloaded)
    assert not [n for n in _adapters(lora_pair) if n.startswith(_tag(b))]
    vc.close_communicator()
    # three live adapters of other runs on a 4-slot server: a run needs two, so it is refused before anything starts
    final = lora_pair["a"].train.final
    now = int(time.time())
    taken = [f"wbl.other-{i}.s1.t{now}" for i in range(3)]
    for name in taken:
        r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(final)},
                          headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    try:  # what `workbench train` runs before its run directory or model exists (cli.cmd_train)
        from workbench.training.config import preflight

        rr = recipe.resolve(recipe.load("smoke", PEFT + ["server.mode=attach", f"server.url={url}", *KEYED]))
        with pytest.raises(WorkbenchError) as refused:
            preflight(rr)
        message = str(refused.value)
        assert "holds 3 adapter(s) of other runs" in message and "has 4 LoRA slots" in message, message
        assert len(message.splitlines()) == 1
    finally:
        for name in taken:
            requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


@pytest.mark.heavy
def test_export_merge_scores_as_the_adapter_does_on_the_server(lora_pair):
    from transformers import AutoModelForCausalLM

    from conftest import model_logprobs
    from workbench.serving import client

    a, url, headers = lora_pair["a"], lora_pair["url"], lora_pair["headers"]
    out = subprocess.run(workbench_command() + ["export", str(a.path), "--merge"], capture_output=True, text=True,
                         timeout=300, cwd=lora_pair["project"])
    assert out.returncode == 0, out.stderr[-2000:]
    merged = a.train.path / "merged"
    assert (merged / "config.json").is_file() and not list(merged.parent.glob("*.partial"))
    from workbench.training import export

    with pytest.raises(WorkbenchError, match="merged exists"):  # never over an earlier export
        export.check(a, None, merge=True)
    with pytest.raises(WorkbenchError, match="holds a LoRA adapter, not a model; fix: pass --merge"):
        export.check(a, a.path / "elsewhere", merge=False)
    # the trained adapter on the base server (no merge) against the merged model in transformers
    name = "wbl.export-check.s0.t0"
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(a.train.final)},
                      headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    try:
        rr = recipe.resolve(recipe.load("smoke", [f"server.url={url}", "server.mode=attach", *KEYED]))
        ids = list(range(3, 40))
        served = client.sequence_logprobs(rr, ids, model=name)
        base = client.sequence_logprobs(rr, ids)
    finally:
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)
    local = model_logprobs(AutoModelForCausalLM.from_pretrained(str(merged)), ids)
    assert max(abs(x - y) for x, y in zip(served, local)) < 1e-4
    assert max(abs(x - y) for x, y in zip(served, base)) > 1e-3  # the adapter changes what the server samples


@pytest.mark.heavy
def test_eval_scores_the_adapter_on_the_base_server_without_merging(lora_pair, tiny_model_dir, monkeypatch):
    """`workbench eval --model trained=RUN/train/final`: one LoRA server of the base model with the adapter as a module
    of its own (its command checked here), each adapter named in its requests; the requests for real on the
    shared LoRA server, the adapter loaded there under the label's name."""
    from workbench.evaluation import evaluate
    from workbench.serving import launch

    a, url, headers = lora_pair["a"], lora_pair["url"], lora_pair["headers"]
    rr = recipe.resolve(recipe.load("smoke", ["eval.num_samples=8", *KEYED]))
    started = []

    class Server:  # what _with_adapters starts: its recipe and model, not a process
        def __init__(self, rr, model, *args, **kwargs):
            started.append((rr, model))
            self.url = url

        def start(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(evaluate, "VLLMServer", Server)
    served = list(evaluate._with_adapters(rr, [("base", str(tiny_model_dir)), ("trained", str(a.train.final))],
                                          None, True))
    assert [label for label, _, _ in served] == ["base", "trained"] and len(started) == 1
    lora_rr, model = started[0]
    cmd = launch.command(lora_rr, model)
    assert model == str(tiny_model_dir) and cmd[cmd.index("--lora-modules") + 1] == f"trained={a.train.final}"
    assert "--enable-lora" in cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch.environment(lora_rr)
    with pytest.raises(WorkbenchError, match="full model beside LoRA adapters"):
        list(evaluate._with_adapters(rr, [("other", str(a.path / "nowhere")), ("trained", str(a.train.final))],
                                     None, True))
    # scored for real under the adapter's name, against the base model on the same server
    # a name of this test's own: the count below cannot include another test's requests, in any order
    import uuid

    name = f"trained-{uuid.uuid4().hex[:8]}"
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(a.train.final)},
                      headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    try:
        rows = evaluate.eval_rows(rr)
        trained, samples = evaluate.evaluate_server(rr, "trained", rows, url, quiet=True, served_as=name)
        base, base_samples = evaluate.evaluate_server(rr, "base", rows, url, quiet=True)
    finally:
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)
    assert trained.n == base.n == 8 and trained.errors == base.errors == 0
    assert all(s.response is not None for s in samples + base_samples)
    # every request of the adapter's evaluation named it (the server's request log): none went to the base model
    log = lora_pair["server_log"].read_text()
    assert log.count(f"lora_request: LoRARequest(lora_name='{name}'") == len(samples)


@pytest.mark.heavy
def test_a_run_whose_adapter_vanished_loads_it_again_under_a_fresh_name(lora_pair):
    """Another run's restart of the shared server, or its stale rule after a long pause of this run, leaves this run's
    requests naming an adapter the server no longer knows (HTTP 404): the client loads its current version again,
    under a new name, and the request goes through; at the end nothing of it is left on the server or the RAM disk."""
    from safetensors.torch import load_file

    from workbench.serving import client
    from workbench.serving.sync import LoraSync, SyncingVLLMClient

    url, headers, final = lora_pair["url"], lora_pair["headers"], lora_pair["a"].train.final
    mine = LoraSync(tag="vanish", slots=4, rank=8)
    vc = SyncingVLLMClient(base_url=url, weight_sync=mine, headers=headers)
    vc.init_communicator("cpu")
    mine.push_adapter(vc, load_file(str(final / "adapter_model.safetensors")),
                      json.loads((final / "adapter_config.json").read_text()), step=3)
    first, directory = mine.current, mine.directory
    time.sleep(1.1)  # a new name carries a later push time
    requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": first}, headers=headers, timeout=60)
    rr = recipe.resolve(recipe.load("smoke", [f"server.url={url}", "server.mode=attach", *KEYED]))
    ids = list(range(3, 20))
    scored = vc._recovering("canary", lambda: client.sequence_logprobs(rr, ids, model=vc.model))
    assert len(scored) == len(ids) - 1
    assert mine.current != first and mine.current.startswith(mine.prefix + "3.") and vc.model == mine.current
    assert mine.current in _adapters(lora_pair)
    vc.close_communicator()
    assert not [n for n in _adapters(lora_pair) if n.startswith(mine.prefix)] and not directory.exists()
