"""The live dashboard as a user meets it: JupyterLab, started by `workbench lab` (what `make lab` runs), in headless
Chromium runs notebook 04 on a short cpu-tiny run (attached to the session's server); the page's progress bar moves while the cell runs; a click on the
page's Stop button is handled while the cell is still running, and the run ends early with its checkpoint.
Fails, with the reason, where Chromium is missing or cannot start (.ci/run installs it)."""
from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import subprocess
import time
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import KEYED, chromium, free_port, workbench_command

REPO = Path(__file__).resolve().parent.parent

MAX_STEPS = 40


class Page:
    """One browser tab, driven over the DevTools protocol (Runtime.evaluate), as a user's clicks would be."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)

    def js(self, expression: str):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": "Runtime.evaluate",
                                 "params": {"expression": expression, "returnByValue": True, "awaitPromise": True}}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                return reply.get("result", {}).get("result", {}).get("value")

    def wait(self, expression: str, until, timeout: float, what: str):
        deadline, value = time.time() + timeout, None
        while time.time() < deadline:
            value = self.js(expression)
            if until(value):
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value {value!r}")


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read()
    except OSError:
        return None


def _notebook(root: Path, runs: Path, server_url: str) -> Path:
    """Notebook 04 with its parameters set the way papermill would set them (an injected cell); the training
    attaches to the session's server (server.mode=attach: what a trainer beside a running server does)."""
    import nbformat
    from papermill.parameterize import parameterize_notebook

    from workbench import paths

    from papermill.iorw import load_notebook_node

    nb = load_notebook_node(str(paths.notebooks_dir() / "04_full_grpo.ipynb"))  # papermill's loader, as papermill
    overrides = ["server.mode=attach", f"server.url={server_url}", *KEYED, f"trainer.max_steps={MAX_STEPS}", "trainer.save_steps=100",
                 "trainer.logging_steps=1", f"monitor.runs_dir={runs}", "monitor.canary_every=0"]
    nb = parameterize_notebook(nb, {"recipe": "cpu-tiny", "overrides": overrides, "refresh_s": 1.0})
    path = root / "04_full_grpo.ipynb"
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def lab(tmp_path):
    """`workbench lab` on a free loopback port, rooted in tmp_path, with a token; stopped with its kernels."""
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(workbench_command() + ["lab", "--port", str(port), "--no-browser", "--root", str(tmp_path),
                                                   "--", f"--ServerApp.token={token}",
                                                   "--LabApp.expose_app_in_browser=True",
                                                   *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI's container
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while _get(f"{url}/api/status?token={token}") is None:
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "lab.log").read_text()[-3000:]
        time.sleep(0.5)
    yield url, token
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture
def browser(tmp_path):
    path = chromium()
    profile = tmp_path / "profile"
    proc = subprocess.Popen([path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--disable-extensions", "--remote-debugging-port=0",
                             "--remote-allow-origins=*", f"--user-data-dir={profile}", "--window-size=1400,1000",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    active, deadline = profile / "DevToolsActivePort", time.time() + 30
    while not active.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if not active.exists():
        proc.kill()
        pytest.fail(f"Chromium could not start headless here (exit {proc.poll()})", pytrace=False)
    port = int(active.read_text().split()[0])
    pages = json.loads(_get(f"http://127.0.0.1:{port}/json/list"))
    yield Page(next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page"))
    os.killpg(proc.pid, signal.SIGKILL)


PROGRESS = """(() => { const b = document.querySelector('.widget-hprogress .progress-bar, .widget-progress .progress-bar');
                       return b ? parseFloat(b.style.width) || 0 : null; })()"""
# the dashboard's Stop button, before ("Stop (checkpoint first)") and after a click ("stopping after this step…")
STOP = """(() => { const b = [...document.querySelectorAll('button')].find(
                       b => b.textContent.includes('Stop (') || b.textContent.includes('stopping after'));
                   return b ? b.textContent.trim() : null; })()"""


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_stop_clicked_in_jupyterlab_ends_the_run_early_with_its_checkpoint(tmp_path, lab, browser, restored_server):
    url, token = lab
    runs = tmp_path / "runs"
    _notebook(tmp_path, runs, restored_server.url)
    page = browser
    page.js(f"window.location.href = '{url}/lab/tree/04_full_grpo.ipynb?reset&token={token}'")
    notebook = "[...((window.jupyterapp && window.jupyterapp.shell.widgets('main')) || [])].find(w => w.sessionContext)"
    kernel = f"""(() => {{ const w = {notebook};
                          const k = w && w.sessionContext.session && w.sessionContext.session.kernel;
                          return k ? k.status : null; }})()"""
    page.wait(kernel, lambda s: s == "idle", 180, "the notebook's kernel to be idle")
    # Run > Run All Cells, on the notebook's tab
    page.js(f"window.jupyterapp.shell.activateById({notebook}.id)")
    page.js("(() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return 'started'; })()")

    # the progress bar appears and moves while the cell runs
    first = page.wait(PROGRESS, lambda v: v is not None and v > 0, 300, "the progress bar to show a step")
    later = page.wait(PROGRESS, lambda v: v is not None and v > first, 120, "the progress bar to move")
    assert later < 100

    # a click in the page, as a user's: handled while the cell still runs (the button says so), not after it
    page.js("[...document.querySelectorAll('button')].find(b => b.textContent.includes('Stop (')).click()")
    page.wait(STOP, lambda t: t is not None and "stopping" in t, 30, "the Stop click to be handled mid-run")

    (train,) = [p / "train" for p in runs.glob("*-notebooks")]  # 04 opened by hand: a notebook walk
    deadline = time.time() + 180
    while not (train / "train.json").exists():
        assert time.time() < deadline, (train / "train.log").read_text()[-3000:]
        time.sleep(1)
    summary = json.loads((train / "train.json").read_text())
    stopped = summary["stopped_early_at"]
    assert stopped is not None and 0 < stopped < MAX_STEPS and summary["steps"] == stopped, summary
    # saved by the stop (save_steps is 100), and the run ended as a finished one does: its final model
    assert (train / "checkpoints" / f"checkpoint-{stopped}" / "trainer_state.json").exists()
    assert (train / "final" / "model.safetensors").exists()
    assert (train / "STOP").read_text().startswith("Stop button")
    # the live widget gives way to a line saying how the run ended (no Stop button left to click)
    page.wait("document.body.innerText.includes('stopped early at step')", bool, 60, "the ended-run line")
    assert page.js(STOP) is None


def test_every_install_route_can_register_the_kernel_for_its_own_python(tmp_path):
    """`workbench kernel` (what make install runs, and what an accelerator's pip install ends with) registers
    this environment's Python through ipykernel's own installer."""
    import subprocess

    from conftest import workbench_command

    out = subprocess.run(workbench_command() + ["kernel", "--prefix", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "grpo-workbench" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and "ipykernel_launcher" in spec["argv"]


@pytest.mark.parametrize("dist", ["torch_npu", "vllm_ascend", "nvidia_cuda_runtime_cu12", "vllm"])
def test_make_refuses_to_install_the_cpu_stack_over_an_accelerator_venv(tmp_path, dist):
    """make install (demo, lab, test) over a venv that holds an accelerator's stack stops with one line and
    installs nothing: the Makefile's own rule, on a real venv carrying that distribution's metadata."""
    import subprocess
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    info = Path(purelib) / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    out = subprocess.run(["make", "-C", str(REPO), "install", f"VENV={venv}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    line = next(line for line in out.stderr.splitlines() if line.startswith("make: ") and "accelerator" in line)
    assert "workbench kernel" in line and not (venv / ".workbench-installed").exists()
    assert "pip install" not in out.stdout  # stopped before the first install line
