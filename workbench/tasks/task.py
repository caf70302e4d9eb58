"""The task a recipe trains and evaluates on, resolved once: where each split's rows come from, and its rewards.

    from workbench.tasks.task import Task
    task = Task.build(recipe)          # no I/O: each split's source resolved, a test set that is the training set refused
    task.rows("train")                 # read once (file, hub or generated), then served from memory
    task.rows("validation", limit=50)
    task.describe()                    # {"train": "file data/mine.jsonl", "test": "carved from train: ...", ...}

Every component of a run (trainer, canary, drift, learning curve, dynamic sampling, evaluation, bench) asks the
run's one Task (`Resolved.task`) for rows instead of reading the recipe's data section again.

The splits are train, validation (for choosing settings) and test (to report; "heldout" is its older name).
Each comes from a source: the generated arithmetic task, a local file, or any hub dataset by id, config and split:

    data:
      name: file                          # or a preset: arithmetic | gsm8k | math500 | aime2024
      train: data/mine.jsonl              # a path, or {path: ...} / {hub: org/name, config: main, split: train}
      test: {hub: org/name, split: test, fields: {question: problem}}
      fields: {question: q, answer: a}    # our columns -> the source's, for every source (a source's own wins)

A preset names the sources itself (gsm8k: the hub's train and test splits); data.train, data.validation and
data.test replace them one by one. A split without a source is carved from the training source by a seeded,
recorded draw (data.seed; data.validation_size and data.heldout_size rows), so a recipe with only a training file
still evaluates on rows it never trained on. A test or validation source that is the training source (the same
file, or the same hub id, config and split) is refused: the gain it reports would mean nothing.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import WorkbenchError
from workbench.tasks import dataset, rewardspec

if TYPE_CHECKING:
    import datasets

SPLITS = ("train", "validation", "test")
ALIASES = {"heldout": "test"}  # the arithmetic task's and older recipes' name for the test split
SOURCE_KEYS = ("path", "hub", "config", "split", "fields")


def split_name(split: str) -> str:
    """train | validation | test, whatever name a recipe used ("heldout" is test)."""
    return ALIASES.get(split, split)


@dataclass(frozen=True)
class Source:
    """Where one split's rows come from. `carve` names the part of the origin it takes (None: all of it)."""
    kind: str  # generated | file | hub
    where: str  # "arithmetic", a resolved file path, or a hub id
    config: str | None = None  # the hub dataset's config
    split: str | None = None  # the hub split, or the arithmetic split
    fields: tuple[tuple[str, str], ...] = ()  # our column -> the source's
    carve: str | None = None  # validation | test | train: a part of the origin drawn by data.seed
    tail: bool = False  # the preset's own carve: the origin's last validation rows (gsm8k's validation)

    @property
    def origin(self) -> tuple:
        """What two sources must not share unless each takes a different carved part."""
        return self.kind, self.where, self.config, self.split

    def label(self) -> str:
        base = {"generated": f"generated {self.where} ({self.split})", "file": f"file {self.where}",
                "hub": f"hub {self.where}" + (f" ({self.config})" if self.config else "") + f", split {self.split}"}
        text = base[self.kind]
        if self.carve:
            how = "its last rows" if self.tail else "drawn by data.seed"
            text = f"{self.carve} part of {text} ({how})"
        return text


