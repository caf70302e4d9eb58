"""Evaluation through the OpenAI-compatible server: repeated, concurrent, verifiable.

    workbench eval --recipe cpu-tiny                          # the recipe's model (base)
    workbench eval --recipe cpu-tiny --model trained=runs/<run>/final --model base=tiny
    workbench eval --recipe cpu-tiny server.mode=attach server.url=http://127.0.0.1:8000

    from workbench.evaluation import evaluate
    result = evaluate.evaluate(rr, {"base": rr.model_path}, stage=run.eval)   # -> Evaluation
    evaluate.Evaluation.load(run.eval).summaries

For each model: serve it (or attach), check before any request that the served name is right and that the longest
prompt plus eval.max_tokens fits the server's max_model_len, send the eval split with bounded concurrency from an
async OpenAI client (chat or completions endpoint; temperature, top_p, seed, max tokens and stop strings from the
recipe's eval section; transient errors retried a bounded number of times), score, and repeat eval.repeats times.

Several models that are checkpoints of one model (the base and what training made of it, a protocol's candidates:
the same architecture, tokenizer and generation defaults, other weights) share one server: after the first is
scored, the next one's weights are loaded into it the way a training pushes its weights (serving/sync.py's reload:
vLLM's `reload_weights`, then a prefix-cache reset), and the weight-parity probes prove the server now answers as
that model before a request is scored (a gap above the canary's warning level stops the evaluation). One server
start instead of one per model. Other models each get their own server, the next one starting on the trainer's
devices (idle during evaluation) while the current one is scored.
Per-sample records go to samples.jsonl, per-model summaries (accuracy mean ± std over repetitions, pass@1, mean
output length, truncation rate, throughput) to summary.json, a comparison table to comparison.md and a figure to
comparison.png. The equivalent lm-evaluation-harness command is printed for a cross-check.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved, load
from workbench.rundir import ADAPTER_CONFIG, StageDir, is_adapter, write_atomic
from workbench.serving import client, launch
from workbench.serving.server import VLLMServer, shared_server
from workbench.tasks.grading import grade
from workbench.tinymodel import ensure_model
from workbench.training.canary import Canary, probe_sequences, thresholds


# ----------------------------------------------------------------------------------------------------------------
# Preflight

def longest_prompt_tokens(rr: Resolved, rows: list[dict], url: str | None = None, sample: int = 16) -> int:
    """Token length of the longest prompts as the server tokenizes them (chat template included)."""
    longest = sorted(rows, key=lambda r: sum(len(m["content"]) for m in r["prompt"]), reverse=True)[:sample]
    return max((client.tokenized_length(rr, row["prompt"], url) for row in longest), default=0)


def preflight(rr: Resolved, rows: list[dict], url: str | None = None) -> dict:
    """Before any request: the model name is served and the longest prompt + max_tokens fits max_model_len."""
    recipe = rr.recipe
    entry = client.served_entry(rr, url)
    name = recipe.server.served_model_name
    limit = entry.get("max_model_len")
    longest = longest_prompt_tokens(rr, rows, url)
    needed = longest + recipe.eval.max_tokens
    if limit is not None and needed > limit:
        raise WorkbenchError(
            f"the longest prompt is {longest} tokens and eval.max_tokens is {recipe.eval.max_tokens}: {needed} > the "
            f"server's max_model_len {limit}",
            f"serve with --max-model-len {needed} or more (server.max_model_len={needed}), or lower eval.max_tokens "
            f"to {max(1, limit - longest)}")
    return {"model": name, "max_model_len": limit, "longest_prompt_tokens": longest}


# ----------------------------------------------------------------------------------------------------------------
# Sending

@dataclass
class Sample:
    model: str
    repeat: int
    id: str
    prompt: str
    gold: str
    response: str = ""
    extracted: str | None = None
    correct: bool | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class Summary:
    model: str
    path: str
    n: int
    repeats: int
    accuracy_per_repeat: list[float] = field(default_factory=list)
    accuracy_mean: float = 0.0
    accuracy_std: float = 0.0
    pass_at_1: float = 0.0
    mean_output_tokens: float = 0.0
    truncation_rate: float = 0.0
    unscored: int = 0
    errors: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    requests_per_second: float = 0.0
    split: str = "heldout"  # the rows' split (eval.split): validation while choosing settings, heldout to report

    @property
    def split_label(self) -> str:
        return split_label(self.split)


def split_label(split: str) -> str:
    """How results on a split are named in logs, reports and figures."""
    return {"heldout": "held-out (test)", "test": "test", "validation": "validation"}.get(split, split)


def _run_async(coro):
    """asyncio.run, also from inside a running loop (a Jupyter kernel): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict = {}

    def target() -> None:
        try:
            box["out"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["out"]


async def _send_all(rr: Resolved, url: str, samples: list[Sample], rows: list[dict], concurrency: int,
                    progress, served_as: str | None = None) -> None:
    from openai import APIConnectionError, APITimeoutError, AsyncOpenAI, InternalServerError, RateLimitError

    recipe, ev = rr.recipe, rr.recipe.eval
    openai_client = AsyncOpenAI(base_url=f"{url}/v1", api_key=rr.api_key or "EMPTY", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)
    transient = (APIConnectionError, APITimeoutError, InternalServerError, RateLimitError)
    done = 0

    async def one(sample: Sample, row: dict) -> None:
        nonlocal done
        common = dict(model=served_as or recipe.server.served_model_name, max_tokens=ev.max_tokens, temperature=ev.temperature,
                      top_p=ev.top_p, seed=ev.seed + sample.repeat, stop=ev.stop or None)
        async with gate:
            for attempt in range(ev.retries + 1):
                started = time.perf_counter()
                try:
                    if ev.endpoint == "chat":
                        out = await openai_client.chat.completions.create(messages=row["prompt"], **common)
                        sample.response = out.choices[0].message.content or ""
                    else:
                        out = await openai_client.completions.create(prompt=row["prompt_text"], **common)
                        sample.response = out.choices[0].text
                    sample.finish_reason = out.choices[0].finish_reason
                    sample.completion_tokens = out.usage.completion_tokens if out.usage else 0
                    sample.latency_s = time.perf_counter() - started
                    sample.error = None
                    break
                except transient as exc:
                    sample.error = f"{type(exc).__name__}: {exc}"[:300]
                    await asyncio.sleep(min(8.0, 0.5 * 2 ** attempt))
        done += 1
        progress(done)

    await asyncio.gather(*(one(s, r) for s, r in zip(samples, rows)))
    await openai_client.close()


class _Progress:
    def __init__(self, total: int, label: str, quiet: bool):
        self.bar = None
        if not quiet:
            import sys

            from tqdm.auto import tqdm

            # In a log file a bar redrawn 20 times a second is noise: redraw every 10 s there.
            self.bar = tqdm(total=total, desc=label, leave=True, mininterval=0.2 if sys.stderr.isatty() else 10)
        self.last = 0

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.last)
        self.last = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def evaluate_server(rr: Resolved, label: str, rows: list[dict], url: str | None = None,
                    concurrency: int | None = None, repeats: int | None = None, quiet: bool = False,
                    model_path: str = "", served_as: str | None = None) -> tuple[Summary, list[Sample]]:
    """Evaluate whatever the server at `url` serves under the recipe's served name (or `served_as`: an adapter's
    name on a LoRA server)."""
    recipe = rr.recipe
    url = url or rr.server_url
    concurrency = concurrency or recipe.eval.concurrency
    repeats = repeats or recipe.eval.repeats
    if recipe.eval.endpoint == "completions":
        rows = _with_prompt_text(rr, rows, url)
    all_samples: list[Sample] = []
    summary = Summary(model=label, path=model_path, n=len(rows), repeats=repeats, split=recipe.eval.split)
    started = time.perf_counter()
    for repeat in range(repeats):
        samples = [Sample(label, repeat, r["id"], r["prompt"][-1]["content"], r["answer"]) for r in rows]
        progress = _Progress(len(samples), f"{label} #{repeat + 1}/{repeats}", quiet)
        _run_async(_send_all(rr, url, samples, rows, concurrency, progress, served_as))
        progress.close()
        for sample, (extracted, correct) in zip(samples, grade([s.gold for s in samples], [s.response for s in samples])):
            sample.extracted, sample.correct = extracted, (correct if sample.error is None else None)
        scored = [s.correct for s in samples if s.correct is not None]
        summary.accuracy_per_repeat.append(sum(scored) / len(samples))
        all_samples += samples
    summary.seconds = time.perf_counter() - started
    summary.accuracy_mean = statistics.fmean(summary.accuracy_per_repeat)
    summary.accuracy_std = statistics.stdev(summary.accuracy_per_repeat) if repeats > 1 else 0.0
    per_problem: dict[str, list[bool]] = {}
    for s in all_samples:
        per_problem.setdefault(s.id, []).append(bool(s.correct))
    summary.pass_at_1 = statistics.fmean(statistics.fmean(v) for v in per_problem.values())
    summary.mean_output_tokens = statistics.fmean(s.completion_tokens for s in all_samples)
    summary.truncation_rate = sum(s.finish_reason == "length" for s in all_samples) / len(all_samples)
    summary.unscored = sum(s.correct is None and s.error is None for s in all_samples)
    summary.errors = sum(s.error is not None for s in all_samples)
    summary.tokens_per_second = sum(s.completion_tokens for s in all_samples) / summary.seconds
    summary.requests_per_second = len(all_samples) / summary.seconds
    return summary, all_samples


