#!/usr/bin/env python3
"""Record the real Requires-Dist of the pinned distributions into tests/fixtures/install/ (refresh script).

tests/test_install_pins.py checks the `ascend` and `cuda` extras against these records, with no network. This script
is the only part that talks to an index. What it writes:

* one compact JSON per distribution, from `pip install --dry-run --ignore-installed --no-deps --report` for a
  CPython 3.11 (PYTHON) manylinux target of each architecture (`--platform ... --only-binary=:all:`):
  `<name>-<version>-<arch>.json` for a platform wheel, `<name>-<version>.json` for a pure-Python wheel or an sdist
  (sdist-only releases: pip is asked to build the metadata; a failure is recorded with pip's decisive line).
  A wheel built for one CPython only (`cpXY-cpXY`, not abi3) also gets `python_tags`, the CPython tags a wheel of that
  release is known to exist for, and `python_tags_source`, where each tag was found: the recorded file for 3.11, and
  the file pip picks with `--python-version` for each other Python recorded here (the Ascend route's 3.12);
* hand-made records for what is not on PyPI (index "source", "huawei", "pytorch-cpu"), each with a "source" field
  naming where its requirements come from; the script says which of them it could refresh and which not, and why.
  Where the index cannot be reached, `python_tags` is not read from wheel names but stated from the documented
  sources in PYTORCH_CPU_TAGS / the triton-ascend record (kept as recorded when a record exists);
* `resolve-<route>-<arch>.json`: a full `pip install --dry-run --report` of the project's dependencies plus one extra,
  every distribution pip would install with its metadata. For the Ascend route, the distributions that do not come
  from PyPI are handed to pip as metadata-only stub wheels (`--find-links`), so pip's own resolver decides the rest.

Resolves and environment markers. `--platform` and `--python-version` change only which wheels pip accepts (tags,
Requires-Python); pip evaluates the environment markers of every Requires-Dist (`platform_machine == "x86_64"`,
`python_version >= "3.12"`) against the interpreter it runs in (packaging's default_environment(): platform.machine(),
sys.version_info). Run plainly on an x86_64 host, an aarch64 resolve would drag in what torch asks for on x86_64
only (nvidia-*-cu12, triton), and a 3.12 resolve from a 3.11 interpreter would miss `python_version >= "3.12"`
requirements. So each resolve runs pip in a child process
  * of a real CPython of the route's Python (the Ascend route: ASCEND_PYTHON, 3.12; the cuda routes: PYTHON, 3.11),
    found as this interpreter, `pythonX.Y` on PATH, or pyenv's versions, each checked by running it. It runs this
    interpreter's own pip (copied to a temporary directory, so the recorded pip version is the same whichever Python
    runs it); with no such interpreter the resolve falls back to `--python-version` on this interpreter with its
    python_version markers, and the header and the summary say so;
  * with platform.machine() replaced, before pip is imported, by one returning the target architecture when that is
    not the host's (packaging caches the marker environment on first use, so it must happen before pip starts). Only
    the markers change; the wheel tags still come from `--platform`.
  pip's report states the environment it evaluated markers in; the script checks platform_machine and python_version
  there against the target and writes them to the resolve's `markers` header field (a resolve whose markers are not
  the target's is not written).

Usage:  python scripts/record_install_metadata.py [--only single|handmade|resolve] [--entry NAME==VERSION]
                                                  [--route ascend|cuda]
Network: PyPI (https://pypi.org/simple). download.pytorch.org and Huawei's index are tried first and reported if
unreachable; then the +cpu records are derived from PyPI's wheels (pytorch_cpu) and triton-ascend's hand-made record
is kept (triton_ascend), each saying so in its "source"/"note"/"python_tags_source".
"""
from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pip
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "install"
PYTHON = "3.11"                     # the single records and the cuda routes (tests/install_check.py PYTHON)
ARCHES = ("x86_64", "aarch64")
PYPI = "https://pypi.org/simple"
PYTORCH_CPU = "https://download.pytorch.org/whl/cpu"
HUAWEI = "https://mirrors.huaweicloud.com/ascend/repos/pypi"

