"""The environment check tells the truth on fake Ascend hosts of each matrix row: the adapters a row can use, the
NZ setting, NNAL/ATB, triton-ascend (and that `triton/` is its own, not NVIDIA's triton), both CANN layouts, the
variables each role really gets; and a hung collective self-test ends every process it started."""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import FIXTURES, REPO
from workbench import envcheck, recipe
from workbench.platform import compat

ROWS = {  # a fake host per row: what `pip list` would show there
    "0.23.0": {"vllm": "0.23.0", "vllm_ascend": "0.23.0", "torch": "2.10.0", "torch_npu": "2.10.0.post4",
               "triton_ascend": "3.2.2"},
    "0.21.0rc1": {"vllm": "0.21.0", "vllm_ascend": "0.21.0rc1", "torch": "2.10.0", "torch_npu": "2.10.0",
                  "triton_ascend": "3.2.1"},
    "0.25.1rc1": {"vllm": "0.25.1", "vllm_ascend": "0.25.1rc1", "torch": "2.10.0", "torch_npu": "2.10.0.post2",
                  "triton_ascend": None},
}


def _fake_host(tmp_path: Path, layout: str) -> tuple[Path, dict]:
    """An /usr/local/Ascend of either layout with CANN's install-info file, NNAL present, and a fake npu-smi."""
    root = tmp_path / "Ascend"
    if layout == "toolkit":
        home = root / "ascend-toolkit" / "latest"
        (home / "aarch64-linux").mkdir(parents=True)
        (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
            (FIXTURES / "cann" / "ascend_toolkit_install.info").read_text())
        (root / "ascend-toolkit" / "set_env.sh").write_text("# CANN\n")
    else:
        home = root / "cann-9.1.0"
        home.mkdir(parents=True)
        (home / "cann_install.info").write_text((FIXTURES / "cann" / "cann_install.info").read_text())
        (home / "set_env.sh").write_text("# CANN\n")
    (root / "nnal" / "atb").mkdir(parents=True)
    (root / "nnal" / "atb" / "set_env.sh").write_text("# ATB\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "npu-smi"
    smi.write_text(f"#!/bin/sh\ncat {FIXTURES / 'npu-smi' / 'info-910b4-narrow.txt'}\n")
    smi.chmod(0o755)
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ASCEND_HOME_PATH": str(home),
               "LD_LIBRARY_PATH": f"{home}/lib64", "ATB_HOME_PATH": str(root / "nnal" / "atb" / "latest")}
    return root, environ


def _check(row: str, tmp_path: Path, layout: str = "toolkit", environ_extra: dict | None = None,
           overrides: list[str] | None = None):
    root, environ = _fake_host(tmp_path, layout)
    environ.update(environ_extra or {})
    versions = {"python": "3.11.7", "trl": "1.16.0", "transformers": "5.5.4", **ROWS[row]}
    server = {k: versions[k] for k in ("vllm", "vllm_ascend")}
    try:
        rr = recipe.resolve(recipe.load("ascend-910b-8card", overrides or []), platform="npu", versions=server)
    except Exception:  # a row that cannot do the recipe's sync: the check below says so; resolve for the report
        rr = recipe.resolve(recipe.load("ascend-910b-8card", overrides or []), platform="npu")
    report = envcheck.Report(platform="npu")
    envcheck.check_versions(report, versions, "npu", envcheck.cann_version(environ, root=str(root)))
    envcheck.check_adapters(report, rr, {k: versions[k] for k in ("vllm", "vllm_ascend")})
    envcheck.check_ascend_env(report, rr, environ, envcheck._run, root=str(root))
    return report


def test_row_with_the_hccl_engine(tmp_path):
    report = _check("0.23.0", tmp_path)
    adapters = report.find("weight-sync adapters")
    assert adapters.status == "pass" and "can use: hccl, none" in adapters.found and "-> hccl" in adapters.found
    assert "npu_reload_weights no" in adapters.found  # reload_weights reached the NPU worker in 0.24.0rc1
    assert report.find("Ascend version chain").status == "pass"  # CANN 9.1.0 from the install-info file
    assert report.find("FRACTAL_NZ off for weight updates").status == "pass"
    assert report.find("NNAL/ATB loaded").status == "pass"
    assert report.find("triton-ascend").status == "pass"


def test_row_before_the_hccl_engine_is_refused_with_the_row_that_can(tmp_path):
    adapters = _check("0.21.0rc1", tmp_path).find("weight-sync adapters")
    assert adapters.status == "fail"
    assert "needs vllm-ascend >= 0.22.1rc1" in adapters.fix and "vllm-ascend 0.23.0" in adapters.fix


def test_row_with_npu_reload_offers_both(tmp_path):
    report = _check("0.25.1rc1", tmp_path)
    assert "can use: hccl, reload, none" in report.find("weight-sync adapters").found
    assert report.find("triton-ascend").status == "fail"  # vllm-ascend >= 0.20.2rc1 needs it
    reload = _check("0.25.1rc1", tmp_path / "b", overrides=["server.weight_sync=reload"])
    assert reload.find("weight-sync adapters").status == "pass"


