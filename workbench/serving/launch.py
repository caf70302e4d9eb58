"""How a managed vLLM server is launched: its command line, its environment, and the checks made before it starts.

    from workbench import recipe
    from workbench.serving import launch
    rr = recipe.resolve(recipe.load("cpu-tiny"))
    launch.command(rr, model_path)      # vllm serve ... (CPU: python -m workbench.serving.vllm_cpu serve ...)
    launch.environment(rr, for_training=True)   # os.environ + the server role's variables (+ VLLM_API_KEY, dev mode)

`vllm serve` on CUDA and Ascend, the workbench's launcher on the CPU build (see vllm_cpu.py), with the recipe's
served name, lengths, parallel sizes and the server role's devices (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES
/ CPU cores, from the resolved recipe). The API key travels in VLLM_API_KEY, never on the command line.

`VLLM_SERVER_DEV_MODE=1` is set only for a server a trainer uses (`for_training=True`: the training stage's server,
and `workbench serve --for-training`, the server a trainer on another node attaches to). In vLLM 0.32 it turns on,
without any authentication (the API key guards /v1, /v2, /inference and /cohere only):
    /server_info, /reset_prefix_cache (+ mm/encoder caches), /collective_rpc, /sleep, /wake_up, ...  (dev routers)
    /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update, /get_world_size,
    /pause, /resume, /weight_info, ...                                                           (RL router)
(vllm/entrypoints/launchers/api_server/routers.py). TRL reads /server_info and /get_world_size and resets the prefix
cache after each push, the reload sync calls /collective_rpc, nccl/hccl the weight-transfer routes; also with
server.weight_sync=none, TRL still needs /server_info and /reset_prefix_cache. A server that only serves (evaluation,
the serving sweep, plain `workbench serve`) gets none of them. So a server on a network address that a trainer uses
needs server.allow_remote_weight_updates=true and an API key (`check_exposure`), and `server.extra_args` cannot
override what the workbench sets and checks, as vLLM's own parser reads them (`check_extra_args`).
"""
from __future__ import annotations

import functools
import ipaddress
import json
import os
import socket
import subprocess
import sys

from workbench.errors import WorkbenchError
from workbench.platform import compat
from workbench.recipe import Resolved
from workbench.secrets import REDACTED

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
    if s.runner == "pooling":  # a reward model's engine (serving/rewards.py): /pooling, no generation
        cmd += ["--runner", "pooling"]
    if s.max_num_seqs:
        cmd += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if s.enforce_eager:
        cmd += ["--enforce-eager"]
    if platform == "cpu":
        cmd += [CPU_NO_CHUNKED_PREFILL]
    # TRL's importance-sampling correction compares the trainer's logprobs with the server's after temperature.
    if s.runner == "generate":
        cmd += ["--logprobs-mode", "processed_logprobs"]
    if serves_lora(rr):
        # one slot per adapter held at once (a run holds two while it swaps versions); all of them kept loaded
        cmd += ["--enable-lora", "--max-lora-rank", str(rr.recipe.served_lora_rank),
                "--max-loras", str(s.lora_slots), "--max-cpu-loras", str(s.lora_slots)]
    if rr.weight_sync == "nccl":
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    elif rr.weight_sync == "hccl":
        # vllm-ascend maps its HCCL engine onto the "nccl" name; the name is the matrix's (compat.yaml)

        cmd += ["--weight-transfer-config", json.dumps({"backend": compat.hccl_backend_name()})]
    return cmd + list(s.extra_args)


def serves_lora(rr: Resolved) -> bool:
    """The server loads adapters: the recipe trains one and pushes it alone (weight_sync lora)."""
    return rr.recipe.lora and rr.weight_sync == "lora"


def with_tunable(tunables: str, name: str, value: str) -> str:
    """A GLIBC_TUNABLES string (colon-separated name=value) with `name` added, unless it already sets it."""
    present = [t for t in tunables.split(":") if t]
    if any(t.split("=", 1)[0] == name for t in present):
        return ":".join(present)
    return ":".join([*present, f"{name}={value}"])


