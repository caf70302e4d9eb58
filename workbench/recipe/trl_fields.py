"""The arguments `trl.GRPOConfig` (and `peft.LoraConfig`) accept, read from the installed sources without importing.

    from workbench.recipe import trl_fields
    trl_fields.names()                        # {'learning_rate', 'num_generations', 'max_completion_length', ...}
    trl_fields.default("max_completion_length")
    trl_fields.lora_names()                   # {'r', 'lora_alpha', 'target_modules', ...}: the recipe's peft: keys

Checking a recipe's `trainer:` keys must not cost an import of TRL (and with it torch and transformers, several
seconds): `workbench recipe show`, `report` and `advise` stay light. So the dataclass fields of GRPOConfig and of
its bases (TRL's base config, transformers' TrainingArguments) are read from the installed files with `ast`,
following each base class to the module it is imported from. The trainer stage still builds the real GRPOConfig
(workbench.training.config), which applies TRL's own cross-field rules.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError

MISSING = object()  # a field without a literal default (a factory, or computed)


def _module_file(module: str) -> Path | None:
    """The source file of a dotted module name, found from its top-level package without importing anything."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolve(module: str, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.split(".")[:-level]
    return ".".join(parts + ([name] if name else []))


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return MISSING
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _default(kw.value)
        return MISSING
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError):
        return MISSING


def _class_fields(module: str, class_name: str, seen: set) -> dict[str, Any]:
    if (module, class_name) in seen:
        return {}
    seen.add((module, class_name))
    path = _module_file(module)
    if path is None:
        return {}
    tree = ast.parse(path.read_text())
    imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imports[alias.asname or alias.name] = _resolve(module, node.level, node.module)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None and path.name == "__init__.py":
        # A lazy package face (transformers exports TrainingArguments without an import statement): the class
        # lives in one of the package's own modules.
        for sibling in sorted(path.parent.glob("*.py")):
            if re.search(rf"^class {class_name}\b", sibling.read_text(errors="replace"), re.M):
                return _class_fields(f"{module}.{sibling.stem}", class_name, seen)
    if cls is None:
        return {}
    fields: dict[str, Any] = {}
    for base in cls.bases:  # bases first: a subclass overrides their defaults
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name and base_name in imports:
            fields.update(_class_fields(imports[base_name], base_name, seen))
        elif base_name:
            fields.update(_class_fields(module, base_name, seen))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if annotation.startswith(("ClassVar", "typing.ClassVar")):
                continue
            fields[node.target.id] = (_default(node.value), annotation)
    return fields


@functools.lru_cache(maxsize=1)
def _read() -> dict[str, tuple[Any, str]]:
    found = _class_fields("trl.trainer.grpo_config", "GRPOConfig", set())
    if "num_generations" not in found or "learning_rate" not in found:
        raise WorkbenchError("cannot read trl.GRPOConfig's arguments from the installed TRL",
                             "install the project (make install): TRL 1.16 is required")
    return found


def fields() -> dict[str, Any]:
    """GRPOConfig's argument names mapped to their literal defaults (MISSING where not a literal)."""
    return {name: default for name, (default, _) in _read().items()}


def annotation(name: str) -> str:
    """The field's type annotation as written in the source, e.g. 'int | None'."""
    return _read()[name][1]


# What a YAML value of each annotated type may be. Names not listed (enums such as SchedulerType) take strings.
_ACCEPTS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "None": (type(None),),
            "list": (list,), "dict": (dict,), "Any": (object,)}


def type_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be GRPOConfig's `name` (its annotation, read from the source), or None when it can.

    A YAML float where an int is declared (`max_steps: 1e3`) and a string where a number is declared
    (`max_completion_length: abc`) are caught here, before TRL or the model is loaded."""
    return _annotation_problem(annotation(name), value, "trl.GRPOConfig")


def _annotation_problem(wanted: str, value: Any, owner: str) -> str | None:
    if wanted.startswith(("Optional[", "Union[")):  # peft writes typing's spelling: Optional[X] is X | None
        inner = wanted[wanted.index("[") + 1:-1]
        if wanted.startswith("Optional["):
            if value is None:
                return None
            wanted_options = [inner]
        else:
            wanted_options = _split_top(inner)
        if any(_annotation_problem(option, value, owner) is None for option in wanted_options):
            return None
        return f"is {value!r} ({type(value).__name__}), {owner} declares {wanted}"
    if wanted.startswith("Literal[") and "|" not in wanted:
        try:
            allowed = ast.literal_eval(f"[{wanted[len('Literal['):-1]}]")
        except (ValueError, SyntaxError):
            return None
        return None if value in allowed else f"is {value!r}, {owner} accepts one of {allowed}"
    for option in (part.strip() for part in wanted.split("|")):
        base = option.split("[", 1)[0]
        if option == "Literal[False]":
            if value is False:
                return None
            continue
        if base == "Literal":  # one of the listed values (peft's init_lora_weights: bool | Literal['gaussian', ...])
            try:
                listed = ast.literal_eval(f"[{option[len('Literal['):-1]}]")
                # a listed pattern ('pissa_niter_[number of iters]'): its fixed start
                if value in listed or (isinstance(value, str) and any(
                        isinstance(x, str) and "[" in x and value.startswith(x.split("[", 1)[0]) for x in listed)):
                    return None
            except (ValueError, SyntaxError):
                return None  # not a list of literals we can read: leave it to the library
            continue
        accepted = _ACCEPTS.get(base, (str,))
        if bool in accepted or not isinstance(value, bool):  # True is an int to Python, not to a recipe
            if isinstance(value, accepted):
                return None
    return f"is {value!r} ({type(value).__name__}), {owner} declares {wanted}"


def _split_top(text: str) -> list[str]:
    """'list[str], str' -> ['list[str]', 'str']: commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def names() -> set[str]:
    return set(fields())


def default(name: str) -> Any:
    value = fields().get(name, MISSING)
    if value is MISSING:
        raise KeyError(f"GRPOConfig.{name} has no literal default")
    return value


# ----------------------------------------------------------------------------------------------------------------
# peft.LoraConfig: the recipe's peft: section

@functools.lru_cache(maxsize=1)
def _read_lora() -> dict[str, tuple[Any, str]]:
    found = _class_fields("peft.tuners.lora.config", "LoraConfig", set())
    if "r" not in found or "lora_alpha" not in found:
        raise WorkbenchError("cannot read peft.LoraConfig's arguments from the installed peft",
                             "install the project (make install): peft is a dependency")
    return found


def lora_names() -> set[str]:
    return set(_read_lora())


def lora_default(name: str) -> Any:
    return _read_lora()[name][0]


def lora_type_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be LoraConfig's `name`, or None when it can (or its annotation is a class of peft's)."""
    return _annotation_problem(_read_lora()[name][1], value, "peft.LoraConfig")
