"""The honest protocol (workbench/experiments/protocol.py): three disjoint arithmetic splits, trainer.seed apart
from the data's, bad candidates refused before any training, and one real protocol run: candidates trained and scored on the
validation split, the chosen one's model scored on the test split."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import free_port, script, workbench_command
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.evaluation.evaluate import Evaluation
from workbench.experiments.protocol import Candidate, Outcome, Protocol, parse_candidate
from workbench.rundir import RunDir
from workbench.tasks import dataset
from workbench.tasks.task import Task


def _question(row: dict) -> str:
    return row["prompt"][-1]["content"]


def test_validation_rows_are_neither_trained_on_nor_the_test_rows():
    r = recipe.load("cpu-tiny")
    task = Task.build(r)
    train = {_question(x) for x in task.rows("train")}
    validation = task.rows("validation")
    test = task.eval_rows(r.eval)
    assert len(validation) == r.data.validation_size == 300 and len(test) == 300
    assert not train & {_question(x) for x in validation}
    assert not {_question(x) for x in validation} & {_question(x) for x in test}
    assert all(x["id"].startswith("arith-validation-") for x in validation)
    chosen = recipe.load("cpu-tiny", ["eval.split=validation"])
    assert Task.build(chosen).eval_rows(chosen.eval) == validation


def test_gsm8k_validation_is_carved_from_the_end_of_train(monkeypatch):
    records = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(10)]
    loaded = []
    monkeypatch.setattr(dataset, "hub_records", lambda hub_id, config, split, **_: loaded.append(split)
                        or list(enumerate(records, start=1)))
    task = Task.build(recipe.load("cpu-tiny", ["data.name=gsm8k", "data.validation_size=3"]))
    train, validation = task.rows("train"), task.rows("validation")
    assert [r["answer"] for r in train] == [str(i) for i in range(7)]
    assert [r["answer"] for r in validation] == ["7", "8", "9"]
    assert validation[0]["id"] == "gsm8k-train-8"  # numbered as the hub's train rows are
    assert loaded == ["train"]  # one read of the hub split serves both parts
    whole = Task.build(recipe.load("cpu-tiny", ["data.name=gsm8k", "data.validation_size=0"]))
    assert len(whole.rows("train")) == 10


@pytest.mark.parametrize("overrides, message", [
    (["eval.split=train"], "eval.split is 'train', not a split kept out of training"),
    (["eval.split=validation", "data.validation_size=0"], "eval.split is validation but data.validation_size is 0"),
    (["data.split=heldout"], "data.split is 'heldout': GRPO trains on the train split"),
    (["data.validation_size=-1"], "data.validation_size is -1"),
])
def test_bad_splits_are_refused_at_load(overrides, message):
    with pytest.raises(WorkbenchError, match=message):
        recipe.load("cpu-tiny", overrides)


def test_the_training_seed_is_its_own_knob():
    from workbench.training.config import trainer_arguments

    def seed(overrides):
        return trainer_arguments(recipe.resolve(recipe.load("cpu-tiny", overrides), platform="cpu"), "/tmp/x")["seed"]

    assert seed([]) == 0  # data.seed when unset, as before
    assert seed(["trainer.seed=7"]) == 7
    assert seed(["data.seed=3"]) == 3
    # the data (and so the tiny model's cache key) does not follow the training seed
    assert recipe.resolve(recipe.load("cpu-tiny", ["trainer.seed=7"]), platform="cpu").model_path == \
        recipe.resolve(recipe.load("cpu-tiny"), platform="cpu").model_path


def test_candidates_parse_with_or_without_a_name():
    assert parse_candidate("lr-high: trainer.learning_rate=1e-4 trainer.warmup_steps=5") == Candidate(
        "lr-high", ["trainer.learning_rate=1e-4", "trainer.warmup_steps=5"])
    assert parse_candidate("trainer.beta=0.04") == Candidate("trainer.beta=0.04", ["trainer.beta=0.04"])
    for text, message in (("lr:", "has no override"), ("x: trainer.beta", "is not section.key=value"),
                          ("recipe: trainer.beta=0", "the name of the recipe")):
        with pytest.raises(WorkbenchError, match=message):
            parse_candidate(text)


def test_the_headline_is_mean_and_sample_std_of_the_test_gains():
    p = Protocol("cpu-tiny", 0, [1, 2, 3], [Candidate("recipe")], chosen="recipe",
                 selected=Outcome("recipe", 0, "heldout", "r0", 0.5, 0.9),
                 test=[Outcome("recipe", s, "heldout", "r", 0.5, t) for s, t in ((1, 0.6), (2, 0.65), (3, 0.7))])
    assert p.to_json()["test_gain_mean"] == pytest.approx(0.15)  # the picked model (+40) is not in it
    assert p.to_json()["test_gain_std"] == pytest.approx(0.05)
    assert "gain +15.0 ± 5.0 points over 3 seed(s)" in p.headline()
    assert "not part of the result" in p.markdown()
    assert Protocol.from_json(json.loads(json.dumps(p.to_json()))) == p  # what --resume reads back


@pytest.mark.parametrize("extra, message", [
    (["--candidate", "x: trainer.learning_rat=1e-4"], "candidate 'x': unknown recipe key 'trainer.learning_rat'"),
    (["--candidate", "x: trainer.seed=3"], "candidate 'x' changes trainer.seed"),
    (["--candidate", "x: data.validation_size=100"], "compared on different problems"),
    (["--seeds", "1,1"], "distinct seeds"),
    (["--seeds", "a"], "--seeds 'a' is not a list"),
    (["--choose-seed", "1", "--seeds", "1,2"], "is also a test seed"),
    (["eval.split=heldout"], "which the protocol sets for each training"),
    (["eval.num_samples=301"], "eval.num_samples=301 but the validation split has 300"),
    (["--resume", "nowhere"], "no run directory nowhere"),
])
def test_bad_protocols_fail_before_any_training(extra, message, tmp_path):
    recipe_args = [] if "--resume" in extra else ["--recipe", "smoke", f"monitor.runs_dir={tmp_path}"]
    out = subprocess.run(workbench_command() + ["protocol", *recipe_args, *extra],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "fix:" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # no protocol directory, no training


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_protocol_chooses_on_validation_and_reports_on_test(tiny_model_dir, tmp_path):
    """Two settings (the recipe and a candidate), smoke-sized LoRA trainings, for real: each trained with the
    choice's seed and scored on the validation split; the picked model scored on the test split (shown, not
    counted); the chosen setting trained afresh with a test seed and scored on the test split (the result). Every
    model is scored once per split, and the whole protocol runs on one server: `--concurrent 2` trains the two
    candidates at the same time on it, each pushing its own adapter, and each adapter is loaded into it to be
    scored. (The full-weight push into a running server for scoring is pipeline_run's, tests/test_pipeline.py.)"""
    port = free_port()
    cmd = workbench_command() + ["protocol", "--recipe", "smoke", "--choose-seed", "3", "--seeds", "4",
                                 "--candidate", "lr-high: trainer.learning_rate=1e-3", "--concurrent", "2",
                                 "peft.r=8", "peft.target_modules=all-linear",
                                 f"server.port={port}", "eval.num_samples=12", f"monitor.runs_dir={tmp_path}"]
    # the server's log at INFO (its adapter loads): importing TRL in this process set vLLM's level to ERROR for children
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [protocol_run] = [p for p in tmp_path.iterdir() if p.name.endswith("-protocol")]
    stage = RunDir(protocol_run).protocol
    result = json.loads(stage.json.read_text())

    assert [o["candidate"] for o in result["validation"]] == ["recipe", "lr-high"]
    assert all(o["split"] == "validation" and o["seed"] == 3 for o in result["validation"])
    best = max(result["validation"], key=lambda o: o["trained"])
    assert result["chosen"] == best["candidate"]
    picked = result["selected"]  # the chosen validation run's model, scored again on test: no new training
    assert (picked["seed"], picked["split"], picked["run"]) == (3, "heldout", best["run"])
    [test] = result["test"]
    assert (test["seed"], test["split"], test["candidate"]) == (4, "heldout", result["chosen"])
    assert test["run"] not in {o["run"] for o in result["validation"]}  # trained afresh
    assert test["base"] == picked["base"] == result["base"]["heldout"]  # one base model, one test split
    assert {o["base"] for o in result["validation"]} == {result["base"]["validation"]}
    assert result["test_gain_mean"] == pytest.approx(test["trained"] - test["base"])
    # what scripts/measure.py reads of it (docs/results/protocol.json)
    figures = script("measure").protocol_figures(protocol_run)
    assert figures["gain_mean"] == pytest.approx(100 * result["test_gain_mean"]) and figures["gain_std"] is None
    assert figures["trainings"] == 1 and figures["seeds"] == [4] and figures["data_seeds"] == []
    assert figures["base_accuracy"] == {"None": test["base"]}
    assert [t["label"] for t in result["trainings"]] == ["c0-seed3-validation", "c1-seed3-validation",
                                                         f"c{[c['name'] for c in result['candidates']].index(result['chosen'])}-seed4-heldout"]

    # each split evaluated once, every model in it once: the base and the split's trained models
    evaluations = {split: Evaluation.load(RunDir(stage.runs / f"eval-{split}").eval) for split in ("validation", "heldout")}
    assert [s.model for s in evaluations["validation"].summaries] == ["base", "c0-seed3-validation",
                                                                      "c1-seed3-validation"]
    index = [c["name"] for c in result["candidates"]].index(result["chosen"])
    assert [s.model for s in evaluations["heldout"].summaries] == ["base", f"c{index}-seed4-heldout",
                                                                   f"c{index}-seed3-heldout"]
    for split, ev in evaluations.items():
        assert {s.split for s in ev.summaries} == {split} and len(ev.samples) == 12 * len(ev.summaries)
    by_label = {**{o["run"]: o for o in result["validation"]}}
    assert by_label[best["run"]]["trained"] == evaluations["validation"].by_model()[
        f"c{index}-seed3-validation"].accuracy_mean
    # one server for the whole protocol: started once, shared by the trainings, loaded with each evaluated model
    (server_log,) = (stage.path / "server").glob("vllm-server-*.log")
    assert list(stage.runs.rglob("vllm-server-*.log")) == []
    loaded = server_log.read_text()
    for label in ("c0-seed3-validation", "c1-seed3-validation", f"c{index}-seed4-heldout", f"c{index}-seed3-heldout"):
        assert f"Loaded new LoRA adapter: name '{label}'" in loaded, label  # scored under its own adapter
    # the two validation trainings ran at the same time (each process's run directory was made before the other's
    # training ended), each with its own adapter
    windows = []
    for o in result["validation"]:
        run = RunDir(o["run"])
        assert json.loads(run.train.summary.read_text())["weight_sync"] == "lora"
        windows.append((run.recipe.stat().st_mtime, run.train.summary.stat().st_mtime))
    assert max(w[0] for w in windows) < min(w[1] for w in windows), windows
    assert "2 trainings, 2 at a time" in out.stdout

    # how each training was seeded, read from the runs themselves; each run's own evaluation (base and trained)
    for o in result["validation"] + result["test"]:
        assert recipe.load(str(RunDir(o["run"]).recipe)).trainer.get("seed") == o["seed"]
    own = sorted(p for p in stage.runs.rglob("samples.jsonl") if not p.parent.parent.name.startswith("eval-"))
    assert len(own) == 4  # two validation runs, the picked model on test, the test run
    for path in own:
        split = "validation" if "-validation" in str(path.relative_to(stage.runs)).split("/")[0] else "heldout"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert sorted({r["model"] for r in rows}) == ["base", "trained"]
        ids = {r["id"] for r in rows}
        assert len(ids) == 12 and all(i.startswith(f"arith-{split}-") for i in ids), (path, sorted(ids)[:3])
        assert {m["split"] for m in json.loads((path.parent / "summary.json").read_text())} == {split}
        assert (path.parent / "analysis.json").exists() and (path.parent.parent / "report.html").exists()
    table = stage.table.read_text()
    assert "Settings chosen on the validation split" in table and result["headline"] in table
    assert result["headline"] in out.stdout


def test_resume_keeps_what_was_recorded_and_redoes_the_interrupted(monkeypatch, tmp_path):
    """The orchestration over many hours: a protocol killed during a training continues with --resume, keeps the
    trainings it recorded, sets the interrupted one aside and runs it again, and takes more test seeds; each split's
    base is scored once. The trainings here are `workbench` calls answered with their result files, the
    evaluations scores by label (the real ones are above)."""
    from workbench import tinymodel
    from workbench.evaluation.evaluate import Evaluation, Summary
    from workbench.experiments import protocol
    from workbench.serving import shared

    calls, scored = [], []
    accuracy = {"recipe": 0.6, "lr-high": 0.7}

    def fake_workbench(args, log):
        calls.append(args)
        opts = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
        runs_dir = Path(opts["monitor.runs_dir"])
        if len(calls) == 3:  # the third training dies half-way, as a killed process would
            (runs_dir / "half-written").mkdir(parents=True)
            raise KeyboardInterrupt
        run = RunDir(runs_dir / f"run-{len(calls)}")
        run.train.make()
        run.train.summary.write_text(json.dumps({"train_seconds": 10.0}))
        run.train.final.mkdir()
        (run.train.final / "model.safetensors").write_bytes(b"")
        (run.path / "recipe.yaml").write_text("name: smoke\n")
        (run.train.final / "candidate").write_text("lr-high" if "trainer.learning_rate=1e-3" in args else "recipe")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("ok")

    def fake_evaluate(rr, models, stage, server, log):
        scored.append((rr.recipe.eval.split, list(models)))
        summaries = [Summary(label, path, 12, 1, accuracy_mean=0.5 if label == "base" else
                             accuracy[(Path(path) / "candidate").read_text()], split=rr.recipe.eval.split)
                     for label, path in models.items()]
        evaluation = Evaluation(summaries, [])
        evaluation.save(stage)
        return evaluation

    monkeypatch.setattr(protocol, "_workbench", fake_workbench)
    monkeypatch.setattr(protocol, "_evaluate", fake_evaluate)
    monkeypatch.setattr(shared.SharedServer, "open", lambda self, rr, model: None)  # no server in this test
    monkeypatch.setattr(tinymodel, "ensure_model", lambda rr, log=print: "/no/model")
    lr_high = protocol.Candidate("lr-high", ["trainer.learning_rate=1e-3"])
    with pytest.raises(KeyboardInterrupt):  # killed during the first test training
        protocol.run("smoke", [lr_high], 0, [1], [f"monitor.runs_dir={tmp_path}"], log=lambda *_: None)
    [run_dir] = list(tmp_path.iterdir())
    kept = json.loads(RunDir(run_dir).protocol.json.read_text())
    assert [o["candidate"] for o in kept["validation"]] == ["recipe", "lr-high"] and kept["selected"] is None
    assert scored == [("validation", ["base", "c0-seed0-validation", "c1-seed0-validation"])]

    result, _ = protocol.run("", [], 0, [2], resume=run_dir, log=lambda *_: None)
    assert [a[0] for a in calls] == ["train"] * 5  # nothing recorded is trained again; the killed one is
    assert [a[-1].rsplit("/", 1)[1] for a in calls[2:]] == ["c1-seed1-heldout", "c1-seed1-heldout",
                                                            "c1-seed2-heldout"]
    # the test split once, its base once, with the picked model and both seeds
    assert scored[1:] == [("heldout", ["base", "c1-seed1-heldout", "c1-seed2-heldout", "c1-seed0-heldout"])]
    assert result.chosen == "lr-high" and result.selected.seed == 0
    assert [o.seed for o in result.test] == [1, 2] and result.seeds == [1, 2]
    assert result.to_json()["test_gain_mean"] == pytest.approx(0.2)
    aside = [p.name for p in RunDir(run_dir).protocol.runs.iterdir() if "incomplete" in p.name]
    assert aside == ["c1-seed1-heldout.incomplete"]

    # a later --resume with one more seed: its model alone is scored; the test split's base is not scored again
    result, _ = protocol.run("", [], 0, [3], resume=run_dir, log=lambda *_: None)
    assert scored[2:] == [("heldout", ["c1-seed3-heldout"])] and [o.seed for o in result.test] == [1, 2, 3]
    assert {o.base for o in result.test} == {0.5}


def test_concurrent_trainings_need_adapters_and_get_one_lora_server_for_all():
    """`--concurrent N`: full-weight candidates would overwrite each other's pushes on the one server (refused
    before anything starts); LoRA candidates get two slots each and the largest rank any of them trains, so that
    every training's server command is the shared one's."""
    from workbench.experiments.protocol import check, concurrent_overrides
    from workbench.serving import launch

    full = [Candidate("recipe", []), Candidate("lr", ["trainer.learning_rate=1e-3"])]
    with pytest.raises(WorkbenchError, match="'recipe', 'lr' pushes full weights"):
        concurrent_overrides("smoke", full, [], 2)
    lora = ["peft.r=8", "peft.target_modules=all-linear"]
    candidates = [Candidate("recipe", []), Candidate("r32", ["peft.r=32"])]
    added = concurrent_overrides("smoke", candidates, lora, 3)
    assert added == ["server.lora_slots=6", "server.max_lora_rank=32"]
    commands = {tuple(launch.command(recipe.resolve(recipe.load("smoke", [*lora, *added, *c.overrides])), "/m"))
                for c in candidates}
    assert len(commands) == 1  # one server for both candidates
    with pytest.raises(WorkbenchError, match="--concurrent 0"):
        check("smoke", candidates, 0, [1], [*lora, *added], concurrent=0)


def test_over_base_models_each_gain_against_its_own_base_and_every_candidate_head_to_head(monkeypatch, tmp_path):
    """`--data-seeds 5,6`: each base model (its data seed's splits and the tiny model built on them) gets its own
    trainings and its own base score per split (scored once); the choice is by the mean over the bases, and the
    chosen setting is trained per base and seed on test, each gain against its own base. `--report-all`: no choice,
    every candidate on test. The trainings and evaluations are answered with result files, as in the resume test
    (the real protocol run is above)."""
    from workbench import tinymodel
    from workbench.evaluation.evaluate import Evaluation, Summary
    from workbench.experiments import protocol
    from workbench.serving import shared

    calls, scored, built = [], [], []
    base_score = {0: 0.5, 5: 0.40, 6: 0.60}
    lift = {"recipe": 0.10, "dynamic": 0.15}

    def fake_workbench(args, log):
        calls.append(args)
        opts = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
        run = RunDir(Path(opts["monitor.runs_dir"]) / "run")
        run.train.make()
        tokens = 1000 * int(opts["trainer.seed"]) + 1
        run.train.summary.write_text(json.dumps({"train_seconds": 10.0, "generated_tokens": tokens}))
        run.train.final.mkdir()
        (run.train.final / "model.safetensors").write_bytes(b"")
        (run.path / "recipe.yaml").write_text("name: smoke\n")
        name = "dynamic" if "rollout.dynamic_sampling=true" in args else "recipe"
        (run.train.final / "who").write_text(f"{name} {opts.get('data.seed', 0)} {opts.get('model.tiny.seed', 0)}")

    def fake_evaluate(rr, models, stage, server, log):
        d = rr.recipe.data.seed
        scored.append((rr.recipe.eval.split, d, list(models)))
        summaries = []
        for label, path in models.items():
            if label == "base":
                accuracy = base_score[d]
            else:
                name, data_seed, tiny_seed = (Path(path) / "who").read_text().split()
                assert int(data_seed) == int(tiny_seed) == d  # trained on the base it is scored against
                accuracy = base_score[d] + lift[name]
            summaries.append(Summary(label, path, 12, 1, accuracy_mean=accuracy, split=rr.recipe.eval.split))
        evaluation = Evaluation(summaries, [])
        evaluation.save(stage)
        return evaluation

    monkeypatch.setattr(protocol, "_workbench", fake_workbench)
    monkeypatch.setattr(protocol, "_evaluate", fake_evaluate)
    monkeypatch.setattr(shared.SharedServer, "open", lambda self, rr, model: None)
    monkeypatch.setattr(tinymodel, "ensure_model",
                        lambda rr, log=print: built.append((rr.recipe.data.seed, rr.recipe.model.tiny.seed)) or "/m")
    dynamic = protocol.Candidate("dynamic", ["rollout.dynamic_sampling=true"])
    result, _ = protocol.run("smoke", [dynamic], 0, [1, 2], [f"monitor.runs_dir={tmp_path / 'bases'}"],
                             log=lambda *_: None, data_seeds=[5, 6])
    labels = [a[-1].rsplit("/", 1)[1] for a in calls]
    assert labels == ["c0-data5-seed0-validation", "c1-data5-seed0-validation", "c0-data6-seed0-validation",
                      "c1-data6-seed0-validation", *[f"c1-data{d}-seed{s}-heldout" for d in (5, 6) for s in (1, 2)]]
    assert set(built) == {(5, 5), (6, 6)}
    # each (split, base) evaluated once, its base scored in it
    assert [(split, d, models[0]) for split, d, models in scored] == [
        ("validation", 5, "base"), ("validation", 6, "base"), ("heldout", 5, "base"), ("heldout", 6, "base")]
    assert result.chosen == "dynamic"  # the higher mean over the bases
    assert len(result.test) == 4 and [(o.data_seed, o.seed) for o in result.picked] == [(5, 0), (6, 0)]
    for o in result.test:
        assert o.base == base_score[o.data_seed] and o.gain == pytest.approx(lift[o.candidate])
        assert o.generated_tokens == 1000 * o.seed + 1
    assert result.base_means() == pytest.approx({5: 15.0, 6: 15.0})
    assert "gain +15.0 ± 0.0 points over 4 trainings (2 base model(s) x 2 seed(s))" in result.headline()
    assert "per base model (data seed: mean gain): 5: +15.0, 6: +15.0" in result.markdown()
    assert Protocol.from_json(json.loads(json.dumps(result.to_json()))) == result

    calls.clear()
    result, run = protocol.run("smoke", [dynamic], 0, [1, 2], [f"monitor.runs_dir={tmp_path / 'both'}"],
                               log=lambda *_: None, report_all=True)
    assert [a[-1].rsplit("/", 1)[1] for a in calls] == ["c0-seed1-heldout", "c1-seed1-heldout", "c0-seed2-heldout",
                                                        "c1-seed2-heldout"]  # nothing on validation
    assert result.chosen is None and result.validation == [] and result.picked == []
    assert result.gains("recipe") == pytest.approx([0.10, 0.10]) and result.gains("dynamic") == pytest.approx(
        [0.15, 0.15])
    table = result.markdown()
    assert "no choice on validation" in table and "every candidate" in table
    assert result.headline("dynamic") in table and result.headline("recipe") in table
    assert "1,501 completion tokens generated per training" in result.headline("recipe")  # seeds 1 and 2
    assert set(result.to_json()["by_candidate"]) == {"recipe", "dynamic"}

    # what scripts/measure.py keeps of it and renders: every arm; the plain one is the protocol measurement's
    measure = script("measure")
    figures = measure.variants_figures(run.path)
    recipe, dyn = figures["arms"]
    assert (recipe["name"], recipe["overrides"], dyn["name"], dyn["overrides"]) == (
        "recipe", [], "dynamic", ["rollout.dynamic_sampling=true"])
    assert recipe["gain_mean"] == pytest.approx(10.0) and dyn["gain_mean"] == pytest.approx(15.0)
    assert dyn["generated_tokens"] == recipe["generated_tokens"] == 1501
    assert dyn["headline"] == result.headline("dynamic")

    def record(figures: dict, commit: str = "0" * 40) -> dict:
        return {"command": "workbench protocol", "commit": commit, "date": "2026-12-04 00:00 UTC", "seconds": 60.0,
                "machine": {"summary": "a machine"}, "versions": {}, "figures": figures}

    results = {"protocol": record(recipe), "variants": record({"arms": [dyn]})}
    page = measure.results_page(results)
    assert ("| dynamic | `rollout.dynamic_sampling=true` | 50.0% → 65.0% | +15.0 ± 0.0 | —: +15.0 "
            "| 1,501 (1.00×) | ") in page and " | +999.33 |" in page
    assert "| dynamic | — | 2 | 50.0% → 65.0% | +15.0 |" in page  # each training (the recipe's own base)
    assert ("Dynamic sampling (`rollout.dynamic_sampling=true`) against the recipe on 1 base model(s) × training "
            "seed(s) 1, 2 (2026-12-04): test gain +15.0 ± 0.0 against +10.0 ± 0.0 points (mean ± sample sd over 2 "
            "trainings each) at 1.00× the recipe's completion tokens") in measure.readme_block(results)
    # paired by (base, seed): +5.0 on each, no spread, so an interval of zero width that excludes zero
    assert "paired difference +5.0 points (95% CI +5.0 to +5.0 over 2 pairs: told apart from zero)" in \
        measure.readme_block(results)
    # a plain arm from another commit is not compared with: the arm is shown alone, and why
    results["protocol"] = record(recipe, commit="1" * 40)
    page = measure.results_page(results)
    assert "Not compared with the recipe: the protocol, its plain arm, ran on another commit." in page
    assert "(1.00×)" not in page and "against the recipe on" not in measure.readme_block(results)
    # ... unless both measured the same code: a later commit that changed only docs or this script does not count
    results = {"protocol": {**record(recipe, commit="1" * 40), "code": "2" * 40},
               "variants": {**record({"arms": [dyn]}), "code": "2" * 40}}
    assert "| dynamic | `rollout.dynamic_sampling=true` | 50.0% → 65.0% | +15.0 ± 0.0 | —: +15.0 " \
           "| 1,501 (1.00×) | " in measure.results_page(results)
    results["variants"]["code"] = "3" * 40
    assert "ran on another commit." in measure.results_page(results)
    results["variants"]["code"] = "2" * 40
    results["variants"]["versions"] = {"vllm": "0.33.0"}  # the same code on another stack is other trainings
    assert "ran on other versions of the stack." in measure.results_page(results)
    results["variants"] = {**results["protocol"], "figures": {"arms": [dyn]}, "clean": False}
    assert "ran on a tree with uncommitted changes." in measure.results_page(results)
    # the choice as the results page shows it: every candidate per base on validation, the chosen one in bold
    choice = measure.choice_figures(measure.only_dir(tmp_path / "bases", "*-protocol"))
    assert choice["chosen"] == "dynamic" and [c["name"] for c in choice["candidates"]] == ["recipe", "dynamic"]
    assert [c["mean_trained"] for c in choice["candidates"]] == pytest.approx([0.60, 0.65])
    assert [(p["data_seed"], p["trained"]) for p in choice["picked"]] == [(5, pytest.approx(0.55)),
                                                                           (6, pytest.approx(0.75))]
    assert choice["test"]["setting"] == "dynamic" and choice["test"]["gain_mean"] == pytest.approx(15.0)
    page = measure.results_page({"choice": record(choice)})
    assert "| the base model | | 40.0% | 60.0% | | |" in page
    assert "| recipe | `(as the recipe)` | 50.0% | 70.0% | 60.0% |" in page
    assert "| **dynamic** | `rollout.dynamic_sampling=true` | 55.0% | 75.0% | **65.0%** |" in page
    assert "Chosen: **dynamic**." in page and "base 5 40.0% → 55.0%, base 6 60.0% → 75.0%" in page
    assert "over base models 5, 6 (training seed 0, 2026-12-04), mean trained accuracy: the recipe 60.0%; dynamic " \
           "65.0%; chosen: dynamic." in measure.readme_block(
        {"choice": record(choice)})
    # a chosen protocol reports one arm, which a variant's measurement names; two arms cannot take one name
    chosen = measure.variants_figures(measure.only_dir(tmp_path / "bases", "*-protocol"), name="variant")
    assert [(a["name"], a["gain_mean"]) for a in chosen["arms"]] == [("variant", pytest.approx(15.0))]
    with pytest.raises(SystemExit, match="reports 2 settings"):
        measure.variants_figures(run.path, name="variant")


@pytest.mark.parametrize("extra, message", [
    (["data.seed=3"], "sets what --data-seeds varies"),
    (["data.name=gsm8k"], "--data-seeds varies the generated splits"),
])
def test_data_seeds_need_the_tiny_model_on_generated_splits(extra, message):
    from workbench.experiments.protocol import check

    with pytest.raises(WorkbenchError, match=message):
        check("smoke", [Candidate("recipe", [])], 0, [1], extra, data_seeds=[0, 1])
    with pytest.raises(WorkbenchError, match="must be distinct"):
        check("smoke", [Candidate("recipe", [])], 0, [1], [], data_seeds=[1, 1])
