"""The recovery's decisions without a server: what counts as a server fault, the restart bound, the hand-over of a
restart between a trainer rank and the process that owns the server, and resume's bookkeeping."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from conftest import free_port
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.records import append_jsonl, read_jsonl, truncate_after
from workbench.rundir import TrainDir
from workbench.training.recovery import Recovery, RestartRequest, ServerLost, serve_restart_requests


class _Client:
    def __init__(self):
        self.device = "cpu"
        self.connects = 0

        class Sync:
            def reconnect(sync, client, device):  # to the restarted server (a new group port where it has one)
                client.connects += 1
        self.weight_sync = Sync()


def _recovery(tmp_path, restarts=2, restart=lambda: 1.0):
    rr = recipe.resolve(recipe.load("smoke", [f"server.max_restarts={restarts}", f"server.port={free_port()}"]))  # nothing listens there
    train_dir = TrainDir(tmp_path / "train").make()
    return Recovery(rr, train_dir, restart, log=lambda *_: None), train_dir


def test_a_dead_server_is_restarted_reconnected_and_repushed_within_the_bound(tmp_path):
    calls = []
    recovery, train_dir = _recovery(tmp_path, restarts=2, restart=lambda: calls.append("restart"))
    recovery.repush = lambda: calls.append("repush")
    recovery.after = lambda reason: calls.append(reason)
    client = _Client()
    for _ in range(2):
        recovery.handle(client, "generation", requests.ConnectionError("refused"))
    assert calls == ["restart", "repush", "after restart"] * 2 and client.connects == 2
    with pytest.raises(ServerLost, match="after 2 restart"):
        recovery.handle(client, "generation", requests.ConnectionError("refused"))
    kinds = [e["kind"] for e in read_jsonl(train_dir.events, normalised=False)]
    assert kinds == ["server_fault", "server_restart"] * 2 + ["server_fault", "server_lost"]


def test_sharded_weights_cannot_be_pushed_by_one_rank(tmp_path):
    recovery, _ = _recovery(tmp_path)
    recovery.repush = None
    with pytest.raises(ServerLost, match="sharded") as lost:
        recovery.handle(_Client(), "generation", requests.Timeout("no answer"))
    assert "workbench train --resume" in str(lost.value)


def test_a_read_timeout_mid_body_is_a_hang_without_asking_health(tmp_path):
    """A server that sends its headers then stops (a SIGSTOPped vLLM mid-answer): requests raises ConnectionError, not
    Timeout, when the body read times out; the recovery names it a timeout and restarts without a health check."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held = []

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")  # then nothing
        held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(requests.RequestException) as raised:
        requests.get(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=0.5).json()
    assert not isinstance(raised.value, requests.Timeout)  # how requests wraps it: the case the recovery must know
    recovery, train_dir = _recovery(tmp_path)
    recovery.repush = lambda: None
    health = []
    import workbench.training.recovery as module
    original, module.server_healthy = module.server_healthy, lambda *a, **k: health.append(1) or False
    try:
        recovery.handle(_Client(), "canary", raised.value)
    finally:
        module.server_healthy = original
        listener.close()
        for conn in held:
            conn.close()
    assert health == [] and recovery.restarts == 1
    fault = read_jsonl(train_dir.events, normalised=False)[0]
    assert fault["kind"] == "server_fault" and "Timeout: " in fault["message"], fault


def test_errors_of_a_live_server_are_not_faults(tmp_path):
    recovery, _ = _recovery(tmp_path)
    recovery.repush = lambda: None
    own = WorkbenchError("the server refused to reset its prefix cache three times")
    with pytest.raises(WorkbenchError, match="refused to reset"):
        recovery.handle(_Client(), "prefix-cache reset", own)
    assert recovery.restarts == 0


def test_a_rank_asks_the_owner_for_a_restart(tmp_path):
    train_dir = TrainDir(tmp_path / "train").make()
    served = []
    stop = threading.Event()

    def owner():  # what `workbench train` does while it waits for its ranks
        while not stop.is_set():
            serve_restart_requests(train_dir, lambda: served.append(1) or 42.0)
            time.sleep(0.05)

    thread = threading.Thread(target=owner)
    thread.start()
    try:
        assert RestartRequest(train_dir, timeout=10)() == 42.0
    finally:
        stop.set()
        thread.join()
    assert served == [1] and not train_dir.restart_request.exists()


