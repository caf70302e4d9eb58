"""`workbench bench` for real on the tiny model (in-process, server, async and lora: a real server, a LoRA server of
the lora path's own, two measured steps each; colocate's engine is tests/test_colocate.py's, through the same local
path of the bench as in-process), the lora path's adapter-only pushes, and the async path's guarantees read from what that run recorded: the reload adapter pushed every step, the server held
the trainer's weights after every push (canary every step), batches were exactly one step stale and the sampler's
log-probs stayed within what one step of training moves them."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from conftest import free_port, workbench_command
from workbench.experiments import bench
from workbench.records import read_jsonl
from workbench.rundir import RunDir, TrainDir

PATHS = ["in-process", "server", "async", "lora"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_model_dir):
    workbench_cmd = workbench_command()
    runs = tmp_path_factory.mktemp("bench-runs")
    log = runs / "bench.log"
    cmd = [*workbench_cmd, "bench", "--recipe", "cpu-tiny", "--sizes", "tiny", "--steps", "2", "--warmup", "1",
           "--concurrency", "1,2", "--paths", ",".join(PATHS), f"server.port={free_port()}", f"monitor.runs_dir={runs}",
           "trainer.per_device_train_batch_size=16", "monitor.canary_every=1"]
    with log.open("w") as out:  # a file: the trainer must never block on a full pipe
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    assert code == 0, log.read_text()[-4000:]
    (path,) = [p for p in runs.iterdir() if p.name.endswith("-bench")]
    run = RunDir(path)
    return run, bench.Bench.load(run.bench), log.read_text()


def test_every_path_trained_and_the_table_has_one_row_each(bench_run):
    run, result, output = bench_run
    assert [(r.size, r.path) for r in result.results] == [("tiny", p) for p in PATHS]
    for r in result.results:
        assert r.steps == 2, r  # the warm-up step is not measured
        assert r.step_seconds > 0 and r.tokens_per_step > 0 and r.training_tokens_per_second > 0, r
        assert set(r.breakdown) == set(bench.BREAKDOWN)
        assert r.breakdown["time/optimisation"] > 0
        metrics = read_jsonl(TrainDir(r.train_dir).metrics, normalised=False)
        assert max(m.get("step", 0) for m in metrics) == 3
    table = run.bench.table.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == len(PATHS) and all(len(row.split("|")) == len(bench.HEADER) + 2 for row in rows)
    assert "| " + " | ".join(bench.HEADER) + " |" in table and table in output
    assert result.machine["cores"] >= 1 and result.machine["versions"]["vllm"] != "-"
    assert run.bench.figure.stat().st_size > 10_000


def test_server_paths_are_compared_with_the_servers_saturated_throughput(bench_run):
    _, result, _ = bench_run
    saturation = result.saturation["tiny"]
    assert set(saturation) == {"1", "2", "best"} and saturation["best"] == max(saturation["1"], saturation["2"]) > 0
    for r in result.results:
        if r.path in ("server", "async"):
            assert r.efficiency == pytest.approx(r.training_tokens_per_second / saturation["best"])
            assert 0 < r.efficiency < 2
        elif r.path == "lora":  # against its own server, under its own trained adapter
            assert r.efficiency == pytest.approx(r.training_tokens_per_second
                                                 / result.lora_saturation["tiny"]["adapter"]["best"])
        else:
            assert r.efficiency is None  # no server to saturate


def test_async_batches_are_one_step_stale_and_the_server_tracks_the_trainer(bench_run):
    _, result, _ = bench_run
    server, ahead = result.result("tiny", "server"), result.result("tiny", "async")
    assert server.staleness == 0 and ahead.staleness == 1
    train_dir = TrainDir(ahead.train_dir)
    summary = json.loads(train_dir.summary.read_text())
    assert summary["weight_sync"] == "reload" and summary["steps"] == 3
    metrics = [m for m in read_jsonl(train_dir.metrics, normalised=False) if "time/step" in m]
    assert [m["sync/count"] for m in metrics] == [1, 1, 1]  # a push every step, with a batch in flight
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]  # the first batch has nothing to overlap with
    # the canary after every push: the server holds exactly the weights the trainer pushed
    canary = read_jsonl(train_dir.canary, normalised=False)
    assert [c["step"] for c in canary] == [0, 1, 2] and all(c["level"] == "ok" for c in canary)
    assert max(c["gap_mean"] for c in canary) < 1e-4  # exact sync: kernel rounding only, far below the warning level
    # sampler vs trainer log-probs: one step of (warm-up) training apart, never more
    gaps = [m["sampling/sampling_logp_difference/mean"] for m in metrics]
    assert all(math.isfinite(g) and g < 0.05 for g in gaps), gaps
    ratios = [m["sampling/importance_sampling_ratio/mean"] for m in metrics]
    assert all(0.8 < r < 1.25 for r in ratios), ratios


def test_the_lora_path_pushes_the_adapter_alone_and_measures_its_decode_cost(bench_run):
    run, result, output = bench_run
    full, lora = result.result("tiny", "server"), result.result("tiny", "lora")
    summary = json.loads(TrainDir(lora.train_dir).summary.read_text())
    assert summary["weight_sync"] == "lora" and summary["adapter"]["rank"] == 16
    # rank 16 on every projection of the 1.3M-parameter model: about a tenth of the full push's bytes, every step
    metrics = [m for m in read_jsonl(TrainDir(lora.train_dir).metrics, normalised=False) if "time/step" in m]
    assert [m["sync/count"] for m in metrics] == [1, 1, 1]
    assert 0 < lora.sync_megabytes < full.sync_megabytes / 5, (lora.sync_megabytes, full.sync_megabytes)
    sat = result.lora_saturation["tiny"]
    assert set(sat) == {"base", "adapter"} and sat["base"]["best"] > 0 and sat["adapter"]["best"] > 0
    assert "under the trained adapter: decode" in output and "of the full push's bytes" in output
