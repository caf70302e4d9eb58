"""`workbench run` for real: the staged notebooks under papermill into one run directory, and its report."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import chromium, free_port, script
from test_notebooks import outputs_of, text_of
from workbench.recipe import yaml_load

SECRET = "sk-workbench-test-7f3a9c"


def run_pipeline(workbench_cmd, runs: Path, stages: str, *overrides, env=None):
    return subprocess.run([*workbench_cmd, "run", "--recipe", "cpu-tiny", "--stages", stages,
                           f"monitor.runs_dir={runs}", *overrides], capture_output=True, text=True, timeout=1500,
                          env=env)


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, tiny_model_dir):
    """env, smoke, train and eval through `workbench run`, smoke-sized: (run directory, completed process)."""
    runs = tmp_path_factory.mktemp("pipeline-runs")
    script = Path(sys.executable).parent / "workbench"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "workbench"]
    env = {**os.environ, "WORKBENCH_TEST_API_KEY": SECRET}
    done = run_pipeline(cmd, runs, "env,smoke,train,eval", f"server.port={free_port()}", "trainer.max_steps=8",
                        "trainer.per_device_train_batch_size=16",
                        "trainer.logging_steps=2", "trainer.save_steps=4", "eval.num_samples=24",
                        "monitor.sample_interval_s=0.5", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    return run_dir, done


def test_pipeline_runs_the_notebooks_into_one_run_directory(pipeline_run):
    run_dir, done = pipeline_run
    record = json.loads((run_dir / "run.json").read_text())
    assert record["stages"] == ["env", "smoke", "train", "eval"] and "failed_stage" not in record
    for stage, name in (("env", "00_env_check"), ("smoke", "03_smoke_grpo"), ("train", "04_full_grpo"),
                        ("eval", "05_evaluation")):
        assert record["results"][stage]["status"] == "passed"
        executed = run_dir / "notebooks" / f"{name}.ipynb"
        page = (run_dir / "notebooks" / f"{name}.html").read_text()
        assert executed.exists() and not re.findall(r"""src=["']https?://""", page)  # readable offline
        assert (run_dir / "logs" / f"{name}.log").exists()
        nb = json.loads(executed.read_text())
        assert any("injected-parameters" in c["metadata"].get("tags", []) for c in nb["cells"])
        # every stage gets the run's recipe.yaml (overrides already in it) and the run root
        params = nb["metadata"]["papermill"]["parameters"]
        assert Path(params.pop("recipe")).resolve() == (run_dir / "recipe.yaml").resolve()
        assert Path(params.pop("run_dir")).resolve() == run_dir.resolve() and params.pop("overrides") == []
        if stage == "eval":
            assert params.pop("models") == {"base": "base", "trained": str((run_dir / "train" / "final").resolve())}
        assert params == {}, stage
    assert "report: " in done.stdout and str(run_dir / "report.html") in done.stdout
    assert "held-out (test) accuracy" in done.stdout and "points) on 24 problems" in done.stdout


