"""A pooled connection that the server drops while it is idle (vLLM closes a keep-alive connection idle past
VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default): the trainer's client sends the request again when nothing of an
answer came back and the call is safe to repeat, counts it, and the training goes on. A real TCP proxy in front of a
real server resets any connection that sends a request after more than `idle_s` of silence, which is what a request
meets on a connection the server closed at that moment, but every time instead of by chance."""
from __future__ import annotations

import http.server
import json
import selectors
import socket
import struct
import subprocess
import threading
import time

import pytest
import requests

from conftest import KEYED, restore_base_weights, workbench_command
from workbench.rundir import RunDir


class ResettingProxy:
    """127.0.0.1:port -> the upstream port: bytes pass as they are, except that a client connection silent for more
    than `idle_s` that then sends gets a TCP reset (SO_LINGER 0) instead of an answer, its bytes not forwarded."""

    def __init__(self, upstream_port: int, idle_s: float):
        self.upstream_port, self.idle_s = upstream_port, idle_s
        self.resets = 0
        self.forwarded = 0  # client connections that passed bytes upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="resetting-proxy")]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener closed: stop
                return
            thread = threading.Thread(target=self._pipe, args=(client,), daemon=True, name="resetting-proxy-pipe")
            self._threads.append(thread)
            thread.start()

    def _pipe(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        with self._lock:
            self._open.update((client, upstream))
        last, used = time.monotonic(), False
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        try:
            while not self._stopped.is_set():
                for key, _ in sel.select(timeout=0.2):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    if key.fileobj is client and used and time.monotonic() - last > self.idle_s:
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        with self._lock:
                            self.resets += 1
                        return
                    if key.fileobj is client and not used:
                        used = True
                        with self._lock:
                            self.forwarded += 1
                    key.data.sendall(data)
                    last = time.monotonic()
        except OSError:
            return
        finally:
            sel.close()
            with self._lock:
                self._open.difference_update((client, upstream))
            client.close()
            upstream.close()

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            for s in list(self._open):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5)


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server: the client's pool reuses the connection
    calls: dict[str, int] = {}

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        _Echo.calls[self.path] = _Echo.calls.get(self.path, 0) + 1
        body = json.dumps({"data": [{"id": "tiny-policy"}], "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_behind_proxy():
    _Echo.calls = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    proxy = ResettingProxy(httpd.server_address[1], idle_s=0.3)
    try:
        yield proxy
    finally:
        proxy.close()
        httpd.shutdown()
        httpd.server_close()


def _client(url: str):
    from workbench.serving import sync

    return sync.SyncingVLLMClient(base_url=url, weight_sync=sync.NoSync(), request_timeout=10.0)


def test_a_generation_on_a_dropped_connection_is_sent_again_and_counted(echo_behind_proxy):
    from workbench.serving import sync

    proxy = echo_behind_proxy
    client = _client(f"http://127.0.0.1:{proxy.port}")
    client._get(f"{client.base_url}/v1/models")  # a connection in the pool
    before = sync.resent_requests()
    time.sleep(0.6)  # the pooled connection is now idle past the proxy's limit
    assert client._post(f"{client.base_url}/v1/completions", json={"prompt": [1, 2]})["path"] == "/v1/completions"
    assert proxy.resets == 1, "the proxy did not reset the idle connection: the test shows nothing"
    assert sync.resent_requests() == before + 1
    assert _Echo.calls["/v1/completions"] == 1  # the reset request never reached the server; its resend did


def test_without_the_resend_the_same_reset_fails(echo_behind_proxy):
    """The policy the client had before: the same reset ends the call (what a training met as its end)."""
    from requests.adapters import HTTPAdapter

    from workbench.serving import sync

    proxy = echo_behind_proxy
    client = _client(f"http://127.0.0.1:{proxy.port}")
    client.session.mount("http://", HTTPAdapter(max_retries=sync.resend_dropped_retry(resend=False)))
    client._get(f"{client.base_url}/v1/models")
    time.sleep(0.6)
    with pytest.raises(requests.ConnectionError, match="Connection aborted|reset"):
        client._post(f"{client.base_url}/v1/completions", json={"prompt": [1, 2]})
    assert proxy.resets == 1


def test_a_weight_transfer_call_on_a_dropped_connection_is_not_sent_again(echo_behind_proxy):
    """/update_weights waits for an NCCL broadcast that would not be sent a second time: not repeated, not counted;
    the error reaches the recovery, which asks /health and restarts or re-raises."""
    from workbench.serving import sync

    proxy = echo_behind_proxy
    client = _client(f"http://127.0.0.1:{proxy.port}")
    client._get(f"{client.base_url}/v1/models")
    before = sync.resent_requests()
    time.sleep(0.6)
    with pytest.raises(requests.ConnectionError):
        client._post(f"{client.base_url}/update_weights", json={"update_info": {}})
    assert proxy.resets == 1 and sync.resent_requests() == before
    assert "/update_weights" not in _Echo.calls


def test_a_timed_out_read_is_not_a_dropped_connection():
    """A timeout may be a server still working on the request: not re-sent (the recovery's hang path)."""
    from urllib3.exceptions import ProtocolError, ReadTimeoutError

    from workbench.serving import sync

    assert sync.dropped_unanswered(ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")))
    assert sync.dropped_unanswered(ProtocolError("Connection aborted.", BrokenPipeError(32, "pipe")))
    assert not sync.dropped_unanswered(ProtocolError("Connection aborted.", TimeoutError("timed out")))
    assert not sync.dropped_unanswered(ReadTimeoutError(None, "/v1/completions", "Read timed out."))


SLOW_REWARD = """
import time

def pause(prompts, completions, seconds=1.0, **kwargs):
    time.sleep(seconds)  # a scorer slower than the proxy's idle limit: the pooled connection goes idle past it
    return [0.0 for _ in completions]
"""


@pytest.mark.timeout(400)  # a smoke training beside the other worker's tests: about 40 s alone, 2-3x that beside
def test_a_training_whose_connections_are_dropped_between_steps_finishes(tiny_server, server_rr, tiny_model_dir,
                                                                        tmp_path):
    """`workbench train --recipe smoke` attached to the session's server through the resetting proxy, with a reward
    that takes a second: every step's first call after scoring meets a reset connection. The training ends
    normally, and its log and train.json say how many requests it sent again."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "slow_rewards.py").write_text(SLOW_REWARD)
    proxy = ResettingProxy(int(tiny_server.url.rsplit(":", 1)[1]), idle_s=0.5)
    runs = project / "runs"
    cmd = workbench_command() + ["train", "--recipe", "smoke", "server.mode=attach",
                                 f"server.url=http://127.0.0.1:{proxy.port}", f"monitor.runs_dir={runs}", *KEYED,
                                 "rewards.slow={function: slow_rewards:pause, weight: 0.01, args: {seconds: 1.0}}",
                                 ]
    try:
        out = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=360)
    finally:
        proxy.close()
        restore_base_weights(tiny_server, server_rr, tiny_model_dir)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert proxy.resets >= 2, f"the proxy reset {proxy.resets} connection(s): the training met no dropped connection"
    (path,) = runs.glob("*-smoke-train")
    summary = json.loads(RunDir.open(path).train.summary.read_text())
    assert summary["steps"] == 3
    # every reset was a request of the trainer's session (the other clients open a connection per request)
    assert summary["resent_requests"] == proxy.resets
    assert f"{proxy.resets} request(s) sent again after the server dropped their connection" in text


def test_a_started_server_keeps_an_idle_connection_past_vllms_own_five_seconds(tiny_server):
    """The session's server was started by the workbench (server.keep_alive_s, 600 s by default): a keep-alive
    connection left idle 6 s still answers. Under vLLM's own default (5 s) the second request finds it closed."""
    host, port = tiny_server.url.removeprefix("http://").rsplit(":", 1)
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        for attempt in range(2):
            conn.sendall(request)
            answer = conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200"), f"request {attempt + 1}: {answer[:80]!r}"
            if attempt == 0:
                time.sleep(6)
