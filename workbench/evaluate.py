"""Evaluation through the OpenAI-compatible server: repeated, concurrent, verifiable.

    workbench eval --recipe cpu-tiny                          # the recipe's model (base)
    workbench eval --recipe cpu-tiny --model trained=runs/<run>/final --model base=tiny
    workbench eval --recipe cpu-tiny server.mode=attach server.url=http://127.0.0.1:8000

For each model: serve it (or attach), check before any request that the served name is right and that the longest
prompt plus eval.max_tokens fits the server's max_model_len, send the eval split with bounded concurrency from an
async OpenAI client (chat or completions endpoint; temperature, top_p, seed, max tokens and stop strings from the
recipe's eval section; transient errors retried a bounded number of times), score, and repeat eval.repeats times.
Per-sample records go to samples.jsonl, per-model summaries (accuracy mean ± std over repetitions, pass@1, mean
output length, truncation rate, throughput) to summary.json, a comparison table to comparison.md and a figure to
comparison.png. The equivalent lm-evaluation-harness command is printed for a cross-check.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import requests

from workbench import dataset, rewards, server
from workbench.errors import WorkbenchError
from workbench.recipe import Recipe


# ----------------------------------------------------------------------------------------------------------------
# Grading

def _match_in_child(gold: str, predicted: str) -> bool | None:
    return rewards.answers_match(gold, predicted)


def grade(golds: list[str], responses: list[str], timeout: float = 5.0) -> list[tuple[str | None, bool | None]]:
    """(extracted answer, correct) per response. Plain numbers are compared inline; anything math-verify must
    parse runs in a worker process with a wall-clock timeout, which works whatever thread calls this (math-verify's
    own timeouts need the main thread). A timeout or an unparseable gold gives None: cannot score."""
    extracted = [rewards.extract_answer(r) for r in responses]
    results: list[bool | None] = [None] * len(golds)
    slow = []
    for i, (gold, pred) in enumerate(zip(golds, extracted)):
        if pred is None:
            results[i] = False
        elif rewards._as_number(gold) is not None and rewards._as_number(pred) is not None:
            results[i] = rewards.answers_match(gold, pred)
        else:
            slow.append(i)
    if slow:
        with ProcessPoolExecutor(max_workers=2) as pool:
            futures = {i: pool.submit(_match_in_child, golds[i], extracted[i]) for i in slow}
            for i, future in futures.items():
                try:
                    results[i] = future.result(timeout=timeout)
                except FutureTimeout:
                    results[i] = None
    return list(zip(extracted, results))


# ----------------------------------------------------------------------------------------------------------------
# Preflight

def longest_prompt_tokens(url: str, model: str, rows: list[dict], key: str | None = None, sample: int = 16) -> int:
    """Token length of the longest prompts as the server tokenizes them (chat template included)."""
    longest = sorted(rows, key=lambda r: sum(len(m["content"]) for m in r["prompt"]), reverse=True)[:sample]
    best = 0
    for row in longest:
        body = {"model": model, "messages": row["prompt"], "add_generation_prompt": True}
        response = requests.post(f"{url}/tokenize", json=body, headers=server._headers(key), timeout=30)
        if response.status_code != 200:
            raise WorkbenchError(f"{url}/tokenize answered HTTP {response.status_code}: {response.text[:200]}",
                                 "evaluate through a vLLM server (it tokenizes for the length preflight)")
        best = max(best, int(response.json()["count"]))
    return best


def preflight(recipe: Recipe, url: str, rows: list[dict], key: str | None = None) -> dict:
    """Before any request: the model name is served and the longest prompt + max_tokens fits max_model_len."""
    entry = server.served_entry(recipe, url, key)
    name = recipe.server.served_model_name
    limit = entry.get("max_model_len")
    longest = longest_prompt_tokens(url, name, rows, key)
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


async def _send_all(recipe: Recipe, url: str, key: str | None, samples: list[Sample], rows: list[dict],
                    concurrency: int, progress) -> None:
    from openai import APIConnectionError, APITimeoutError, AsyncOpenAI, InternalServerError, RateLimitError

    ev = recipe.eval
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "EMPTY", max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)
    transient = (APIConnectionError, APITimeoutError, InternalServerError, RateLimitError)
    done = 0

    async def one(sample: Sample, row: dict) -> None:
        nonlocal done
        common = dict(model=recipe.server.served_model_name, max_tokens=ev.max_tokens, temperature=ev.temperature,
                      top_p=ev.top_p, seed=ev.seed + sample.repeat, stop=ev.stop or None)
        async with gate:
            for attempt in range(ev.retries + 1):
                started = time.perf_counter()
                try:
                    if ev.endpoint == "chat":
                        out = await client.chat.completions.create(messages=row["prompt"], **common)
                        sample.response = out.choices[0].message.content or ""
                    else:
                        out = await client.completions.create(prompt=row["prompt_text"], **common)
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
    await client.close()


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


def evaluate_server(recipe: Recipe, url: str, label: str, rows: list[dict], key: str | None = None,
                    concurrency: int | None = None, repeats: int | None = None, quiet: bool = False,
                    model_path: str = "") -> tuple[Summary, list[Sample]]:
    """Evaluate whatever the server at `url` serves under the recipe's served name."""
    concurrency = concurrency or recipe.eval.concurrency
    repeats = repeats or recipe.eval.repeats
    if recipe.eval.endpoint == "completions":
        rows = _with_prompt_text(url, recipe, rows, key)
    all_samples: list[Sample] = []
    summary = Summary(model=label, path=model_path, n=len(rows), repeats=repeats)
    started = time.perf_counter()
    for repeat in range(repeats):
        samples = [Sample(label, repeat, r["id"], r["prompt"][-1]["content"], r["answer"]) for r in rows]
        progress = _Progress(len(samples), f"{label} #{repeat + 1}/{repeats}", quiet)
        _run_async(_send_all(recipe, url, key, samples, rows, concurrency, progress))
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