def test_pipeline_stage_outputs(pipeline_run):
    run_dir, _ = pipeline_run
    # one run root: the recipe written once, every stage under its own directory
    assert yaml_load((run_dir / "recipe.yaml").read_text())["trainer"]["max_steps"] == 8
    env = json.loads((run_dir / "env.json").read_text())
    assert env["ok"] and any(c["name"] == "gloo all-reduce" and c["status"] == "pass" for c in env["checks"])
    assert not [p.name for p in run_dir.iterdir() if p.suffix == ".jsonl"]  # no stage output left at the root
    # smoke: every check passed, shown as a table
    checks = json.loads((run_dir / "smoke" / "smoke_checks.json").read_text())
    assert [c["name"] for c in checks if not c["ok"]] == [] and len(checks) == 6
    assert "| loss finite | pass |" in text_of(outputs_of(run_dir / "notebooks" / "03_smoke_grpo.ipynb"), "text/markdown")
    # the smoke run is a training directory of its own, with the smoke variant of the recipe beside it
    smoke_recipe = yaml_load((run_dir / "smoke" / "recipe.yaml").read_text())
    assert smoke_recipe["trainer"]["max_steps"] == 3 and smoke_recipe["server"] == yaml_load(
        (run_dir / "recipe.yaml").read_text())["server"]
    smoke_steps = {json.loads(line).get("step") for line in (run_dir / "smoke" / "metrics.jsonl").read_text().splitlines()}
    assert 3 in smoke_steps and 8 not in smoke_steps
    assert json.loads((run_dir / "smoke" / "train.json").read_text())["steps"] == 3
    # train: the dashboard left a static PNG, the summary table and the advisor in the executed notebook
    outputs = outputs_of(run_dir / "notebooks" / "04_full_grpo.ipynb")
    assert any("image/png" in o.get("data", {}) for o in outputs)
    html = text_of(outputs, "text/html")
    assert "step time (s)" in html and "Advisor" in html
    summary = json.loads((run_dir / "train" / "train.json").read_text())
    assert summary["steps"] == 8 and summary["monitor"]["samples"] > 0
    roles = {json.loads(line)["role"] for line in (run_dir / "train" / "devices.jsonl").read_text().splitlines()}
    assert roles == {"server", "trainer"}
    assert (run_dir / "train" / "rollout.jsonl").read_text().count("\n") > 0
    # eval: base and trained, both through the server
    evals = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert [e["model"] for e in evals] == ["base", "trained"] and all(e["n"] == 24 and e["errors"] == 0 for e in evals)
    assert (run_dir / "eval" / "samples.jsonl").read_text().count("\n") == 2 * 24
    table = (run_dir / "eval" / "comparison.md").read_text()
    assert "| base |" in table and "| trained |" in table
    assert (run_dir / "eval" / "comparison.png").stat().st_size > 0


def test_run_directory_keeps_the_environment_with_secrets_redacted(pipeline_run):
    run_dir, _ = pipeline_run
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["versions"]["trl"] == "1.16.0" and environment["kernel"]
    assert environment["variables"]["WORKBENCH_TEST_API_KEY"] == "<redacted>"
    for path in run_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".html", ".ipynb", ".log", ".jsonl", ".yaml"):
            assert SECRET not in path.read_text(errors="replace"), path


def test_report_is_self_contained(pipeline_run):
    import re

    run_dir, _ = pipeline_run
    page = (run_dir / "report.html").read_text()
    for section in ("Stages", "Evaluation through the server", "Training", "Step-time breakdown", "Advisor",
                    "Smoke run checks", "Environment and versions", "Recipe (resolved)"):
        assert f">{section}" in page, section
    assert "held-out (test) accuracy" in page and "points</b>" in page
    assert page.count("data:image/png;base64,") >= 2  # training curves and the accuracy comparison
    external = re.findall(r"""(?:src|href)\s*=\s*['"]?(?:https?:)?//""", page)
    external += re.findall(r"""url\(\s*['"]?(?:https?:)?//""", page)
    assert external == []


