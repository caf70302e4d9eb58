"""Learning parity of async rollouts: the same task trained sync and async, over several seeds, side by side.

    .venv/bin/python scripts/async_parity.py --seeds 0,1 --out parity.json     # ~45 min on 2 cores
    .venv/bin/python scripts/async_parity.py --seeds 0 --steps 40              # a quick look

Each (recipe, seed) is one `workbench run --stages train,eval` (the tiny model, its held-out split and the trainer's
seed all follow data.seed), run one after the other so that the timings do not compete for cores. Prints a
markdown table (held-out accuracy base → trained, gain, training seconds, median step time) and the means per recipe.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(recipe: str, seed: int, steps: int | None, log: Path) -> Path:
    cmd = [str(ROOT / ".venv/bin/workbench"), "run", "--recipe", recipe, "--stages", "train,eval", f"data.seed={seed}"]
    if steps:
        cmd.append(f"trainer.max_steps={steps}")
    with log.open("w") as out:  # a file, not a pipe: an unread pipe blocks the trainer
        code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("run directory:")]
    if code != 0 or not lines:
        sys.exit(f"{recipe} seed {seed} failed (exit {code}); see {log}")
    return ROOT / lines[-1].split(":", 1)[1].split()[0]  # "run directory: PATH  (kernel ...; stages ...)"


def _row(recipe: str, seed: int, run: Path) -> dict:
    summary = {m["model"]: m for m in json.loads((run / "eval/summary.json").read_text())}
    train = json.loads((run / "train/train.json").read_text())
    metrics = [json.loads(line) for line in (run / "train/metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m["time/step"] for m in metrics if "time/step" in m][1:]  # the first log holds the warm-up
    gaps = [m["sampling/sampling_logp_difference/mean"] for m in metrics
            if "sampling/sampling_logp_difference/mean" in m]
    return {"recipe": recipe, "seed": seed, "run": str(run.relative_to(ROOT)),
            "base": summary["base"]["accuracy_mean"], "trained": summary["trained"]["accuracy_mean"],
            "gain": summary["trained"]["accuracy_mean"] - summary["base"]["accuracy_mean"],
            "train_seconds": train["train_seconds"], "steps": train["steps"],
            "median_step_seconds": statistics.median(steps) if steps else None,
            "sampler_trainer_logp_gap": statistics.mean(gaps) if gaps else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--recipes", default="cpu-tiny,cpu-tiny-async")
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the recipe's)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/async_parity.json")
    args = parser.parse_args(argv)
    rows = []
    started = time.time()
    for seed in [int(s) for s in args.seeds.split(",")]:
        for recipe in args.recipes.split(","):
            log = args.out.with_name(f"{args.out.stem}-{recipe}-{seed}.log")
            run = _run(recipe, seed, args.steps, log)
            rows.append(_row(recipe, seed, run))
            print(json.dumps(rows[-1]), flush=True)
            args.out.write_text(json.dumps(rows, indent=2))
    print(f"\n{len(rows)} runs in {(time.time() - started) / 60:.1f} min\n")
    print("| recipe | seed | held-out base → trained | gain | training s | median step s | sampler–trainer log-p gap |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gap = f"{r['sampler_trainer_logp_gap']:.4f}" if r["sampler_trainer_logp_gap"] is not None else "—"
        print(f"| {r['recipe']} | {r['seed']} | {r['base']:.1%} → {r['trained']:.1%} | {r['gain'] * 100:+.1f} | "
              f"{r['train_seconds']:.0f} | {r['median_step_seconds']:.2f} | {gap} |")
    for recipe in args.recipes.split(","):
        mine = [r for r in rows if r["recipe"] == recipe]
        gains = [r["gain"] * 100 for r in mine]
        print(f"{recipe}: gain {statistics.mean(gains):+.1f} ± {statistics.pstdev(gains):.1f} points over "
              f"{len(mine)} seed(s); training {statistics.mean(r['train_seconds'] for r in mine):.0f} s")


if __name__ == "__main__":
    main()