def _with_prompt_text(url: str, recipe: Recipe, rows: list[dict], key: str | None) -> list[dict]:
    """The completions endpoint takes text: render the chat template with the served model's tokenizer."""
    from transformers import AutoTokenizer

    root = server.served_entry(recipe, url, key).get("root")
    tokenizer = AutoTokenizer.from_pretrained(root)
    return [{**r, "prompt_text": tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)}
            for r in rows]


# ----------------------------------------------------------------------------------------------------------------
# Models, outputs

def eval_rows(recipe: Recipe) -> list[dict]:
    rows = dataset.recipe_rows(recipe, split=recipe.eval.split, limit=recipe.eval.num_samples)
    if len(rows) < recipe.eval.num_samples and recipe.data.name == "arithmetic":
        raise WorkbenchError(f"eval.num_samples={recipe.eval.num_samples} but the held-out split has {len(rows)}",
                             "raise data.heldout_size or lower eval.num_samples")
    return rows


def lm_eval_command(recipe: Recipe, url: str) -> str:
    """The lm-evaluation-harness command that scores the same server, for a cross-check."""
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


def write_outputs(out_dir: Path, summaries: list[Summary], samples: list[Sample]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"samples": out_dir / "samples.jsonl", "summary": out_dir / "summary.json",
             "table": out_dir / "comparison.md", "figure": out_dir / "comparison.png"}
    with open(paths["samples"], "w") as f:
        for s in samples:
            f.write(json.dumps(s.__dict__) + "\n")
    paths["summary"].write_text(json.dumps([s.__dict__ for s in summaries], indent=2))
    paths["table"].write_text(comparison_table(summaries))
    comparison_figure(summaries, paths["figure"])
    return paths


def comparison_table(summaries: list[Summary]) -> str:
    lines = ["| model | n × repeats | accuracy (mean ± std) | pass@1 | mean output tokens | truncated | unscored | "
             "tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.model} | {s.n} × {s.repeats} | {s.accuracy_mean:.1%} ± {s.accuracy_std:.1%} | "
                     f"{s.pass_at_1:.1%} | {s.mean_output_tokens:.1f} | {s.truncation_rate:.1%} | {s.unscored} | "
                     f"{s.tokens_per_second:.0f} |")
    return "\n".join(lines) + "\n"


