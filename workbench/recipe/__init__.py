"""Recipes: one YAML file drives every stage; loaded and checked once, resolved once, passed down.

    from workbench import recipe
    r = recipe.load("cpu-tiny", ["trainer.max_steps=50"])     # sections as dataclasses (schema.py), checked
    rr = recipe.resolve(r)                                    # platform, model path, sync, URL, roles (resolve.py)

The shipped recipes are in recipes/ beside this file; `workbench recipe list` names them.
"""
from workbench.recipe.load import RECIPES_DIR, apply_overrides, available, load, parse_override, yaml_load
from workbench.recipe.resolve import Resolved, Role, resolve
from workbench.recipe.schema import SECTIONS, Recipe

__all__ = ["RECIPES_DIR", "SECTIONS", "Recipe", "Resolved", "Role", "apply_overrides", "available", "load",
           "parse_override", "resolve", "yaml_load"]
