"""The install routes resolve: the pinned distributions' real Requires-Dist agree, for each target architecture.

Fixtures in tests/fixtures/install/ are recorded by scripts/record_install_metadata.py from
`pip install --dry-run --report` (PyPI), or hand-made from upstream sources for what is not on PyPI (vLLM built from
source with VLLM_TARGET_DEVICE=empty, triton-ascend from Huawei's index, torch +cpu from PyTorch's CPU index).
The check itself (tests/install_check.py) needs no network and no pip.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import install_check as ic
from conftest import REPO

# Today's `ascend` extra: the "before" case; it must be caught.
OLD_ASCEND = ["torch==2.10.0", "torch-npu==2.10.0.post4", "vllm==0.23.0", "vllm-ascend==0.23.0.post1"]
# The `ascend` extra (one row of compat.yaml with the HCCL engine: vllm-ascend 0.23.0); pip installs it only after
# the route's steps outside PyPI (install_check.ROUTE_STEPS).
PROPOSED_ASCEND = ic.pyproject_extra("ascend")
ROUTE_STEPS = ic.ROUTE_STEPS
NO_STEPS = {"x86_64": {}, "aarch64": {}}
CUDA_ENDS = ("0.22.0", "0.31.0")   # lowest and highest vLLM inside the cuda extra's `vllm>=0.22.0,<=0.31.0`


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def _exact(requirement: str) -> str | None:
    specs = list(Requirement(requirement).specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def closure(route: str, arch: str) -> tuple[dict, dict[str, ic.Dist]]:
    path = ic.FIXTURES / f"resolve-{route}-{arch}.json"
    assert path.exists(), f"{path.name} missing: run scripts/record_install_metadata.py"
    return ic.load_closure(path)


def core_pins(route: str, arch: str) -> dict[str, ic.Dist]:
    """trl 1.16.0 and the project's other dependencies at the versions pip picks with this route (its recorded full
    resolve); a distribution's own single record is used where there is one."""
    _, dists = closure(route, arch)
    pins = {}
    for requirement in project()["dependencies"]:
        name = _name(requirement)
        assert name in dists, f"{name} is not in resolve-{route}-{arch}.json: run scripts/record_install_metadata.py"
        picked = dists[name]
        pins[name] = ic.load(name, picked.version, arch) or picked
    return pins


def route_pins(extra: list[str], arch: str, steps=ROUTE_STEPS, core_route: str = "ascend"):
    """{name: Dist} for an `ascend` extra installed by the route on arch, plus the project's core dependencies;
    and the problems found while pinning (a step that does not meet the extra, a pin without a record)."""
    problems, pins = [], {}
    wanted = {_name(r): r for r in extra}
    for name, version in steps[arch].items():
        wanted.setdefault(name, f"{name}=={version}")
    for name, requirement in wanted.items():
        version = steps[arch].get(name) or _exact(requirement)
        if version is None:
            problems.append(f"{requirement}: not an exact pin")
            continue
        if not Requirement(requirement).specifier.contains(version, prereleases=True):
            problems.append(f"the extra asks {requirement}; the route installs {name} {version}")
        dist = ic.load(name, version, arch)
        if dist is None:
            problems.append(f"{name} {version} ({arch}): no recorded metadata; run scripts/record_install_metadata.py")
            continue
        pins[name] = dist
    for name, dist in core_pins(core_route, arch).items():
        pins.setdefault(name, dist)
    return pins, problems


def ascend_section() -> str:
    page = (REPO / "docs" / "ascend.md").read_text()
    return re.search(r"^### Ascend install.*?(?=^## )", page, re.S | re.M).group(0)


def route_python() -> dict[str, str]:
    """The Ascend route's Python as its two descriptions state it: environment.yml's `python=X.Y` and the venv
    step of docs/ascend.md (`pythonX.Y -m venv`)."""
    env = re.findall(r"^\s*-\s*python\s*=\s*(3\.\d+)\s*$", (REPO / "environment.yml").read_text(), re.M)
    venv = re.findall(r"\bpython(3\.\d+) -m venv\b", ascend_section())
    assert len(env) == 1 and len(venv) == 1, (env, venv)
    return {"environment.yml": env[0], "docs/ascend.md": venv[0]}


