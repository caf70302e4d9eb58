"""The managed vLLM server, for real: start, verify, answer, stop without orphans; and every bad input."""
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import SERVER_KEY_ENV, free_port
from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.platform import compat
from workbench.serving import launch
from workbench.serving.server import VLLMServer, group_members


def test_server_answers_chat_and_serves_the_recipe_name(tiny_server, server_recipe, server_rr):
    body = tiny_server.chat("What is 12 + 34?", max_tokens=40)
    assert body["model"] == "tiny-policy"
    text = body["choices"][0]["message"]["content"]
    assert "<answer>" in text  # the tiny model answers in the task's format
    # the session's server takes a key (server.api_key_env): without it the OpenAI routes answer 401
    assert requests.get(f"{tiny_server.url}/v1/models", timeout=10).status_code == 401
    key = {"Authorization": f"Bearer {os.environ[SERVER_KEY_ENV]}"}
    models = requests.get(f"{tiny_server.url}/v1/models", headers=key, timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny-policy"] and models[0]["max_model_len"] == 256
    assert os.environ[SERVER_KEY_ENV] not in tiny_server.log_path.read_text()  # never in the server's log
    assert tiny_server.log_path.exists() and "--served-model-name tiny-policy" in tiny_server.log_path.read_text()
    assert tiny_server.startup_seconds and tiny_server.startup_seconds < server_recipe.server.startup_timeout_s
    # the CPU device split: every server process pinned to the server role's cores (devices.server)
    members = group_members(tiny_server.pgid)
    assert members
    assert server_rr.server.devices == tuple(server_recipe.devices.server)
    assert {tuple(psutil.Process(pid).cpu_affinity()) for pid in members} == {server_rr.server.devices}


def test_a_child_forked_from_a_short_lived_thread_outlives_it():
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: the pipeline restarts a shared server from a thread
    that returns at the stage's end. `popen` forks from a thread that lives as long as the process; the control, a
    plain Popen from the same kind of thread, shows the signal that the restarted server used to get."""
    from workbench.serving.server import child_setup, popen

    def from_a_thread(spawn) -> subprocess.Popen:
        box = {}
        thread = threading.Thread(target=lambda: box.update(proc=spawn(["sleep", "30"], preexec_fn=child_setup())))
        thread.start()
        thread.join()
        return box["proc"]

    ours, control = from_a_thread(popen), from_a_thread(subprocess.Popen)
    try:
        assert control.wait(timeout=10) == -signal.SIGTERM  # the thread ended: PDEATHSIG's SIGTERM
        time.sleep(0.5)
        assert ours.poll() is None  # still running
    finally:
        for proc in (ours, control):
            proc.kill()
            proc.wait()


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_server_dies_with_a_parent_killed_during_startup(tiny_model_dir, tmp_path):
    """SIGKILL of the trainer while vLLM is still importing: PR_SET_PDEATHSIG's SIGTERM is lost then (no handler
    yet); the launcher's parent watch ends the whole server group anyway."""
    port = free_port()
    script = textwrap.dedent(f"""
        import threading, time
        from workbench import recipe
        from workbench.serving.server import VLLMServer
        rr = recipe.resolve(recipe.load("cpu-tiny", ["server.port={port}", "monitor.runs_dir={tmp_path}"]))
        srv = VLLMServer(rr, "{tiny_model_dir}", "{tmp_path}", quiet=True)
        def report():
            while srv.process is None:
                time.sleep(0.05)
            print(srv.pgid, flush=True)
        threading.Thread(target=report, daemon=True).start()
        srv.start()
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pgid = int(parent.stdout.readline())
    # late in the start-up: vLLM has spawned its engine core (it holds a SIGTERM handler of its own by then), and
    # /health does not answer yet
    deadline = time.time() + 120
    while len(group_members(pgid)) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert len(group_members(pgid)) >= 3
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while group_members(pgid) and time.time() < deadline:
        time.sleep(0.5)
    assert group_members(pgid) == []


@pytest.mark.heavy
def test_startup_timeout_stops_the_server_and_says_why(server_recipe, tiny_model_dir, tmp_path):
    rr = recipe.resolve(recipe.load(server_recipe, {"server.port": free_port(), "server.startup_timeout_s": 3}))
    srv = VLLMServer(rr, str(tiny_model_dir), tmp_path, quiet=True)
    with pytest.raises(WorkbenchError, match=r"(?s)did not answer /health within 3s.*raise server.startup_timeout_s"):
        srv.start()
    assert srv.process is None
    port = f"--port {rr.recipe.server.port}"  # stopped: none of its processes runs
    assert not [p for p in psutil.process_iter(["cmdline"]) if port in " ".join(p.info["cmdline"] or [])]


@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_server_exiting_during_startup_shows_log_tail(server_recipe, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    rr = recipe.resolve(recipe.load(server_recipe, {"server.port": free_port()}))
    with pytest.raises(WorkbenchError, match=r"(?s)exited with status \d+ during start-up; last lines of .*likely cause") as info:
        VLLMServer(rr, str(broken), tmp_path, quiet=True).start()
    assert "no-such-architecture" in str(info.value)


def test_port_in_use_names_the_process(server_recipe, tiny_model_dir, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rr = recipe.resolve(recipe.load(server_recipe, {"server.port": port}))
        with pytest.raises(WorkbenchError, match=rf"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}"):
            VLLMServer(rr, str(tiny_model_dir), tmp_path, quiet=True).start()


def test_network_address_without_api_key_is_refused(server_recipe, tiny_model_dir, tmp_path, monkeypatch):
    rr = recipe.resolve(recipe.load(server_recipe, {"server.host": "0.0.0.0", "server.api_key_env": None}))
    with pytest.raises(WorkbenchError, match=r"server.host=0.0.0.0 exposes .*no API key.*api_key_env"):
        VLLMServer(rr, str(tiny_model_dir), tmp_path, quiet=True).start()
    monkeypatch.setenv("WB_TEST_KEY", "s3cret")  # before resolving: the key is read from the variable then
    keyed = recipe.resolve(recipe.load(server_recipe, {"server.host": "0.0.0.0", "server.api_key_env": "WB_TEST_KEY"}))
    launch.check_exposure(keyed)  # allowed with a key (and a warning)
    assert "s3cret" not in " ".join(launch.command(keyed, str(tiny_model_dir)))
    assert launch.environment(keyed)["VLLM_API_KEY"] == "s3cret"


def _attach(server_recipe, url, **overrides):
    return recipe.resolve(recipe.load(server_recipe, {"server.mode": "attach", "server.url": url, **overrides}))


def test_attach_checks_the_served_name(tiny_server, server_recipe):
    ok = VLLMServer(_attach(server_recipe, tiny_server.url)).start()
    assert ok.model_entry["id"] == "tiny-policy"
    wrong = _attach(server_recipe, tiny_server.url, **{"server.served_model_name": "policy-7b"})
    with pytest.raises(WorkbenchError, match=r"does not serve 'policy-7b'; it serves \['tiny-policy'\]"):
        VLLMServer(wrong).start()


def test_a_wrong_or_missing_key_is_one_line_before_anything_starts(tiny_server, tmp_path):
    """Against the session's keyed server, as a user types it: a wrong key, and no server.api_key_env at all, each
    get one line naming server.api_key_env, exit 2, before a model is built or a run directory written (train and
    eval, through the console script's own entry point)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bad_inputs import run_all

    attach = ["server.mode=attach", f"server.url={tiny_server.url}"]
    cases = [(["train", "--recipe", "smoke", *attach, "server.api_key_env=WB_TEST_WRONG_KEY"],
              "refused the key in $WB_TEST_WRONG_KEY (server.api_key_env): HTTP 401"),
             (["train", "--recipe", "smoke", *attach], "wants an API key (HTTP 401) and server.api_key_env is not set"),
             (["eval", "--recipe", "smoke", *attach, "server.api_key_env=WB_TEST_WRONG_KEY"],
              "refused the key in $WB_TEST_WRONG_KEY")]
    os.environ["WB_TEST_WRONG_KEY"] = "not-the-key"
    try:
        results = run_all(cases, tmp_path, free_port())
    finally:
        del os.environ["WB_TEST_WRONG_KEY"]
    for (args, expected), out in zip(cases, results):
        errors = [line for line in out["stderr"].splitlines() if line.startswith("error: ")]
        assert out["code"] == 2 and len(errors) == 1 and expected in errors[0], (args, out["stderr"][-1500:])
        assert "not-the-key" not in out["stderr"] + out["stdout"]  # the key itself is never printed
    runs = tmp_path / "runs"
    assert not (runs.exists() and any(runs.iterdir())), list(runs.iterdir())


def test_attach_checks_max_model_len_fits(tiny_server, server_recipe):
    long = _attach(server_recipe, tiny_server.url,
                   **{"trainer.max_completion_length": 300, "server.max_model_len": 1024})
    with pytest.raises(WorkbenchError, match=r"max_model_len is 256, below max prompt \(64\) \+ completion \(300\) = 364"):
        VLLMServer(long).start()


def test_attach_to_something_that_is_not_vllm(server_recipe):
    class NotVllm(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotVllm)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(WorkbenchError, match=r"is not a vLLM server \(GET /v1/models answered HTTP 404"):
            VLLMServer(_attach(server_recipe, url)).start()
    finally:
        httpd.shutdown()
        httpd.server_close()
    with pytest.raises(WorkbenchError, match="no server answers at"):
        VLLMServer(_attach(server_recipe, f"http://127.0.0.1:{free_port()}")).start()


def test_launch_command_per_platform(tmp_path):
    r = recipe.load("ascend-910b-8card")
    npu = recipe.resolve(r, platform="npu")
    cmd = launch.command(npu, "/models/policy")
    assert cmd[:3] == ["vllm", "serve", "/models/policy"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--served-model-name"] == "policy-7b" and flags["--tensor-parallel-size"] == "4"
    assert flags["--max-model-len"] == "1024" and flags["--max-num-batched-tokens"] == "2048"
    # the HCCL engine, under the name vllm-ascend maps onto it (the compatibility matrix's hccl_backend_name)
    assert npu.weight_sync == "hccl"
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": compat.hccl_backend_name()}
    env = launch.environment(npu, for_training=True)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3" and env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in launch.environment(npu)  # a server no trainer uses
    cuda = launch.environment(recipe.resolve(recipe.load("ascend-910b-8card", ["devices.platform=cuda"])))
    assert cuda["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    cpu = recipe.resolve(recipe.load("cpu-tiny"), platform="cpu")
    cpu_cmd = launch.command(cpu, "/m")
    assert cpu_cmd[1:4] == ["-m", "workbench.serving.vllm_cpu", "serve"] and "--weight-transfer-config" not in cpu_cmd
    assert "--gpu-memory-utilization" not in cpu_cmd
    cpu_env = launch.environment(cpu)
    assert cpu_env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and cpu_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cpu.weight_sync == "reload"
    assert recipe.resolve(r, platform="cuda").weight_sync == "nccl" and npu.weight_sync == "hccl"


def test_the_cpu_server_keeps_large_blocks_mmapped_on_huge_pages(tiny_server):
    """The CPU server's allocator: large blocks mmapped (a fixed threshold: what a reload frees goes back to the
    OS) and, through glibc.malloc.hugetlb, on transparent huge pages (a reload faults in 2 MiB pages instead of
    4 KiB ones). Read from the running server's own processes: the variables it got and the huge pages its memory
    really sits on (the merge with a user's tunables: tests/test_launch_safety.py)."""
    # the launcher's environment (the group's leader): the engine core's /proc environ is overwritten by its title
    raw = Path(f"/proc/{tiny_server.pgid}/environ").read_text().split("\0")
    env = dict(line.split("=", 1) for line in raw if "=" in line)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and "glibc.malloc.hugetlb=1" in env["GLIBC_TUNABLES"].split(":")
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[madvise]" not in mode:  # never: nothing to see; always: huge pages with or without the tunable
        pytest.skip(f"transparent huge pages are not in madvise mode here ({mode.strip()}): smaps cannot tell")

    def huge_kib(pid: int) -> int:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    assert max(huge_kib(pid) for pid in group_members(tiny_server.pgid)) >= 2048, \
        "no process of the server sits on a huge page"
