"""A server shared by the stages of `workbench run`: a stage's VLLMServer with the same command line adopts it (no
second process), its stop() leaves it running, its restart() is carried out by the owner on request, and a server
with another command line (another model) is not adopted."""
from __future__ import annotations

import json
import threading

import pytest
import requests


from conftest import free_port


@pytest.fixture
def shared_rr(tmp_path):
    """cpu-tiny on a port of its own (the session's tiny_server may hold the other)."""
    from workbench import recipe

    return recipe.resolve(recipe.load("cpu-tiny", [f"server.port={free_port()}", f"monitor.runs_dir={tmp_path}"]))


@pytest.fixture
def owner(shared_rr, tiny_model_dir, tmp_path, monkeypatch):
    from workbench.serving.server import SHARED_ENV, VLLMServer

    srv = VLLMServer(shared_rr, str(tiny_model_dir), tmp_path, for_training=True, quiet=True).start()
    monkeypatch.setenv(SHARED_ENV, json.dumps(srv.share(tmp_path)))
    yield srv
    srv.stop()


def test_adopted_server_is_the_owners_and_restarts_through_it(owner, shared_rr, tiny_model_dir, tmp_path):
    from workbench.serving.server import VLLMServer, serve_shared_requests

    stage = VLLMServer(shared_rr, str(tiny_model_dir), tmp_path / "stage", for_training=True, quiet=True).start()
    assert stage.adopted is not None and stage.process is None and stage.pid == owner.pid
    assert stage.model_entry["id"] == shared_rr.recipe.server.served_model_name

    done = threading.Event()

    def answer():  # what the pipeline does while a stage runs
        while not done.wait(0.2):
            serve_shared_requests(owner, tmp_path)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        before = owner.pid
        seconds = stage.restart()
    finally:
        done.set()
        thread.join(timeout=5)
    assert seconds and seconds > 0 and owner.restarts == 1
    assert stage.pid == owner.pid != before  # the adopter follows the new process
    assert requests.get(f"{owner.url}/health", timeout=5).status_code == 200

    stage.stop()  # the stage is done with it: the owner's server keeps serving
    assert requests.get(f"{owner.url}/health", timeout=5).status_code == 200


def test_another_command_line_is_not_adopted(owner, shared_rr, tmp_path):
    from workbench.errors import WorkbenchError
    from workbench.serving.server import VLLMServer

    other = VLLMServer(shared_rr, str(tmp_path / "another-model"), tmp_path / "x", for_training=True, quiet=True)
    with pytest.raises(WorkbenchError, match="already in use"):  # it would launch its own, and the port is taken
        other.start()
    assert other.adopted is None