def _with_prompt_text(rr: Resolved, rows: list[dict], url: str) -> list[dict]:
    """The completions endpoint takes text: render the chat template with the served model's tokenizer."""
    from transformers import AutoTokenizer

    root = client.served_entry(rr, url).get("root")
    tokenizer = AutoTokenizer.from_pretrained(root)
    return [{**r, "prompt_text": tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)}
            for r in rows]


# ----------------------------------------------------------------------------------------------------------------
# Models, outputs

def eval_rows(rr: Resolved) -> list[dict]:
    return rr.task.eval_rows(rr.recipe.eval)


def lm_eval_command(rr: Resolved, url: str | None = None) -> str:
    """The lm-evaluation-harness command that scores the same server, for a cross-check."""
    recipe, url = rr.recipe, url or rr.server_url
    task = {"gsm8k": "gsm8k", "math500": "minerva_math500", "aime2024": "aime24"}.get(recipe.data.name)
    ev = recipe.eval
    if ev.endpoint == "chat":
        backend, endpoint, extra = "local-chat-completions", "chat/completions", " --apply_chat_template"
    else:
        backend, endpoint, extra = "local-completions", "completions", ""
    gen = f"temperature={ev.temperature},top_p={ev.top_p},max_gen_toks={ev.max_tokens},seed={ev.seed}"
    command = (f"lm_eval --model {backend} --model_args model={recipe.server.served_model_name},"
               f"base_url={url}/v1/{endpoint},num_concurrent={ev.concurrency},max_retries={ev.retries},"
               f"tokenized_requests=False --tasks {task or '<task>'}{extra} --gen_kwargs {gen}")
    if task is None:
        command += f"   # the harness has no task for data.name={recipe.data.name!r}: cross-check on gsm8k"
    return command


