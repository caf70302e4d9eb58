"""A metadata-only install check: do these pinned distributions agree with each other?

Reads the compact fixtures that `scripts/record_install_metadata.py` writes into tests/fixtures/install/ (each one the
real `Requires-Dist` of one distribution, taken from `pip install --dry-run --report`, or hand-made from upstream
sources where the distribution is not on PyPI) and evaluates them the way pip's resolver would for one target:
markers for that architecture and Python, requested extras followed, PEP 440 matching (so `==2.10.0+cpu` is NOT
met by a plain 2.10.0, while `==2.10.0` is met by 2.10.0+cpu). No network, no pip, no workbench import.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "install"
PYTHON = "3.11"            # the CUDA routes' records (scripts/record_install_metadata.py's PYTHON)
# The Ascend route's Python: triton-ascend 3.2.2's wheels are cp312 only (its fixture's python_tags) and upstream's
# vllm-ascend v0.23.0 images are Python 3.12. tests/test_install_pins.py holds docs/ascend.md and environment.yml to it.
ASCEND_PYTHON = "3.12"
ARCHES = ("x86_64", "aarch64")
# Where a distribution comes from. Everything but "pypi" is a step outside pip's default index (docs/ascend.md).
OUTSIDE_PYPI = {"source", "huawei", "pytorch-cpu"}
# The Ascend route's steps outside pip's default index and what they leave installed (docs/ascend.md, "Ascend install"):
# x86_64: PyTorch's CPU index (torch-npu's x86_64 wheels require torch==2.10.0+cpu); both: triton-ascend from Huawei's
# index; vLLM from a v0.23.0 checkout with VLLM_TARGET_DEVICE=empty (no torch pin of its own, version 0.23.0+empty).
ROUTE_STEPS = {
    "x86_64": {"torch": "2.10.0+cpu", "torchvision": "0.25.0+cpu", "torchaudio": "2.10.0+cpu",
               "triton-ascend": "3.2.2", "vllm": "0.23.0+empty"},
    "aarch64": {"triton-ascend": "3.2.2", "vllm": "0.23.0+empty"},
}


def pyproject_extra(name: str) -> list[str]:
    """A pyproject.toml extra of this repository, as requirement strings."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    return list(project["optional-dependencies"][name])


@dataclass
class Dist:
    name: str
    version: str
    arch: str                      # "x86_64", "aarch64" or "any" (pure-Python wheel, sdist, source build)
    kind: str                      # "wheel" | "sdist" | "source"
    index: str                     # "pypi" | "source" | "huawei" | "pytorch-cpu"
    requires_python: str | None = None
    requires_dist: list[str] | None = None
    builds: bool | None = None     # sdists: did pip manage to build its metadata (None: not an sdist)
    build_error: str | None = None
    note: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def _dist(data: dict) -> Dist:
    known = {f for f in Dist.__dataclass_fields__ if f != "extra"}
    return Dist(**{k: v for k, v in data.items() if k in known},
                extra={k: v for k, v in data.items() if k not in known})


def fixture_path(name: str, version: str, arch: str | None = None) -> Path:
    name = canonicalize_name(name)
    return FIXTURES / (f"{name}-{version}-{arch}.json" if arch else f"{name}-{version}.json")


def load(name: str, version: str, arch: str) -> Dist | None:
    """The recorded metadata of name==version for arch: the arch's wheel, else the arch-independent record."""
    for path in (fixture_path(name, version, arch), fixture_path(name, version)):
        if path.exists():
            return _dist(json.loads(path.read_text()))
    return None


def load_closure(path: Path) -> tuple[dict, dict[str, Dist]]:
    """A recorded full resolve: (its header, {name: Dist}) for every distribution pip would install."""
    data = json.loads(path.read_text())
    dists = {canonicalize_name(d["name"]): _dist({"arch": data["arch"], **d}) for d in data["install"]}
    return {k: v for k, v in data.items() if k != "install"}, dists


def environment(arch: str, python: str = PYTHON) -> dict[str, str]:
    """PEP 508 marker environment of a manylinux CPython target."""
    return {
        "implementation_name": "cpython", "implementation_version": f"{python}.0",
        "os_name": "posix", "platform_machine": arch, "platform_release": "", "platform_system": "Linux",
        "platform_version": "", "python_full_version": f"{python}.0",
        "platform_python_implementation": "CPython", "python_version": python, "sys_platform": "linux",
    }


def _applies(req: Requirement, env: dict, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in {""} | extras)


