"""The tiny reward model: a sequence-classification head on the tiny base, trained on the base's own completions
labelled by the rule reward, so the CPU demo has a learned reward to train against (recipe cpu-tiny-rm).

    workbench reward-model --recipe cpu-tiny-rm       # builds it once (a few minutes on 2 cores), then reuses it

    from workbench.training import rewardmodel
    path = rewardmodel.ensure(rr)                     # data/tiny-rm/<tiny model key>-rm<N>/, with reward-model.json

Completions are sampled from the tiny base at the training temperature (transformers' generate, seeded) for the
training split's prompts, and for the validation split's prompts as the held-out set: no prompt is in both. Each
is labelled 1/0 by the `correctness` rule. The head (`AutoModelForSequenceClassification`, one label) reads the
prompt and completion through the tokenizer's chat template, as vLLM's `/pooling` renders chat messages, and is
trained on the logit with a binary cross-entropy. heldout.jsonl keeps the held-out completions and labels (a judge
is scored on the same ones: scripts/judge_agreement.py). reward-model.json records its held-out accuracy (logit > 0) and
AUC against the rule, the label balance, the sizes and the build time: the agreement is what it is, not tuned
to look good. The build runs in a child process under the tiny model's PINNED_ENV and is written to a
`.partial` directory first, renamed when whole.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.recipe.resolve import tiny_reward_model_dir
from workbench.rundir import write_atomic
from workbench.tasks.rewards import correctness

INFO = "reward-model.json"
HELDOUT = "heldout.jsonl"  # the held-out completions with their rule labels
SETTINGS = {"train_prompts": 512, "heldout_prompts": 256, "samples": 4, "epochs": 3, "batch_size": 32,
            "learning_rate": 1e-3, "temperature": 1.0, "max_new_tokens": 48, "seed": 0}


def needed(rr: Resolved) -> bool:
    """The recipe trains against the tiny reward model."""
    return any(s.is_learned and s.learned.model == "tiny-rm" for s in rr.task.reward_specs)


def ensure(rr: Resolved, log=print, force: bool = False) -> Path:
    """The tiny reward model's directory, built first when missing (one build at a time per model)."""
    if not rr.is_tiny:
        raise WorkbenchError("tiny-rm is built on the tiny base model, and this recipe's model is not tiny",
                             "use a reward model of your own (a directory or hub id) for this model")
    target = tiny_reward_model_dir(rr.recipe)
    if (target / INFO).is_file() and not force:
        return _reused(target, log)
    from workbench import tinymodel

    base = tinymodel.ensure_model(rr, log=log)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / INFO).is_file() and not force:
            return _reused(target, log)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        rows = {"train": rr.task.rows("train", SETTINGS["train_prompts"]),
                "heldout": rr.task.rows("validation", SETTINGS["heldout_prompts"])}
        partial.mkdir(parents=True)
        write_atomic(partial / "rows.json", json.dumps(rows))
        log(f"building the tiny reward model from {base} ({SETTINGS['train_prompts']} training prompts x "
            f"{SETTINGS['samples']} completions, held out: {SETTINGS['heldout_prompts']} validation prompts)")
        env = {**os.environ, **tinymodel.PINNED_ENV}
        proc = subprocess.run([sys.executable, "-m", "workbench.training.rewardmodel", base, str(partial)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise WorkbenchError(f"the reward model build failed: {proc.stderr.strip()[-600:]}",
                                 "read the error above; rerun with `workbench reward-model --force`")
        (partial / "rows.json").unlink()
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return _reused(target, log)


def _reused(target: Path, log) -> Path:
    info = json.loads((target / INFO).read_text())
    held = info["heldout"]
    log(f"tiny reward model: {target} (held-out agreement with the rule: accuracy {held['accuracy']:.1%}, AUC "
        f"{held['auc']:.3f}, {held['completions']} completions)")
    return target


def auc(scores: list[float], labels: list[int]) -> float | None:
    """The probability that a random positive scores above a random negative (ties count half)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    pos_ranks = sum(r for r, y in zip(ranks, labels) if y)
    return (pos_ranks - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def _sample(model, tokenizer, rows: list[dict], seed: int) -> list[dict]:
    """SETTINGS['samples'] completions per row from the base, each labelled by the correctness rule."""
    import torch

    torch.manual_seed(seed)
    out = []
    for start in range(0, len(rows), 64):
        chunk = rows[start:start + 64]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=SETTINGS["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=SETTINGS["max_new_tokens"], num_return_sequences=SETTINGS["samples"],
                                 pad_token_id=tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, text in enumerate(completions):
            row = chunk[i // SETTINGS["samples"]]
            label = correctness(None, [text], answer=[row["answer"]])[0]
            if label is not None:
                out.append({"prompt": row["prompt"], "completion": text, "label": int(label)})
    return out


def _texts(tokenizer, examples: list[dict]) -> list[str]:
    return [tokenizer.apply_chat_template(e["prompt"] + [{"role": "assistant", "content": e["completion"]}],
                                          tokenize=False) for e in examples]


def _logits(model, tokenizer, examples: list[dict]) -> list[float]:
    import torch

    scores = []
    with torch.no_grad():
        for start in range(0, len(examples), 128):
            enc = tokenizer(_texts(tokenizer, examples[start:start + 128]), return_tensors="pt", padding=True,
                            padding_side="right", add_special_tokens=False)
            scores += model(**enc).logits[:, 0].tolist()
    return scores


def build(base: str, out: Path) -> dict:
    """Sample, label, train and score; saves the model, its tokenizer and reward-model.json into `out`."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    started = time.time()
    rows = json.loads((out / "rows.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    data = {split: _sample(policy, tokenizer, rows[split], SETTINGS["seed"] + k)
            for k, split in enumerate(("train", "heldout"))}
    sampled = time.time() - started
    del policy
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=SETTINGS["learning_rate"])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    rng = random.Random(SETTINGS["seed"])
    train = list(data["train"])
    model.train()
    for _ in range(SETTINGS["epochs"]):
        rng.shuffle(train)
        for start in range(0, len(train), SETTINGS["batch_size"]):
            batch = train[start:start + SETTINGS["batch_size"]]
            enc = tokenizer(_texts(tokenizer, batch), return_tensors="pt", padding=True, padding_side="right",
                            add_special_tokens=False)
            loss = loss_fn(model(**enc).logits[:, 0], torch.tensor([float(e["label"]) for e in batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    report = {"base": base, "settings": SETTINGS, "sample_seconds": round(sampled, 1)}
    for split, examples in data.items():
        logits = _logits(model, tokenizer, examples)
        labels = [e["label"] for e in examples]
        report[split] = {"completions": len(examples), "positive_share": round(sum(labels) / max(1, len(labels)), 4),
                         "accuracy": round(sum((s > 0) == bool(y) for s, y in zip(logits, labels)) / len(labels), 4),
                         "auc": round(auc(logits, labels) or float("nan"), 4)}
    with open(out / HELDOUT, "w") as f:  # the held-out completions, for a judge's agreement on the same ones
        for e in data["heldout"]:
            f.write(json.dumps(e) + "\n")
    model.save_pretrained(str(out))
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(str(out))
    report["build_seconds"] = round(time.time() - started, 1)
    report["architecture"] = model.config.architectures[0]
    write_atomic(out / INFO, json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]))