@dataclass
class Evaluation:
    """The evaluation stage's result: a summary per model and every scored sample; saves and loads itself."""
    summaries: list[Summary]
    samples: list[Sample] = field(default_factory=list)

    def save(self, stage: StageDir) -> StageDir:
        stage.make()
        write_atomic(stage.samples, "".join(json.dumps(asdict(s)) + "\n" for s in self.samples))
        write_atomic(stage.summary, json.dumps([asdict(s) for s in self.summaries], indent=2))
        write_atomic(stage.table, comparison_table(self.summaries))
        comparison_figure(self.summaries, stage.figure)
        return stage

    @classmethod
    def load(cls, stage: StageDir) -> "Evaluation | None":
        try:
            summaries = [Summary(**s) for s in json.loads(Path(stage.summary).read_text())]
        except (OSError, json.JSONDecodeError, TypeError):
            return None
        samples = []
        if Path(stage.samples).exists():
            for line in Path(stage.samples).read_text().splitlines():
                try:
                    samples.append(Sample(**json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    continue
        return cls(summaries, samples)

    def by_model(self) -> dict[str, Summary]:
        return {s.model: s for s in self.summaries}

    def gain(self) -> tuple[Summary, Summary] | None:
        """(base, trained) when both were evaluated."""
        models = self.by_model()
        return (models["base"], models["trained"]) if "base" in models and "trained" in models else None


def comparison_table(summaries: list[Summary]) -> str:
    lines = ["| model | n × repeats | accuracy (mean ± std) | pass@1 | mean output tokens | truncated | unscored | "
             "tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.model} | {s.n} × {s.repeats} | {s.accuracy_mean:.1%} ± {s.accuracy_std:.1%} | "
                     f"{s.pass_at_1:.1%} | {s.mean_output_tokens:.1f} | {s.truncation_rate:.1%} | {s.unscored} | "
                     f"{s.tokens_per_second:.0f} |")
    return "\n".join(lines) + "\n"


def comparison_figure(summaries: list[Summary], path: Path) -> Path:
    from workbench.plots import plt, save_png  # lazy: matplotlib

    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(summaries)), 3.2))
    names = [s.model for s in summaries]
    means = [100 * s.accuracy_mean for s in summaries]
    errs = [100 * s.accuracy_std for s in summaries]
    bars = ax.bar(names, means, yerr=errs, capsize=6, color=["#8c959f", "#0969da", "#1a7f37", "#9a6700"][:len(names)])
    for bar, mean in zip(bars, means):
        ax.text(bar.get_x() + bar.get_width() / 2, mean + 1, f"{mean:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_ylim(0, min(100, max(means + [10]) * 1.25 + 5))
    ax.set_title(f"{summaries[0].split_label} accuracy, {summaries[0].n} problems × {summaries[0].repeats}")
    fig.tight_layout()
    return save_png(fig, path, dpi=110)


# config.json keys a checkpoint may change without changing what the server must be (written by whoever saved it)
NOT_ARCHITECTURE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}