# The Ascend route proposed for pyproject's `ascend` extra (tests/test_install_pins.py PROPOSED_ASCEND is the same list).
sys.path.insert(0, str(REPO / "tests"))
from install_check import ASCEND_PYTHON, ROUTE_STEPS, pyproject_extra  # noqa: E402  (the test's own, one definition)

ASCEND_EXTRA = pyproject_extra("ascend")
CUDA_ENDS = ["0.22.0", "0.31.0"]

# Single distributions: (name, version, arches). Today's (old) ascend extra, the new route, TRL, the cuda window ends.
SINGLE = [
    ("torch", "2.10.0", ARCHES),
    ("torch-npu", "2.10.0.post4", ARCHES),
    ("vllm", "0.23.0", ARCHES),
    ("vllm-ascend", "0.23.0.post1", ARCHES),      # sdist only on PyPI
    ("vllm-ascend", "0.23.0", ARCHES),
    ("torchvision", "0.25.0", ARCHES),
    ("torchaudio", "2.10.0", ARCHES),
    ("transformers", "5.5.4", ARCHES),
    ("arctic-inference", "0.1.1", ARCHES),        # sdist only on PyPI, pinned by vllm-ascend 0.23.0
    ("trl", "1.16.0", ARCHES),
] + [("vllm", v, ("x86_64",)) for v in CUDA_ENDS]


HOST_MACHINE = os.uname().machine
# The CPythons whose wheel tags the single records state (python_tags): the records' own and the Ascend route's.
TAG_PYTHONS = sorted({PYTHON, ASCEND_PYTHON}, key=lambda v: tuple(int(p) for p in v.split(".")))
TODAY = _dt.date.today().isoformat()

# The +cpu builds' python_tags where download.pytorch.org cannot be read (see pytorch_cpu): what is documented.
PYTORCH_CPU_TAGS = (["cp312"], "cp312 only as far as known here: download.pytorch.org was not reachable from the "
                    "recording machine; vllm-ascend v0.23.0's Dockerfile installs the route on its Python 3.12 image "
                    "(quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12) with --extra-index "
                    "https://download.pytorch.org/whl/cpu/, where torch-npu's x86_64 wheel takes torch==2.10.0+cpu; "
                    "cp311 not checked")

# What the child interpreter runs instead of `-m pip` (argv: pip's directory or "", machine or "", pip's arguments).
# platform.machine() is replaced before pip (and its vendored packaging, which caches the marker environment on first
# use) is imported, so every marker pip evaluates sees the target's platform_machine; nothing else is changed.
PIP_DRIVER = """\
import platform, runpy, sys
pip_dir, machine = sys.argv[1], sys.argv[2]
if pip_dir:
    sys.path.insert(0, pip_dir)
if machine:
    platform.machine = lambda: machine
sys.argv = ["pip"] + sys.argv[3:]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def log(*args):
    print(*args, flush=True)


def platform_args(arch: str, python: str = PYTHON) -> list[str]:
    tags = [f"manylinux2014_{arch}"] + [f"manylinux_2_{m}_{arch}" for m in range(17, 40)]
    args = [a for t in tags for a in ("--platform", t)]
    return args + ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]


def _is_cpython(exe: str, python: str) -> bool:
    """Whether exe runs and is CPython `python` (a pyenv shim of a version not selected exists but fails)."""
    probe = "import platform, sys; print('%d.%d' % sys.version_info[:2], platform.python_implementation())"
    try:
        proc = subprocess.run([exe, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and proc.stdout.split() == [python, "CPython"]


_INTERPRETERS: dict[str, str | None] = {}


def interpreter(python: str) -> str | None:
    """A CPython `python` (X.Y) here: this one, `pythonX.Y` on PATH, or pyenv's newest X.Y.*; None if none."""
    if python not in _INTERPRETERS:
        root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
        pyenv = sorted(root.glob(f"versions/{python}.*/bin/python{python}"),
                       key=lambda p: [int(x) if x.isdigit() else -1 for x in p.parts[-3].split(".")], reverse=True)
        candidates = [sys.executable, shutil.which(f"python{python}")] + [str(p) for p in pyenv]
        _INTERPRETERS[python] = next((c for c in candidates if c and _is_cpython(c, python)), None)
    return _INTERPRETERS[python]