def route_conflicts(extra: list[str], arch: str, steps=ROUTE_STEPS, python: str = ic.ASCEND_PYTHON) -> list[str]:
    pins, problems = route_pins(extra, arch, steps)
    outside = {pins[name].index for name in steps[arch] if name in pins}   # what the route's own steps provide
    return problems + ic.check(pins, arch, python, outside=outside)


# --- (a) today's pins fail ---------------------------------------------------------------------------------------------

def test_old_ascend_extra_conflicts_on_x86_64():
    conflicts = route_conflicts(OLD_ASCEND, "x86_64", NO_STEPS)
    assert "torch-npu 2.10.0.post4 requires torch==2.10.0+cpu; pinned torch 2.10.0" in conflicts
    assert "vllm 0.23.0 requires torch==2.11.0; pinned torch 2.10.0" in conflicts
    post1 = [c for c in conflicts if c.startswith("vllm-ascend 0.23.0.post1 is sdist-only on PyPI and pip cannot build")]
    assert post1 and "triton-ascend==3.2.2" in post1[0], conflicts


def test_old_ascend_extra_conflicts_on_aarch64():
    conflicts = route_conflicts(OLD_ASCEND, "aarch64", NO_STEPS)
    assert "vllm 0.23.0 requires torch==2.11.0; pinned torch 2.10.0" in conflicts
    assert any(c.startswith("vllm-ascend 0.23.0.post1 is sdist-only on PyPI") for c in conflicts)
    assert not any(c.startswith("torch-npu") for c in conflicts)   # aarch64 torch-npu takes PyPI's plain torch


def test_each_step_outside_pip_is_needed():
    """The new pins from PyPI alone still fail: every out-of-pip step of the route removes a real conflict."""
    x86 = route_conflicts(PROPOSED_ASCEND, "x86_64", NO_STEPS)
    assert "torch-npu 2.10.0.post4 requires torch==2.10.0+cpu; pinned torch 2.10.0" in x86   # PyTorch CPU index
    assert "vllm 0.23.0 requires torch==2.11.0; pinned torch 2.10.0" in x86                   # vLLM source build
    arm = route_conflicts(PROPOSED_ASCEND, "aarch64", NO_STEPS)
    assert "vllm 0.23.0 requires torch==2.11.0; pinned torch 2.10.0" in arm
    assert not any("torch-npu" in c for c in arm)
    for conflicts in (x86, arm):                                                            # Huawei's index
        assert "triton-ascend 3.2.2 is not on PyPI (from huawei)" in conflicts


# --- (b) the new Ascend route resolves ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ic.ARCHES)
def test_proposed_ascend_route_has_no_conflict(arch):
    assert route_conflicts(PROPOSED_ASCEND, arch) == []


@pytest.mark.parametrize("arch", ic.ARCHES)
def test_pyproject_ascend_extra_resolves(arch):
    """Fails on today's pins (OLD_ASCEND), passes once pyproject's `ascend` extra is the proposed route."""
    assert route_conflicts(project()["optional-dependencies"]["ascend"], arch) == []


def test_transformers_pin_meets_trl_and_vllm():
    """vllm-ascend 0.23.0 pins transformers==5.5.4: TRL 1.16.0 and vLLM 0.23.0 (source) must both accept it."""
    trl = ic.load("trl", "1.16.0", "x86_64")
    vllm = ic.load("vllm", "0.23.0+empty", "x86_64")
    for dist in (trl, vllm):
        (req,) = [Requirement(r) for r in dist.requires_dist if _name(r) == "transformers" and "extra" not in r]
        assert req.specifier.contains("5.5.4"), (dist.label, str(req))
    for arch in ic.ARCHES:
        assert "transformers==5.5.4" in ic.load("vllm-ascend", "0.23.0", arch).requires_dist


@pytest.mark.parametrize("arch", ic.ARCHES)
def test_ascend_route_full_resolve_is_consistent(arch):
    """pip's own resolve of the whole route (core dependencies + the extra + the steps, the non-PyPI pieces handed
    to pip as metadata-only stubs) recorded every distribution; together they leave no requirement unmet."""
    header, dists = closure("ascend", arch)
    for requirement in PROPOSED_ASCEND:
        name = _name(requirement)
        assert dists[name].version == ROUTE_STEPS[arch].get(name, _exact(requirement)), name
    assert set(project()["dependencies"]) <= set(header["requirements"])
    assert header["python"] == ic.ASCEND_PYTHON, "the route's resolve is of another Python: re-record it"
    assert ic.check(dists, arch, header["python"], closed=True) == []


