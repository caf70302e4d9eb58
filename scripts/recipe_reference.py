"""docs/recipe-reference.md: every recipe key, its type, its default and what it does, read from the schema itself
(workbench/recipe/schema.py: the dataclass fields and the comments beside or above them).

    python scripts/recipe_reference.py            # rewrite docs/recipe-reference.md
    python scripts/recipe_reference.py --check    # exit 1 when the page differs from the schema (tests do this)
"""
from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "workbench" / "recipe" / "schema.py"
PAGE = REPO / "docs" / "recipe-reference.md"


def comments(source: str) -> dict[int, str]:
    """Line number -> the comment text on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def fields(source: str) -> dict[str, list[dict]]:
    """Class name -> its annotated fields: name, type, default, doc (the comment on its line, else the comment lines
    right above it), in source order; with the class docstring as a pseudo-field '' first."""
    tree = ast.parse(source)
    notes = comments(source)
    lines = source.splitlines()
    out: dict[str, list[dict]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        rows = []
        doc = ast.get_docstring(node)
        if doc:
            rows.append({"name": "", "doc": " ".join(doc.split())})
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            text = notes.get(stmt.lineno, "")
            if not text:
                above, n = [], stmt.lineno - 1
                while n >= 1 and lines[n - 1].strip().startswith("#"):
                    above.insert(0, notes.get(n, ""))
                    n -= 1
                text = " ".join(above)
            rows.append({"name": stmt.target.id, "type": ast.unparse(stmt.annotation),
                         "default": _default(stmt.value), "doc": text})
        out[node.name] = rows
    return out


def _default(value: ast.expr | None) -> str:
    if value is None:
        return "(required)"
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default_factory":
                factory = kw.value
                if isinstance(factory, ast.Lambda):
                    return ast.unparse(factory.body)
                name = ast.unparse(factory)
                return {"list": "[]", "dict": "{}"}.get(name, f"{name} defaults")
            if kw.arg == "default":
                return ast.unparse(kw.value)
    return ast.unparse(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def page() -> str:
    schema = fields(SCHEMA.read_text())
    recipe = {r["name"]: r for r in schema["Recipe"] if r["name"]}
    out = ["# Recipe reference", "",
           "Generated from workbench/recipe/schema.py by `python scripts/recipe_reference.py`: every key a recipe may",
           "set, its type, its default and what it does. A recipe is YAML with these sections; any key can be",
           "overridden on the command line as `section.key=value` (docs/recipes.md). A `Literal[...]` type lists",
           "every value the loader accepts.", "",
           "## Top level", "", "| key | type | default | what it does |", "|---|---|---|---|"]
    sections = []
    for name, r in recipe.items():
        kind = r["type"]
        if kind.endswith("Config"):
            sections.append((name, kind))
            out.append(f"| `{name}` | section | | [below](#{name}) |")
        else:
            out.append(f"| `{name}` | `{_cell(kind)}` | `{_cell(r['default'])}` | {_cell(r['doc'])} |")
    out.append("")
    nested = {"ModelConfig": [("tiny", "TinyModelConfig")]}
    for name, kind in sections:
        out += _section(name, schema[kind])
        for sub, sub_kind in nested.get(kind, []):
            out += _section(f"{name}.{sub}", schema[sub_kind])
    return "\n".join(out) + "\n"


def _section(title: str, rows: list[dict]) -> list[str]:
    out = [f"## {title}", ""]
    doc = next((r["doc"] for r in rows if not r["name"]), "")
    if doc:
        out += [doc, ""]
    out += ["| key | type | default | what it does |", "|---|---|---|---|"]
    for r in rows:
        if r["name"] and not r["type"].endswith("Config"):
            out.append(f"| `{title}.{r['name']}` | `{_cell(r['type'])}` | `{_cell(r['default'])}` | {_cell(r['doc'])} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the schema")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} differs from the schema: python scripts/recipe_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
