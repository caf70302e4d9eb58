"""The notebooks' one setup call (recipe loaded and resolved, run directory opened or created), and JupyterLab for them.

    rr, run = notebook.setup(recipe, overrides, run_dir, kind="train")
    workbench lab            # (make lab) JupyterLab on 127.0.0.1:8888, new notebooks on the project's kernel

An entry point like the CLI: papermill hands each notebook the run's recipe.yaml and the run directory
(`workbench run`); a notebook opened by hand gets a recipe name and an empty run_dir, and a new run directory is made.
Overrides may be a list of `section.key=value` words, one space-separated string (what `papermill -p` passes), or
that list written as text (`-p overrides '["server.port=8011"]'`: papermill -p hands the notebook a string).
"""
from __future__ import annotations

import shlex

from workbench import recipe as recipes
from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.rundir import RunDir


def parameter_list(value, name: str = "overrides", example: str = "section.key=value") -> list[str]:
    """A notebook's list parameter as papermill users pass it: a list, one space-separated string (`-p` passes a
    string), or a list typed as text (JSON or YAML flow style)."""
    if value is None:
        return []
    if isinstance(value, str):
        import yaml

        text = value.strip()
        try:
            if text.startswith("["):
                return parameter_list(yaml.safe_load(text), name, example)
            return shlex.split(text)
        except (yaml.YAMLError, ValueError) as exc:  # a broken list, or shlex's unbalanced quotes
            raise WorkbenchError(f"{name} {text[:80]!r} does not parse ({getattr(exc, 'problem', None) or exc})",
                                 f"write it as '[\"{example}\", ...]', or as space-separated words") from None
    if isinstance(value, (list, tuple)):
        return [str(o) for o in value]
    raise WorkbenchError(f"{name} is a {type(value).__name__}",
                         f"pass a list of {example} words, or one space-separated string")


def overrides_list(overrides) -> list[str]:
    return parameter_list(overrides)


def setup(recipe: str, overrides=None, run_dir: str = "", kind: str = "run",
          extra: dict | None = None) -> tuple[Resolved, RunDir]:
    """Load the recipe (+ overrides, + `extra` dotted values), resolve it, and open `run_dir` or create a run."""
    r = recipes.load(recipe, overrides_list(overrides))
    if extra:
        r = recipes.load(r, extra)
    run = RunDir.at(run_dir, r) if run_dir else RunDir.create(r, kind)
    return recipes.resolve(r), run


KERNEL = "grpo-workbench"  # the project's Jupyter kernel, as `make install` registers it (Makefile: KERNEL)


def kernel_name() -> str:
    """The project's kernel when registered (make install does it), else the default python3 kernel."""
    from jupyter_client.kernelspec import KernelSpecManager

    return KERNEL if KERNEL in KernelSpecManager().find_kernel_specs() else "python3"


def lab_command(port: int = 8888, root: str = ".", open_browser: bool = True, extra: list[str] | None = None) -> list[str]:
    """JupyterLab for the notebooks (`make lab`, `workbench lab`): on loopback only (a notebook server runs code:
    never on a network address by accident), opening notebooks/, new notebooks on the project's kernel."""
    import sys

    cmd = [sys.executable, "-m", "jupyter", "lab", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
           f"--MappingKernelManager.default_kernel_name={kernel_name()}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if not open_browser:
        cmd.append("--no-browser")
    return cmd + list(extra or [])