def native(arch: str, python: str) -> bool:
    """Whether pip can resolve for arch and python without --platform/--python-version: the host is arch and a CPython
    `python` is here (then sdists may be built for their metadata too)."""
    return arch == HOST_MACHINE and interpreter(python) is not None


def pip_copy(directory: Path) -> str:
    """This interpreter's pip, copied for another interpreter to import (pip is pure Python and vendors what it needs),
    so that every record names one pip version whichever Python ran it."""
    shutil.copytree(Path(pip.__file__).parent, directory / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    return str(directory)


def pip_env() -> dict:
    """pip with no local configuration: no constraint file, no find-links, no extra indexes of this machine."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_report(requirements: list[str], arch: str | None, *, no_deps: bool, index: str = PYPI,
               extra_index: list[str] = (), find_links: Path | None = None, extra: list[str] = (),
               timeout: int = 900, python: str = PYTHON, exe: str | None = None, pip_dir: str = "",
               machine: str = "") -> tuple[dict | None, str]:
    """Run one `pip install --dry-run --report`; (report or None, pip's decisive stderr lines).
    arch: --platform for arch and --python-version python (None: the interpreter's own tags). exe: the interpreter
    (default this one), pip_dir: where it imports pip from ("" its own), machine: what platform.machine() reports."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [exe or sys.executable, "-I", "-c", PIP_DRIVER, pip_dir, machine,
               "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--index-url", index]
        for url in extra_index:
            cmd += ["--extra-index-url", url]
        if find_links:
            cmd += ["--find-links", str(find_links)]
        if no_deps:
            cmd.append("--no-deps")
        if arch:
            cmd += platform_args(arch, python)
        cmd += list(extra) + list(requirements)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"pip timed out after {timeout} s"
        if proc.returncode == 0 and report.exists():
            return json.loads(report.read_text()), ""
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines()]
        decisive = [ln for ln in lines if (ln.startswith(("ERROR:", "error:")) or " depends on " in ln
                                           or "user requested" in ln) and not ln.startswith("ERROR: Ignored")]
        return None, " / ".join(decisive[-4:]) or (lines[-1] if lines else f"pip exited {proc.returncode}")


def wheel_arch(filename: str) -> str:
    if filename.endswith("-any.whl"):
        return "any"
    for arch in ARCHES:
        if arch in filename:
            return arch
    return "unknown"


def compact(item: dict, *, index: str = "pypi") -> dict:
    """The fixture form of one pip report entry."""
    meta = item["metadata"]
    url = item["download_info"]["url"]
    filename = url.rsplit("/", 1)[-1]
    kind = "wheel" if filename.endswith(".whl") else "sdist"
    out = {"name": canonicalize_name(meta["name"]), "version": meta["version"],
           "arch": wheel_arch(filename) if kind == "wheel" else "any", "kind": kind, "index": index,
           "requires_python": meta.get("requires_python"), "requires_dist": meta.get("requires_dist") or [],
           "file": filename}
    if kind == "sdist":
        out["builds"] = True
    return out


def python_only_tags(filename: str) -> set[str]:
    """The CPython tags of a wheel built for particular CPythons (`cp311-cp311`); empty for abi3, py3-none, sdists."""
    if not filename.endswith(".whl"):
        return set()
    return {t.interpreter for t in parse_wheel_filename(filename)[3]
            if t.interpreter.startswith("cp") and t.abi not in ("abi3", "none")}


def _tag_key(tag: str) -> tuple[int, int]:
    return int(tag[2]), int(tag[3:] or 0)


def add_python_tags(rec: dict, requirement: str, arch: str, filename: str, problems: list[str], *,
                    index: str = PYPI, where: str = "PyPI") -> dict:
    """python_tags/python_tags_source for a wheel built for particular CPythons: the recorded file's tags, and for
    each Python of TAG_PYTHONS it does not cover, the wheel pip picks for that Python (same index, arch, no deps)."""
    own = python_only_tags(filename)
    if not own:
        return rec
    sources = {tag: "the recorded file" for tag in own}
    found = set(own)
    for python in TAG_PYTHONS:
        tag = "cp" + python.replace(".", "")
        if tag in sources:
            continue
        how = (f"with pip {pip.__version__} `install --dry-run --no-deps --only-binary=:all: --python-version {python} "
               f"--platform manylinux_2_*_{arch}` on {TODAY}")
        report, err = pip_report([requirement], arch, no_deps=True, python=python, index=index, timeout=300)
        if report:
            other = report["install"][0]["download_info"]["url"].rsplit("/", 1)[-1]
            sources[tag] = f"{other}, found on {where} {how}"
            found.add(tag)
        else:
            sources[tag] = f"no wheel found on {where} {how} ({err})"
            problems.append(f"{requirement} {arch}: no wheel for Python {python} on {where} ({err})")
    rec["python_tags"] = sorted(found, key=_tag_key)
    rec["python_tags_source"] = "; ".join(f"{t}: {sources[t]}" for t in sorted(sources, key=_tag_key)) \
        + "; other tags not checked"
    return rec


def write(record: dict, path: Path | None = None) -> Path:
    arch = record["arch"]
    path = path or OUT / (f"{record['name']}-{record['version']}" + ("" if arch == "any" else f"-{arch}") + ".json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


# --- single distributions --------------------------------------------------------------------------------------------

def record_single(name: str, version: str, arches, problems: list[str]) -> None:
    no_wheel = []
    for arch in arches:
        report, err = pip_report([f"{name}=={version}"], arch, no_deps=True)
        if report:
            rec = compact(report["install"][0])
            rec = add_python_tags(rec, f"{name}=={version}", arch, rec["file"], problems)
            log(f"  {name} {version} {arch}: {rec['file']} {rec.get('python_tags', '')} -> {write(rec).name}")
            if rec["arch"] == "any":
                return                   # a pure-Python wheel: one record serves every architecture
        else:
            no_wheel.append(arch)
            log(f"  {name} {version} {arch}: no wheel ({err})")
    if no_wheel and len(no_wheel) == len(arches):
        record_sdist(name, version, no_wheel, problems)


def record_sdist(name: str, version: str, no_wheel: list[str], problems: list[str]) -> None:
    """An sdist-only release: ask pip (host interpreter) to build its metadata, record the result either way."""
    report, err = pip_report([f"{name}=={version}"], None, no_deps=True, extra=["--no-binary", name], timeout=1500)
    if report:
        rec = compact(report["install"][0])
    else:
        rec = {"name": canonicalize_name(name), "version": version, "arch": "any", "kind": "sdist", "index": "pypi",
               "requires_python": None, "requires_dist": None, "builds": False, "build_error": err}
        problems.append(f"{name} {version}: sdist only, metadata build fails ({err})")
    rec["note"] = f"no wheel on PyPI for {', '.join(no_wheel)}"
    log(f"  {name} {version}: sdist, builds={rec['builds']} -> {write(rec).name}")


# --- hand-made records (not on PyPI) ---------------------------------------------------------------------------------

def _pypi_file_url(project: str, filename: str) -> str:
    req = urllib.request.Request(f"{PYPI}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    return next(f["url"] for f in files if f["filename"] == filename)


def vllm_empty(version: str = "0.23.0") -> dict:
    """vLLM built from source with VLLM_TARGET_DEVICE=empty: setup.py's get_requirements() reads
    requirements/common.txt only (no torch), and get_vllm_version() appends "+empty". Read from PyPI's sdist of the
    release (cut from the git tag), parsed the way setup.py's _read_requirements does."""
    url = _pypi_file_url("vllm", f"vllm-{version}.tar.gz")
    with urllib.request.urlopen(url, timeout=600) as resp:
        data = resp.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        def read(member):
            return tar.extractfile(f"vllm-{version}/{member}").read().decode()

        setup_py = read("setup.py")
        pkg_info = read("PKG-INFO")

        def requirements(filename):
            out = []
            for line in read(f"requirements/{filename}").strip().split("\n"):
                if line.startswith("-r "):
                    out += requirements(line.split()[1])
                elif not line.startswith("--") and not line.startswith("#") and line.strip():
                    out.append(line.split(" #")[0].split("#")[0].strip())
            return out

        reqs = [str(Requirement(r)) for r in requirements("common.txt")]
    assert 'requirements = _read_requirements("common.txt")' in setup_py, "setup.py no longer maps empty -> common.txt"
    assert 'version += f"{sep}empty"' in setup_py, "setup.py no longer appends +empty"
    requires_python = re.search(r"^Requires-Python: (.+)$", pkg_info, re.M).group(1).strip()
    return {"name": "vllm", "version": f"{version}+empty", "arch": "any", "kind": "source", "index": "source",
            "requires_python": requires_python, "requires_dist": reqs,
            "source": f"vllm v{version}: requirements/common.txt (setup.py get_requirements() for "
                      f"VLLM_TARGET_DEVICE=empty; version suffix '+empty' from get_vllm_version()); read from PyPI's "
                      f"sdist vllm-{version}.tar.gz",
            "note": "built from source: VLLM_TARGET_DEVICE=empty pip install . in a v" + version + " checkout; "
                    "build needs cmake and a C++ compiler (the vllm.spinloop extension), its isolated build "
                    "environment pulls torch==2.11.0 (pyproject [build-system])"}


def reachable(url: str) -> str:
    """'' when the index answers, else why not (checked before pip, whose retries on a dead host take minutes)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15).close()
        return ""
    except Exception as exc:  # noqa: BLE001
        return f"{url} not reachable: {exc}"


def pytorch_cpu(name: str, version: str, problems: list[str]) -> dict:
    """x86_64 +cpu build from PyTorch's CPU index. Recorded from that index when reachable (python_tags from the wheel
    names pip picks there); otherwise derived from PyPI's x86_64 wheel of the same version with the CUDA-only
    requirements (nvidia-*, cuda-*, triton) removed: the rule holds where both builds can be read here (torch
    2.13.0+cpu in /opt/wheels vs PyPI's torch 2.13.0), and python_tags as documented in PYTORCH_CPU_TAGS."""
    err = reachable(f"{PYTORCH_CPU}/{name}/")
    report, err = (None, err) if err else pip_report([f"{name}=={version}+cpu"], "x86_64", no_deps=True,
                                                     index=PYTORCH_CPU, timeout=300)
    if report:
        rec = compact(report["install"][0], index="pytorch-cpu")
        filename = rec.pop("file")
        rec["source"] = f"{PYTORCH_CPU} ({filename})"
        return add_python_tags(rec, f"{name}=={version}+cpu", "x86_64", filename, problems,
                               index=PYTORCH_CPU, where=PYTORCH_CPU)
    problems.append(f"{name} {version}+cpu: not refreshed from {PYTORCH_CPU} ({err}); derived from PyPI's wheel, "
                    "python_tags as documented (PYTORCH_CPU_TAGS)")
    report, err = pip_report([f"{name}=={version}"], "x86_64", no_deps=True)
    if not report:
        raise SystemExit(f"{name} {version}: not on PyPI either: {err}")
    base = compact(report["install"][0])
    cuda = re.compile(r"^(nvidia-|cuda-|triton\b)", re.I)
    reqs = [r for r in base["requires_dist"] if not cuda.match(r)]
    return {"name": base["name"], "version": f"{version}+cpu", "arch": "x86_64", "kind": "wheel",
            "index": "pytorch-cpu", "requires_python": base["requires_python"], "requires_dist": reqs,
            "source": f"derived: PyPI {base['file']} Requires-Dist minus nvidia-*/cuda-*/triton",
            "note": f"{PYTORCH_CPU} was not reachable from the recording machine; the local label of any torch "
                    "pin inside is as on PyPI (either form is met by torch 2.10.0+cpu)",
            "python_tags": list(PYTORCH_CPU_TAGS[0]), "python_tags_source": PYTORCH_CPU_TAGS[1]}


def triton_ascend(version: str, problems: list[str]) -> dict:
    """From Huawei's index when reachable (asked for the Ascend route's Python: 3.2.2's wheels are cp312); otherwise the
    record already here is kept as it is (python_tags included), or the hand-made one below is written."""
    err = reachable(f"{HUAWEI}/triton-ascend/")
    report, err = (None, err) if err else pip_report([f"triton-ascend=={version}"], "aarch64", no_deps=True,
                                                     index=HUAWEI, python=ASCEND_PYTHON, timeout=300)
    if report:
        rec = compact(report["install"][0], index="huawei")
        filename = rec.pop("file")
        rec["source"] = f"{HUAWEI} ({filename})"
        return add_python_tags(rec, f"triton-ascend=={version}", "aarch64", filename, problems,
                               index=HUAWEI, where=HUAWEI)
    old = OUT / f"triton-ascend-{version}.json"
    problems.append(f"triton-ascend {version}: not refreshed from {HUAWEI} ({err}); "
                    + ("kept the hand-made record" if old.exists() else "wrote the hand-made record"))
    if old.exists():
        return json.loads(old.read_text())
    return {"name": "triton-ascend", "version": version, "arch": "any", "kind": "wheel", "index": "huawei",
            "requires_python": None, "requires_dist": [],
            "source": f"hand-made: not on PyPI (PyPI has 3.2.0 and rcs, whose wheels declare no Requires-Dist and "
                      f"are cp39-cp311 only); upstream installs it with `pip install triton-ascend=={version} "
                      f"--extra-index-url {HUAWEI}` (vllm-ascend docs/source/installation.md)",
            "note": "3.2.2 itself could not be read here (Huawei's index not reachable): the empty Requires-Dist is "
                    "that of the PyPI releases (3.2.0, 3.2.0rc*), whose wheels are cp39-cp311",
            "python_tags": ["cp312"],
            "python_tags_source": "not read from Huawei's index (unreachable here). The 3.2.2 wheels that public "
                                  f"install scripts fetch are triton_ascend-{version}-cp312-cp312-"
                                  "manylinux_2_27_<arch>.manylinux_2_28_<arch>.whl for x86_64 and aarch64 (the "
                                  "v3.2.2 release assets of github.com/triton-lang/triton-ascend and the same names "
                                  "on Huawei's mirror); no "
                                  "other tag of 3.2.2 was found; vllm-ascend v0.23.0's Dockerfile installs it on a "
                                  "Python 3.12 image"}


def record_handmade(problems: list[str]) -> dict[str, dict]:
    recs = {}
    try:
        recs["vllm"] = vllm_empty("0.23.0")
    except Exception as exc:  # noqa: BLE001 - report and keep the old record
        problems.append(f"vllm 0.23.0+empty: could not read PyPI's sdist ({exc}); kept the old record")
    recs["triton-ascend"] = triton_ascend("3.2.2", problems)
    for name, version in (("torch", "2.10.0"), ("torchvision", "0.25.0"), ("torchaudio", "2.10.0")):
        recs[f"{name}+cpu"] = pytorch_cpu(name, version, problems)
    for rec in recs.values():
        log(f"  {rec['name']} {rec['version']} ({rec['index']}) -> {write(rec).name}")
    return recs


# --- full resolves ---------------------------------------------------------------------------------------------------

def stub_wheel(directory: Path, rec: dict) -> Path:
    """A metadata-only wheel standing in for a distribution pip cannot fetch here."""
    dist = re.sub(r"[-_.]+", "_", rec["name"])
    info = f"{dist}-{rec['version']}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {rec['name']}", f"Version: {rec['version']}"]
    if rec.get("requires_python"):
        meta.append(f"Requires-Python: {rec['requires_python']}")
    meta += [f"Requires-Dist: {r}" for r in rec.get("requires_dist") or []]
    path = directory / f"{dist}-{rec['version']}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", "\n".join(meta) + "\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: record_install_metadata\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def core_requirements() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def trim_extras(install: list[dict], requirements: list[str]) -> list[dict]:
    """Leave out Requires-Dist lines of extras that nobody in this resolve asks for (most of the bulk: vllm's, torch's,
    transformers' optional groups). An extra counts as asked for if any requirement names it, marker or not."""
    asked: dict[str, set[str]] = {}
    for text in requirements + [r for rec in install for r in rec.get("requires_dist") or []]:
        req = Requirement(text)
        asked.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    extra = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
    out = []
    for rec in install:
        keep = asked.get(rec["name"], set())
        reqs = [r for r in rec.get("requires_dist") or []
                if not extra.findall(r) or any(canonicalize_name(e) in {canonicalize_name(k) for k in keep}
                                               for e in extra.findall(r))]
        out.append({**rec, "requires_dist": reqs} if rec.get("requires_dist") is not None else rec)
    return out


def write_resolve(path: Path, header: dict, install: list[dict]) -> None:
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()] + [' "install": [']
    lines += [f"  {json.dumps(rec, separators=(',', ':'))}," for rec in sorted(install, key=lambda r: r["name"])]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ]", "}"]
    path.write_text("\n".join(lines) + "\n")


