"""The staged notebooks' one setup call: recipe loaded and resolved, run directory opened or created.

    rr, run = notebook.setup(recipe, overrides, run_dir, kind="train")

An entry point like the CLI: papermill hands each notebook the run's recipe.yaml and the run directory
(`workbench run`); a notebook opened by hand gets a recipe name and an empty run_dir, and a new run directory is made.
Overrides may be a list of `section.key=value` words or one space-separated string (what `papermill -p` passes).
"""
from __future__ import annotations

import shlex

from workbench import recipe as recipes
from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.rundir import RunDir


def overrides_list(overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return shlex.split(overrides)
    if isinstance(overrides, (list, tuple)):
        return [str(o) for o in overrides]
    raise WorkbenchError(f"overrides is a {type(overrides).__name__}",
                         "pass a list of section.key=value words, or one space-separated string")


def setup(recipe: str, overrides=None, run_dir: str = "", kind: str = "run",
          extra: dict | None = None) -> tuple[Resolved, RunDir]:
    """Load the recipe (+ overrides, + `extra` dotted values), resolve it, and open `run_dir` or create a run."""
    r = recipes.load(recipe, overrides_list(overrides))
    if extra:
        r = recipes.load(r, extra)
    run = RunDir.at(run_dir, r) if run_dir else RunDir.create(r, kind)
    return recipes.resolve(r), run
