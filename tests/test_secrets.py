"""Secrets are redacted by name and by value (issue 14, nothing lost, nothing leaked): the copied recipe.yaml,
environment.json, env.json and the HTML report hold no secret value, wherever it appeared. No server, no kernel.
"""
from __future__ import annotations

import json

import pytest

from workbench import recipe
from workbench.rundir import RunDir, recipe_text
from workbench.secrets import REDACTED, redact, scrub, secret_values

HF = "hf_zzzzzzzzzzzzzz"
RECIPE_SECRET = "supersecretvalue123"


@pytest.fixture
def hf_token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    return HF


def test_secret_values_by_name_long_enough(monkeypatch, hf_token):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # a switch, not a secret
    monkeypatch.setenv("WB_API_KEY", "1")
    values = secret_values({"MY_API_TOKEN": RECIPE_SECRET, "PLAIN": "notasecretatall", "SHORT_KEY": "true"})
    assert {HF, RECIPE_SECRET} <= values
    assert not {"false", "1", "true", "notasecretatall"} & values
    monkeypatch.setenv("WB_SERVER_PASS", "keyed-by-recipe-999")  # a name without a secret word, given by name
    assert "keyed-by-recipe-999" in secret_values(names=["WB_SERVER_PASS"])
    assert "keyed-by-recipe-999" not in secret_values()


def test_scrub_replaces_every_occurrence(hf_token):
    text = f"token {HF} and again {HF}: Authorization: Bearer {HF}\n"
    assert scrub(text) == f"token {REDACTED} and again {REDACTED}: Authorization: Bearer {REDACTED}\n"
    assert scrub("nothing here") == "nothing here"
    assert scrub("abc secret123 xyz", values=["secret123"]) == f"abc {REDACTED} xyz"


def test_redact_by_name_and_by_value(hf_token):
    out = redact({"HF_TOKEN": HF, "NOTE": f"uses {HF}", "HCCL_CONNECT_TIMEOUT": "1800", "FLAG": "1"})
    assert out == {"HF_TOKEN": REDACTED, "NOTE": REDACTED, "HCCL_CONNECT_TIMEOUT": "1800", "FLAG": "1"}


def _secret_recipe(tmp_path):
    return recipe.load("cpu-tiny", [f"server.env.MY_API_TOKEN={RECIPE_SECRET}", "server.env.VLLM_LOGGING_LEVEL=INFO",
                                    f"devices.env.NOTE=uses {HF}", f"monitor.runs_dir={tmp_path}"])


def test_copied_recipe_holds_no_secret(tmp_path, hf_token):
    r = _secret_recipe(tmp_path)
    run = RunDir.create(r, "run")
    text = run.recipe.read_text()
    assert RECIPE_SECRET not in text and HF not in text
    # still a recipe every stage can load: the names stay, only the values are gone
    copy = recipe.load(str(run.recipe))
    assert copy.server.env == {"MY_API_TOKEN": REDACTED, "VLLM_LOGGING_LEVEL": "INFO"}
    assert copy.devices.env == {"NOTE": REDACTED}
    assert copy.monitor.runs_dir == str(tmp_path) and copy.server.port == r.server.port
    # RunDir.at writes the same copy
    at = RunDir.at(tmp_path / "at", r)
    assert at.recipe.read_text() == text


def test_recipe_without_secrets_is_copied_exactly(tmp_path, hf_token):
    r = recipe.load("cpu-tiny", [f"monitor.runs_dir={tmp_path}", "server.env.VLLM_LOGGING_LEVEL=INFO"])
    assert recipe_text(r) == r.to_yaml()


def test_report_and_environment_files_hold_no_secret(tmp_path, monkeypatch, hf_token):
    from workbench.envcheck import Report
    from workbench.observe import report
    from workbench.pipeline import environment_summary
    from workbench.rundir import write_atomic

    monkeypatch.setenv("WORKBENCH_NOTE", f"copied {HF}")  # recorded prefix, harmless name, secret value
    run = RunDir.create(_secret_recipe(tmp_path), "run")
    summary = environment_summary()
    assert summary["variables"]["HF_TOKEN"] == REDACTED and summary["variables"]["WORKBENCH_NOTE"] == REDACTED
    write_atomic(run.environment, json.dumps(summary))
    checks = Report()
    checks.add("env", "token check", "WARN", f"HF_TOKEN={HF} <&>", "")
    checks.save(run)
    write_atomic(run.record, json.dumps({"recipe": "cpu-tiny", "stages": ["env"], "failed_stage": "env",
                                         "error": f"HTTPError: 401 for token {HF}",
                                         "results": {"env": {"status": "failed"}}}))
    page = report.build(run).read_text()
    assert "stage &#x27;env&#x27; failed" in page or "stage 'env' failed" in page
    assert "HTTPError: 401 for token " + REDACTED in page  # the rest of the message stays readable
    for path in (run.recipe, run.environment, run.env_check, run.report):  # what the workbench wrote
        assert HF not in path.read_text() and RECIPE_SECRET not in path.read_text(), path


def test_the_servers_key_reaches_no_file_of_a_keyed_training(smoke_run):
    """The smoke run trained against the session's keyed server (server.api_key_env): the key's name is in its
    recipe, its value in none of the run's files (logs, metrics, events, report inputs, the server log)."""
    import os

    from conftest import SERVER_KEY_ENV

    run, _ = smoke_run
    key = os.environ[SERVER_KEY_ENV].encode()
    assert f"api_key_env: {SERVER_KEY_ENV}" in run.recipe.read_text()
    leaked = [p for p in run.path.rglob("*") if p.is_file() and p.stat().st_size < 50_000_000 and key in p.read_bytes()]
    assert not leaked, leaked


def test_a_secret_in_devices_env_is_not_written_to_ranks_json(hf_token, monkeypatch):
    """devices.env reaches the trainer processes (a token a reward needs, say); what each rank records of it is
    redacted by name and by value."""
    import types

    import torch

    from workbench.training.train import _rank_record

    rr = recipe.resolve(recipe.load("cpu-tiny", [f"devices.env.NOTE=uses {HF}", "devices.env.FLAG=1"]))
    monkeypatch.setenv("NOTE", f"uses {HF}")
    monkeypatch.setenv("FLAG", "1")
    accelerator = types.SimpleNamespace(process_index=0, local_process_index=0, device=torch.device("cpu"))
    record = _rank_record(rr, accelerator)
    assert record["env"] == {"NOTE": REDACTED, "FLAG": "1"} and HF not in json.dumps(record)