def markers_line(env: dict, arch: str, python: str, exe: str | None) -> tuple[str, str]:
    """(the header's `markers` text, why the resolve must not be written or ''), from the environment pip reports."""
    machine, version = env.get("platform_machine"), env.get("python_version")
    impl = env.get("platform_python_implementation") or "CPython"
    if machine != arch:
        return "", f"pip evaluated markers with platform_machine={machine!r}, not {arch!r}"
    if arch == HOST_MACHINE:
        line = f"{impl} {version} interpreter, platform_machine={arch} (native)"
    else:
        line = (f"{impl} {version} interpreter on an {HOST_MACHINE} host with platform.machine() reporting {arch}, "
                f"so pip evaluated markers for {arch} (--platform alone changes only the wheel tags)")
    if version != python:
        if exe is not None:
            return "", f"pip evaluated markers with python_version={version!r}, not {python!r}"
        line += (f"; no CPython {python} interpreter found here, so python_version markers are {version}'s "
                 f"(--python-version {python} set only the wheel tags and Requires-Python)")
    return line, ""


def record_resolve(route: str, arch: str, python: str, requirements: list[str], problems: list[str],
                   stubs: dict[str, dict] | None = None) -> None:
    """One full resolve for arch and CPython `python`, pip run by an interpreter of that Python with arch's
    platform.machine() (module docstring); the stubs' records replace the stub wheels' entries in the result."""
    stubs = stubs or {}
    exe = interpreter(python)
    plain = native(arch, python)
    if exe is None:
        problems.append(f"resolve {route} {arch}: no CPython {python} interpreter here; pip ran on {sys.executable} "
                        f"with --python-version {python}, its python_version markers are the host's")
    with tempfile.TemporaryDirectory() as tmp:
        links = Path(tmp) / "links"
        links.mkdir()
        for rec in stubs.values():
            stub_wheel(links, rec)
        pip_dir = pip_copy(Path(tmp) / "pip") if exe and exe != sys.executable else ""
        report, err = pip_report(requirements, None if plain else arch, no_deps=False, python=python,
                                 exe=exe, pip_dir=pip_dir, machine="" if arch == HOST_MACHINE else arch,
                                 find_links=links if stubs else None, timeout=1800)
    path = OUT / f"resolve-{route}-{arch}.json"
    if not report:
        problems.append(f"resolve {route} {arch}: pip fails: {err}")
        log(f"  resolve {route} {arch}: FAILS: {err}")
        return
    markers, wrong = markers_line(report.get("environment") or {}, arch, python, exe)
    if wrong:
        problems.append(f"resolve {route} {arch}: not written: {wrong}")
        log(f"  resolve {route} {arch}: NOT WRITTEN: {wrong}")
        return
    install = []
    for item in report["install"]:
        name = canonicalize_name(item["metadata"]["name"])
        rec = compact(item)
        if name in stubs and item["metadata"]["version"] == stubs[name]["version"]:
            rec = {k: v for k, v in stubs[name].items() if k in
                   ("name", "version", "arch", "kind", "index", "requires_python", "requires_dist", "builds")}
        rec.pop("file", None)
        install.append(rec)
    header = {"route": route, "arch": arch, "python": python, "requirements": requirements,
              "stubs": {n: f"{r['version']} ({r['index']})" for n, r in sorted(stubs.items())},
              "resolver": f"pip {report.get('pip_version')} --dry-run --ignore-installed"
                          + ("" if plain else " --only-binary=:all: --platform manylinux*_" + arch),
              "markers": markers,
              "recorded": TODAY,
              "trimmed": "Requires-Dist lines of extras that no requirement in this resolve asks for are left out"}
    write_resolve(path, header, trim_extras(install, requirements))
    log(f"  resolve {route} {arch}: {len(install)} distributions -> {path.name}")


