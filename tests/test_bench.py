"""`workbench bench` for real on the tiny model (in-process, server and async: a real server, two measured steps each;
colocate's engine is tests/test_colocate.py's, through the same local path of the bench as in-process; the lora
path's table lines from a hand-made result, its training and adapter pushes are tests/test_lora.py's), and the async
path's guarantees read from what that run recorded: the reload adapter pushed every step, the server held
the trainer's weights after every push (canary every step), batches were exactly one step stale and the sampler's
log-probs stayed within what one step of training moves them."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from conftest import free_port, script, workbench_command
from workbench.experiments import bench
from workbench.records import read_jsonl
from workbench.rundir import RunDir, TrainDir

PATHS = ["in-process", "server", "async"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_model_dir):
    workbench_cmd = workbench_command()
    runs = tmp_path_factory.mktemp("bench-runs")
    log = runs / "bench.log"
    cmd = [*workbench_cmd, "bench", "--recipe", "cpu-tiny", "--sizes", "tiny", "--steps", "2", "--warmup", "1",
           "--repeats", "1",  # one training per path (repeats: the unit test below)
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
    # TRL's log dicts went to each training's train.log, not into the bench's output around its table
    assert "'loss':" not in output and "{'loss'" not in output
    assert all("'loss'" in TrainDir(r.train_dir).log.read_text() for r in result.results)
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


def test_each_push_is_timed_in_parts_and_set_against_the_copy_bandwidth(bench_run):
    """The reload pushes of the served paths: our write and the server's reload call inside each push's time, and
    the table's line for each such path sets its GB/s against the machine's measured copy bandwidth."""
    run, result, _ = bench_run
    copy = result.machine["copy_gbps"]
    assert copy["repeats"] == 5 and 0 < copy["min"] <= copy["median"] <= copy["max"]
    table = run.bench.table.read_text()
    for r in result.results:
        metrics = [m for m in read_jsonl(TrainDir(r.train_dir).metrics, normalised=False) if "time/step" in m]
        if r.path == "in-process":
            assert not r.sync_parts and not any("sync/write_seconds" in m for m in metrics)
            continue
        for m in metrics:
            parts = m["sync/write_seconds"] + m["sync/server_seconds"]
            assert 0.9 * m["sync/seconds"] <= parts <= m["sync/seconds"], m
        assert set(r.sync_parts) == {"write", "server"} and r.sync_seconds > 0
        assert bench.sync_line(r, copy) in table


def test_the_gauge_measures_each_role_and_sets_every_path_against_it(bench_run):
    """The limits measured on the recipe's own split (server core 0, trainer core 1), the model's shape read from
    its directory, and a gauge line per path in the table: generation against the decode ceiling (the served
    paths; both cores for colocate), the optimisation against its cores' GEMM throughput (every path)."""
    run, result, _ = bench_run
    assert result.limits["server"]["cores"] == [0] and result.limits["trainer"]["cores"] == [1]
    assert result.limits["both"]["cores"] == [0, 1]
    for role, threads in (("server", 1), ("trainer", 1), ("both", 2)):
        for kind in ("copy", "read", "gemm"):
            measured = result.limits[role][kind]
            assert measured["threads"] == threads and 0 < measured["min"] <= measured["median"] <= measured["max"]
    shape = result.sizes["tiny"]["shape"]
    assert shape["parameters"] == result.sizes["tiny"]["parameters"] and shape["in_flight"] == 16
    table = run.bench.table.read_text()
    for r in result.results:
        line = result.gauge_line(r)
        whose = "both cores'" if r.path == "in-process" else "the trainer cores'"  # no server: both cores train
        assert line in table and "optimisation at" in line and f"of {whose} float32 GEMM throughput" in line
        assert ("of the server cores' decode ceiling" in line) == (r.path != "in-process")