def _config(path: str, name: str) -> dict | None:
    file = Path(path) / name
    if not file.is_file():
        return None
    return {k: v for k, v in json.loads(file.read_text()).items() if k not in NOT_ARCHITECTURE}


def weights_apart(first: str, other: str) -> str | None:
    """None when `other` is `first` with other weights (a checkpoint of it, what a training saves): the same
    architecture (config.json), generation defaults and tokenizer (its vocabulary, special tokens, chat template and
    how it encodes a chat prompt; the files may be written differently). Else what differs."""
    for name in ("config.json", "generation_config.json"):
        if _config(first, name) != _config(other, name):
            return f"{name} differs"
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(first), AutoTokenizer.from_pretrained(other)
    if a.get_vocab() != b.get_vocab() or a.all_special_tokens != b.all_special_tokens:
        return "the tokenizers' vocabularies differ"
    if a.chat_template != b.chat_template:
        return "the chat templates differ"
    chat = [{"role": "user", "content": "What is 12 + 34?"}]
    if a.apply_chat_template(chat, add_generation_prompt=True) != b.apply_chat_template(chat, add_generation_prompt=True):
        return "the tokenizers encode a chat prompt differently"
    return None


def _one_server(rr: Resolved, paths: list[str], log) -> bool:
    """Whether these models are scored on one server, loaded in turn: checkpoints of one model, on a server whose
    weight-update endpoints stay on this machine (or that the recipe lets take remote updates). Always when
    `workbench run` shares a server of this recipe with its stages: it holds whatever the training left in it, so
    even a single model is loaded into it before it is scored."""
    s = rr.recipe.server
    shared = (shared_server() or {}).get("command") == launch.command(rr, str(paths[0]))
    if not shared and (len(paths) < 2 or not (launch.is_loopback(s.host) or s.allow_remote_weight_updates)):
        return False
    for path in paths[1:]:
        why = weights_apart(paths[0], path)
        if why and shared:
            raise WorkbenchError(f"{path} is not a checkpoint of {paths[0]}, which the shared server serves ({why})",
                                 "evaluate it apart, with `workbench eval`")
        if why:
            log(f"{path} is not a checkpoint of {paths[0]} ({why}): each model gets a server of its own")
            return False
    return True