@dataclass
class Task:
    """One recipe's splits and rewards. Build with `Task.build(recipe)`; rows are read on first use and kept."""
    data: Any  # the recipe's DataConfig (duck-typed: the tasks package does not import the recipe)
    sources: dict[str, Source | None]
    rewards: dict
    _rows: dict[str, list[dict]] = field(default_factory=dict, repr=False)
    _carved: dict[tuple, dict[str, list[dict]]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, recipe) -> "Task":
        problems = source_problems(recipe.data)
        if problems:
            raise problems[0]
        return cls(recipe.data, resolve_sources(recipe.data), recipe.rewards)

    # -- rewards -------------------------------------------------------------------------------------------------
    @property
    def reward_specs(self) -> list[rewardspec.RewardSpec]:
        """The recipe's rewards, imported and checked (rewardspec.specs), once."""
        if "_specs" not in self.__dict__:
            self.__dict__["_specs"] = rewardspec.specs(self.rewards)
        return self.__dict__["_specs"]

    # -- rows ----------------------------------------------------------------------------------------------------
    def rows(self, split: str = "train", limit: int | None = None) -> list[dict]:
        """A split's rows in source order; the training split is cut to data.train_size. Each call returns fresh
        row dicts, so a caller that edits one does not change another's."""
        split = split_name(split)
        if split not in SPLITS:
            raise WorkbenchError(f"there is no split {split!r}", f"use one of: {', '.join(SPLITS)}")
        if split not in self._rows:
            self._rows[split] = self._load(split)
        rows = self._rows[split]
        if split == "train" and self.data.train_size is not None:
            rows = rows[: self.data.train_size]
        return [dict(r) for r in rows[:limit]]

    def train_rows(self, tokenizer=None) -> list[dict]:
        """The training rows; with a tokenizer, a prompt longer than data.max_prompt_length is an error."""
        rows = self.rows("train")
        if tokenizer is not None:
            longest = dataset.max_prompt_tokens(rows, tokenizer)
            if longest > self.data.max_prompt_length:
                raise WorkbenchError(
                    f"the longest training prompt is {longest} tokens, over data.max_prompt_length="
                    f"{self.data.max_prompt_length}",
                    f"raise data.max_prompt_length to {longest} (and server.max_model_len with it), or use shorter "
                    "prompts")
        return rows

    def train_dataset(self, tokenizer=None) -> "datasets.Dataset":
        """The training rows as a datasets.Dataset, the form TRL's GRPOTrainer takes: every column of the rows,
        extra source columns included, reaches each reward function as a keyword argument."""
        import datasets

        return datasets.Dataset.from_list(self.train_rows(tokenizer))

    def eval_rows(self, eval_config) -> list[dict]:
        """The rows an eval section scores: the first eval.num_samples of eval.split."""
        rows = self.rows(eval_config.split, limit=eval_config.num_samples)
        if len(rows) < eval_config.num_samples and self.sources["train"] and self.sources["train"].kind == "generated":
            size = "data.validation_size" if split_name(eval_config.split) == "validation" else "data.heldout_size"
            raise WorkbenchError(f"eval.num_samples={eval_config.num_samples} but the {eval_config.split} split has "
                                 f"{len(rows)}", f"raise {size} or lower eval.num_samples")
        return rows

    def describe(self) -> dict[str, str]:
        """Each split's source in words, for `recipe show`, env.json and the report."""
        return {split: (src.label() if src else "none") for split, src in self.sources.items()}

    def _load(self, split: str) -> list[dict]:
        src = self.sources[split]
        if src is None:
            raise WorkbenchError(f"the recipe has no {split} split",
                                 f"name one as data.{split} (a file or a hub dataset), or keep "
                                 f"data.{'validation' if split == 'validation' else 'heldout'}_size above 0 to carve "
                                 "it from the training source")
        d = self.data
        if src.kind == "generated":
            return dataset.generated_rows(src.split, d.seed, d.heldout_size, d.validation_size, d.system_prompt,
                                          d.instruction)
        whole = self._origin_rows(src)
        if not src.carve:
            return whole
        return self._carve(src, whole)[src.carve]

    def _origin_rows(self, src: Source) -> list[dict]:
        key = ("origin", *src.origin)
        if key not in self._carved:
            preset = dataset.DATASETS.get(self.data.name, dataset.DATASETS["file"])
            columns = {**preset["fields"], **(self.data.fields or {}), **dict(src.fields)}
            if src.kind == "file":
                name = Path(src.where).stem if self.data.name == "file" else self.data.name
            else:
                name = self.data.name if self.data.name != "file" else src.where.rsplit("/", 1)[-1]
            label = {"file": "train" if src.carve else _role_of(self.sources, src), "hub": src.split}[src.kind]
            rows = dataset.source_rows(src.kind, src.where, src.config, src.split, columns, preset["extract"], name,
                                       label, self.data.system_prompt, self.data.instruction)
            self._carved[key] = {"whole": rows}
        return self._carved[key]["whole"]

    def _carve(self, src: Source, whole: list[dict]) -> dict[str, list[dict]]:
        key = ("carve", *src.origin)
        if key in self._carved:
            return self._carved[key]
        parts = [s.carve for s in self.sources.values() if s and s.origin == src.origin and s.carve]
        d = self.data
        sizes = {"validation": d.validation_size if "validation" in parts else 0,
                 "test": d.heldout_size if "test" in parts else 0}
        taken = sizes["validation"] + sizes["test"]
        if taken >= len(whole):
            raise WorkbenchError(
                f"carving {' and '.join(p for p in ('validation', 'test') if sizes[p])} from "
                f"{replace(src, carve=None).label()} takes "
                f"{taken} of its {len(whole)} rows (data.validation_size={sizes['validation']}, "
                f"data.heldout_size={sizes['test']}), leaving none to train on",
                "lower data.validation_size / data.heldout_size, or name data.validation / data.test sources")
        if src.tail:  # the preset's validation: the origin's last rows, as the dataset's own users carve it
            out = {"validation": whole[len(whole) - sizes["validation"]:], "test": [],
                   "train": whole[: len(whole) - sizes["validation"]]}
        else:
            order = list(range(len(whole)))
            random.Random(d.seed).shuffle(order)
            picks = {"validation": set(order[: sizes["validation"]]),
                     "test": set(order[sizes["validation"]: taken])}
            out = {p: [r for i, r in enumerate(whole) if i in picks[p]] for p in picks}
            out["train"] = [r for i, r in enumerate(whole) if i not in picks["validation"] | picks["test"]]
        self._carved[key] = out
        return out

    def carve_record(self) -> dict[str, Any]:
        """What a carve drew, so a run can be checked against another: the seed and each part's ids' digest."""
        out: dict[str, Any] = {}
        for (kind, *origin), parts in self._carved.items():
            if kind != "carve":
                continue
            out[" ".join(str(o) for o in origin if o)] = {
                "seed": self.data.seed,
                **{p: {"rows": len(r), "ids_sha256": hashlib.sha256("\n".join(x["id"] for x in r).encode()).hexdigest()[:16]}
                   for p, r in parts.items()}}
        return out