def comparison_figure(summaries: list[Summary], path: Path) -> Path:
    from workbench import figures
    plt = figures.plt

    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(summaries)), 3.2))
    names = [s.model for s in summaries]
    means = [100 * s.accuracy_mean for s in summaries]
    errs = [100 * s.accuracy_std for s in summaries]
    bars = ax.bar(names, means, yerr=errs, capsize=6, color=["#8c959f", "#0969da", "#1a7f37", "#9a6700"][:len(names)])
    for bar, mean in zip(bars, means):
        ax.text(bar.get_x() + bar.get_width() / 2, mean + 1, f"{mean:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_ylim(0, min(100, max(means + [10]) * 1.25 + 5))
    ax.set_title(f"held-out accuracy, {summaries[0].n} problems × {summaries[0].repeats}")
    fig.tight_layout()
    return figures.save_png(fig, path, dpi=110)


def evaluate(recipe: Recipe, models: dict[str, str] | None = None, out_dir: Path | None = None,
             quiet: bool = False, log=print) -> list[Summary]:
    """Evaluate each labelled model directory (serving it in turn), or the attached server; write the outputs."""
    from workbench import tinymodel
    from workbench.rundir import new_run_dir

    rows = eval_rows(recipe)
    out_dir = out_dir or new_run_dir(recipe, "eval")
    summaries: list[Summary] = []
    samples: list[Sample] = []
    key = server.api_key(recipe)
    if recipe.server.mode == "attach":
        url = server.server_url(recipe)
        info = preflight(recipe, url, rows, key)
        log(f"preflight: {info}")
        summary, got = evaluate_server(recipe, url, recipe.server.served_model_name, rows, key, quiet=quiet)
        summaries.append(summary)
        samples += got
        log(lm_eval_command(recipe, url))
    else:
        models = models or {"base": tinymodel.resolve_model_path(recipe, log=log)}
        for label, path in models.items():
            path = tinymodel.resolve_model_path(recipe, log=log) if path in ("tiny", "base") else path
            with server.VLLMServer(recipe, path, out_dir, quiet=quiet) as srv:
                info = preflight(recipe, srv.url, rows, key)
                log(f"{label}: serving {path} ({info['longest_prompt_tokens']} + {recipe.eval.max_tokens} tokens "
                    f"fit max_model_len {info['max_model_len']})")
                summary, got = evaluate_server(recipe, srv.url, label, rows, key, quiet=quiet, model_path=str(path))
                summaries.append(summary)
                samples += got
                if label == list(models)[0]:
                    log("cross-check with the standard harness while a server runs:\n  " + lm_eval_command(recipe, srv.url))
    paths = write_outputs(out_dir, summaries, samples)
    log(comparison_table(summaries))
    log(f"samples: {paths['samples']}\nfigure: {paths['figure']}")
    return summaries


def benchmark(recipe: Recipe, url: str, rows: list[dict], concurrencies: list[int], log=print) -> dict:
    """Requests/s of a plain sequential loop and of the evaluator at each concurrency, in one run, as ratios."""
    sequential = sequential_baseline(recipe, url, rows)
    result = {"sequential_requests_per_second": sequential, "n": len(rows), "by_concurrency": {}}
    log(f"sequential loop: {sequential:.1f} requests/s over {len(rows)} requests")
    for c in concurrencies:
        summary, _ = evaluate_server(recipe, url, f"c{c}", rows, server.api_key(recipe), concurrency=c, repeats=1,
                                     quiet=True)
        result["by_concurrency"][c] = {"requests_per_second": summary.requests_per_second,
                                       "tokens_per_second": summary.tokens_per_second,
                                       "speedup_vs_sequential": summary.requests_per_second / sequential}
        log(f"concurrency {c:3d}: {summary.requests_per_second:6.1f} requests/s, {summary.tokens_per_second:6.0f} "
            f"tokens/s, x{summary.requests_per_second / sequential:.2f} vs sequential")
    return result


BENCHMARK_HEADER = ["requests in flight", "requests/s", "tokens/s", "vs sequential loop"]


def benchmark_rows(result: dict) -> list[list[str]]:
    """The concurrency sweep as table rows, the sequential loop first (the notebook's and the report's table)."""
    rows = [["sequential loop", f"{result['sequential_requests_per_second']:.1f}", "–", "×1.00"]]
    for c, row in sorted(result["by_concurrency"].items(), key=lambda kv: int(kv[0])):
        rows.append([str(c), f"{row['requests_per_second']:.1f}", f"{row['tokens_per_second']:.0f}",
                     f"×{row['speedup_vs_sequential']:.2f}"])
    return rows


def benchmark_table(result: dict) -> str:
    lines = ["| " + " | ".join(BENCHMARK_HEADER) + " |", "|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in benchmark_rows(result)])


def benchmark_figure(result: dict, path: Path) -> Path:
    """Throughput against requests in flight, with the sequential loop as the reference line."""
    from workbench import figures
    plt = figures.plt

    rows = sorted(result["by_concurrency"].items(), key=lambda kv: int(kv[0]))
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot([int(c) for c, _ in rows], [r["requests_per_second"] for _, r in rows], marker="o", label="evaluator")
    ax.axhline(result["sequential_requests_per_second"], color="gray", ls="--", label="sequential loop")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("requests / s")
    ax.set_title(f"server throughput vs concurrency ({result['n']} requests each)")
    ax.legend()
    fig.tight_layout()
    return figures.save_png(fig, path, dpi=100)


def sequential_baseline(recipe: Recipe, url: str, rows: list[dict]) -> float:
    """Requests per second of a plain loop, one request at a time (the benchmark's reference point)."""
    started = time.perf_counter()
    for row in rows:
        requests.post(f"{url}/v1/chat/completions", json={
            "model": recipe.server.served_model_name, "messages": row["prompt"], "max_tokens": recipe.eval.max_tokens,
            "temperature": recipe.eval.temperature, "seed": recipe.eval.seed},
            headers=server._headers(server.api_key(recipe)), timeout=120).raise_for_status()
    return len(rows) / (time.perf_counter() - started)