def load_weights(rr: Resolved, url: str, path: str) -> tuple[float, float]:
    """Load the model at `path` into the server at `url` (serving/sync.py's reload, as a training pushes its weights;
    the server must have its weight-update endpoints) and prove it: the canary's probe sequences scored by the
    server and by the model itself. Returns (seconds, the probes' mean gap in nats a token); a gap above the
    canary's warning level raises."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.serving import sync  # lazy: torch

    started = time.perf_counter()
    dtype = rr.recipe.server.dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    vc = sync.SyncingVLLMClient(base_url=url, weight_sync=sync.ReloadSync(aliases=sync.tied_aliases(model)),
                                headers=rr.headers)
    vc.init_communicator("cpu")
    try:
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        vc.update_named_params(metadata, iter(model.named_parameters()))
        vc.reset_prefix_cache()
    finally:
        vc.close_communicator()
    seconds = time.perf_counter() - started
    warn, stop = thresholds(rr)
    canary = Canary(None, probe_sequences(rr, AutoTokenizer.from_pretrained(path)), 1, warn, stop)
    mine = canary.trainer_logprobs(model)
    served = [client.sequence_logprobs(rr, ids, url=url) for ids in canary.sequences]
    gaps = [abs(a - b) for xs, ys in zip(mine, served) for a, b in zip(xs, ys)]
    gap = sum(gaps) / max(1, len(gaps))
    if gap > warn:
        raise WorkbenchError(f"after loading {path} into the evaluation's server, its log-probs differ from the "
                             f"model's by {gap:.3g} nats/token (above {warn:g}): it does not serve that model",
                             "evaluate that model on a server of its own: give it a different tokenizer or config, "
                             "or report the reload failure with the server log")
    return seconds, gap


def check_inputs(rr: Resolved, models: dict[str, str] | None = None) -> None:
    """What an evaluation needs before anything starts or is written: the model directories it names, and the key
    the recipe names (set; accepted by an attached server)."""
    missing = [f"{label}={path}" for label, path in (models or {}).items()
               if path not in ("tiny", "base") and not (Path(path) / "config.json").is_file() and not is_adapter(path)]
    if missing:
        raise WorkbenchError(f"no model directory at {', '.join(missing)} (no config.json or adapter_config.json)",
                             "pass --model LABEL=DIR with a Hugging Face model directory or a LoRA adapter, e.g. "
                             "RUN/train/final")
    adapters = {label: path for label, path in (models or {}).items() if is_adapter(path)}
    if adapters:
        _adapter_base_matches(rr, adapters)
    client.check_key(rr)


def evaluate(rr: Resolved, models: dict[str, str] | None = None, stage: StageDir | None = None,
             quiet: bool = False, log=print, server=None) -> Evaluation:
    """Evaluate each labelled model directory (serving it in turn), or the attached server; save the result into
    `stage` (a run's eval directory) when given. `server`: a running server of this recipe with its weight-update
    endpoints (a shared one, serving/shared.py) to load every model into instead of starting one; the models must
    be checkpoints of the model it serves."""
    recipe = rr.recipe
    rows = eval_rows(rr)
    result = Evaluation([])
    log_dir = stage.path if stage is not None else None
    if recipe.server.attached:
        info = preflight(rr, rows)
        log(f"preflight: {info}")
        summary, got = evaluate_server(rr, recipe.server.served_model_name, rows, quiet=quiet)
        result.summaries.append(summary)
        result.samples += got
        log(lm_eval_command(rr))
    else:
        models = models or {"base": "base"}
        check_inputs(rr, models)  # before the first server starts, not after the first model was scored
        items = [(label, str(ensure_model(rr, log=log)) if path in ("tiny", "base") else path)
                 for label, path in models.items()]
        if any(is_adapter(path) for _, path in items):
            log(f"{len(items)} model(s) on one LoRA server of the base model: each adapter named in its requests, "
                "nothing merged")
            servers = _with_adapters(rr, items, log_dir, quiet, running=server)
        elif server is not None:
            for label, path in items:
                why = weights_apart(str(server.model_path), path)
                if why:
                    raise WorkbenchError(f"{label}={path} is not a checkpoint of {server.model_path}, which the "
                                         f"running server serves ({why})", "evaluate it on a server of its own")
            log(f"{len(items)} model(s) loaded in turn into the running server at {server.url}")
            servers = _loaded_in_turn(rr, items, log_dir, quiet, log, running=server)
        elif _one_server(rr, [path for _, path in items], log):
            log(f"{len(items)} checkpoints of one model: one server, each model's weights loaded in turn")
            servers = _loaded_in_turn(rr, items, log_dir, quiet, log)
        else:
            lanes = _lanes(rr, len(items))
            if len(lanes) > 1:
                log(f"{len(items)} models: the next model's server starts on the trainer's devices "
                    f"({', '.join(map(str, lanes[1].server.devices))}, port {lanes[1].recipe.server.port}) while "
                    "the current one starts or is scored")
            servers = _servers(items, lanes, log_dir, quiet)
        # closing(): an exception in the loop (kept alive by a notebook's traceback) must still stop the servers
        with contextlib.closing(servers):
            for label, path, srv in servers:
                info = preflight(rr, rows, srv.url)
                log(f"{label}: serving {path} ({info['longest_prompt_tokens']} + {recipe.eval.max_tokens} tokens "
                    f"fit max_model_len {info['max_model_len']})")
                summary, got = evaluate_server(rr, label, rows, srv.url, quiet=quiet, model_path=str(path),
                                               served_as=label if is_adapter(path) else None)
                result.summaries.append(summary)
                result.samples += got
                if label == items[0][0]:
                    log("cross-check with the standard harness while a server runs:\n  " + lm_eval_command(rr, srv.url))
    log(comparison_table(result.summaries))
    if stage is not None:
        result.save(stage)
        log(f"samples: {stage.samples}\nfigure: {stage.figure}")
    return result


def _adapter_base_matches(rr: Resolved, adapters: dict[str, str]) -> None:
    """An adapter is scored on the recipe's model: it must have been trained on that model."""
    for label, path in adapters.items():
        base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if rr.is_tiny or not base:
            continue  # the tiny model's cache directory moves with the checkout; its config is checked at load
        if Path(str(base)).resolve() != Path(rr.model_path).resolve() and str(base) != rr.model_path:
            raise WorkbenchError(f"{label}={path} is an adapter of {base}, but the recipe's model is {rr.model_path}",
                                 f"evaluate it with the recipe it was trained with (model.path={base})")


def _with_adapters(rr: Resolved, items: list[tuple[str, str]], log_dir: Path | None, quiet: bool, running=None):
    """Yield (label, path, server) for each model from one vLLM server of the recipe's base model started with LoRA
    and each adapter as a module of its own (`--lora-modules LABEL=DIR`, served from the start: no run-time loading,
    no weight-update endpoint). The base model's label is answered by the base; every other by its adapter. With
    `running` (a shared LoRA server that loads adapters at run time: the protocol's), each adapter is loaded into
    it under its label for its turn and unloaded after."""
    base = str(ensure_model(rr, log=lambda *_: None)) if rr.is_tiny else rr.model_path
    for label, path in items:
        if not is_adapter(path) and Path(path).resolve() != Path(base).resolve():
            raise WorkbenchError(f"{label}={path} is a full model beside LoRA adapters of {base}",
                                 "evaluate adapters together with the base model only, or merge them first "
                                 "(workbench export RUN --merge)")
    if running is not None:
        yield from _loaded_adapters(rr, items, running)
        return
    ranks = [int(json.loads((Path(p) / ADAPTER_CONFIG).read_text()).get("r", 8)) for _, p in items if is_adapter(p)]
    modules = [f"{label}={path}" for label, path in items if is_adapter(path)]
    served = load(rr.recipe, {"peft.r": max(ranks), "server.weight_sync": "lora",
                              "server.lora_slots": max(2, len(modules)),
                              "server.extra_args": [*rr.recipe.server.extra_args, "--lora-modules", *modules]})
    srv = VLLMServer(rr.with_recipe(served), base, log_dir, quiet=quiet, name="lora")
    try:
        srv.start()
        for label, path in items:
            yield label, path, srv
    finally:
        srv.stop()


def _loaded_adapters(rr: Resolved, items: list[tuple[str, str]], srv):
    import requests

    for label, path in items:
        if not is_adapter(path):
            yield label, path, srv
            continue
        response = requests.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": label, "lora_path": str(path)},
                                 headers=rr.headers, timeout=120)
        if response.status_code != 200:
            raise WorkbenchError(f"the shared server did not load the adapter {label}={path}: HTTP "
                                 f"{response.status_code} {response.text[:200]}",
                                 "a server that loads adapters at run time is one started for a LoRA training")
        try:
            yield label, path, srv
        finally:
            try:
                requests.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": label}, headers=rr.headers,
                              timeout=120)
            except requests.RequestException:  # a dead server: its error is the one that matters
                pass