def test_two_ranks_asking_at_once_get_one_restart(tmp_path):
    """Two processes see one fault (the concurrent trainings of a protocol on its shared server): the second request
    overwrites the first, and the one restart answers both; neither waits until its timeout."""
    train_dir = TrainDir(tmp_path / "train").make()
    served, answers = [], []
    askers = [threading.Thread(target=lambda: answers.append(RestartRequest(train_dir, timeout=10)()))
              for _ in range(2)]
    for asker in askers:
        asker.start()
    time.sleep(0.3)  # both requests written (the second over the first) before the owner looks
    stop = threading.Event()

    def owner():
        while not stop.is_set():
            serve_restart_requests(train_dir, lambda: served.append(1) or time.sleep(0.2) or 42.0)
            time.sleep(0.05)

    thread = threading.Thread(target=owner)
    thread.start()
    started = time.time()
    try:
        for asker in askers:
            asker.join(timeout=15)
    finally:
        stop.set()
        thread.join()
    assert answers == [42.0, 42.0] and served == [1] and time.time() - started < 5


def test_a_failed_restart_reaches_the_rank(tmp_path):
    train_dir = TrainDir(tmp_path / "train").make()

    def owner():
        while not serve_restart_requests(train_dir, lambda: (_ for _ in ()).throw(OSError("port in use"))):
            time.sleep(0.05)

    thread = threading.Thread(target=owner)
    thread.start()
    with pytest.raises(WorkbenchError, match="port in use"):
        RestartRequest(train_dir, timeout=10)()
    thread.join()


def test_truncate_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 8):
        append_jsonl(path, {"step": step, "loss": 0.1})
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # the killed process's half line
    assert truncate_after(path, 4) == 4
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    assert path.read_text().endswith("\n")


def test_resume_needs_a_complete_checkpoint(tmp_path):
    from workbench.training.train import prepare_resume

    rr = recipe.resolve(recipe.load("smoke"))
    train_dir = TrainDir(tmp_path / "train").make()
    (train_dir.checkpoints / "checkpoint-4").mkdir(parents=True)  # killed while saving: no trainer_state.json
    with pytest.raises(WorkbenchError, match="no complete checkpoint"):
        prepare_resume(rr, train_dir, log=lambda *_: None)
    (train_dir.checkpoints / "checkpoint-2").mkdir()
    (train_dir.checkpoints / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    for step in (1, 2, 3):
        append_jsonl(train_dir.metrics, {"step": step, "loss": 0.0})
    train_dir.request_stop("test")
    assert prepare_resume(rr, train_dir, log=lambda *_: None).name == "checkpoint-2"
    assert [r["step"] for r in read_jsonl(train_dir.metrics)] == [1, 2] and not train_dir.stop_flag.exists()
    (resume,) = read_jsonl(train_dir.events, normalised=False)
    assert resume["kind"] == "resume" and resume["step"] == 2 and resume["reached"] == 3


def test_a_hung_server_is_noticed_after_one_request_timeout():
    """server.request_timeout_s bounds a hung server: a generation the server took and never answers fails after
    that long, not after TRL's five read retries with back-off (about 6 x the timeout + 62 s); then the recovery
    restarts the server (tests/test_faults.py, a SIGSTOPped vLLM). Here an HTTP endpoint that takes the request and
    never answers."""
    import http.server

    from workbench.serving import sync

    class Hung(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # what TRL's client reads when it is built
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"data": [{"id": "tiny-policy"}]}).encode())

        def do_POST(self):
            time.sleep(20)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hung)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = sync.SyncingVLLMClient(base_url=f"http://127.0.0.1:{httpd.server_address[1]}",
                                        weight_sync=sync.NoSync(), request_timeout=1.0)
        started = time.time()
        with pytest.raises(requests.ConnectionError, match="Read timed out"):
            client.generate_once(prompts=[[1, 2, 3]], n=2, max_tokens=4)
        assert time.time() - started < 3
    finally:
        httpd.shutdown()
        httpd.server_close()
