"""How a managed vLLM server is launched: its command line, its environment, and the checks made before it starts.

    from workbench import recipe
    from workbench.serving import launch
    rr = recipe.resolve(recipe.load("cpu-tiny"))
    launch.command(rr, model_path)      # vllm serve ... (CPU: python -m workbench.serving.vllm_cpu serve ...)
    launch.environment(rr)              # os.environ + the server role's variables (+ VLLM_API_KEY)

`vllm serve` on CUDA and Ascend, the workbench's launcher on the CPU build (see vllm_cpu.py), with the recipe's
served name, lengths, parallel sizes and the server role's devices (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES
/ CPU cores, from the resolved recipe). `VLLM_SERVER_DEV_MODE=1` is always set: TRL reads /server_info, and the
reload weight sync uses /collective_rpc. The API key travels in VLLM_API_KEY, never on the command line.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def command(rr: Resolved, model_path: str) -> list[str]:
    """The server's command line; the API key never appears in it (it travels in VLLM_API_KEY)."""
    platform, s = rr.platform, rr.recipe.server
    if platform == "cpu":
        cmd = [sys.executable, "-m", "workbench.serving.vllm_cpu", "serve", model_path]
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
    if rr.weight_sync == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    elif rr.weight_sync == "hccl":
        # vllm-ascend maps its HCCL engine onto the "nccl" name; the name is the matrix's (compat.yaml)
        from workbench.platform import compat

        cmd += ["--weight-transfer-config", json.dumps({"backend": compat.hccl_backend_name()})]
    return cmd + list(s.extra_args)


def environment(rr: Resolved) -> dict[str, str]:
    """Environment for the server process: this one's, plus the server role's variables and the API key."""
    env = dict(os.environ)
    # Importing TRL sets VLLM_LOGGING_LEVEL=ERROR in this process unless it is set (trl/_compat.py, to quiet its own
    # vLLM): inherited, the server would log no INFO or WARNING line at all (start-up, engine, memory warnings).
    # A level set in server.env still applies.
    if env.get("VLLM_LOGGING_LEVEL") == "ERROR" and "trl" in sys.modules:
        del env["VLLM_LOGGING_LEVEL"]
    env.update(rr.server.env)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if rr.api_key:
        env["VLLM_API_KEY"] = rr.api_key
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


def check_exposure(rr: Resolved) -> None:
    """Weight-update endpoints on a network address need at least an API key."""
    host = rr.recipe.server.host
    if is_loopback(host):
        return
    if not rr.api_key:
        raise WorkbenchError(
            f"server.host={host} exposes the server beyond this machine, with weight-update endpoints "
            "(/collective_rpc, /update_weights) enabled and no API key",
            "keep server.host=127.0.0.1, or set server.api_key_env to the name of an environment variable that "
            "holds a key (and firewall the port: vLLM's key guards /v1 routes only)")
    print(f"warning: server.host={host}: vLLM's API key guards /v1 routes only; its weight-update endpoints stay "
          "reachable from the network, so firewall the port to the trainer hosts", file=sys.stderr)


def check_cpu_cores(rr: Resolved) -> None:
    available = os.sched_getaffinity(0)
    wanted = set(rr.server.devices) | set(rr.trainer.devices)
    missing = sorted(wanted - available)
    if missing:
        raise WorkbenchError(f"devices lists CPU cores {missing}, but this process may use only {sorted(available)}",
                             "set devices.server and devices.trainer to cores that exist, e.g. [0] and [1]")
