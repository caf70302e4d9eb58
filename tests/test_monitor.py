"""Monitoring: metric names, JSONL that survives a kill, device probes, the /metrics scraper, the sampler, STOP."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CURVE_SAMPLES, served_during, workbench_command
from test_npusmi import WIDE_DUAL_DIE
from workbench import recipe, records
from workbench.errors import WorkbenchError
from workbench.platform.npusmi import NpuSmiFormatError
from workbench.platform.probes import ascend, cpu, nvidia
from workbench.rundir import RunDir
from workbench.serving import scraper
from workbench.training.monitor import device_roles

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NPU_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "npu-smi"


# --- metric names ----------------------------------------------------------------------------------------------

def test_old_and_prefixed_trl_names_are_normalised():
    old = {"train/completion_length": 31.5, "rewards/correctness": 0.25, "rewards/format": 1.0, "kl": 0.01,
           "train/reward": 0.4, "clip_ratio": 0.0, "loss": 0.1}
    new = records.normalise(old)
    assert new == {"completions/mean_length": 31.5, "rewards/correctness/mean": 0.25, "rewards/format/mean": 1.0,
                   "kl": 0.01, "reward": 0.4, "clip_ratio/region_mean": 0.0, "loss": 0.1}
    current = {"completions/mean_length": 30.0, "rewards/correctness/mean": 0.5, "rewards/correctness/std": 0.1}
    assert records.normalise(current) == current  # TRL 1.16's own names pass unchanged


def test_newer_spelling_wins_when_both_are_logged():
    assert records.normalise({"completion_length": 1.0, "completions/mean_length": 2.0}) == \
        {"completions/mean_length": 2.0}
    assert records.normalise({"completions/mean_length": 2.0, "completion_length": 1.0}) == \
        {"completions/mean_length": 2.0}


def test_jsonl_readers_skip_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records.append_jsonl(path, {"step": 1, "completion_length": 10})
    records.append_jsonl(path, {"step": 2, "completion_length": 12})
    with open(path, "a") as f:
        f.write('{"step": 3, "compl')  # a run killed in the middle of a write
    rows = records.read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["completions/mean_length"] == 10

    tail = records.Tail(path)
    assert [r["step"] for r in tail.read()] == [1, 2]
    assert tail.read() == []
    with open(path, "a") as f:
        f.write('etion_length": 14}\n')  # the writer finishes the line
    assert tail.read() == [{"step": 3, "completions/mean_length": 14}]


# --- rollout health from /metrics --------------------------------------------------------------------------------

def test_recorded_vllm_metrics_parse_to_their_values():
    values = scraper.parse((FIXTURES / "vllm-0.32-cpu-metrics.prom").read_text())
    assert values["running"] == 32.0 and values["waiting"] == 0.0
    assert values["kv_cache_usage"] == pytest.approx(0.007814407814407787)
    assert values["preemptions"] == 0.0
    assert values["prompt_tokens"] == 18936.0 and values["generation_tokens"] == 23306.0
    assert values["requests_finished"] == 704.0  # summed over finish reasons (stop 704, the others 0)
    # 88 prompts asked for 48 tokens each with n=8: 704 sequences; no one-token probe on this page
    assert (values["generation_prompts"], values["generation_sequences"], values["probe_requests"]) == (88, 704, 0)


def test_one_token_probes_are_counted_apart_from_generation():
    """Two prompts with n=4 (max_tokens 48) and three log-prob probes (max_tokens 1), as vLLM's histograms of the
    requested tokens record them: per request and per sample."""
    def histogram(name, first, total, per):
        return "".join([f"# TYPE {name} histogram\n",
                        f'{name}_bucket{{engine="0",le="1.0",model_name="m"}} {first}\n',
                        f'{name}_bucket{{engine="0",le="50.0",model_name="m"}} {total}\n',
                        f'{name}_bucket{{engine="0",le="+Inf",model_name="m"}} {total}\n',
                        f'{name}_count{{engine="0",model_name="m"}} {total}\n',
                        f'{name}_sum{{engine="0",model_name="m"}} {per}\n'])

    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 0.0\n'
            + histogram("vllm:request_max_num_generation_tokens", 3, 5, 99)
            + histogram("vllm:request_params_max_tokens", 3, 11, 387))
    values = scraper.parse(text)
    assert (values["generation_prompts"], values["generation_sequences"], values["probe_requests"]) == (2, 8, 3)


def test_older_vllm_metric_names_are_accepted():
    text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3.0\n"
            "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n")
    assert scraper.parse(text) == {"running": 3.0, "kv_cache_usage": 0.5}


def test_a_page_that_is_not_vllm_metrics_is_an_error():
    with pytest.raises(WorkbenchError, match="num_requests_running"):
        scraper.parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.0\n")


# --- device probes ----------------------------------------------------------------------------------------------

def _npu_roles(server, trainer):
    """The roles the sampler gives the probe for an npu recipe with this device split."""
    return device_roles(recipe.load("cpu-tiny", {"devices.platform": "npu", "devices.server": server,
                                                 "devices.trainer": trainer}))


def test_ascend_probe_reads_the_recorded_table_with_roles():
    calls = []

    def runner(*args):
        calls.append(args)
        return (NPU_FIXTURES / "info-910b2c-narrow.txt").read_text()

    probe = ascend.AscendProbe(_npu_roles([0], [1]), runner=runner)
    samples = probe.sample()
    assert [(s["device"], s["role"], s["util_pct"], s["mem_used_mb"], s["mem_total_mb"], s["power_w"], s["temp_c"])
            for s in samples] == [("npu:0", "server", 0.0, 3455, 65536, 94.2, 43.0),
                                  ("npu:1", "trainer", 0.0, 3434, 65536, 99.0, 45.0)]
    assert calls == [()]  # AICore is in the table: no per-chip usages call


def test_ascend_probe_asks_usages_where_the_table_has_no_aicore():
    table = WIDE_DUAL_DIE.replace("| 1       1                     | 0000:C2:00.0    | 0   ",
                                  "| 1       1                     | 0000:C2:00.0    | -   ")
    usage = (NPU_FIXTURES / "usages-chip0.txt").read_text()
    usage_chip1 = usage.replace("Aicore Usage Rate(%)           : 0", "Aicore Usage Rate(%)           : 42") \
                       .replace("Chip ID                        : 0", "Chip ID                        : 1")

    def runner(*args):
        return usage + "\n" + usage_chip1 if args else table

    samples = ascend.AscendProbe(_npu_roles([0], [1]), runner=runner).sample()
    assert [(s["npu"], s["chip"], s["util_pct"]) for s in samples] == [(0, 0, 37.0), (0, 1, 42)]


def test_ascend_probe_fails_loudly_on_unknown_output_and_missing_devices():
    with pytest.raises(NpuSmiFormatError):
        ascend.AscendProbe(_npu_roles([0], [1]), runner=lambda *a: "npu-smi 30.0\nsomething else\n").sample()
    table = (NPU_FIXTURES / "info-910b4-narrow.txt").read_text()
    with pytest.raises(WorkbenchError, match=r"NPUs \[2, 3\].*2 chips"):
        ascend.AscendProbe(_npu_roles([0], [2, 3]), runner=lambda *a: table).sample()


class _FakeNvml:
    """NVML's calls as the probe uses them (no NVIDIA GPU here): two GPUs with fixed readings."""
    NVML_TEMPERATURE_GPU = 0

    class _Util:
        def __init__(self, gpu):
            self.gpu = gpu

    class _Mem:
        def __init__(self, used, total):
            self.used, self.total = used, total

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._Util([15, 88][h])

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._Mem([2 * 2**30, 60 * 2**30][h], 80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return [100_000, 350_500][h]

    def nvmlDeviceGetTemperature(self, h, kind):
        return [40, 71][h]

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"


def test_nvidia_probe_maps_roles_to_physical_gpus(monkeypatch):
    """Recipe ids are nvidia-smi's GPU numbers (NVML's), whatever the sampling process's CUDA_VISIBLE_DEVICES says
    (tests/test_probes.py: the 8-GPU case)."""
    r = recipe.load("cpu-tiny", {"devices.platform": "cuda", "devices.server": [0], "devices.trainer": [1]})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the trainer process's own cards
    samples = nvidia.NvidiaProbe(device_roles(r), nvml=_FakeNvml()).sample()
    assert [(s["device"], s["role"], s["util_pct"], s["mem_used_mb"], s["power_w"], s["temp_c"]) for s in samples] == [
        ("gpu:0", "server", 15.0, 2048.0, 100.0, 40.0), ("gpu:1", "trainer", 88.0, 61440.0, 350.5, 71.0)]
    r = recipe.load("cpu-tiny", {"devices.platform": "cuda", "devices.server": [0], "devices.trainer": [2]})
    with pytest.raises(WorkbenchError, match=r"GPU 2, but NVML sees 2"):
        nvidia.NvidiaProbe(device_roles(r), nvml=_FakeNvml())


def test_cpu_probe_tells_the_busy_server_tree_from_the_idle_trainer(cpu_recipe):
    busy = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        probe = cpu.CpuProbe(device_roles(cpu_recipe), server_pid=busy.pid, trainer_pid=idle.pid)
        probe.sample()  # primes the per-process counters
        time.sleep(1.5)
        samples = probe.sample()
    finally:
        busy.kill(), idle.kill()
    by_role = {s["role"]: s for s in samples}
    assert set(by_role) == {"server", "trainer"} and by_role["server"]["device"] == "cpu0"
    # (thresholds leave room for other load on core 0: the busy loop gets at least a good share of it)
    assert by_role["server"]["proc_util_pct"] > 30 and by_role["trainer"]["proc_util_pct"] < 5
    assert by_role["server"]["util_pct"] > 30  # core 0 itself is busy
    assert 0 < by_role["trainer"]["mem_used_mb"] < by_role["trainer"]["mem_total_mb"]


def test_cpu_probe_refuses_cores_the_machine_lacks(cpu_recipe):
    r = recipe.load("cpu-tiny", {"devices.server": [0], "devices.trainer": [os.cpu_count() + 3]})
    with pytest.raises(WorkbenchError, match="cores"):
        cpu.CpuProbe(device_roles(r))


# --- the smoke run's records -------------------------------------------------------------------------------------

def test_smoke_run_records_metrics_devices_and_rollout(smoke_run):
    run, _ = smoke_run
    train = run.train
    rows = records.read_jsonl(train.metrics)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        phases = sum(row[k] for k in ("time/generation", "time/weight_sync", "time/reward", "time/scoring",
                                      "time/optimisation"))
        assert row["time/step"] > 0 and phases == pytest.approx(row["time/step"], rel=0.05)
        assert row["time/generation"] > 0 and row["time/optimisation"] > 0 and row["time/weight_sync"] > 0
        assert row["rollout/tokens_per_second"] > 0 and row["rollout/completion_tokens"] > 0

    devices = [json.loads(line) for line in train.devices.read_text().splitlines()]
    assert {d["role"] for d in devices} == {"server", "trainer"} and not any("error" in d for d in devices)
    assert all(0 <= d["util_pct"] <= 100 and d["mem_used_mb"] > 0 for d in devices)
    server_mem = max(d["mem_used_mb"] for d in devices if d["role"] == "server")
    assert server_mem > 100  # the vLLM process tree, not an empty set of processes

    scraped = [json.loads(line) for line in train.rollout.read_text().splitlines()]
    assert scraped and not any("error" in r for r in scraped)
    # the last scrape (after the last step): 3 steps of 2 prompts x 4 generations, apart from the canary's probes
    # and the learning curve's greedy requests (one per problem at each of the 3 pushes and the final one)
    assert scraped[-1]["generation_tokens"] > 0
    last = served_during(train, end=scraped[-1])  # the shared server's counters, less what it served before
    curve = 4 * CURVE_SAMPLES
    assert (last["generation_prompts"] - curve, last["generation_sequences"] - curve) == (6, 24), scraped[-1]
    summary = json.loads(train.summary.read_text())
    assert summary["monitor"]["samples"] >= 1 and summary["monitor"]["errors"] == 0


def test_a_cpu_training_logs_its_share_of_its_cores_limits(smoke_run):
    """training/gauge.py on the smoke run (attached to a loopback server: both roles' cores measured): the limits
    and the model's shape written once, each step's gauge/generation and gauge/optimisation recomputed here from the
    step's own numbers, and the dashboard's and report's summary rows showing their means."""
    from workbench.observe import rundata, views
    from workbench.platform import limits

    run, _ = smoke_run
    saved = json.loads(run.train.limits.read_text())
    measured, shape = saved["limits"], limits.Shape(**saved["shape"])
    assert measured["server"]["cores"] == [0] and measured["trainer"]["cores"] == [1]
    for role in ("server", "trainer"):
        assert measured[role]["gemm"]["median"] > 0 and measured[role]["read"]["megabytes"] == 128
    assert shape.parameters > 1e6 and shape.bytes_per_parameter == 4  # the tiny model, float32
    assert shape.in_flight == 8  # the smoke recipe: 2 groups of 4 completions a generation
    steps = [r for r in records.read_jsonl(run.train.metrics, normalised=False) if "time/step" in r]
    assert len(steps) == 3
    for r in steps:
        ceiling = limits.decode_ceiling(shape, measured["server"])["ceiling"]
        assert r["gauge/generation"] == pytest.approx(r["rollout/tokens_per_second"] / ceiling, rel=1e-9)
        share = limits.optimisation_share(shape, r["rollout/completion_tokens"], r["time/optimisation"],
                                          measured["trainer"])
        assert r["gauge/optimisation"] == pytest.approx(share, rel=1e-9) and 0 < share < 1
    rows = dict(views.summary_rows(rundata.load(run.train)))
    mean = sum(r["gauge/generation"] for r in steps) / 3
    assert rows["generation, share of the server cores' decode ceiling"] == f"{mean:.0%}"
    assert "optimisation, share of the trainer cores' GEMM throughput" in rows
    # what measuring the limits cost, set against the training's time (issue: the gauge within 2% of a core)
    cost, summary = saved["cost"], json.loads(run.train.summary.read_text())
    assert 0 < cost["cpu_seconds"] and 0 < cost["seconds"] < 60
    assert rows["roofline gauge's cost"] == (f"{cost['cpu_seconds']:.2f} CPU-s measuring the limits before the first "
                                             f"step ({cost['cpu_seconds'] / summary['train_seconds']:.2%} of a core "
                                             "over the training)")


def test_report_to_passes_through_next_to_the_workbench_metrics(smoke_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = smoke_run
    (events,) = (run.train.checkpoints / "runs").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert "train/reward" in tags and "train/time/step" in tags  # TRL's and the workbench's, in the user's tracker
    assert [e.step for e in accumulator.Scalars("train/loss")] == [1, 2, 3]
    assert run.train.metrics.read_text().count('"loss"') == 3


def test_export_writes_the_trained_model_with_its_recipe_and_results_beside_it(smoke_run, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from workbench.training import export

    run, _ = smoke_run
    with pytest.raises(WorkbenchError, match="already a full model.*drop --merge"):
        export.check(run, tmp_path / "x", merge=True)
    out = subprocess.run(workbench_command() + ["export", str(run.path), "--out", str(tmp_path / "model")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    model_dir = tmp_path / "model"
    assert (model_dir / "workbench-recipe.yaml").read_text() == run.train.recipe.read_text()
    assert json.loads((model_dir / "workbench-train.json").read_text()) == json.loads(run.train.summary.read_text())
    assert not list(tmp_path.glob("*.partial"))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trained = load_file(str(run.train.final / "model.safetensors"))
    shared = set(model.state_dict()) & set(trained)
    assert len(shared) >= len(trained) - 1  # every saved tensor (a tied head is saved once)
    for name in shared:
        assert torch.equal(model.state_dict()[name], trained[name]), name
    with pytest.raises(WorkbenchError, match="model exists"):  # never over an earlier export
        export.check(run, model_dir, merge=False)


# --- a killed run keeps its lines; `workbench stop` asks for a clean stop ------------------------------------------

def test_killing_the_trainer_leaves_every_line_readable(killed_run):
    """conftest's `killed_run`, as the SIGKILL left it (before its resume): every record is whole lines."""
    killed = killed_run.as_killed
    train = killed.train
    for path in (train.metrics, train.devices, train.rollout):
        name = path.name
        text = path.read_text()
        lines = text.splitlines()
        assert lines, name
        complete = lines if text.endswith("\n") else lines[:-1]
        assert all(isinstance(json.loads(line), dict) for line in complete), name
        assert len(records.read_jsonl(path)) == len(complete)
    assert not train.summary.exists()
    from workbench.observe import report

    page = report.build(killed.path).read_text()  # a report of what the killed run wrote
    assert "did not finish" in page and "data:image/png;base64," in page


def test_stop_command_writes_the_flag_the_trainer_checks(tmp_path, workbench_cmd):
    """`workbench stop RUN` writes RUN/train/STOP, the file the trainer's StopFlag callback reads after each step
    (the trainer's side, checkpoint and early end, is tests/test_lab.py: the dashboard's Stop writes the same file)."""
    from workbench.rundir import write_atomic

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    write_atomic(run.recipe, "name: smoke\n")
    done = subprocess.run([*workbench_cmd, "stop", str(run.path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "STOP" in done.stdout, done.stderr
    assert run.train.stop_flag.read_text().startswith("workbench stop at ")
    from transformers import TrainerControl, TrainerState

    from workbench.training.callbacks import StopFlag

    state = TrainerState()
    state.global_step = 7
    control = StopFlag(run.train, log=lambda *_: None).on_step_end(None, state, TrainerControl())
    assert control.should_save and control.should_training_stop  # checkpoint first, then end