def environment(rr: Resolved, for_training: bool = False) -> dict[str, str]:
    """Environment for the server process: this one's, plus the server role's variables and the API key; with
    `for_training`, vLLM's development endpoints too (VLLM_SERVER_DEV_MODE=1, see the module docstring)."""
    env = dict(os.environ)
    # Importing TRL sets VLLM_LOGGING_LEVEL=ERROR in this process unless it is set (trl/_compat.py, to quiet its own
    # vLLM): inherited, the server would log no INFO or WARNING line at all (start-up, engine, memory warnings).
    # A level set in server.env still applies.
    if env.get("VLLM_LOGGING_LEVEL") == "ERROR" and "trl" in sys.modules:
        del env["VLLM_LOGGING_LEVEL"]
    # A run's copied recipe.yaml has secret-looking values redacted (workbench/secrets.py): the placeholder must not
    # become the server's value; the variable inherited from this process (if any) applies instead.
    # vLLM's API server closes a connection idle 5 s by default; a request the trainer sends on one as it closes is
    # reset (the client sends those again, serving/sync.py, but each costs a round trip and a warning). The recipe's
    # knob, not a value inherited from the shell; a variable in server.env still wins.
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(rr.recipe.server.keep_alive_s)
    env.update({name: value for name, value in rr.server.env.items() if value != REDACTED})
    if rr.platform == "cpu":
        # vLLM's CPU platform runs the model in a third process (its "mp" executor: API server -> engine core ->
        # worker) unless V1 multiprocessing is off; then the worker runs inside the engine-core process (the API
        # server still reaches it through its queues: AsyncLLM always does). One interpreter, torch and vLLM
        # import fewer: a start took 33-37 s instead of 43-48 s on a 2-core AMD EPYC, decoding as fast (3395-3830
        # vs 2982-3647 tokens/s, 64 prompts x 48 tokens). A recipe's server.env still decides.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # The recipe fixes glibc's mmap threshold for CPU servers (recipe/resolve.py: what a reload frees goes back
        # to the OS), but then every reload faults in and zeroes fresh 4 KiB pages for the whole model: 65% of the
        # engine's reload time in the kernel (perf), 0.77 s for the 100m bench model against 0.29 s with glibc's
        # default. glibc.malloc.hugetlb=1 (glibc >= 2.35; older ones ignore it) puts those mappings on transparent
        # huge pages (THP "madvise" mode, the usual default): 0.42 s. Added to the tunables the server is launched
        # with (a user's own kept; their hugetlb setting wins).
        env["GLIBC_TUNABLES"] = with_tunable(env.get("GLIBC_TUNABLES", ""), "glibc.malloc.hugetlb", "1")
    if for_training:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if serves_lora(rr):  # /v1/load_lora_adapter and /v1/unload_lora_adapter (under /v1: the key guards them)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    else:
        # unauthenticated weight-update endpoints only where a trainer needs them, never inherited by accident
        env.pop("VLLM_SERVER_DEV_MODE", None)
        env.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if rr.api_key:
        env["VLLM_API_KEY"] = rr.api_key
    return env


# ----------------------------------------------------------------------------------------------------------------
# Checks before launch

def listening_pid(port: int) -> int | None:
    """The process listening on `port` on this machine, when it can be seen (same user, or root)."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return conn.pid
    except Exception:  # permissions or a process that just ended
        pass
    return None


def _who_listens(port: int) -> str:
    pid = listening_pid(port)
    if pid is None:
        return ""
    try:
        import psutil

        return f" by pid {pid} ({' '.join(psutil.Process(pid).cmdline()[:4])[:120]})"
    except Exception:  # a process that just ended: the pid alone still helps
        return f" by pid {pid}"


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the server binds (uvicorn sets SO_REUSEADDR): a previous server's TIME_WAIT sockets must not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise WorkbenchError(f"port {port} on {host} is already in use{_who_listens(port)}",
                                 "stop that process, or choose another port with server.port=<free port>") from None


# Flags the workbench sets itself, and what to set instead: the health check, the clients, the exposure check and
# the weight sync all read these from the recipe, so a second value in extra_args would silently disagree with them.
RESERVED_FLAGS = {
    "--host": "server.host",
    "--port": "server.port",
    "--uds": "server.host / server.port",
    "--api-key": "server.api_key_env (the name of a variable holding the key)",
    "--served-model-name": "server.served_model_name",
    "--max-model-len": "server.max_model_len",
    "--weight-transfer-config": "server.weight_sync",
    "--enable-lora": "a peft: section (the server then loads the run's adapters)",
    "--max-lora-rank": "server.max_lora_rank",
    "--max-loras": "server.lora_slots",
    "--max-cpu-loras": "server.lora_slots",
    "--runner": "a rewards: entry of kind model (the policy server generates; a reward model gets its own engine)",
}


# vLLM 0.32's CPU build kills its engine core when a seeded request's prefill is split over engine steps: after a
# partial prefill it rewinds the request's generator, which a CPU generator cannot do ("CPU Generator does not use
# offset", gpu_model_runner._bookkeeping_sync). A trainer's requests are all seeded (training/seeding.py), and enough
# of them in flight split a prefill: dynamic sampling's refills beside async ask-ahead did (104 requests, 2048
# tokens in one step). Without chunked prefill a prompt waits for a step with room for all of it.
CPU_NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"


def _flag_name(arg: str) -> str:
    """`--api_key=x`, `--weight-transfer-config.backend` -> the option vLLM's parser sees (`--api-key`, ...)."""
    option = arg.split("=", 1)[0][2:].split(".", 1)[0]  # vLLM: dotted JSON sub-keys, underscores read as dashes
    return "--" + option.replace("_", "-")