def _lanes(rr: Resolved, models: int) -> list[Resolved]:
    """Where the evaluation's servers run: on the server's devices, and, with two or more models on one node, also
    on the trainer's (idle while evaluating) under the next port, so that the next model's server starts while the
    current one is scored (a server start is 20-60 s of imports and engine set-up). One lane where the trainer's
    devices are fewer than the server's, shared with it, or on another node, or where the next port is taken."""
    r = rr.recipe
    server, trainer = list(r.devices.server), list(r.devices.trainer)
    if models < 2 or r.distributed.nodes > 1 or len(trainer) < len(server) or set(trainer) & set(server):
        return [rr]
    port = r.server.port + 1
    try:
        launch.check_port_free(r.server.host, port)
    except WorkbenchError:
        return [rr]
    other = load(r, {"server.port": port, "devices.server": trainer[:len(server)], "devices.trainer": server})
    return [rr, rr.with_recipe(other)]


def _loaded_in_turn(rr: Resolved, items: list[tuple[str, str]], log_dir: Path | None, quiet: bool, log,
                    running=None):
    """Yield (label, path, server) for each model from one server: started with the first model, the others loaded
    into it (load_weights) when their turn comes; or one someone else owns (`running`: a protocol's shared server;
    or the one `workbench run` shares with its stages, which the start adopts), into which every model is loaded
    (it holds whatever a training left in it). The weight-update endpoints are on (for_training): on
    loopback, or where the recipe allows remote weight updates (_one_server). A server started here is stopped
    however the caller ends."""
    srv = running or VLLMServer(rr, items[0][1], log_dir, quiet=quiet, for_training=True, name=items[0][0])
    try:
        if running is None:
            srv.start()  # adopts the server `workbench run` shares with its stages, when it announces this one
        fresh = running is None and srv.adopted is None  # a server started here holds the first model
        for i, (label, path) in enumerate(items):
            if i or not fresh:
                seconds, gap = load_weights(rr, srv.url, path)
                log(f"{label}: loaded into the server in {seconds:.1f}s; it answers as the model "
                    f"({gap:.1e} nats/token apart)")
            yield label, path, srv
    finally:
        if running is None:
            srv.stop()