def test_nz_left_on_is_refused_before_anything_starts():
    from workbench.errors import WorkbenchError

    with pytest.raises(WorkbenchError, match="VLLM_ASCEND_ENABLE_NZ=0"):
        recipe.resolve(recipe.load("ascend-910b-8card", ["server.env.VLLM_ASCEND_ENABLE_NZ=1"]), platform="npu")
    rr = recipe.resolve(recipe.load("ascend-910b-8card"), platform="npu")
    assert rr.server.env["VLLM_ASCEND_ENABLE_NZ"] == "0" and "VLLM_ASCEND_ENABLE_NZ" not in rr.trainer.env


def test_both_cann_layouts_give_the_version(tmp_path):
    for layout in ("toolkit", "cann"):
        root, environ = _fake_host(tmp_path / layout, layout)
        assert envcheck.cann_version(environ, root=str(root)) == "9.1.0"
        environ.pop("ASCEND_HOME_PATH")
        assert envcheck.cann_version(environ, root=str(root)) == "9.1.0"  # found without set_env.sh too
        assert envcheck.set_env_scripts(str(root))


def test_cann_not_loaded_names_the_script_of_this_host(tmp_path):
    report = _check("0.23.0", tmp_path, layout="cann", environ_extra={"ASCEND_HOME_PATH": ""})
    loaded = report.find("CANN loaded")
    assert loaded.status == "fail" and "cann-9.1.0/set_env.sh" in loaded.fix


def test_atb_missing(tmp_path):
    report = _check("0.23.0", tmp_path, environ_extra={"ATB_HOME_PATH": ""})
    atb = report.find("NNAL/ATB loaded")
    assert atb.status == "fail" and "nnal/atb/set_env.sh" in atb.fix


def test_timeouts_are_reported_per_role(tmp_path):
    report = _check("0.23.0", tmp_path, overrides=["devices.env={}"], environ_extra={"HCCL_CONNECT_TIMEOUT": "300"})
    connect = report.find("HCCL_CONNECT_TIMEOUT")
    assert connect.status == "warn" and connect.found == "server 300; trainer 300"
    assert "every trainer rank" in connect.fix
    ok = _check("0.23.0", tmp_path / "b").find("HCCL_CONNECT_TIMEOUT")
    assert ok.status == "pass" and ok.found == "server 1800; trainer 1800"


# --- the triton package: triton-ascend's, or NVIDIA's triton written over it ----------------------------------------

NVIDIA_INIT = b"# NVIDIA triton\n__version__ = '3.9.0'\n"
ASCEND_INIT = b"# triton-ascend\n__version__ = '3.2.0'\n"   # triton-ascend 3.2.2's package says 3.2.0


