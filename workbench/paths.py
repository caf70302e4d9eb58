"""Where the workbench's shipped files and caches live, found through one setting.

    from workbench import paths
    paths.notebooks_dir()     # the staged notebooks: package data, so a wheel install can run them too
    paths.data_dir()          # caches (the tiny model): $WORKBENCH_DATA, else the checkout's data/, else ~/.cache

The notebooks ship inside the package (workbench/notebooks/; the checkout's top-level notebooks/ points there), so
`workbench run` works the same from a clone, an editable install or a wheel. Built artefacts go to WORKBENCH_DATA
when it is set; in a source checkout to its data/ directory (what `make demo` and the tests use); otherwise to the
user's cache directory, never into site-packages.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def notebooks_dir() -> Path:
    return PACKAGE / "notebooks"


def data_dir() -> Path:
    if os.environ.get("WORKBENCH_DATA"):
        return Path(os.environ["WORKBENCH_DATA"])
    checkout = PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "workbench").resolve() == PACKAGE:
        return checkout / "data"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo-workbench"
