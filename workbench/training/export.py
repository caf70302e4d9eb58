"""Export a run's trained model as a plain Hugging Face model directory (a LoRA run's adapter merged in), with
the run's recipe and results beside the weights.

    workbench export runs/<id>                          # a full fine-tuning -> runs/<id>/train/export/
    workbench export runs/<id> --merge                  # a LoRA run -> runs/<id>/train/merged/
    workbench export runs/<id> --merge --out /models/x

A run trained with a peft: section saves the adapter alone in train/final/ (peft's adapter_model.safetensors and
adapter_config.json, a few MB): the server samples and evaluates under it without merging. `--merge` is for
everything that wants one model: the base model of the run's recipe is loaded, peft applies the adapter and merges
it into the weights (`merge_and_unload`), and the model and tokenizer are written to a temporary directory that is
renamed into place whole, so a failed export leaves nothing half-written. A full fine-tuning's final/ is already a
model directory: it is copied the same way (no --merge). Beside the weights go the run's recipe
(workbench-recipe.yaml), its training summary (workbench-train.json) and, when the run was evaluated, the
evaluation's summary (workbench-eval.json): what the model is, how it was made and what it scored travel with it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RunDir, is_adapter

__all__ = ["ADAPTER_CONFIG", "adapter_bytes", "check", "export", "is_adapter"]


def adapter_bytes(path: Path | str) -> int:
    """The size of an adapter's weights file: what each push of a LoRA run moves."""
    file = Path(path) / ADAPTER_WEIGHTS
    return file.stat().st_size if file.is_file() else 0


def check(run: RunDir, out: Path | None, merge: bool) -> tuple[Path, Path]:
    """Where the adapter is and where the merged model goes; one clear line for anything that cannot work, before
    any model is loaded."""
    final = run.train.final
    if not final.is_dir():
        raise WorkbenchError(f"{run.path} has no trained model (no train/final/)",
                             "export a run whose training finished, e.g. runs/<id> of `workbench train`")
    adapter = is_adapter(final)
    if not adapter and merge:
        raise WorkbenchError(f"{final} is already a full model (the run trained without peft:): nothing to merge",
                             "drop --merge: the model is copied as it is")
    if adapter and not merge:
        raise WorkbenchError(f"{final} holds a LoRA adapter, not a model",
                             "pass --merge to write a model with the adapter merged in")
    target = Path(out) if out else final.parent / ("merged" if adapter else "export")
    if target.exists():
        raise WorkbenchError(f"{target} exists", "remove it, or pass --out with a new directory")
    return final, target


# what goes beside the weights, from the run directory: (file in the export, the run's file)
BESIDE = {"workbench-recipe.yaml": lambda run: run.train.recipe, "workbench-train.json": lambda run: run.train.summary,
          "workbench-eval.json": lambda run: run.eval.summary}


def export(run: RunDir, out: Path | str | None = None, merge: bool = False, log=print) -> Path:
    """Write the run's model (its adapter merged into the base with `merge`) and its recipe and results to a new
    directory; returns it."""
    final, target = check(run, Path(out) if out else None, merge)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        base = _merge(run, final, partial, log) if merge else shutil.copytree(final, partial)
        for name, source in BESIDE.items():
            if source(run).is_file():
                shutil.copyfile(source(run), partial / name)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log(f"merged {final} into {base}: {target}" if merge else f"exported {final}: {target}")
    return target


def _merge(run: RunDir, final: Path, partial: Path, log) -> str:
    """The base model with the adapter merged in, written with its tokenizer to `partial`; returns the base."""
    from workbench import recipe, tinymodel

    rr = recipe.resolve(recipe.load(str(run.train.recipe)))
    base = tinymodel.ensure_model(rr, log=log) if rr.is_tiny else rr.model_path

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = rr.recipe.model.dtype
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    merged = PeftModel.from_pretrained(model, str(final)).merge_and_unload()
    merged.save_pretrained(str(partial))
    AutoTokenizer.from_pretrained(str(final)).save_pretrained(str(partial))
    return str(base)