def test_colocate_is_gauged_against_both_cores():
    """colocate runs vLLM and the training in the trainer process, on both cores: its generation and optimisation
    are set against both cores' limits, not the server's or the trainer's."""
    limits = {role: {"cores": cores, "read": {"median": gbps}, "copy": {"median": gbps},
                     "gemm": {"median": flops, "min": flops, "max": flops}}
              for role, cores, gbps, flops in (("server", [0], 10.0, 100.0), ("trainer", [1], 10.0, 100.0),
                                               ("both", [0, 1], 20.0, 200.0))}
    shape = {"parameters": 100_000_000, "bytes_per_parameter": 4, "layers": 10, "kv_heads": 8, "head_dim": 64,
             "in_flight": 8, "context": 100.0}
    r = bench.PathResult(size="100m", path="colocate", steps=4, step_seconds=20.0, tokens_per_step=800,
                         breakdown={"time/optimisation": 6.0}, generation_tokens_per_second=50.0,
                         training_tokens_per_second=40.0, staleness=0.0, sampler_cpu_percent=None, train_dir="")
    result = bench.Bench("cpu-tiny", 4, 1, {"summary": "x"}, [r], sizes={"100m": {"shape": shape}}, limits=limits)
    line = result.gauge_line(r)
    assert "of both cores' decode ceiling (370 tokens/s" in line  # 8 x 20 GB/s / (400 MB + 8 x 4.096 MB)
    assert "optimisation at 40% of both cores' float32 GEMM throughput (200 GFLOP/s" in line  # 6 x 1e8 x 800 / 6 s


def test_the_ceilings_follow_the_roofline():
    """A 100M-parameter float32 model, 8 sequences in flight: bytes read per decode step are the weights plus each
    sequence's KV cache, at the read bandwidth; compute allows GEMM FLOP/s over 2 FLOPs per parameter; the
    optimisation counts 6 per token."""
    from workbench.platform import limits as roofline

    shape = roofline.Shape(parameters=100_000_000, bytes_per_parameter=4, layers=10, kv_heads=8, head_dim=64,
                           in_flight=8, context=100.0)
    assert shape.kv_bytes_per_token == 2 * 10 * 8 * 64 * 4 * 100  # 4.096 MB
    server = {"read": {"median": 10.0}, "copy": {"median": 1.0}, "gemm": {"median": 100.0}}
    ceiling = roofline.decode_ceiling(shape, server)
    assert ceiling["memory"] == pytest.approx(8 * 10e9 / (400e6 + 8 * 4.096e6))
    assert ceiling["compute"] == pytest.approx(100e9 / 2e8) and ceiling["bound"] == "memory"
    assert ceiling["ceiling"] == ceiling["memory"]
    assert roofline.optimisation_share(shape, 1000, 10.0, {"gemm": {"median": 100.0}}) == pytest.approx(0.6)
    assert roofline.optimisation_share(shape, 0, 10.0, {"gemm": {"median": 100.0}}) is None


def test_the_sync_line_names_the_rate_the_ceiling_and_the_servers_share():
    r = bench.PathResult(size="100m", path="server", steps=4, step_seconds=28.0, breakdown={}, tokens_per_step=800,
                         generation_tokens_per_second=50.0, training_tokens_per_second=20.0, staleness=0.0,
                         sampler_cpu_percent=None, train_dir="", sync_megabytes=380.6, sync_seconds=0.8,
                         sync_parts={"write": 0.056, "server": 0.744})
    line = bench.sync_line(r, {"median": 15.5, "min": 15.0, "max": 15.9, "megabytes": 256, "repeats": 5})
    assert line == ("100m server: a weight push moved 380.6 MB in 0.800 s (0.48 GB/s, 3% of the machine's copy "
                    "bandwidth, 15.5 GB/s: median of 5 copies of 256 MB, 15.0-15.9); our write 0.056 s (6.80 GB/s), "
                    "the server's reload call 0.744 s (93% of the push)")
    assert bench.sync_line(r, {}).startswith("100m server: a weight push moved 380.6 MB in 0.800 s (0.48 GB/s);")


def test_the_lora_lines_compare_its_push_and_decode_with_the_full_path():
    """What the bench says of a lora path beside a server path (the numbers of the 100m bench in the README)."""
    common = dict(size="100m", steps=4, tokens_per_step=800, generation_tokens_per_second=50.0,
                  training_tokens_per_second=20.0, staleness=0.0, sampler_cpu_percent=None, train_dir="")
    full = bench.PathResult(path="server", step_seconds=28.0, sync_megabytes=380.6,
                            breakdown={k: (1.2 if k == "time/weight_sync" else 1.0) for k in bench.BREAKDOWN}, **common)
    lora = bench.PathResult(path="lora", step_seconds=39.6, sync_megabytes=10.5,
                            breakdown={k: (0.05 if k == "time/weight_sync" else 1.0) for k in bench.BREAKDOWN}, **common)
    result = bench.Bench("cpu-tiny", 4, 1, {"summary": "x"}, [full, lora],
                         lora_saturation={"100m": {"base": {"best": 150.0}, "adapter": {"best": 50.0}}})
    text = result.markdown()
    assert "decode 3.00× slower with it" in text
    assert "a LoRA push moved 10.50 MB in 0.050 s, 2.8% of the full push's bytes and 4.2% of its seconds" in text
    rows = [line for line in text.splitlines() if line.startswith("| 100m |")]
    assert rows[1].split("|")[2].strip() == "lora" and rows[1].rstrip(" |").endswith("10.50")
    assert bench.PATHS["lora"][-3:] == bench.LORA and "lora" in bench.OWN_SERVER


