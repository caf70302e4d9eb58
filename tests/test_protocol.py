"""The honest protocol (workbench/evaluation/protocol.py): three disjoint arithmetic splits, trainer.seed apart
from the data's, bad candidates refused before any training, and one real protocol run: candidates trained and scored on the
validation split, the chosen one's model scored on the test split."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import free_port, workbench_command
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.evaluation.protocol import Candidate, Outcome, Protocol, parse_candidate
from workbench.rundir import RunDir
from workbench.tasks import dataset


def _question(row: dict) -> str:
    return row["prompt"][-1]["content"]


def test_validation_rows_are_neither_trained_on_nor_the_test_rows():
    r = recipe.load("cpu-tiny")
    train = {_question(x) for x in dataset.recipe_rows(r)}
    validation = dataset.recipe_rows(r, split="validation")
    test = dataset.eval_rows(r)
    assert len(validation) == r.data.validation_size == 300 and len(test) == 300
    assert not train & {_question(x) for x in validation}
    assert not {_question(x) for x in validation} & {_question(x) for x in test}
    assert all(x["id"].startswith("arith-validation-") for x in validation)
    assert dataset.eval_rows(recipe.load("cpu-tiny", ["eval.split=validation"])) == validation


def test_gsm8k_validation_is_carved_from_the_end_of_train(monkeypatch):
    records = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(10)]
    monkeypatch.setattr(dataset, "_load_hub", lambda name, split, spec: records)
    train = dataset.load_rows("gsm8k", "train", validation_size=3)
    validation = dataset.load_rows("gsm8k", "validation", validation_size=3)
    assert [r["answer"] for r in train] == [str(i) for i in range(7)]
    assert [r["answer"] for r in validation] == ["7", "8", "9"]
    assert validation[0]["id"] == "gsm8k-validation-8"  # numbered as the hub's train rows are
    with pytest.raises(WorkbenchError, match="validation split is empty"):
        dataset.load_rows("gsm8k", "validation", validation_size=0)
    assert len(dataset.load_rows("gsm8k", "train", validation_size=0)) == 10


@pytest.mark.parametrize("overrides, message", [
    (["eval.split=train"], "eval.split is 'train', not an arithmetic evaluation split"),
    (["eval.split=validation", "data.validation_size=0"], "eval.split is validation but data.validation_size is 0"),
    (["data.split=heldout"], "arithmetic trains on its 'train' split only"),
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
    p = Protocol("cpu-tiny", [0, 1, 2], [Candidate("recipe")], chosen="recipe",
                 test=[Outcome("recipe", s, "heldout", "r", 0.5, t) for s, t in ((0, 0.6), (1, 0.65), (2, 0.7))])
    assert p.to_json()["test_gain_mean"] == pytest.approx(0.15)
    assert p.to_json()["test_gain_std"] == pytest.approx(0.05)
    assert "gain +15.0 ± 5.0 points over 3 seed(s)" in p.headline()


@pytest.mark.parametrize("extra, message", [
    (["--candidate", "x: trainer.learning_rat=1e-4"], "candidate 'x': unknown recipe key 'trainer.learning_rat'"),
    (["--candidate", "x: trainer.seed=3"], "sets trainer.seed"),
    (["--seeds", "0,0"], "distinct seeds"),
    (["--seeds", "a"], "--seeds 'a' is not a list"),
])
def test_bad_protocols_fail_before_any_training(extra, message, tmp_path):
    out = subprocess.run(workbench_command() + ["protocol", "--recipe", "smoke", f"monitor.runs_dir={tmp_path}", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "fix:" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # no protocol directory, no training


def test_protocol_chooses_on_validation_and_reports_on_test(tiny_model_dir, tmp_path):
    """Two settings (the recipe and a candidate), smoke-sized trainings, for real: each trained once and scored on
    the validation split, the chosen one's model then scored on the test split. One seed keeps it to three
    trainings' worth of CI time; a further seed is one more training of the same kind (`train` in protocol.run),
    and the statistics over seeds are checked above."""
    port = free_port()
    cmd = workbench_command() + ["protocol", "--recipe", "smoke", "--seeds", "3",
                                 "--candidate", "lr-high: trainer.learning_rate=1e-3",
                                 f"server.port={port}", "eval.num_samples=12", f"monitor.runs_dir={tmp_path}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [protocol_run] = [p for p in tmp_path.iterdir() if p.name.endswith("-protocol")]
    stage = RunDir(protocol_run).protocol
    result = json.loads(stage.json.read_text())

    assert [o["candidate"] for o in result["validation"]] == ["recipe", "lr-high"]
    assert all(o["split"] == "validation" and o["seed"] == 3 for o in result["validation"])
    best = max(result["validation"], key=lambda o: o["trained"])
    assert result["chosen"] == best["candidate"]
    [test] = result["test"]
    assert (test["seed"], test["split"], test["candidate"]) == (3, "heldout", result["chosen"])
    # the test result is the chosen validation run's model, scored again, not a new training
    assert test["run"] == best["run"] and test["train_seconds"] == best["train_seconds"]
    assert result["test_gain_mean"] == pytest.approx(test["trained"] - test["base"])

    # how each training was seeded and what each evaluation scored, read from the runs themselves
    for o in result["validation"]:
        assert recipe.load(str(RunDir(o["run"]).recipe)).trainer.get("seed") == 3
    samples = sorted(stage.runs.rglob("samples.jsonl"))
    assert len(samples) == 3  # two validation runs, one test evaluation
    for path in samples:
        split = "validation" if "-validation" in str(path.relative_to(stage.runs)).split("/")[0] else "heldout"
        ids = {json.loads(line)["id"] for line in path.read_text().splitlines()}
        assert len(ids) == 12 and all(i.startswith(f"arith-{split}-") for i in ids), (path, sorted(ids)[:3])
    table = stage.table.read_text()
    assert "Settings chosen on the validation split" in table and result["headline"] in table
    assert result["headline"] in out.stdout