def check_extra_args(rr: Resolved) -> None:
    """server.extra_args may add vLLM flags, never replace the address, the key, the names and lengths the
    workbench checks, the weight-transfer engine it sets from server.weight_sync, or a CPU server's chunked prefill
    (off: CPU_NO_CHUNKED_PREFILL). The flag names first (no process), then the values as vLLM's own parser reads
    them (check_extra_args_parsed)."""
    s = rr.recipe.server
    if rr.platform == "cpu" and s.max_num_batched_tokens and s.max_num_batched_tokens < s.max_model_len:
        raise WorkbenchError(f"server.max_num_batched_tokens={s.max_num_batched_tokens} is below server.max_model_len="
                             f"{s.max_model_len}: a CPU server runs without chunked prefill, so one engine step must "
                             "hold a whole prompt", f"set server.max_num_batched_tokens to at least {s.max_model_len}")
    for arg in rr.recipe.server.extra_args:
        arg = str(arg)
        if not arg.startswith("--") or len(arg) <= 2:
            continue
        name = _flag_name(arg)
        if rr.platform == "cpu" and name in ("--enable-chunked-prefill", CPU_NO_CHUNKED_PREFILL):
            raise WorkbenchError(f"server.extra_args contains {arg!r}: the workbench runs CPU servers without chunked "
                                 "prefill (vLLM's CPU build stops its engine when a seeded request's prefill is split)",
                                 "remove it from server.extra_args")
        for flag, knob in RESERVED_FLAGS.items():
            # argparse also takes an unambiguous prefix (`--hos` for `--host`)
            if name == flag or (len(name) >= 5 and flag.startswith(name)):
                raise WorkbenchError(f"server.extra_args contains {arg!r}, which would override {flag} that the "
                                     "workbench sets (and its checks and clients rely on)",
                                     f"remove it from server.extra_args and set {knob} instead")
    check_extra_args_parsed(rr)


# What the workbench sets or checks, by the name vLLM's parser stores it under, and the knob to use instead: a value of
# these that server.extra_args changes, as vLLM reads them, would disagree with the recipe the checks read.
PARSED_KNOBS = {
    "host": "server.host", "port": "server.port", "uds": "server.host / server.port",
    "api_key": "server.api_key_env (the name of a variable holding the key)",
    "model_tag": "model.path", "model": "model.path", "served_model_name": "server.served_model_name",
    "max_model_len": "server.max_model_len", "dtype": "server.dtype",
    "tensor_parallel_size": "server.tensor_parallel_size", "data_parallel_size": "server.data_parallel_size",
    "gpu_memory_utilization": "server.gpu_memory_utilization", "max_num_seqs": "server.max_num_seqs",
    "max_num_batched_tokens": "server.max_num_batched_tokens", "enforce_eager": "server.enforce_eager",
    "weight_transfer_config": "server.weight_sync",
    "enable_lora": "a peft: section (the server then loads the run's adapters)",
    "max_lora_rank": "server.max_lora_rank", "max_loras": "server.lora_slots", "max_cpu_loras": "server.lora_slots",
    "logprobs_mode": "nothing: TRL's importance-sampling correction compares the trainer's log-probs with the "
                     "server's processed ones (--logprobs-mode processed_logprobs)",
}
# A CPU server runs without chunked prefill (CPU_NO_CHUNKED_PREFILL): nothing may split a prompt's prefill again.
CPU_PARSED_KNOBS = {
    "enable_chunked_prefill": "nothing: a CPU server runs without chunked prefill",
    "long_prefill_token_threshold": "nothing: it splits a long prompt's prefill, which a CPU server cannot do",
    "max_num_partial_prefills": "nothing: partial prefills split a prompt, which a CPU server cannot do",
}