@pytest.mark.parametrize("arch", ic.ARCHES)
def test_ascend_resolve_is_of_its_own_architecture(arch):
    """Evaluated with arch's markers, every distribution of the recorded resolve is required by something. pip takes
    markers from the machine it runs on (--platform only changes wheel tags), so an aarch64 resolve recorded on an
    x86_64 host holds what torch asks for on x86_64 only (nvidia-*-cu12, triton)."""
    header, dists = closure("ascend", arch)
    assert ic.unreached(header, dists, arch, header["python"]) == []


# --- the route's Python has a wheel of every pin ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ic.ARCHES)
def test_the_routes_python_has_a_wheel_of_every_pin(arch):
    """The Python that environment.yml and docs/ascend.md's venv step name must have a wheel of every distribution the
    route pins (the extra, the steps outside PyPI, TRL), by the CPython tags recorded for each (python_tags)."""
    pins, problems = route_pins(PROPOSED_ASCEND, arch)
    assert problems == []
    pinned = {_name(r) for r in PROPOSED_ASCEND} | set(ROUTE_STEPS[arch]) \
        | {_name(r) for r in project()["dependencies"] if _exact(r)}
    missing = []
    for where, python in route_python().items():
        for name in sorted(pinned):
            dist = pins[name]
            if dist.requires_python and not SpecifierSet(dist.requires_python).contains(f"{python}.0"):
                missing.append(f"{where} Python {python}: {dist.label} requires Python {dist.requires_python}")
            missing += [f"{where} Python {python}: {p}" for p in ic.wheel_tag_problems(dist, python, require=True)]
    assert missing == []


def test_the_routes_python_is_the_recorded_one():
    """environment.yml and docs/ascend.md state one Python, the one the route's resolves were recorded for."""
    stated = route_python()
    assert set(stated.values()) == {ic.ASCEND_PYTHON}, stated
    for arch in ic.ARCHES:
        assert closure("ascend", arch)[0]["python"] == ic.ASCEND_PYTHON


def test_x86_64_resolve_puts_nvidia_triton_beside_triton_ascend():
    """Why the route removes `triton` and reinstalls triton-ascend on x86_64 (a step of docs/ascend.md; workbench env checks it):
    vLLM's xgrammar asks for NVIDIA's triton on x86_64, and both distributions write site-packages/triton/."""
    _, x86 = closure("ascend", "x86_64")
    assert {"triton", "triton-ascend"} <= set(x86)
    askers = [d.name for d in x86.values() for r in d.requires_dist or [] if _name(r) == "triton"
              and Requirement(r).marker.evaluate(ic.environment("x86_64", ic.ASCEND_PYTHON))]
    assert askers == ["xgrammar"]
    _, arm = closure("ascend", "aarch64")
    assert "triton" not in arm and "triton-ascend" in arm


# --- (c) the cuda extra ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", CUDA_ENDS)
def test_cuda_extra_window_ends_have_no_conflict(version):
    route = f"cuda-vllm{version}"
    pins = {"vllm": ic.load("vllm", version, "x86_64"), **core_pins(route, "x86_64")}
    assert pins["vllm"] is not None and pins["vllm"].index == "pypi"
    assert ic.check(pins, "x86_64") == []
    header, dists = closure(route, "x86_64")
    assert dists["vllm"].version == version and dists["trl"].version == "1.16.0"
    assert ic.check(dists, "x86_64", closed=True) == []


def trl_vllm_window() -> tuple[str, str]:
    """The vLLM range the installed TRL supports, read from its own check (trl/import_utils.py warns outside it)."""
    source = (Path(importlib.util.find_spec("trl").origin).parent / "import_utils.py").read_text()
    found = re.search(r'Version\("([^"]+)"\)\s*<=\s*_vllm_base_version\s*<=\s*Version\("([^"]+)"\)', source)
    assert found, "TRL's vLLM window check moved out of trl/import_utils.py: read the window from TRL again"
    return found.group(1), found.group(2)