def _browse(browser: str, url: str, profile: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Open url headless with every network request sent to a local proxy that records it and answers 404."""
    import http.server
    import socketserver
    import threading

    seen: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)  # a URL for http, host:port for an https CONNECT
            self.send_response(404)
            self.end_headers()

        do_CONNECT = do_POST = do_HEAD = do_GET

        def log_message(self, *args):
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Recorder) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--disable-default-apps", "--disable-sync", "--disable-extensions", "--no-pings",
                 "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,MediaRouter,Translate",
                 f"--proxy-server=http://127.0.0.1:{proxy.server_address[1]}", "--proxy-bypass-list=<-loopback>",
                 f"--user-data-dir={profile}", "--virtual-time-budget=5000", *extra]
        done = subprocess.run([browser, *flags, url], capture_output=True, text=True, timeout=120)
        proxy.shutdown()
    return done, seen


def _host(request: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(request).hostname if "://" in request else request.rsplit(":", 1)[0]


def test_report_renders_in_headless_chromium_without_network(pipeline_run, tmp_path):
    """The report in a real browser: every figure decodes, no request leaves the machine, a screenshot is kept."""
    import re

    from PIL import Image

    browser = chromium()
    run_dir, _ = pipeline_run
    url = (run_dir / "report.html").resolve().as_uri()
    # Chromium phones home by itself (www/accounts.google.com) even for a blank page: measure that first, so
    # only what the report asks for counts
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body>blank</body></html>")
    _, own = _browse(browser, blank.as_uri(), tmp_path / "p0", "--dump-dom")
    dom, seen = _browse(browser, url, tmp_path / "p1", "--dump-dom")
    shot = run_dir / "report.png"
    _browse(browser, url, tmp_path / "p2", f"--screenshot={shot}", "--window-size=1280,2400")
    assert dom.returncode == 0, dom.stderr[-2000:]
    figures = re.search(r'data-figures="(\d+)"', dom.stdout)
    rendered = re.search(r'data-figures-rendered="(\d+)"', dom.stdout)
    assert figures and rendered, "the page's load script did not run"
    assert int(figures.group(1)) >= 2 and rendered.group(1) == figures.group(1)  # every figure decoded
    browser_hosts = {_host(r) for r in own}
    from_page = [r for r in seen if _host(r) not in browser_hosts]
    assert from_page == [], f"the report asked the network for {from_page}"
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 2400)
    low, high = image.getextrema()
    assert high - low > 100  # not a blank page


def test_the_network_check_catches_an_external_resource(tmp_path):
    browser = chromium()
    page = tmp_path / "leaky.html"
    page.write_text("<html><body><img src='http://cdn.example.org/plot.png'></body></html>")
    _, seen = _browse(browser, page.as_uri(), tmp_path / "p", "--dump-dom")
    assert "http://cdn.example.org/plot.png" in seen


def test_stage_parameters_point_every_notebook_at_the_run(tmp_path):
    from workbench import recipe
    from workbench.pipeline import STAGES, stage_parameters
    from workbench.rundir import RunDir

    run = RunDir.create(recipe.load("cpu-tiny", [f"monitor.runs_dir={tmp_path}"]), "run")
    base = {"recipe": str(run.recipe), "overrides": [], "run_dir": str(run.path)}
    for stage in STAGES:
        expected = {**base, "models": {"base": "base"}} if stage == "eval" else base
        assert stage_parameters(stage, run) == expected, stage
    # once the training saved a final model, the evaluation compares it with the base
    run.train.final.mkdir(parents=True)
    (run.train.final / "model.safetensors").write_bytes(b"")
    assert stage_parameters("eval", run)["models"] == {"base": "base", "trained": str(run.train.final)}


def test_missing_model_fails_before_any_stage(workbench_cmd, tmp_path):
    """The recipe is resolved once, at the entry point: a model path that does not exist stops `workbench run`
    before a run directory or a kernel is made."""
    missing = tmp_path / "no-such-model"
    done = run_pipeline(workbench_cmd, tmp_path / "runs", "env,offline,serving", f"model.path={missing}")
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: model.path {missing} does not exist") and "fix:" in message
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_failing_stage_stops_the_run_and_names_its_notebook(workbench_cmd, tmp_path, tiny_model_dir):
    # resolves and passes the environment check, then fails in the offline stage: more eval rows than held out
    done = run_pipeline(workbench_cmd, tmp_path / "runs", "env,offline,serving", "eval.num_samples=100000")
    assert done.returncode == 2
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    assert "eval.num_samples=100000 but the heldout split has 300" in record["error"]
    assert record["failed_stage"] == "offline" and record["results"]["env"]["status"] == "passed"
    assert "serving" not in record["results"]  # stopped at the first failure
    executed = run_dir / "notebooks" / "01_offline_generation.ipynb"
    errors = [o for o in outputs_of(executed) if o.get("output_type") == "error"]
    assert errors and (run_dir / "notebooks" / "01_offline_generation.html").exists()
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: stage 'offline' failed") and str(executed) in message
    assert "logs/01_offline_generation.log" in message and (run_dir / "report.html").exists()
    assert "stage 'offline' failed" in (run_dir / "report.html").read_text()
    assert not (run_dir / "offline" / "offline.json").exists()


def test_resume_keeps_passed_stages_and_resumes_the_training(tmp_path):
    """`workbench run --resume RUN`: the stages that passed are not run again; the training stage gets `resume`
    once a checkpoint exists (notebook 04 then continues from it)."""
    from workbench import pipeline, recipe
    from workbench.rundir import RunDir

    r = recipe.load("cpu-tiny", [f"monitor.runs_dir={tmp_path}"])
    run = RunDir.create(r, "run")
    (run.path / "run.json").write_text(json.dumps({
        "recipe": r.name, "stages": ["env", "train"], "failed_stage": "train", "error": "killed",
        "results": {"env": {"status": "passed", "seconds": 3.0}, "train": {"status": "failed", "seconds": 9.0}}}))
    assert "resume" not in pipeline.stage_parameters("train", run, resuming=True)  # nothing to resume from yet
    state = run.train.checkpoints / "checkpoint-5" / "trainer_state.json"
    state.parent.mkdir(parents=True)
    state.write_text("{}")
    assert pipeline.stage_parameters("train", run, resuming=True)["resume"] is True
    assert "resume" not in pipeline.stage_parameters("train", run)  # a new run never resumes
    lines = []
    pipeline.run(recipe.resolve(r), ["env"], log=lines.append, resume=run)  # env passed: nothing to run again
    record = json.loads((run.path / "run.json").read_text())
    assert record["resumed"][0]["kept"] == ["env"] and record["resumed"][0]["again"] == []
    assert "failed_stage" not in record and record["results"]["env"]["status"] == "passed"
    assert (run.path / "report.html").exists() and any("resuming" in line for line in lines)


def test_measure_reads_a_runs_figures(pipeline_run):
    """scripts/measure.py's demo figures (docs/results/demo.json) are what the run directory recorded."""
    run_dir, _ = pipeline_run
    figures = script("measure").demo_figures(run_dir, 600.0)
    summaries = {s["model"]: s for s in json.loads((run_dir / "eval" / "summary.json").read_text())}
    assert figures["base_accuracy"] == summaries["base"]["accuracy_mean"]
    assert figures["trained_accuracy"] == summaries["trained"]["accuracy_mean"]
    assert figures["n"] == 24 and figures["minutes"] == 10.0 and figures["steps"] == 8
    assert list(figures["stage_seconds"]) == ["env", "smoke", "train", "eval"]
    assert all(v > 0 for v in figures["stage_seconds"].values()) and figures["step_seconds"] > 0
    spread = figures["groups_with_spread"]
    assert 0 <= spread["first_fifth"] <= 1 and 0 <= spread["last_fifth"] <= 1
    # monitoring's cost: the sampler's share of a core and the gauge's CPU seconds, as the training recorded them
    from workbench.rundir import RunDir

    train = RunDir.open(run_dir).train
    summary, cost = json.loads(train.summary.read_text()), json.loads(train.limits.read_text())["cost"]
    overhead = figures["overhead"]
    assert overhead["sampler_core_share"] == summary["monitor"]["core_share"] > 0
    assert overhead["gauge_cpu_seconds"] == cost["cpu_seconds"] > 0
    assert overhead["gauge_core_share"] == cost["cpu_seconds"] / summary["train_seconds"]
    # the roofline gauge's mean shares over the steps, against the cores the training measured
    logged = [json.loads(line) for line in train.metrics.read_text().splitlines() if line.strip()]
    generation = [r["gauge/generation"] for r in logged if isinstance(r.get("gauge/generation"), (int, float))]
    gauge = figures["gauge"]
    assert generation and gauge["generation_share"] == pytest.approx(sum(generation) / len(generation))
    assert gauge["basis"] == "cores" and gauge["peak"] == "GEMM throughput" and gauge["optimisation_share"] > 0
    page = script("measure").results_page({"demo": {"command": "workbench run", "commit": "0" * 40, "date": "d",
                                                    "machine": {"summary": "a box"}, "versions": {}, "seconds": 600.0,
                                                    "figures": figures}})
    assert f"generation at {gauge['generation_share']:.0%} of the server cores' decode ceiling" in page