def _show(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{canonicalize_name(req.name)}{extras}{req.specifier}"


def _contains(spec: SpecifierSet, version: str) -> bool:
    return spec.contains(Version(version), prereleases=True)


def availability(dist: Dist, arch: str, outside: set[str] = OUTSIDE_PYPI) -> list[str]:
    """Why pip could not install this distribution on arch (empty: it can). outside: the sources other than PyPI that
    the install route provides (a source build, Huawei's index, PyTorch's CPU index)."""
    if dist.index != "pypi":
        return [] if dist.index in outside else [f"{dist.label} is not on PyPI (from {dist.index})"]
    if dist.kind == "wheel":
        if dist.arch not in (arch, "any"):
            return [f"{dist.label} has no wheel for {arch} (recorded: {dist.arch})"]
        return []
    if dist.kind == "sdist":
        if dist.builds:
            return []
        why = f": {dist.build_error}" if dist.build_error else ""
        return [f"{dist.label} is sdist-only on PyPI and pip cannot build it{why}"]
    return [f"{dist.label}: unknown kind {dist.kind!r}"]


def cp_tag(python: str) -> str:
    return "cp" + python.replace(".", "")


def wheel_tag_problems(dist: Dist, python: str, require: bool = False) -> list[str]:
    """Whether a wheel of dist exists for CPython `python`, from the CPython tags recorded for it (python_tags: the tags
    a wheel is known to exist for, each list with its python_tags_source). require: a platform wheel without recorded
    tags is a problem too (for the pins of a route; a recorded resolve's own entries were picked for its Python)."""
    tags = dist.extra.get("python_tags")
    if tags:
        return [] if cp_tag(python) in tags else [
            f"{dist.label} has no wheel recorded for {cp_tag(python)} (recorded: {', '.join(tags)}); target {python}"]
    if require and dist.kind == "wheel" and (dist.arch != "any" or dist.index != "pypi"):
        return [f"{dist.label}: no wheel tags recorded (python_tags); cannot tell whether Python {python} has a wheel"]
    return []


def check(pins: dict[str, Dist], arch: str, python: str = PYTHON,
          requested: dict[str, set[str]] | None = None, closed: bool = False,
          outside: set[str] = OUTSIDE_PYPI) -> list[str]:
    """Every conflict among the pinned distributions, as readable lines (empty: they agree).

    pins: {name: Dist}, one installed version per name. requested: extras asked for at the top
    (`{"fastapi": {"standard"}}`); extras asked for by a pinned distribution's own requirements are followed too.
    outside: the non-PyPI sources the route provides (pass an empty set for "plain pip from PyPI").
    closed: the pins are a whole environment (a recorded full resolve), so a requirement on a name that is not pinned
    is a missing distribution. Otherwise requirements on unpinned names are only compared with each other where one
    of them is an exact `==` pin.
    """
    pins = {canonicalize_name(k): v for k, v in pins.items()}
    env = environment(arch, python)
    conflicts: list[str] = []
    for name, dist in sorted(pins.items()):
        if dist.requires_python and not _contains(SpecifierSet(dist.requires_python), f"{python}.0"):
            conflicts.append(f"{dist.label} requires Python {dist.requires_python}; target {python}")
        conflicts += wheel_tag_problems(dist, python)
        conflicts += availability(dist, arch, outside)
        if dist.requires_dist is None and not (dist.kind == "sdist" and not dist.builds):
            conflicts.append(f"{dist.label}: no recorded Requires-Dist")

    # which extras are active: the requested ones, then whatever active requirements ask for, to a fixed point
    extras = {n: set(e) for n, e in ((canonicalize_name(k), v) for k, v in (requested or {}).items())}
    parsed = {n: [Requirement(r) for r in (d.requires_dist or [])] for n, d in pins.items()}
    changed = True
    while changed:
        changed = False
        for name, reqs in parsed.items():
            for req in reqs:
                target = canonicalize_name(req.name)
                if req.extras and _applies(req, env, extras.get(name, set())):
                    if not set(req.extras) <= extras.setdefault(target, set()):
                        extras[target] |= set(req.extras)
                        changed = True

    unpinned: dict[str, list[tuple[Dist, Requirement]]] = {}
    for name, reqs in sorted(parsed.items()):
        dist = pins[name]
        for req in reqs:
            if not _applies(req, env, extras.get(name, set())):
                continue
            target = canonicalize_name(req.name)
            if target == name:
                continue                   # self-reference through an extra (`pkg[extra]` in pkg's own metadata)
            if target in pins:
                have = pins[target]
                if not _contains(req.specifier, have.version):
                    conflicts.append(f"{dist.label} requires {_show(req)}; pinned {have.label}")
            elif closed:
                conflicts.append(f"{dist.label} requires {_show(req)}; not in the environment")
            else:
                unpinned.setdefault(target, []).append((dist, req))

    # unpinned names: where someone asks for an exact version, one of the exact versions must satisfy everybody
    for target, wants in sorted(unpinned.items()):
        candidates = {s.version for _, r in wants for s in r.specifier
                      if s.operator in ("==", "===") and "*" not in s.version}
        if candidates and not any(all(_contains(r.specifier, c) for _, r in wants) for c in candidates):
            conflicts.append(f"no {target} satisfies all of: "
                             + "; ".join(f"{d.label} requires {_show(r)}" for d, r in wants))
    return sorted(set(conflicts))


def unreached(header: dict, dists: dict[str, Dist], arch: str, python: str) -> list[str]:
    """The distributions of a recorded resolve that nothing reaches from its requirements under arch's and python's
    markers (extras followed): pip evaluates markers on the machine it runs on, so a resolve recorded for aarch64 on
    an x86_64 host drags in what only x86_64 markers ask for (torch's nvidia-* and triton). Empty: it is arch's."""
    env = environment(arch, python)
    extras: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo: list[Requirement] = [Requirement(r) for r in header["requirements"]]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        new_extras = set(req.extras) - extras.setdefault(name, set())
        if name in seen and not new_extras:
            continue
        seen.add(name)
        extras[name] |= new_extras
        dist = dists.get(name)
        if dist is None:
            continue
        for text in dist.requires_dist or []:
            sub = Requirement(text)
            if _applies(sub, env, extras[name]):
                todo.append(Requirement(str(sub).split(";")[0]))
    return [f"{dists[n].label} is in the {arch} resolve, but nothing requires it on {arch} (Python {python})"
            for n in sorted(set(dists) - seen)]


def notes(pins: dict[str, Dist], arch: str) -> list[str]:
    """What is not a conflict but is not a plain PyPI wheel either (steps docs/ascend.md must state)."""
    out = []
    for dist in sorted(pins.values(), key=lambda d: d.name):
        if dist.index in OUTSIDE_PYPI:
            out.append(f"{dist.label}: from {dist.index}" + (f" ({dist.note})" if dist.note else ""))
        elif dist.kind == "sdist" and dist.builds:
            out.append(f"{dist.label}: sdist only on PyPI, pip builds it on {arch}")
    return out
