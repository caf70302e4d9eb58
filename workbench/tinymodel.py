"""The tiny policy model the workbench builds itself, so the whole pipeline runs on a CPU with no download.

Three steps, all seeded:
1. a byte-level BPE tokenizer (digits split one per token; asked for 512 tokens, the arithmetic text saturates it at
   358) trained on the arithmetic task's text,
   with a ChatML chat template, eos `<|im_end|>` and pad `<|pad|>`;
2. a Qwen2-architecture model (hidden 256, 2 layers, 4/2 heads, tied embeddings: about 1.3M parameters);
3. a short supervised pre-training on worked answers, stopped early on purpose: the model learns the answer format
   but is often wrong, which leaves GRPO room to teach it. Held-out greedy accuracy is measured and saved.

The result is a normal Hugging Face directory (vLLM serves it, TRL trains it), cached under
data/tiny-model/<settings-hash>/ (see workbench.paths) and reused when the settings are the same.

    workbench tiny-model              # build or reuse, print the held-out accuracy
    python -m workbench.tinymodel
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from workbench import recipe as recipes
from workbench.errors import WorkbenchError, die_with_parent, exit_on_sigterm
from workbench.recipe.resolve import model_dir  # where a tiny model lives is part of the resolution
from workbench.recipe.schema import TINY_BUILD_VERSION, Recipe, TinyModelConfig
from workbench.tasks import arithmetic, rewards

BUILD_VERSION = TINY_BUILD_VERSION
INFO_FILE = "tiny_model.json"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


def _chat_text(row: dict) -> str:
    messages = row["prompt"] + [{"role": "assistant", "content": row["target"]}]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single-digit tokens: the model has to see each digit to learn carrying.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                      bos_token=None, unk_token=None, padding_side="left")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(tokenizer, tiny: TinyModelConfig):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=2 * tiny.hidden_size,
        num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="float32", use_cache=True,
    )
    return Qwen2ForCausalLM(config)


def _encode_examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(token ids, index where the answer starts): the loss covers only the assistant's answer."""
    out = []
    for row in rows:
        prompt_ids = _ids(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True))
        answer_ids = tokenizer(row["target"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append((prompt_ids + answer_ids, len(prompt_ids)))
    return out


def _ids(encoded) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def pretrain(model, tokenizer, rows: list[dict], tiny: TinyModelConfig, log=print) -> list[float]:
    import torch

    examples = _encode_examples(tokenizer, rows)
    rng = random.Random(tiny.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.learning_rate, weight_decay=0.01)
    total, warm = tiny.pretrain_steps, max(1, tiny.warmup_steps)

    # Warm-up, then cosine down to 10%: a constant rate leaves held-out accuracy swinging by ±15 points
    # from one step to the next, and the baseline should not depend on where the swing stops.
    def rate(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        if tiny.lr_schedule == "constant":
            return 1.0
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    pad = tokenizer.pad_token_id
    losses = []
    model.train()
    for step in range(tiny.pretrain_steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(tiny.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, start) in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, start:len(ids)] = torch.tensor(ids[start:])
            attention[i, :len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == tiny.pretrain_steps - 1:
            log(f"  pre-train step {step + 1}/{tiny.pretrain_steps}  loss {loss:.3f}")
    model.eval()
    return losses


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 48, batch_size: int = 100) -> dict:
    """Exact-match and format rates of greedy answers, scored by the same rewards GRPO uses."""
    import torch

    if not rows:  # model.tiny.eval_size: 0 (the benchmark's random-weight model is not scored)
        return {"n": 0, "accuracy": 0.0, "format_rate": 0.0, "samples": []}

    texts: list[str] = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = rewards.score("correctness", texts, answer=[r["answer"] for r in rows])
    formatted = rewards.score("format", texts)
    return {
        "n": len(rows),
        "accuracy": sum(c or 0.0 for c in correct) / len(rows),
        "format_rate": sum(formatted) / len(rows),
        "samples": [{"question": r["prompt"][-1]["content"], "answer": r["answer"], "completion": t}
                    for r, t in zip(rows[:5], texts[:5])],
    }


def _count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# A build runs in a child process with every numeric library pinned to one code path, so that the same settings give
# the same weights on any x86-64 CPU with AVX2, whatever its own vector units, its core count or the caller's thread
# settings. Built with each machine's fastest kernels, the default model scored 63.0% held-out on one AVX2 box and
# 54.7% with ATEN_CPU_CAPABILITY=default on the same box: two machines started GRPO from different bases. Scoring is
# portable (one set of weights scores the same under every kernel level); building was not.
PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "default",  # torch's own kernels (norms, softmax, the optimizer): the baseline build
    "MKL_CBWR": "AVX2,STRICT",  # MKL's matrix products: its AVX2 path on every CPU, whatever the memory alignment
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",  # one thread: no sum whose order follows the core count
    # libm's baseline exp/log, not its FMA variants (these feature names are glibc 2.33's and later's)
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX2,-FMA,-AVX",
}

# Reference builds, by settings key (the cache directory's name): the weights' digest (weights_digest) and what they
# score. A build whose digest differs says so instead of passing for the reference (docs/results.md starts from it).
# Made with `workbench tiny-model --force` (torch 2.13.0+cpu, MKL in its wheel, glibc 2.36) on a 2-core AMD EPYC.
REFERENCE: dict[str, dict] = {
    # cpu-tiny and the recipes that extend it (the demo's): 250 steps on data seed 0's training split
    "e6e64e60d509": {"weights_sha256": "b3e0aa63c189a9b7846fe6dd87cb3590fbd7afe910a0b83f5d61f112492c0f82",
                     "heldout_accuracy": 0.5467, "torch": "2.13.0+cpu"},
}


def weights_digest(model) -> str:
    """sha256 over the state dict: each tensor's name, dtype, shape and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _build(spec: dict, into: Path, log=print) -> None:
    """The build itself, in the pinned child process: tokenizer, model, pre-training, held-out score, saved into
    `into` with its record."""
    import torch

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False  # oneDNN picks kernels by CPU; MKL under MKL_CBWR does not
    tiny = TinyModelConfig(**spec["tiny"])
    started = time.time()
    torch.manual_seed(tiny.seed)
    random.seed(tiny.seed)
    splits = {"seed": spec["data_seed"], "heldout_size": spec["heldout_size"],
              "validation_size": spec["validation_size"]}
    # pre-trained on the train split only: the validation problems stay as unseen as the held-out ones
    train_rows = arithmetic.rows("train", **splits)
    heldout_rows = arithmetic.rows("heldout", **splits)
    tokenizer = build_tokenizer([_chat_text(r) for r in train_rows[:4000]], tiny.vocab_size)
    torch.manual_seed(tiny.seed)
    model = build_model(tokenizer, tiny)
    log(f"  tokenizer {len(tokenizer)} tokens, model {_count_params(model) / 1e6:.2f}M parameters, one thread, "
        f"{torch.backends.cpu.get_cpu_capability().lower()} kernels")
    t0 = time.time()
    losses = pretrain(model, tokenizer, train_rows, tiny, log=log)
    pretrain_s = time.time() - t0
    t0 = time.time()
    heldout = greedy_accuracy(model, tokenizer, heldout_rows[:tiny.eval_size])
    eval_s = time.time() - t0
    info = {
        "settings": asdict(tiny),
        "data_seed": spec["data_seed"],
        "heldout_size": spec["heldout_size"],
        "validation_size": spec["validation_size"],
        "build_version": BUILD_VERSION,
        "parameters": _count_params(model),
        "final_loss": losses[-1] if losses else None,
        "heldout": heldout,
        "weights_sha256": weights_digest(model),
        "pinned": {k: os.environ.get(k) for k in PINNED_ENV},
        "torch": torch.__version__,
        "glibc": platform.libc_ver()[1],  # its libm's variants are masked by name: glibc 2.33 or newer
        "seconds": {"pretrain": round(pretrain_s, 1), "eval": round(eval_s, 1),
                    "total": round(time.time() - started, 1)},
        "torch_threads": torch.get_num_threads(),
    }
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    (into / INFO_FILE).write_text(json.dumps(info, indent=2))


def ensure(recipe: Recipe, root: Path | None = None, force: bool = False, log=print) -> Path:
    """Build the recipe's tiny model unless an identical one is cached; return its directory. The build runs in a
    child process under PINNED_ENV and is checked against REFERENCE."""
    if recipe.model.tiny.lr_schedule not in ("cosine", "constant"):
        raise WorkbenchError(f"model.tiny.lr_schedule is {recipe.model.tiny.lr_schedule!r}",
                             "use cosine or constant")
    target = model_dir(recipe, root)
    if (target / INFO_FILE).is_file() and not force:
        return _reused(target, log)
    tiny, d = recipe.model.tiny, recipe.data
    if tiny.eval_size > d.heldout_size:
        raise WorkbenchError(f"model.tiny.eval_size={tiny.eval_size} exceeds data.heldout_size={d.heldout_size}",
                             "lower model.tiny.eval_size or raise data.heldout_size")
    target.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per model: a second process asking for it (two notebooks, two test workers) waits and
    # reuses it, instead of building it again and replacing the directory under the first one's readers.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / INFO_FILE).is_file() and not force:
            return _reused(target, log)
        return _build_into(target, recipe, log)


def _reused(target: Path, log) -> Path:
    info = json.loads((target / INFO_FILE).read_text())
    log(f"tiny model reused: {target} (held-out accuracy {info['heldout']['accuracy']:.1%}, "
        f"format {info['heldout']['format_rate']:.1%})")
    return target


def _build_into(target: Path, recipe: Recipe, log) -> Path:
    import subprocess
    import sys
    from collections import deque

    tiny, d = recipe.model.tiny, recipe.data
    log(f"building tiny model -> {target}")
    # Built next to the target and renamed: a crash never leaves a half-written model that looks cached.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    spec = {"tiny": asdict(tiny), "data_seed": d.seed, "heldout_size": d.heldout_size,
            "validation_size": d.validation_size}
    cmd = [sys.executable, "-m", "workbench.tinymodel", "--pinned-build", json.dumps(spec), "--into", str(tmp)]
    tail: deque[str] = deque(maxlen=20)
    env = {**os.environ, **PINNED_ENV}
    if os.environ.get("GLIBC_TUNABLES"):  # the caller's own tunables kept (colon-separated), the mask after them
        env["GLIBC_TUNABLES"] = f"{os.environ['GLIBC_TUNABLES']}:{PINNED_ENV['GLIBC_TUNABLES']}"
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                preexec_fn=die_with_parent)
        try:
            for line in proc.stdout:
                tail.append(line.rstrip())
                if line.startswith("  "):  # the build's progress lines; warnings stay in the tail for a failure
                    log(line.rstrip())
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode:
            raise WorkbenchError(f"building the tiny model failed (exit {proc.returncode}):\n" + "\n".join(tail),
                                 "fix the cause above and run `workbench tiny-model` again")
        info = json.loads((tmp / INFO_FILE).read_text())
        reference = REFERENCE.get(target.name)
        if reference is not None:
            info["reference"] = {**reference, "matches": info["weights_sha256"] == reference["weights_sha256"]}
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:  # a failed or interrupted build leaves nothing half-made beside the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    heldout = info["heldout"]
    log(f"tiny model built in {info['seconds']['total']:.0f} s: held-out accuracy {heldout['accuracy']:.1%} "
        f"(format {heldout['format_rate']:.1%}) on {heldout['n']} problems")
    if reference is not None and not info["reference"]["matches"]:
        log(f"warning: these weights differ from the reference build of the same settings "
            f"({info['weights_sha256'][:12]} vs {reference['weights_sha256'][:12]}; reference held-out accuracy "
            f"{reference['heldout_accuracy']:.1%}, torch {reference['torch']}): results from this base are not "
            f"comparable with those in docs/results.md. The build is reproducible on x86-64 CPUs with AVX2 under "
            f"the same torch; this machine has torch {info['torch']}")
    return target


def info(path: Path) -> dict:
    """The build record saved beside a tiny model (settings, held-out accuracy, timings)."""
    return json.loads((Path(path) / INFO_FILE).read_text())


def ensure_model(rr, log=print) -> str:
    """The resolved model path, with the tiny model built first when the recipe asks for it and it is missing."""
    if rr.is_tiny and not (Path(rr.model_path) / INFO_FILE).is_file():
        ensure(rr.recipe, log=log)
    return rr.model_path


def check_tokenizer(path: str) -> None:
    """A policy without a chat template cannot be prompted with chat messages: say so before anything starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise WorkbenchError(f"the tokenizer at {path} has no chat template",
                             "use an instruct/chat model, or add a chat_template to its tokenizer_config.json")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workbench.tinymodel")
    parser.add_argument("--recipe", default="cpu-tiny")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--pinned-build", help=argparse.SUPPRESS)  # the child ensure() starts: a JSON spec
    parser.add_argument("--into", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.pinned_build:
        _build(json.loads(args.pinned_build), Path(args.into), log=lambda line: print(line, flush=True))
        return
    exit_on_sigterm()  # a stopped build removes its temporary directory and ends its child
    r = recipes.load(args.recipe, overrides)
    print(ensure(r, force=args.force))


if __name__ == "__main__":
    main()