def record_resolves(handmade: dict[str, dict], problems: list[str], routes=("ascend", "cuda")) -> None:
    core = core_requirements()
    for arch in ARCHES if "ascend" in routes else ():
        stubs = {"vllm": handmade["vllm"], "triton-ascend": handmade["triton-ascend"]}
        if arch == "x86_64":
            for name in ("torch", "torchvision", "torchaudio"):
                stubs[name] = handmade[f"{name}+cpu"]
        if not native(arch, ASCEND_PYTHON):
            # --only-binary=:all: cannot take an sdist: stand in arctic-inference's metadata as pip built it
            arctic = json.loads((OUT / "arctic-inference-0.1.1.json").read_text())
            stubs["arctic-inference"] = arctic
        steps = [f"{n}=={v}" for n, v in sorted(ROUTE_STEPS[arch].items())]
        record_resolve("ascend", arch, ASCEND_PYTHON, core + ASCEND_EXTRA + steps, problems, stubs)
    cuda = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    for version in CUDA_ENDS if "cuda" in routes else ():
        reqs = [r for r in cuda if canonicalize_name(Requirement(r).name) != "vllm"] + [f"vllm=={version}"]
        record_resolve(f"cuda-vllm{version}", "x86_64", PYTHON, core + reqs, problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["single", "handmade", "resolve"], action="append")
    parser.add_argument("--entry", action="append", metavar="NAME==VERSION",
                        help="with --only single: record just these entries of the list")
    parser.add_argument("--route", choices=["ascend", "cuda"], action="append",
                        help="with --only resolve: record just these routes' resolves (default both)")
    args = parser.parse_args()
    parts = args.only or ["single", "handmade", "resolve"]
    OUT.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    if "single" in parts:
        log("single distributions (pip --no-deps, PyPI):")
        for name, version, arches in SINGLE:
            if not args.entry or f"{name}=={version}" in args.entry:
                record_single(name, version, arches, problems)
    handmade = {}
    if "handmade" in parts or "resolve" in parts:
        log("not on PyPI (hand-made or other indexes):")
        handmade = record_handmade(problems)
    if "resolve" in parts:
        log("full resolves:")
        record_resolves(handmade, problems, args.route or ("ascend", "cuda"))
    if problems:
        log("\nNot refreshed from the real source, or failing (expected ones included):")
        for p in problems:
            log(f"  - {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