def test_cuda_extra_stays_inside_trls_vllm_window():
    """TRL 1.16 warns for any vLLM above its supported maximum: the cuda extra must not let pip pick one."""
    low, high = trl_vllm_window()
    (vllm,) = [Requirement(r) for r in project()["optional-dependencies"]["cuda"] if _name(r) == "vllm"]
    top = Version(high)
    above = [f"{top.major}.{top.minor}.{top.micro + 1}", f"{top.major}.{top.minor}.{top.micro + 1}rc1",
             f"{top.major}.{top.minor + 1}.0"]
    allowed = [v for v in above if vllm.specifier.contains(v, prereleases=True)]
    trl = importlib.metadata.version("trl")
    assert allowed == [], f"the cuda extra's {vllm} allows vLLM {allowed}, above TRL {trl}'s supported {high}"
    assert vllm.specifier.contains(low) and vllm.specifier.contains(high)
    assert CUDA_ENDS == (low, high)                                    # the recorded resolves are the window's ends
    (trl_extra,) = [Requirement(r) for r in importlib.metadata.requires("trl") if _name(r) == "vllm"]
    assert all(trl_extra.specifier.contains(v) for v in (low, high)) and not any(
        trl_extra.specifier.contains(v, prereleases=True) for v in above)   # TRL's own trl[vllm] says the same


def test_cuda_extra_states_the_driver_its_wheels_need():
    """Both ends of the window take PyPI's CUDA 13 torch (cuda-toolkit 13.0.x), which needs an NVIDIA driver of the
    R580 branch or newer: pyproject's comment on the extra says so."""
    majors = set()
    for version in CUDA_ENDS:
        _, dists = closure(f"cuda-vllm{version}", "x86_64")
        (toolkit,) = [Requirement(r) for r in dists["torch"].requires_dist if _name(r) == "cuda-toolkit"]
        majors |= {Version(s.version).major for s in toolkit.specifier}
    assert majors == {13}
    text = (REPO / "pyproject.toml").read_text()
    comment = re.search(r"((?:^#.*\n)+)cuda = \[", text, re.M).group(1)
    assert "CUDA 13" in comment and "R580" in comment, comment


def test_cuda_window_ends_are_the_extras_and_trls():
    (vllm,) = [Requirement(r) for r in project()["optional-dependencies"]["cuda"] if _name(r) == "vllm"]
    trl = ic.load("trl", "1.16.0", "x86_64")
    (trl_vllm,) = [Requirement(r) for r in trl.requires_dist if _name(r) == "vllm"]   # trl[vllm]
    for version in CUDA_ENDS:
        assert vllm.specifier.contains(version) and trl_vllm.specifier.contains(version)
    assert min(s.version for s in vllm.specifier if s.operator == ">=") == CUDA_ENDS[0]


# --- (d) the fixtures cover what pyproject pins ------------------------------------------------------------------------

def test_every_pin_of_the_extras_has_a_record():
    extras = project()["optional-dependencies"]
    missing = []
    for requirement in extras["ascend"]:
        name, version = _name(requirement), _exact(requirement)
        assert version, f"ascend extra: {requirement} is not an exact pin"
        for arch in ic.ARCHES:
            for v in {version, ROUTE_STEPS[arch].get(name, version)}:
                if ic.load(name, v, arch) is None:
                    missing.append(f"{name} {v} {arch}")
    for version in CUDA_ENDS:
        if ic.load("vllm", version, "x86_64") is None:
            missing.append(f"vllm {version} x86_64")
    assert missing == [], "run scripts/record_install_metadata.py"


def test_recorded_resolves_are_of_todays_dependencies():
    core = project()["dependencies"]
    cuda = [r for r in project()["optional-dependencies"]["cuda"] if _name(r) != "vllm"]
    for version in CUDA_ENDS:
        header, _ = closure(f"cuda-vllm{version}", "x86_64")
        assert header["requirements"] == core + cuda + [f"vllm=={version}"], "run scripts/record_install_metadata.py"
    for arch in ic.ARCHES:
        header, _ = closure("ascend", arch)
        assert header["requirements"][:len(core)] == core, "run scripts/record_install_metadata.py"


# --- the checker itself ------------------------------------------------------------------------------------------------

def _dist(name, version, requires=(), **kw):
    return ic.Dist(name=name, version=version, arch="any", kind="wheel", index="pypi", requires_dist=list(requires), **kw)


