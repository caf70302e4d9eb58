"""The package's seams, checked on its source: the rooms stand on floors (no import runs up, no circle), private
names stay private, platform detection happens in one place, light commands stay light, and nothing reaches outside
the repository."""
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
    assert rooms == ["evaluation", "experiments", "observe", "platform", "recipe", "serving", "tasks", "training"]
    for room in rooms:
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())), room
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 14, loose  # entry points and the few seams everyone shares, each on a floor (FLOORS)
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


# ----------------------------------------------------------------------------------------------------------------
# Floors: the rooms in the order they are built on each other. A room imports only itself and rooms on lower
# floors (imports inside functions count too: they run just the same); rooms on one floor stand apart.
FLOORS = (
    ("errors", "paths", "secrets", "records"),  # what every room shares; none knows another room
    ("rundir",),                                 # the run directory's file names (its writer: write_atomic)
    ("platform", "tasks", "plots"),              # the machine, the task and headless figures: no recipe in them
    ("recipe",),                                 # one YAML file, checked against the rooms below, resolved
    ("tinymodel", "envcheck", "notebook"),       # what a recipe needs before anything is served
    ("serving",),
    ("training",),
    ("evaluation", "plan"),
    ("observe",),                                # the readers of what training and evaluation wrote
    ("experiments", "pipeline"),                 # workflows over all of the above
    ("cli",),
    ("__main__",),
)
# (importing room, imported room): why an import may run up. Each one is a debt, named here.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def room_of(module: str) -> str:
    """workbench.serving.sync -> serving; workbench.records -> records; workbench -> the package's face."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor_of(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the workbench modules it imports (anywhere in the file), from module name -> source text."""
    graph: dict[str, set[str]] = {}
    for module, text in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in sources]
                # `from pkg import sub` imports the submodule; any other name is the package's (or module's) own
                names = modules + ([node.module] if len(modules) < len(node.names) else [])
            targets |= {n for n in names if n.split(".")[0] == "workbench" and n in sources}
        graph[module] = targets - {module}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        mine = room_of(module)
        for target in sorted(targets):
            theirs = room_of(target)
            if "" in (mine, theirs) or mine == theirs or (mine, theirs) in UPWARD_ALLOWED:
                continue
            if floor_of(theirs) >= floor_of(mine):
                found.append(f"{module} -> {target} ({mine} on floor {floor_of(mine) + 1}, {theirs} on "
                             f"{floor_of(theirs) + 1})")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in MODULES}


def test_every_room_is_on_a_floor():
    rooms = {room_of(m) for m in _package_sources()} - {""}
    declared = {room for floor in FLOORS for room in floor}
    assert rooms == declared, (f"not on a floor: {sorted(rooms - declared)}; "
                               f"declared but gone: {sorted(declared - rooms)}")


def test_no_import_runs_up_and_no_circle():
    graph = import_graph(_package_sources())
    assert upward_imports(graph) == []
    assert circles(graph) == []
    assert len(UPWARD_ALLOWED) <= 2


def test_the_floor_checks_see_a_planted_upward_import_and_circle():
    sources = _package_sources()
    sources["workbench.records"] += "\nfrom workbench.serving import client\n"
    sources["workbench.serving.client"] += "\nimport workbench.records\n"
    graph = import_graph(sources)
    assert [line.split(" (")[0] for line in upward_imports(graph)] == ["workbench.records -> workbench.serving.client"]
    assert ["workbench.records", "workbench.serving.client"] in circles(graph)


# ----------------------------------------------------------------------------------------------------------------
# One object owns the run directory's file names (workbench/rundir.py): no other module builds a path from one.

# The numbered and derived names rundir.py makes (checkpoint-8, step_000008.parquet, ...), by their fixed part.
TEMPLATED = ("checkpoint-", "completions_", "step_", ".before-restart-", "restart.request", "restart.answer",
             "vllm-server-", ".incomplete", "-compare", "model.safetensors")
# (file, name): a path that shares a run-file name but is no run's.
NOT_RUN_FILES = {("workbench/paths.py", "notebooks"): "the package's own notebooks, not a run's executed copies"}
PATH_CALLS = {"glob", "rglob", "with_name", "with_suffix", "joinpath", "Path"}


def run_file_names() -> set[str]:
    """Every file and directory name a run gets, read off rundir's objects for a sample run."""
    from workbench import rundir

    run = rundir.RunDir("/run")
    holders = [run, run.train, run.smoke, run.offline, run.serving, run.eval, run.bench, run.lab, run.protocol,
               run.server, rundir.comparison("/out")]
    names = set()
    for holder in holders:
        for attr in dir(holder):
            if not attr.startswith("_") and isinstance(value := getattr(holder, attr, None), Path):
                names.add(value.name)
    return names - {"run", "out"}


def _literal(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def run_paths_spelled(text: str, where: str, names: set[str]) -> list[str]:
    """Path constructions (`x / "name"`, glob/with_name/Path(...) of a literal) that spell a run-file name."""
    found = []
    for node in ast.walk(ast.parse(text)):
        literals = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            literals = [_literal(node.right)]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in PATH_CALLS:
                literals = [_literal(a) for a in node.args]
        for text_ in filter(None, literals):
            parts = set(text_.replace("{}", "/").split("/")) - {""}
            if ((parts & names) or any(t in text_ for t in TEMPLATED)) and (where, text_) not in NOT_RUN_FILES:
                found.append(f"{where}:{node.lineno}: {text_!r}")
    return found


def _notebook_code(path: Path) -> str:
    """A notebook's code cells as one module (IPython's % and ! lines left out)."""
    import json

    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(line for line in c["source"] if not line.lstrip().startswith(("%", "!")))
                     for c in cells if c["cell_type"] == "code")


def test_only_rundir_spells_the_names_of_a_runs_files():
    names = run_file_names()
    assert {"metrics.jsonl", "train.json", "checkpoints", "final", "STOP", "samples.jsonl", "report.html"} <= names
    spelled = []
    for path in MODULES:
        where = str(path.relative_to(REPO))
        if where != "workbench/rundir.py":
            spelled += run_paths_spelled(path.read_text(), where, names)
    for path in sorted((PACKAGE / "notebooks").glob("*.ipynb")):  # the notebooks write into runs too
        spelled += run_paths_spelled(_notebook_code(path), str(path.relative_to(REPO)), names)
    assert spelled == []


def test_the_run_file_check_sees_a_planted_path():
    planted = ('p = run.path / "train" / "metrics.jsonl"\nq = d.glob("checkpoint-*")\n'
               'r = Path(f"{d}/train.json")\nmessage = "see train.json"\n')
    found = run_paths_spelled(planted, "planted.py", run_file_names())
    assert sorted(line.split(": ", 1)[1] for line in found) == ["'checkpoint-*'", "'metrics.jsonl'", "'train'",
                                                                "'{}/train.json'"]  # not the message
