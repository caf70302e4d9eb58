"""The serving sweep: the server's throughput against requests in flight, next to a plain sequential loop.

    from workbench.evaluation import sweep
    result = sweep.run(rr, rows, [1, 4, 16], url=srv.url)     # -> Sweep
    result.save(run.serving); sweep.Sweep.load(run.serving)   # serving.json (+ serving.png from result.figure)
    result, path = sweep.measure(rr, [1, 4, 16])              # on a server and in a run directory of its own
    workbench eval --sweep 1,4,16                              # the same from the shell

Each concurrency sends the same rows through the evaluator's async client; the sequential loop is the reference,
so the table reads as ratios measured in one run on one machine. Notebook 02 and the report show it.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from workbench.evaluation.evaluate import evaluate_server, preflight
from workbench.recipe import Resolved
from workbench.rundir import RunDir, StageDir, write_atomic
from workbench.serving.server import VLLMServer
from workbench.tinymodel import ensure_model

HEADER = ["requests in flight", "requests/s", "tokens/s", "vs sequential loop"]


@dataclass
class Sweep:
    n: int
    sequential_requests_per_second: float
    by_concurrency: dict[int, dict] = field(default_factory=dict)  # c -> requests_per_second, tokens_per_second, ...
    machine: str = ""

    def save(self, stage: StageDir) -> Path:
        stage.make()
        return write_atomic(stage.json, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, stage: StageDir) -> "Sweep | None":
        try:
            raw = json.loads(Path(stage.json).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        raw["by_concurrency"] = {int(c): row for c, row in raw.get("by_concurrency", {}).items()}
        return cls(**raw)

    def rows(self) -> list[list[str]]:
        """The table rows, the sequential loop first (the notebook's and the report's table)."""
        rows = [["sequential loop", f"{self.sequential_requests_per_second:.1f}", "–", "×1.00"]]
        for c, row in sorted(self.by_concurrency.items()):
            rows.append([str(c), f"{row['requests_per_second']:.1f}", f"{row['tokens_per_second']:.0f}",
                         f"×{row['speedup_vs_sequential']:.2f}"])
        return rows

    def markdown(self) -> str:
        lines = ["| " + " | ".join(HEADER) + " |", "|---|---|---|---|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in self.rows()])

    def figure(self, path: Path) -> Path:
        """Throughput against requests in flight, with the sequential loop as the reference line."""
        from workbench.plots import plt, save_png  # lazy: matplotlib

        items = sorted(self.by_concurrency.items())
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        ax.plot([c for c, _ in items], [r["requests_per_second"] for _, r in items], marker="o", label="evaluator")
        ax.axhline(self.sequential_requests_per_second, color="gray", ls="--", label="sequential loop")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("requests / s")
        ax.set_title(f"server throughput vs concurrency ({self.n} requests each)")
        ax.legend()
        fig.tight_layout()
        return save_png(fig, path, dpi=100)


def sequential_baseline(rr: Resolved, rows: list[dict], url: str | None = None) -> float:
    """Requests per second of a plain loop, one request at a time (the sweep's reference point)."""
    url = url or rr.server_url
    ev = rr.recipe.eval
    started = time.perf_counter()
    for row in rows:
        requests.post(f"{url}/v1/chat/completions", json={
            "model": rr.recipe.server.served_model_name, "messages": row["prompt"], "max_tokens": ev.max_tokens,
            "temperature": ev.temperature, "seed": ev.seed}, headers=rr.headers, timeout=120).raise_for_status()
    return len(rows) / (time.perf_counter() - started)


def run(rr: Resolved, rows: list[dict], concurrencies: list[int], url: str | None = None, log=print) -> Sweep:
    """The sequential loop, then the evaluator at each concurrency, against one running server."""
    url = url or rr.server_url
    result = Sweep(n=len(rows), sequential_requests_per_second=sequential_baseline(rr, rows, url))
    sequential = result.sequential_requests_per_second
    log(f"sequential loop: {sequential:.1f} requests/s over {len(rows)} requests")
    for c in concurrencies:
        summary, _ = evaluate_server(rr, f"c{c}", rows, url=url, concurrency=c, repeats=1, quiet=True)
        result.by_concurrency[c] = {"requests_per_second": summary.requests_per_second,
                                    "tokens_per_second": summary.tokens_per_second,
                                    "speedup_vs_sequential": summary.requests_per_second / sequential}
        log(f"concurrency {c:3d}: {summary.requests_per_second:6.1f} requests/s, {summary.tokens_per_second:6.0f} "
            f"tokens/s, x{summary.requests_per_second / sequential:.2f} vs sequential")
    return result


def measure(rr: Resolved, concurrencies: list[int], log=print) -> tuple[Sweep, Path]:
    """`workbench eval --sweep`: a run directory of its own, a server of its own on the recipe's model, the sweep
    over the recipe's evaluation rows, saved there. Returns the sweep and its serving.json."""
    stage = RunDir.create(rr.recipe, "sweep").serving
    rows = rr.task.eval_rows(rr.recipe.eval)
    with VLLMServer(rr, ensure_model(rr), stage.make().path) as srv:
        preflight(rr, rows, srv.url)
        result = run(rr, rows, concurrencies, url=srv.url, log=log)
    result.machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, server on {list(rr.server.devices)}"
    return result, result.save(stage)