@functools.lru_cache(maxsize=32)
def _vllm_reads(argvs: tuple[tuple[str, ...], ...]) -> dict:
    from workbench.serving import vllm_args

    return vllm_args.parse([list(a) for a in argvs])


def check_extra_args_parsed(rr: Resolved) -> None:
    """server.extra_args as vLLM's own `vllm serve` parser reads them (serving/vllm_args: prefixes, underscores,
    `=`, a --config YAML): refused when vLLM would not take them, or when they change a value the workbench sets
    or checks (PARSED_KNOBS), with the knob to use instead. A process of its own (about 10 s), once per
    command line and process; nothing to do without extra_args."""
    extra = tuple(str(a) for a in rr.recipe.server.extra_args)
    if not extra:
        return
    full = command(rr, rr.model_path)
    own = full[full.index("serve") + 1:len(full) - len(extra)]
    try:
        answer = _vllm_reads((tuple(own), tuple(own) + extra))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise WorkbenchError(f"server.extra_args {list(extra)} could not be read with vLLM's parser ({exc})",
                             "check that vLLM imports here (workbench env), or remove server.extra_args") from None
    if "error" in answer:
        raise WorkbenchError(f"vLLM's parser refuses server.extra_args {list(extra)}: {answer['error']}",
                             "fix or remove the flag (`vllm serve --help` lists what this vLLM takes)")
    before, after = answer["parsed"]
    knobs = dict(PARSED_KNOBS)
    if rr.platform == "cpu":
        knobs.pop("gpu_memory_utilization")  # not read by the CPU build (its KV cache is server.kv_cache_space_gib)
        knobs.update(CPU_PARSED_KNOBS)
    for key, knob in knobs.items():
        if key in after and before.get(key) != after[key]:
            what = "the model" if key in ("model", "model_tag") else "--" + key.replace("_", "-")
            fix = (f"remove it from server.extra_args and set {knob} instead" if not knob.startswith("nothing")
                   else f"remove it from server.extra_args ({knob.removeprefix('nothing: ')})")
            own_value = ("which the recipe leaves to vLLM's default" if before.get(key) is None
                         else f"where the recipe's command sets {before.get(key)!r}")
            raise WorkbenchError(f"server.extra_args {list(extra)} set {what} to {after[key]!r} as vLLM reads them, "
                                 f"{own_value}", fix)


def check_exposure(rr: Resolved, for_training: bool = False) -> None:
    """A server on a network address needs an API key; one a trainer uses (its weight-update endpoints, which no
    key guards, are on) also needs server.allow_remote_weight_updates=true."""
    s = rr.recipe.server
    host = s.host
    if is_loopback(host):
        return
    if for_training and not s.allow_remote_weight_updates:
        raise WorkbenchError(
            f"server.host={host} exposes the training server's weight-update endpoints (/collective_rpc, "
            "/update_weights, /init_weight_transfer_engine; no API key guards them) beyond this machine",
            "keep server.host=127.0.0.1, or set server.allow_remote_weight_updates=true and server.api_key_env, "
            "and firewall the port to the trainer hosts")
    if not rr.api_key:
        what = "with weight-update endpoints enabled and " if for_training else "with "
        raise WorkbenchError(
            f"server.host={host} exposes the server beyond this machine, {what}no API key",
            "keep server.host=127.0.0.1, or set server.api_key_env to the name of an environment variable that "
            "holds a key" + (" (and firewall the port: vLLM's key guards /v1 routes only)" if for_training else ""))
    if for_training:
        print(f"warning: server.host={host}: vLLM's API key guards /v1 routes only; its weight-update endpoints stay "
              "reachable from the network, so firewall the port to the trainer hosts", file=sys.stderr)


def check_cpu_cores(rr: Resolved) -> None:
    available = os.sched_getaffinity(0)
    wanted = set(rr.server.devices) | set(rr.trainer.devices)
    missing = sorted(wanted - available)
    if missing:
        raise WorkbenchError(f"devices lists CPU cores {missing}, but this process may use only {sorted(available)}",
                             "set devices.server and devices.trainer to cores that exist, e.g. [0] and [1]")