def test_checker_local_versions_markers_and_extras():
    a = _dist("a", "1.0", ["torch==2.10.0+cpu; platform_machine == 'x86_64'", "torch==2.10.0; platform_machine == 'aarch64'",
                           "b[fast]>=2", "c<1; python_version > '3.11'"])
    b = _dist("b", "2.0", ["d==1.0; extra == 'fast'", "e==3; extra == 'slow'"])
    torch_plain, torch_cpu = _dist("torch", "2.10.0"), _dist("torch", "2.10.0+cpu")
    d = _dist("d", "2.0")
    e = _dist("e", "1")
    assert ic.check({"a": a, "b": b, "torch": torch_plain, "d": d, "e": e}, "x86_64") == [
        "a 1.0 requires torch==2.10.0+cpu; pinned torch 2.10.0",
        "b 2.0 requires d==1.0; pinned d 2.0",            # b's "fast" extra, asked for by a
    ]
    assert ic.check({"a": a, "b": b, "torch": torch_cpu, "d": _dist("d", "1.0")}, "x86_64") == []
    assert ic.check({"a": a, "b": b, "torch": torch_cpu, "d": _dist("d", "1.0")}, "aarch64") == []
    assert ic.check({"a": a, "b": b, "torch": torch_plain}, "x86_64", closed=True)[-1] == \
        "b 2.0 requires d==1.0; not in the environment"


def test_checker_availability_and_unpinned_exact_pins():
    wheel_x86 = ic.Dist("w", "1", arch="x86_64", kind="wheel", index="pypi", requires_dist=["z==1"])
    broken = ic.Dist("s", "1", arch="any", kind="sdist", index="pypi", builds=False, build_error="boom")
    other = _dist("o", "1", ["z>=2"], requires_python=">=3.12")
    huawei = ic.Dist("h", "1", arch="any", kind="wheel", index="huawei", requires_dist=[],
                     extra={"python_tags": ["cp39", "cp310"]})
    assert ic.check({"w": wheel_x86, "s": broken, "o": other, "h": huawei}, "aarch64") == [
        "h 1 has no wheel recorded for cp311 (recorded: cp39, cp310); target 3.11",
        "no z satisfies all of: o 1 requires z>=2; w 1 requires z==1",
        "o 1 requires Python >=3.12; target 3.11",
        "s 1 is sdist-only on PyPI and pip cannot build it: boom",
        "w 1 has no wheel for aarch64 (recorded: x86_64)",
    ]
    assert ic.check({"h": huawei}, "aarch64", outside=set()) == [
        "h 1 has no wheel recorded for cp311 (recorded: cp39, cp310); target 3.11", "h 1 is not on PyPI (from huawei)"]
    assert ic.wheel_tag_problems(huawei, "3.10") == []
    untagged = ic.Dist("u", "1", arch="x86_64", kind="wheel", index="pypi", requires_dist=[])
    assert ic.wheel_tag_problems(untagged, "3.12") == []
    assert ic.wheel_tag_problems(untagged, "3.12", require=True) == [
        "u 1: no wheel tags recorded (python_tags); cannot tell whether Python 3.12 has a wheel"]
    assert ic.wheel_tag_problems(_dist("pure", "1"), "3.12", require=True) == []   # py3-none-any


def test_checker_reachability_uses_the_target_machines_markers():
    """A resolve is checked with its own architecture's markers: what only x86_64 asks for is foreign on aarch64."""
    top = _dist("top", "1", ["gpu==1; platform_machine == 'x86_64'", "both[x]>=1"])
    both = _dist("both", "1", ["extra-dep==1; extra == 'x'", "old==1; python_version < '3.12'"])
    dists = {d.name: d for d in (top, both, _dist("gpu", "1"), _dist("extra-dep", "1"), _dist("old", "1"))}
    header = {"requirements": ["top==1"]}
    assert ic.unreached(header, dists, "x86_64", "3.11") == []
    assert ic.unreached(header, dists, "aarch64", "3.11") == [
        "gpu 1 is in the aarch64 resolve, but nothing requires it on aarch64 (Python 3.11)"]
    assert ic.unreached(header, dists, "x86_64", "3.12") == [
        "old 1 is in the x86_64 resolve, but nothing requires it on x86_64 (Python 3.12)"]


def test_recording_script_records_this_route():
    """scripts/record_install_metadata.py resolves the same extra, steps and window ends that this file checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_install_metadata",
                                                  REPO / "scripts" / "record_install_metadata.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.ASCEND_EXTRA == PROPOSED_ASCEND  # both read pyproject's extra
    assert tuple(script.CUDA_ENDS) == CUDA_ENDS
    assert script.OUT == ic.FIXTURES and script.PYTHON == ic.PYTHON