def test_repeats_take_turns_and_each_ratio_is_paired_per_repeat_with_its_range(tmp_path):
    """Three repeats of server and async: a path's row is its median repeat; the async/server ratio is taken within
    each repeat (a slow moment of the machine slows both of its pair) and shown as median (range)."""
    common = dict(size="100m", steps=4, tokens_per_step=800, generation_tokens_per_second=50.0, staleness=0.0,
                  training_tokens_per_second=20.0, sampler_cpu_percent=None, train_dir="",
                  breakdown={k: 1.0 for k in bench.BREAKDOWN})
    server = [bench.PathResult(path="server", step_seconds=s, repeat=k, **common)
              for k, s in enumerate((30.0, 40.0, 36.0))]
    ahead = [bench.PathResult(path="async", step_seconds=s, repeat=k, **common)
             for k, s in enumerate((21.0, 24.0, 24.0))]
    result = bench.Bench("cpu-tiny", 4, 1, {"summary": "x"}, [server[0], ahead[0], server[1], ahead[1], server[2],
                                                              ahead[2]], repeats=3)
    assert result.ratios("100m", "async") == pytest.approx([0.70, 0.60, 24 / 36])
    assert result.ratio_text("100m", "async") == "0.67 (0.60-0.70)"
    # unpaired medians would say 24/36 too, but a pairing by position matters when the machine drifts:
    assert result.result("100m", "server").step_seconds == 36.0 and result.result("100m", "async").repeat in (1, 2)
    assert [(r.path, r.repeat) for r in result.medians()] == [("server", 2), ("async", 1)]
    text = result.markdown()
    assert "each path 3 times, taking turns" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 100m |")]
    assert [(r[2].strip(), r[4].strip()) for r in rows] == [("server", "1.00 (1.00-1.00)"),
                                                            ("async", "0.67 (0.60-0.70)")]
    from workbench.rundir import StageDir

    stage = StageDir(tmp_path / "bench", json="bench.json", table="bench.md", figure="bench.png")
    result.save(stage)
    again = bench.Bench.load(stage)
    assert again.ratio_text("100m", "async") == "0.67 (0.60-0.70)" and again.repeats == 3
    # one repeat: the ratio says it has no spread, and the table says not to read it as a finding
    single = bench.Bench("cpu-tiny", 4, 1, {"summary": "x"}, [server[0], ahead[0]], repeats=1)
    assert single.ratio_text("100m", "async") == "0.70 (1 repeat)"
    assert "Read no ratio as a finding before --repeats 3" in single.markdown()
    assert "Read no ratio" not in result.markdown()



def test_measure_reads_the_bench_figures(bench_run):
    """scripts/measure.py's bench figures (docs/results/bench.json): each path's median step and its ratio to the
    synchronous server path's step."""
    run, result, _ = bench_run
    figures = script("measure").bench_figures(run.path)
    assert figures["size"] == "tiny" and figures["repeats"] == 1 and list(figures["paths"]) == list(PATHS)
    server = result.result("tiny", "server").step_seconds
    for path, row in figures["paths"].items():
        assert row["step_seconds"] == result.result("tiny", path).step_seconds
        if path == "server":
            assert row["ratio_to_server"] is None
        else:
            assert row["ratio_to_server"] == pytest.approx(row["step_seconds"] / server)
            assert row["ratio_range"] == [row["ratio_to_server"]] * 2
        # the bench's own lines against the machine travel verbatim, and the results page shows them
        median = result.result("tiny", path)
        assert row["gauge"] == result.gauge_line(median) and "optimisation at" in row["gauge"]
        assert (row["sync"] is None) == (path == "in-process")
        if row["sync"]:
            assert "of the machine's copy bandwidth" in row["sync"]
    record = {"command": "workbench bench", "commit": "0" * 40, "date": "d", "machine": {"summary": "a box"},
              "versions": {}, "seconds": 60.0, "figures": figures}
    page = script("measure").results_page({"bench": record})
    assert all(f"- {row['gauge']}" in page for row in figures["paths"].values())
    assert f"- {figures['paths']['server']['sync']}" in page
