"""The package's seams, checked on its source: private names stay private, platform detection happens in one place,
light commands stay light, and nothing reaches outside the repository."""
from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "workbench"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "notebooks" not in p.parts)
# The recipe resolver is the one caller of the detection; detect.py defines it.
DETECTION_ALLOWED = {"workbench/recipe/resolve.py", "workbench/platform/detect.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(tree: ast.AST) -> dict[str, str]:
    """Local names bound to workbench modules by this file's imports: name -> module."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("workbench") and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or \
                        (PACKAGE.parent / Path(*candidate.split("."))).is_dir():
                    bound[alias.asname or alias.name] = candidate
    return bound


def private_uses(path: Path) -> list[str]:
    """`from workbench.x import _y` and `x._y` where x is a workbench module, from another module."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("workbench") and node.module != me:
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    modules = _imported_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__") and modules[node.value.id] != me:
                found.append(f"{node.value.id}.{node.attr}")
    return found


def detection_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"line {n.lineno}" for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id == "detect_platform")
            or (isinstance(n, ast.Attribute) and n.attr == "detect_platform")
            or (isinstance(n, ast.alias) and n.name == "detect_platform")]


def test_the_ast_checks_see_what_they_look_for(tmp_path):
    """The checks below must be able to fail: they find a planted private import and a planted detection call."""
    bad = PACKAGE / "observe" / "_planted_for_test.py"
    bad.write_text("from workbench.tasks.rewards import _boxed\nfrom workbench.tasks import rewards\n"
                   "rewards._FORMAT\nfrom workbench.platform.detect import detect_platform\ndetect_platform()\n")
    try:
        assert private_uses(bad) == ["from workbench.tasks.rewards import _boxed", "rewards._FORMAT"]
        assert len(detection_calls(bad)) == 2
    finally:
        bad.unlink()


def test_no_module_uses_another_modules_private_names():
    offenders = {str(p.relative_to(REPO)): private_uses(p) for p in MODULES}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_the_resolver_detects_the_platform():
    callers = {str(p.relative_to(REPO)): detection_calls(p) for p in MODULES}
    callers = {k: v for k, v in callers.items() if v and k not in DETECTION_ALLOWED}
    assert callers == {}
    # and the notebooks (entry points) resolve through workbench.notebook.setup, never detect themselves
    for nb in (PACKAGE / "notebooks").glob("*.ipynb"):
        assert "detect_platform" not in nb.read_text()


def test_no_file_in_package_or_tests_reaches_outside_the_repository():
    for path in MODULES + sorted((REPO / "tests").glob("*.py")):
        text = path.read_text()
        beside = "sha" + "red"  # the workspace folder beside the checkout (spelled so this file does not name it)
        assert f"../{beside}" not in text and f"/{beside}/" not in text and "parents" + "[2]" not in text, path
        assert "parent.parent" not in text or path.parent.name == "tests", path  # tests find REPO that way


def test_layout_groups_modules_by_concern():
    """`ls workbench/` reads as the system's diagram: a few rooms, each with a docstring saying what it holds."""
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["evaluation", "observe", "platform", "recipe", "serving", "tasks", "training"]
    for room in rooms:
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())), room
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 10, loose  # entry points and the few seams everyone shares
    for path in MODULES:
        if path.name != "__init__.py" or path.parent == PACKAGE:
            assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no module docstring"


HEAVY = ("torch", "transformers", "vllm", "trl")
PROBE = ("import runpy, sys\nsys.argv = ['workbench'] + sys.argv[1:]\n"
         "try:\n    runpy.run_module('workbench', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
         "else:\n    code = 0\n"
         "print('HEAVY=' + ','.join(m for m in %r if m in sys.modules), file=sys.stderr)\nsys.exit(code or 0)\n" % (HEAVY,))


@pytest.mark.parametrize("command", [
    ["recipe", "show", "cpu-tiny"],
    ["recipe", "show", "ascend-910b-8card"],
    ["recipe", "list"],
    ["report", "{run}"],
    ["advise", "{run}"],
    ["stop", "{run}"],
])
def test_light_commands_do_not_import_torch_transformers_or_vllm(command, smoke_run, tmp_path):
    import shutil

    run_src, _ = smoke_run
    run = tmp_path / "run"
    shutil.copytree(run_src.path, run, ignore=shutil.ignore_patterns("final", "checkpoints*"))
    argv = [a.replace("{run}", str(run)) for a in command]
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={**__import__("os").environ, "WORKBENCH_PLATFORM": ""})
    seconds = time.perf_counter() - started
    assert out.returncode == 0, out.stderr[-2000:]
    heavy = [line for line in out.stderr.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], f"{command} imported {heavy} ({seconds:.1f}s)"
    print(f"{' '.join(command[:2])}: {seconds:.2f}s")


def test_grpo_fields_read_from_source_match_the_real_class():
    """The light trainer-key check (an AST read of TRL's source) knows exactly GRPOConfig's fields and defaults."""
    import dataclasses

    from trl import GRPOConfig

    from workbench.recipe import trl_fields

    real = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    read = trl_fields.fields()
    assert set(read) == set(real)
    literal = {k: v for k, v in read.items() if v is not trl_fields.MISSING}
    assert len(literal) > 100
    for name, value in literal.items():
        if real[name].default is not dataclasses.MISSING:
            assert value == real[name].default, name