def _role_of(sources: dict, src: Source) -> str:
    return next((split for split, s in sources.items() if s == src), "train")


def _source(value: Any, where: str) -> Source:
    """A recipe's source value (a path string, or a mapping with path or hub) as a Source."""
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, dict):
        raise WorkbenchError(f"{where} is a {type(value).__name__}",
                             f"give {where} a file path, or {{path: FILE}} or {{hub: org/name, split: SPLIT}}")
    unknown = sorted(set(value) - set(SOURCE_KEYS))
    if unknown:
        raise WorkbenchError(f"{where} has unknown keys {unknown}", f"use only {', '.join(SOURCE_KEYS)}")
    if ("path" in value) == ("hub" in value):
        raise WorkbenchError(f"{where} names {'both path and hub' if 'path' in value else 'neither path nor hub'}",
                             f"give {where} exactly one of path: FILE or hub: org/name")
    fields = value.get("fields") or {}
    if not isinstance(fields, dict) or set(fields) - set(dataset.FIELD_KEYS):
        raise WorkbenchError(f"{where}.fields has unknown keys {sorted(set(fields) - set(dataset.FIELD_KEYS))}",
                             f"map only {', '.join(dataset.FIELD_KEYS)} onto the source's columns")
    if "path" in value:
        if "config" in value or "split" in value:
            raise WorkbenchError(f"{where} is a file with a config or split", "a file is one split: drop them")
        return Source("file", str(Path(value["path"]).expanduser().resolve()), fields=tuple(sorted(fields.items())))
    return Source("hub", str(value["hub"]), config=value.get("config"), split=str(value.get("split", "train")),
                  fields=tuple(sorted(fields.items())))


