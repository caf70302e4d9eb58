"""The install files agree with each other and with the version matrix."""
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from workbench.platform import compat

REPO = Path(__file__).resolve().parent.parent


def _pins(requirements):
    pins = {}
    for text in requirements:
        if text.startswith("-"):  # pip options: -e ., --extra-index-url (not requirements)
            continue
        req = Requirement(text)
        (spec,) = list(req.specifier) if len(req.specifier) == 1 else (None,)
        if spec is not None and spec.operator == "==":
            pins[req.name.replace("_", "-").lower()] = spec.version
    return pins


def _environment_yml():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    return env, _pins(pip), python.split("=", 1)[1]


def _row_check(pins, python=None):
    row = compat.row_for(pins["vllm-ascend"])
    assert row is not None, f"vllm-ascend {pins['vllm-ascend']} is not in compat.yaml"
    assert pins["vllm"] == row["vllm"]
    assert pins["torch"] == row["torch"]
    assert pins["torch-npu"] == row["torch_npu"]
    if python:
        assert Version(python + ".0") in SpecifierSet(row["python"])
    return row


def test_environment_yml_is_one_matrix_row():
    env, pins, python = _environment_yml()
    row = _row_check(pins, python)
    assert env["variables"]["CANN_VERSION"] == row["cann"]
    assert row == compat.recommended()


def test_pyproject_ascend_extra_is_the_same_row_as_environment_yml():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ascend = _pins(project["optional-dependencies"]["ascend"])
    _, env_pins, _ = _environment_yml()
    _row_check(ascend)
    assert ascend == env_pins


def test_ascend_row_sits_in_trls_vllm_window():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    trl = _pins(project["dependencies"])["trl"]
    assert compat.matrix()["trl_vllm_window"]["trl"] == trl
    assert compat.in_trl_window(compat.recommended()["vllm"])
    cuda = [Requirement(r) for r in project["optional-dependencies"]["cuda"] if r.startswith("vllm")][0]
    window = compat.matrix()["trl_vllm_window"]
    assert window["min"] in cuda.specifier and window["max"] in cuda.specifier and "0.31.1" not in cuda.specifier


def test_cpu_extra_matches_the_tested_stack():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cpu = {Requirement(r).name: Requirement(r).specifier for r in project["optional-dependencies"]["cpu"]}
    assert str(cpu["torch"]) == "==2.13.0"  # unpinned torch pulls a CUDA build
    assert "5.19.0" in cpu["transformers"] and "5.20.0" not in cpu["transformers"]


def test_matrix_rows_are_well_formed():
    for row in compat.rows():
        assert set(row) == {"vllm_ascend", "vllm", "python", "cann", "torch", "torch_npu"}
        assert Version(row["vllm_ascend"]).base_version.startswith(Version(row["vllm"]).base_version[:4])
        SpecifierSet(row["python"])
    assert compat.row_for("0.23.0.post1")["cann"] == "9.1.0"
    assert compat.row_for("0.23.0rc1")["cann"] == "9.0.1"
    assert compat.row_for("9.9.9") is None


def test_makefile_installs_what_the_readme_promises():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "uninstall" in makefile and "torchvision" in makefile and "workbench kernel" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_package_data_ships_every_non_python_file_of_the_package():
    """Recipes, the version matrix and the staged notebooks live inside the package; a wheel must carry them."""
    import fnmatch

    from workbench import paths, recipe

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["workbench"]
    package = REPO / "workbench"
    data = [p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert {"platform/compat.yaml", "recipe/recipes/cpu-tiny.yaml", "notebooks/05_evaluation.ipynb"} <= set(data)
    assert [d for d in data if not any(fnmatch.fnmatch(d, g) for g in globs)] == []
    assert recipe.RECIPES_DIR == package / "recipe" / "recipes"
    assert Path(paths.notebooks_dir()).resolve() == package / "notebooks"
    # tomllib (this file) needs 3.11; the project says so
    assert Version("3.10") not in SpecifierSet(pyproject["project"]["requires-python"])
    assert Version("3.11") in SpecifierSet(pyproject["project"]["requires-python"])