def _site(tmp_path: Path, installed: dict[str, tuple[str, bytes]], on_disk: bytes | None):
    """A site-packages where each of `installed` ({name: (version, its copy of triton/__init__.py)}) has a dist-info
    whose RECORD lists triton/__init__.py with its copy's hash, as pip writes it; the file itself holds `on_disk`
    (None: gone). Returns the lookup the env check takes: importlib.metadata's own, over this directory only."""
    site = tmp_path / "site-packages"
    (site / "triton").mkdir(parents=True)
    if on_disk is not None:
        (site / "triton" / "__init__.py").write_bytes(on_disk)
    for name, (version, content) in installed.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(f"triton/__init__.py,sha256={digest},{len(content)}\n"
                                     f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return lambda: importlib.metadata.distributions(path=[str(site)])


def _triton(tmp_path, installed, on_disk, triton_ascend="3.2.2"):
    report = envcheck.Report(platform="npu")
    envcheck.check_triton_package(report, {"triton_ascend": triton_ascend}, _site(tmp_path, installed, on_disk))
    return report


FIX = "pip uninstall -y triton triton-ascend && pip install triton-ascend==3.2.2 --extra-index-url " \
      "https://mirrors.huaweicloud.com/ascend/repos/pypi"


def test_nvidia_triton_written_over_triton_ascend_fails_with_the_repair(tmp_path):
    """x86_64: vLLM's xgrammar pulls NVIDIA's triton 3.9.0, whose triton/__init__.py replaces triton-ascend's."""
    both = {"triton": ("3.9.0", NVIDIA_INIT), "triton-ascend": ("3.2.2", ASCEND_INIT)}
    check = _triton(tmp_path, both, NVIDIA_INIT).find("triton package")
    assert check.status == "fail"
    assert check.found == ("triton/__init__.py is triton 3.9.0's, not triton-ascend 3.2.2's: NVIDIA's triton (on "
                           "x86_64 vLLM's xgrammar pulls it) was installed over it")
    assert check.fix == FIX == envcheck.triton_ascend_fix("3.2.2")


def test_triton_ascend_alone_passes(tmp_path):
    check = _triton(tmp_path, {"triton-ascend": ("3.2.2", ASCEND_INIT)}, ASCEND_INIT).find("triton package")
    assert (check.status, check.found) == ("pass", "triton/__init__.py is triton-ascend 3.2.2's")


def test_nvidia_triton_beside_triton_ascend_fails_even_when_triton_ascend_wrote_last(tmp_path):
    both = {"triton": ("3.9.0", NVIDIA_INIT), "triton-ascend": ("3.2.2", ASCEND_INIT)}
    check = _triton(tmp_path, both, ASCEND_INIT).find("triton package")
    assert check.status == "fail" and check.found.startswith("triton 3.9.0 also installed into triton/ beside")
    assert check.fix == FIX


def test_triton_package_gone_after_removing_nvidia_triton_fails(tmp_path):
    """`pip uninstall triton` alone deletes the files both distributions list: triton-ascend is left without them."""
    check = _triton(tmp_path, {"triton-ascend": ("3.2.2", ASCEND_INIT)}, None).find("triton package")
    assert check.status == "fail" and "triton/__init__.py is missing" in check.found and check.fix == FIX


def test_triton_file_changed_by_something_unlisted_fails(tmp_path):
    check = _triton(tmp_path, {"triton-ascend": ("3.2.2", ASCEND_INIT)}, NVIDIA_INIT).find("triton package")
    assert check.status == "fail" and "not the file triton-ascend 3.2.2 installed" in check.found


def test_no_triton_ascend_no_triton_check(tmp_path):
    report = envcheck.Report(platform="cpu")
    envcheck.check_triton_package(report, {"triton_ascend": None}, _site(tmp_path, {"triton": ("3.9.0", NVIDIA_INIT)},
                                                                         NVIDIA_INIT))
    assert report.checks == []   # NVIDIA's triton is the right one where triton-ascend is not installed


def test_env_check_runs_the_triton_check(tmp_path):
    """`workbench env` itself (envcheck.check) asks the injected metadata lookup, not only the unit above."""
    root, environ = _fake_host(tmp_path, "toolkit")
    versions = {"python": "3.12.9", "trl": "1.16.0", "transformers": "5.5.4", **ROWS["0.23.0"]}
    rr = recipe.resolve(recipe.load("ascend-910b-8card"), platform="npu",
                        versions={k: versions[k] for k in ("vllm", "vllm_ascend")})
    both = {"triton": ("3.9.0", NVIDIA_INIT), "triton-ascend": ("3.2.2", ASCEND_INIT)}
    report = envcheck.check(rr, collective=False, platform="npu", environ=environ, versions=versions,
                            runner=lambda cmd: (0, ""), devices=[f"910B4 {i}" for i in range(8)],
                            distributions=_site(tmp_path / "x", both, NVIDIA_INIT))
    assert report.find("triton package").status == "fail"
    assert f"-> {FIX}" in report.to_text()


def test_readme_and_environment_yml_carry_the_repair():
    """The install route itself removes NVIDIA's triton and puts triton-ascend back (vllm-ascend's Dockerfile does the
    same): the Ascend steps of docs/ascend.md and environment.yml's post-step say the command the env check prints."""
    page = (REPO / "docs" / "ascend.md").read_text()
    section = re.search(r"^### Ascend install.*?(?=^## )", page, re.S | re.M).group(0)
    assert FIX in section
    assert FIX in (REPO / "environment.yml").read_text()


HANG = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a rank stuck in a collective ignores the polite signal
    with open(os.environ["HANG_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(3600)
""")


def test_hung_self_test_ends_its_whole_process_group(tmp_path):
    (tmp_path / "hangrank.py").write_text(HANG)
    pids = tmp_path / "pids.txt"
    environ = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "HANG_PIDS": str(pids)}
    report = envcheck.Report(platform="cpu")
    started = time.time()
    envcheck.run_collective(report, "cpu", 2, timeout=10, environ=environ, module="hangrank")
    check = report.checks[-1]
    assert check.status == "fail" and "a hang; all ended" in check.found
    ranks = [int(p) for p in pids.read_text().split()]
    assert len(ranks) == 2
    deadline = time.time() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks) \
            and time.time() < deadline:
        time.sleep(0.2)
    alive = [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"ranks still running: {alive}"
    assert time.time() - started < 60


def test_capabilities_follow_compat_yaml():
    caps = compat.capabilities({"vllm": "0.23.0", "vllm_ascend": "0.23.0.post1"})
    assert caps["hccl_engine"] and not caps["npu_reload_weights"] and not caps["reset_prefix_cache_json"]
    assert compat.capabilities({"vllm": "0.32.0+cpu"})["reset_prefix_cache_json"]
    assert compat.hccl_backend_name() == "nccl"
    assert sys.version_info >= (3, 11)