def resolve_sources(data) -> dict[str, Source | None]:
    """Each split's source for a recipe's data section (no I/O). Raises the first problem of `source_problems`."""
    if data.name == "arithmetic":
        return {s: Source("generated", "arithmetic", split={"test": "heldout"}.get(s, s)) for s in SPLITS}
    own = {"train": data.train if data.train is not None else data.path,
           "validation": data.validation, "test": data.test}
    preset = dataset.DATASETS.get(data.name) or {}
    sources: dict[str, Source | None] = {}
    for split in SPLITS:
        if own[split] is not None:
            sources[split] = _source(own[split], "data.path" if split == "train" and data.train is None
                                     else f"data.{split}")
        elif preset.get("hub") and _preset_split(preset, split):
            hub_id, config = preset["hub"]
            sources[split] = Source("hub", hub_id, config=config, split=_preset_split(preset, split))
        else:
            sources[split] = None
    train, validation = sources["train"], sources["validation"]
    if (own["train"] is None and own["validation"] is None and train and validation
            and validation.origin == train.origin):
        # the preset's validation is its training split's last rows (gsm8k): a carve of it, not the same rows
        sources["validation"] = replace(validation, carve="validation", tail=True)
    elif own["train"] is not None and own["validation"] is None and validation and train \
            and validation.origin != train.origin and _preset_split(preset, "validation") == _preset_split(preset, "train"):
        sources["validation"] = None  # the preset carves its own training split, which this recipe does not train on
    for split, size in (("validation", data.validation_size), ("test", data.heldout_size)):
        if train and sources[split] is None and size > 0:
            sources[split] = replace(train, carve=split)
    if train and any(s.carve for s in sources.values() if s is not None and s is not train
                     and s.origin == train.origin):
        tail = any(s.tail for s in sources.values() if s is not None)
        sources["train"] = replace(train, carve="train", tail=tail)
    return sources


def _preset_split(preset: dict, split: str) -> str | None:
    splits = preset["splits"] or {}
    return splits.get(split) or (splits.get("heldout") if split == "test" else None)


def source_problems(data) -> list[WorkbenchError]:
    """What is wrong with a data section's sources, before anything is read: each one a clear line with its fix."""
    if data.name == "arithmetic":
        named = [f"data.{s}" for s in ("train", "validation", "test") if getattr(data, s) is not None]
        if named:
            return [WorkbenchError(f"{', '.join(named)} set, but dataset 'arithmetic' is generated and reads no source",
                                   "set data.name=file (or a preset such as gsm8k) to read them")]
        return []
    if data.name == "file" and data.path is None and data.train is None:
        return [WorkbenchError("data.name is 'file' but neither data.train nor data.path is set",
                               "set data.train to a local .jsonl, .json or .parquet file, or {hub: org/name, split: "
                               "train}")]
    if data.path is not None and data.train is not None:
        return [WorkbenchError("data.path and data.train both name the training source",
                               "keep data.train and drop data.path")]
    try:
        sources = resolve_sources(data)
    except WorkbenchError as exc:
        return [exc]
    out = []
    for split, src in sources.items():
        if src and src.kind == "file" and not (src.carve and split != "train"):  # a carve: its file checked once
            path = Path(src.where)
            if not path.is_file():
                out.append(WorkbenchError(f"data.{split if split != 'train' or data.train is not None else 'path'} "
                                          f"{path} does not exist", "point it at a local data file"))
            elif path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
                out.append(WorkbenchError(f"data.{split} {path} has format {path.suffix or '(no extension)'!r}",
                                          "use a .jsonl, .json or .parquet file"))
    refused: set[str] = set()  # one line per split: the first source it repeats
    for a, b in (("train", "test"), ("train", "validation"), ("validation", "test")):
        sa, sb = sources[a], sources[b]
        if b not in refused and sa and sb and sa.origin == sb.origin and (
                not sa.carve or not sb.carve or sa.carve == sb.carve):
            refused.add(b)
            out.append(WorkbenchError(
                f"the {b} split's source is the {a} split's ({sb.label()}): a score on it would be a score on rows "
                f"the run {'trained on' if a == 'train' else 'chose its settings on'}",
                f"name another source as data.{b}, or drop data.{b} to carve it from the training source by data.seed"))
    return out
