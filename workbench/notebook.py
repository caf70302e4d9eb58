"""The notebooks' one setup call (recipe loaded and resolved, run directory opened or created), and JupyterLab for them.

    rr, run = notebook.setup(recipe, overrides, run_dir, kind="train")
    workbench lab            # (make lab) JupyterLab on 127.0.0.1:8888, new notebooks on the project's kernel
    workbench kernel         # register this environment as the grpo-workbench kernel (papermill -k grpo-workbench)

An entry point like the CLI: papermill hands each notebook the run's recipe.yaml and the run directory
(`workbench run`). The staged notebooks opened by hand (an empty run_dir) share one run directory, as `workbench
run` does: 00 makes a new `<time>-<recipe>-notebooks/` under monitor.runs_dir, and 01–05 find the newest one of
their recipe and overrides (or make one, when 00 was skipped or ran with other overrides), so 05 evaluates what 04
trained. Each says which it took; a
run_dir given chooses another. The tools (06–08) make runs of their own.
Overrides may be a list of `section.key=value` words, one space-separated string (what `papermill -p` passes), or
that list written as text (`-p overrides '["server.port=8011"]'`: papermill -p hands the notebook a string).
"""
from __future__ import annotations

import shlex
from pathlib import Path

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


STAGES = ("env", "offline", "serving", "smoke", "train", "eval")  # the kinds of notebooks 00-05, in order
WALK = "notebooks"  # the kind of the run directory the staged notebooks share when opened by hand


def setup(recipe: str, overrides=None, run_dir: str = "", kind: str = "run",
          extra: dict | None = None, log=print) -> tuple[Resolved, RunDir]:
    """Load the recipe (+ overrides, + `extra` dotted values), resolve it, and open `run_dir`; without one, a
    staged notebook takes its walk's run directory (the module docstring), a tool makes a run of its own."""
    given = recipes.load(recipe, overrides_list(overrides))
    r = recipes.load(given, extra) if extra else given
    if run_dir:
        run = RunDir.at(run_dir, r)
    elif kind not in STAGES:
        run = RunDir.create(r, kind)
    else:
        # only a walk of these very settings: 04 trains from the run's recipe.yaml, so a walk made with other
        # overrides would train what this notebook does not say
        latest = None if kind == STAGES[0] else RunDir.latest(given.monitor.runs_dir, given.name, WALK, given)
        run = latest or RunDir.create(given, WALK)
        how = ("the newest notebook walk of this recipe and these overrides" if latest else
               "a new notebook walk" + ("" if kind == STAGES[0] else ": no walk of this recipe with these overrides"))
        log(f"run directory: {run.path} ({how}; pass run_dir to choose another)")
    return recipes.resolve(r), run


KERNEL = "grpo-workbench"  # the project's Jupyter kernel, as `make install` registers it (Makefile: KERNEL)


def register_kernel(prefix: str | None = None) -> str:
    """Register this Python as the `grpo-workbench` Jupyter kernel in `prefix` (default: this environment), with
    ipykernel's own installer, so `papermill -k grpo-workbench` and JupyterLab run the notebooks on the install
    that has the accelerator's stack. Every install route ends with it (make install; `workbench kernel` after a
    pip install of the accelerator extras); `workbench lab` runs it when the kernel is missing. Returns where."""
    import sys

    from ipykernel.kernelspec import install

    where = prefix or sys.prefix
    return install(kernel_name=KERNEL, display_name=f"GRPO Workbench ({Path(where).name})", prefix=where)


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
