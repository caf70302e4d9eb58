"""A server shared by the stages of `workbench run`: a stage's VLLMServer with the same command line adopts it (no
second process), its stop() leaves it running, its restart() is carried out by the owner on request, and a server
with another command line (another model) is not adopted. The owner is the session's server (conftest's
tiny_server): the tests leave it serving."""
from __future__ import annotations

import json
import threading

import pytest
import requests


@pytest.fixture(scope="module")
def shared_rr(server_rr):
    """The session server's recipe: a stage's server with it has the shared server's command line."""
    return server_rr


@pytest.fixture(scope="module")
def shared_owner(tiny_server, tmp_path_factory):
    """The session's server, shared the way `workbench run` shares its own (named in the environment, restart
    requests answered by its owner); its requests directory. A restart leaves it serving the base model afresh."""
    from workbench.serving.server import SHARED_ENV

    home = tmp_path_factory.mktemp("owner")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SHARED_ENV, json.dumps(tiny_server.share(home)))
        yield tiny_server, home


def test_adopted_server_is_the_owners_and_restarts_through_it(shared_owner, shared_rr, tiny_model_dir, tmp_path):
    from workbench.serving.server import VLLMServer, serve_shared_requests

    owner, home = shared_owner
    stage = VLLMServer(shared_rr, str(tiny_model_dir), tmp_path / "stage", for_training=True, quiet=True).start()
    assert stage.adopted is not None and stage.process is None and stage.pid == owner.pid
    assert stage.model_entry["id"] == shared_rr.recipe.server.served_model_name

    done = threading.Event()

    def answer():  # what the pipeline does while a stage runs
        while not done.wait(0.2):
            serve_shared_requests(owner, home)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        before, restarts = owner.pid, owner.restarts
        seconds = stage.restart()
    finally:
        done.set()
        thread.join(timeout=5)
    assert seconds and seconds > 0 and owner.restarts == restarts + 1
    assert stage.pid == owner.pid != before  # the adopter follows the new process
    assert requests.get(f"{owner.url}/health", timeout=5).status_code == 200

    stage.stop()  # the stage is done with it: the owner's server keeps serving
    assert requests.get(f"{owner.url}/health", timeout=5).status_code == 200


def test_another_command_line_is_not_adopted(shared_owner, shared_rr, tmp_path):
    from workbench.errors import WorkbenchError
    from workbench.serving.server import VLLMServer

    owner, _ = shared_owner
    other = VLLMServer(shared_rr, str(tmp_path / "another-model"), tmp_path / "x", for_training=True, quiet=True)
    with pytest.raises(WorkbenchError, match="already in use"):  # it would launch its own, and the port is taken
        other.start()
    assert other.adopted is None