def _servers(items: list[tuple[str, str]], lanes: list[Resolved], log_dir: Path | None, quiet: bool):
    """Yield (label, path, started server) for each model in turn; with two lanes, the next model's server is
    started in the background on the other lane while the caller scores the current one. Every server is stopped,
    also when the caller stops early or raises."""
    from concurrent.futures import ThreadPoolExecutor

    def server(i: int):
        label, path = items[i]
        # a server started in the background stays quiet: its waiting line would land in whatever cell prints
        return VLLMServer(lanes[i % len(lanes)], path, log_dir, quiet=quiet or i > 0, name=label)

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-server")
    ahead = None  # (server, future of its start)
    try:
        for i, (label, path) in enumerate(items):
            srv, started = ahead if ahead is not None else (server(i), None)
            ahead = None
            if len(lanes) > 1 and i + 1 < len(items):  # the lane of model i - 1, whose server has stopped
                nxt = server(i + 1)
                ahead = (nxt, pool.submit(nxt.start))
            try:
                if started is not None:
                    started.result()  # a start-up failure is raised here, as if it had started now
                else:
                    srv.start()
            except BaseException:
                srv.stop()
                raise
            try:
                yield label, path, srv
            finally:
                srv.stop()
    finally:
        if ahead is not None:  # stopped early: let the start finish (it cannot be interrupted safely), then stop
            srv, started = ahead
            try:
                started.result()
            except BaseException:
                pass
            srv.stop()
        pool.shutdown(wait=True)
