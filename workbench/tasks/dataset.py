"""Load a training or evaluation set as workbench rows, from the Hugging Face hub or from a local file.

Every row has the same columns, whatever the source, so rewards, training and evaluation need not know it:

    prompt   chat messages: an optional system message, then the question as the user message
    answer   the gold final answer as a string ("42", "\\frac{1}{2}"), never a worked solution
    id       a string, unique within the dataset
    source   the dataset's name ("gsm8k", "math500", ...; a file's stem for name="file")

Known datasets are "arithmetic" (generated, see workbench.arithmetic), "gsm8k", "math500" and "aime2024";
"file" reads any local file given `path` and `fields`. A hub dataset can always be read from a local copy
instead (`path=`, .jsonl, .json list or .parquet), which is the way to go where the hub cannot be reached:

    from workbench.tasks.dataset import load_rows
    rows = load_rows("gsm8k", "train", limit=100)
    rows = load_rows("gsm8k", "test", path="gsm8k_test.jsonl")
    rows = load_rows("file", "train", path="mine.parquet", fields={"question": "q", "answer": "a"})

    python -m workbench.tasks.dataset gsm8k test [path]     # prints the first rows
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError
from workbench.tasks import arithmetic

def _gsm8k_answer(text: str) -> str:
    # GSM8K answers are worked solutions ending "#### 1,234"; a file with answers already reduced has no '####'.
    return text.rsplit("####", 1)[-1].replace(",", "").strip()


def _plain_answer(text: str) -> str:
    return text.strip()


# hub: (id, config); splits: our split name -> hub split. MATH-500 and AIME 2024 have a single split each and
# are evaluation sets, so they offer no "train", which keeps them from being trained on by accident.
DATASETS: dict[str, dict[str, Any]] = {
    "gsm8k": {
        "hub": ("openai/gsm8k", "main"),
        # validation: the last data.validation_size rows of the hub's train split, which training then leaves out
        "splits": {"train": "train", "validation": "train", "test": "test", "heldout": "test"},
        "fields": {"question": "question", "answer": "answer"},
        "extract": _gsm8k_answer,
    },
    "math500": {
        "hub": ("HuggingFaceH4/MATH-500", None),
        "splits": {"test": "test", "heldout": "test"},
        "fields": {"question": "problem", "answer": "answer"},
        "extract": _plain_answer,
    },
    "aime2024": {
        "hub": ("HuggingFaceH4/aime_2024", None),
        "splits": {"test": "train", "heldout": "train"},
        "fields": {"question": "problem", "answer": "answer", "id": "id"},
        "extract": _plain_answer,
    },
    "file": {
        "hub": None,
        "splits": None,
        "fields": {"question": "question", "answer": "answer"},
        "extract": _plain_answer,
    },
}
KNOWN = ("arithmetic", *DATASETS)
FIELD_KEYS = ("question", "answer", "id")
_HUB_PROBE_TIMEOUT_S = 3


def load_rows(
    name: str,
    split: str,
    path: str | None = None,
    fields: dict | None = None,
    limit: int | None = None,
    seed: int = 0,
    system_prompt: str | None = None,
    instruction: str | None = None,
    heldout_size: int = 300,
    validation_size: int = 300,
) -> list[dict]:
    """Rows of one source as it stands (a dataset's hub split, or a file), in its order: a look at one source.

    A run's splits come from its Task (workbench/tasks/task.py), which alone carves a validation or test split
    out of a training source and keeps those rows out of training; so here gsm8k's "train" is the whole hub
    split, and a split that only a carve makes (gsm8k's "validation") is refused with that pointer.
    With `path`, the file is the split: `split` is not checked. `fields` maps our columns ("question",
    "answer", optional "id") to the file's columns, over the dataset's defaults. `limit` keeps the first N rows
    in that order (no shuffle; the trainer shuffles). `seed`, `heldout_size` and `validation_size` only matter
    for "arithmetic", whose splits are drawn from them. `instruction` goes on a new line after the question;
    `system_prompt` becomes a first, system message.
    """
    if name not in KNOWN:
        raise WorkbenchError(f"unknown dataset {name!r}", f"use one of: {', '.join(KNOWN)}")
    if limit is not None and limit < 1:
        raise WorkbenchError(f"limit={limit} keeps no rows", "set limit to a positive number, or leave it out")
    if name == "arithmetic":
        return generated_rows(split, seed, heldout_size, validation_size, system_prompt, instruction, path, limit)

    spec = DATASETS[name]
    columns = _field_map(name, spec["fields"], fields)
    if path is not None:
        records = read_file(path)
        where, source = f"{name} file {path}", Path(path).stem if name == "file" else name
    elif name == "file":
        raise WorkbenchError("dataset 'file' needs a path", "set data.path to a local .jsonl, .json or .parquet file")
    else:
        if split not in spec["splits"]:
            raise WorkbenchError(f"dataset {name!r} has no split {split!r}", f"use one of: {', '.join(spec['splits'])}")
        if split == "validation" and spec["splits"]["validation"] == spec["splits"].get("train"):
            raise WorkbenchError(f"{name}'s validation split is carved from its train split, by a run's Task",
                                 "read it with Task.build(recipe).rows('validation'), which also leaves it out of "
                                 "training")
        hub_id, config = spec["hub"]
        records = hub_records(hub_id, config, spec["splits"][split], name=name, fields=spec["fields"])
        where, source = f"{name} from the hub", name
    rows = to_rows(records[:limit], columns, spec["extract"], where=where, source=source, split=split,
                   unit=row_unit(path), system_prompt=system_prompt, instruction=instruction)
    if not rows:
        raise WorkbenchError(f"{where} has no rows", "point data.path at a file with at least one row")
    return rows


# the columns every row has; a source's own column of the same name would be overwritten, so it is refused
RESERVED = ("prompt", "answer", "id", "source")


def to_rows(records: list[tuple[int, Any]], columns: dict, extract, where: str, source: str, split: str,
            unit: str = "row", system_prompt: str | None = None, instruction: str | None = None) -> list[dict]:
    """Workbench rows from (number, record) pairs: the mapped question/answer/id, and every other column of the
    record as it is (a test list, a rubric, a reference solution), which TRL hands to each reward function as a
    keyword argument of the same name."""
    mapped = {columns[k] for k in FIELD_KEYS if k in columns}
    rows = []
    seen_ids: set[str] = set()
    for number, record in records:
        at = f"{where} {unit} {number}"
        if not isinstance(record, Mapping):
            raise WorkbenchError(f"{at} is a {type(record).__name__}, not an object",
                                 "write one JSON object (question, answer, ...) per row")
        question = _field(record, columns["question"], at)
        gold = extract(str(_field(record, columns["answer"], at)))
        row_id = str(_field(record, columns["id"], at)) if "id" in columns else f"{source}-{split}-{number}"
        if row_id in seen_ids:
            raise WorkbenchError(f"{at} repeats id {row_id!r}",
                                 "give every row its own id, or drop 'id' from data.fields to number rows instead")
        seen_ids.add(row_id)
        clash = sorted(k for k in record if k in RESERVED and k not in mapped)
        if clash:
            raise WorkbenchError(f"{at} has a column named {clash[0]!r}, a name every workbench row uses itself",
                                 f"rename that column, or map it in data.fields (e.g. answer: {clash[0]})")
        extra = {k: v for k, v in record.items() if k not in mapped}
        rows.append({**extra, "prompt": prompt_messages(str(question), system_prompt, instruction), "answer": gold,
                     "id": row_id, "source": source})
    return rows


def source_rows(kind: str, where: str, config: str | None, split: str | None, columns: dict, extract,
                source: str, label: str, system_prompt: str | None = None,
                instruction: str | None = None) -> list[dict]:
    """Every row of one source: a local file (`where` its path) or a hub split (`where` its id); `label` goes in
    numbered ids ("<source>-<label>-<n>")."""
    if kind == "file":
        records, at, unit = read_file(where), f"file {where}", row_unit(where)
    else:
        records = hub_records(where, config, split, fields=columns)
        at, unit = f"hub {where}" + (f" ({config})" if config else "") + f" split {split}", "row"
    rows = to_rows(records, columns, extract, where=at, source=source, split=label, unit=unit,
                   system_prompt=system_prompt, instruction=instruction)
    if not rows:
        raise WorkbenchError(f"{at} has no rows", "point the split's source at a file with rows")
    return rows


def row_unit(path: str | None) -> str:
    # jsonl rows are numbered by line, so that an error points at the line an editor shows.
    return "line" if path and Path(path).suffix.lower() == ".jsonl" else "row"


def max_prompt_tokens(rows: Iterable[dict], tokenizer) -> int:
    """Length in tokens of the longest prompt once the chat template and generation prompt are applied; 0 if none."""
    longest = 0
    for row in rows:
        out = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding; older versions a plain list of ids.
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        if len(ids) and isinstance(ids[0], (list, tuple)):
            ids = ids[0]
        longest = max(longest, len(ids))
    return longest


def prompt_messages(question: str, system_prompt: str | None, instruction: str | None) -> list[dict]:
    user = f"{question}\n{instruction}" if instruction else question
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": user}]


def generated_rows(split: str, seed: int, heldout_size: int, validation_size: int, system_prompt: str | None = None,
                   instruction: str | None = None, path: str | None = None, limit: int | None = None) -> list[dict]:
    """One split of the generated arithmetic task (workbench/tasks/arithmetic.py), prompts as the recipe asks."""
    if path is not None:
        # Silently ignoring the path would train on something other than what the recipe says.
        raise WorkbenchError("dataset 'arithmetic' is generated and reads no file",
                             "drop data.path, or use name 'file' to read it")
    rows = arithmetic.rows(split, seed=seed, heldout_size=heldout_size, limit=limit, validation_size=validation_size)
    if system_prompt or instruction:
        for row in rows:
            row["prompt"] = prompt_messages(row["prompt"][-1]["content"], system_prompt, instruction)
    return rows


def _field_map(name: str, defaults: dict, fields: dict | None) -> dict:
    unknown = sorted(set(fields or {}) - set(FIELD_KEYS))
    if unknown:
        raise WorkbenchError(f"data.fields for {name!r} has unknown keys {unknown}",
                             f"use only {', '.join(FIELD_KEYS)} as keys, each naming a column of the file")
    return {**defaults, **(fields or {})}


def _field(record: Mapping, column: str, at: str) -> Any:
    # A null counts as missing: str(None) would become a question or gold answer reading "None".
    value = record.get(column)
    if value is None:
        raise WorkbenchError(f"{at} has no {column!r} field (it has: {', '.join(map(str, record)) or 'none'})",
                             "set data.fields to map question/answer/id onto the file's column names")
    return value


def read_file(path: str) -> list[tuple[int, Any]]:
    """(row number, record) pairs: the line number for .jsonl, the 1-based position otherwise."""
    file = Path(path)
    if not file.is_file():
        raise WorkbenchError(f"data file {path} does not exist",
                             "check data.path, or download the dataset there as .jsonl, .json or .parquet")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return list(_read_jsonl(file))
    if suffix == ".json":
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise WorkbenchError(f"{path} is not valid JSON ({e})",
                                 "write a JSON list of objects, or use .jsonl") from None
        if not isinstance(data, list):
            raise WorkbenchError(f"{path} holds a JSON {type(data).__name__}, not a list",
                                 "write a JSON list of objects, one per row, or use .jsonl")
        return list(enumerate(data, start=1))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(file).to_pylist(), start=1))
    raise WorkbenchError(f"data file {path} has unknown format {suffix or '(no extension)'!r}",
                         "use a .jsonl, .json (a list of objects) or .parquet file")


def _read_jsonl(file: Path) -> Iterable[tuple[int, Any]]:
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkbenchError(f"{file} line {number} is not valid JSON ({e.msg})",
                                     "write one JSON object per line") from None


def hub_records(hub_id: str, config: str | None, split: str, name: str | None = None,
                fields: dict | None = None) -> list[tuple[int, Any]]:
    """(row number, record) pairs of one hub split, or of the local hub cache when the hub cannot be reached."""
    name = name or hub_id
    columns = ", ".join((fields or {}).values()) or "question, answer"
    fix = (f"download {hub_id} where the hub is reachable (or set HF_ENDPOINT to a mirror), save the split as .jsonl "
           f"or .parquet, and name it as the split's source, e.g. data.test: {{path: FILE}} (data.fields if its "
           f"columns are not {columns})")
    import datasets

    try:
        with _cache_only(not hub_reachable()):
            loaded = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - any failure here means "no copy of this dataset", with one fix
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise WorkbenchError(f"cannot load {name} ({hub_id}"
                             f"{', ' + config if config else ''}, split {split}) from the hub or its cache: {reason}",
                             fix) from None
    return list(enumerate(loaded, start=1))


def hub_reachable() -> bool:
    """One short request, because datasets retries an unreachable hub for about half a minute before failing."""
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - DNS, refused, timeout, offline mode: all mean "not reachable"
        return False
    return True


def hub_cached(hub_id: str) -> bool:
    """Whether a hub dataset has a local copy: datasets' prepared cache (HF_DATASETS_CACHE/<org>___<name>), or the
    hub's file cache (HF_HUB_CACHE/datasets--<org>--<name>)."""
    import datasets
    from huggingface_hub import constants

    prepared = Path(datasets.config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")
    files = Path(constants.HF_HUB_CACHE) / ("datasets--" + hub_id.replace("/", "--"))
    return prepared.is_dir() or (files / "snapshots").is_dir()


@contextmanager
def _cache_only(active: bool) -> Iterator[None]:
    """The hub libraries' offline mode for one load, so a cached copy still loads and a missing one fails at once.

    They read HF_HUB_OFFLINE only when imported, so setting the variable later would not reach them.
    """
    if not active:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3:
        sys.exit("usage: python -m workbench.tasks.dataset NAME SPLIT [PATH]")
    try:
        for r in load_rows(sys.argv[1], sys.argv[2], path=sys.argv[3] if len(sys.argv) > 3 else None, limit=3):
            print(r["id"], repr(r["prompt"][-1]["content"][:80]), "->", r["answer"])
    except WorkbenchError as e:
        sys.exit(str(e))
