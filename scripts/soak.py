"""Soak: a long training on the CPU with each role's memory sampled, to see whether it stays flat.

    python scripts/soak.py --steps 1000 --out /tmp/soak.json          # ~15 min on 2 cores
    python scripts/soak.py --steps 1000 --env MALLOC_ARENA_MAX=2        # the same with an environment change

Runs `workbench train --recipe cpu-tiny` with a small batch (so that 1000 steps fit in minutes), samples every
`--every` seconds the resident memory of the server's process tree and of the trainer (the training process
without the server's tree): RSS, and its anonymous part (RSS minus file-backed and shared pages, from
/proc/PID/status), with the step reached. Prints start / end / slope per 1000 steps for each role and writes
everything to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:  # gone, or a zombie at the end of the run
        return []


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline() or [])
    except psutil.Error:
        return ""


def _memory(procs: list[psutil.Process]) -> dict:
    rss = anon = shmem = 0
    for p in procs:
        rss += _status_kb(p.pid, "VmRSS")
        anon += _status_kb(p.pid, "RssAnon")
        shmem += _status_kb(p.pid, "RssShmem")
    return {"rss_mb": rss / 1024, "anon_mb": anon / 1024, "shmem_mb": shmem / 1024}


def _last_step(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, metrics.stat().st_size - 4000))
            lines = f.read().decode(errors="replace").splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, json.JSONDecodeError):
                continue
    except OSError:
        pass
    return 0


def _slope(samples: list[dict], role: str, key: str) -> tuple[float, float, float]:
    """(start, end, MB per 1000 steps) after the first 5% of the steps (model loading and warm-up)."""
    last = samples[-1]["step"]
    points = [(s["step"], s[role][key]) for s in samples if s["step"] >= 0.05 * last and s[role][key] > 0]
    if len(points) < 3:
        return float("nan"), float("nan"), float("nan")
    steps, values = zip(*points)
    slope = statistics.linear_regression(steps, values).slope * 1000
    return values[0], values[-1], slope


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the training and its server")
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="soak-runs-"))
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    cmd = [sys.executable, "-m", "workbench", "train", "--recipe", "cpu-tiny", f"monitor.runs_dir={runs}",
           f"trainer.max_steps={args.steps}", "trainer.per_device_train_batch_size=16", "trainer.logging_steps=10",
           "trainer.save_steps=100000", "trainer.log_completions=false", f"server.port={args.port}", *args.overrides]
    started = time.time()
    log = open(runs / "soak.log", "w")  # a file, not a pipe: a pipe nobody reads fills up and blocks the trainer
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    samples = []
    while proc.poll() is None:
        time.sleep(args.every)
        servers = [c for c in _tree(root)[1:] if "workbench.serving.vllm_cpu" in _cmdline(c)]
        server_tree = [p for s in servers for p in _tree(s)]
        trainer = [p for p in _tree(root) if p.pid not in {s.pid for s in server_tree}]
        metrics = next(runs.glob("*/train/metrics.jsonl"), None)
        step = _last_step(metrics) if metrics else 0
        samples.append({"time": time.time() - started, "step": step, "server": _memory(server_tree),
                        "trainer": _memory(trainer)})
    log.close()
    err = (runs / "soak.log").read_text(errors="replace")
    result = {"command": cmd, "env": args.env, "returncode": proc.returncode, "seconds": time.time() - started,
              "samples": samples, "runs": str(runs), "summary": {}}
    for role in ("trainer", "server"):
        for key in ("rss_mb", "anon_mb", "shmem_mb"):
            start, end, slope = _slope(samples, role, key)
            result["summary"][f"{role}.{key}"] = {"start": start, "end": end, "per_1000_steps": slope}
            print(f"{role:8s} {key:9s} {start:8.0f} -> {end:8.0f} MB  ({slope:+.0f} MB per 1000 steps)")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"status {proc.returncode} after {result['seconds']:.0f}s, {samples[-1]['step'] if samples else 0} steps; "
          f"{args.out}")
    if proc.returncode:
        print(err[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
