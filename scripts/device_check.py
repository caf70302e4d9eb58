"""The prepared device check: the trainer side of the workbench on a real NVIDIA GPU, in a few minutes, offline.

    bash scripts/device_check.sh            # on the GPU machine, in the repository root (wheels in .whl/ if needed)
    python scripts/device_check.py --out DIR [--platform cpu]   # what the shell script runs; cpu: a dry run here

What it proves where the CPU cannot (vLLM is too large to bring along, so generation is TRL's own, in process):
  1. the NVIDIA probe reads the real devices by physical id (NVML), whatever this process's CUDA_VISIBLE_DEVICES;
  2. `workbench train` places a single trainer: it starts it as a child process with the trainer role's
     CUDA_VISIBLE_DEVICES (the last GPU of the machine), and the trainer's ranks.json records that physical card;
  3. a few bfloat16 GRPO steps on that GPU (the tiny model, TRL's generate): finite loss, weights saved, device
     samples of the trainer's card in devices.jsonl.
Prints one line per check (PASS/FAIL and the figures) and writes DIR/device_check.json; exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def single_trainer_placed(rank: dict, platform: str, last: int) -> bool:
    """The trainer's ranks.json entry says it ran with the trainer role's environment and, on a GPU, on the last
    card: CUDA_VISIBLE_DEVICES is that card alone, its device is CUDA's and its physical card is that card."""
    visible = rank["env"].get("CUDA_VISIBLE_DEVICES")
    return rank["env"].get("WORKBENCH_DEVICE_CHECK") == "trainer-role" and (
        platform == "cpu" or (rank["card"] == last and visible == str(last) and rank["device"].startswith("cuda")))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--platform", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run without a GPU")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def record(name: str, ok: bool, detail: str) -> None:
        results.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    import torch

    gpus = torch.cuda.device_count() if args.platform == "cuda" else 0
    record("torch sees the GPUs", args.platform == "cpu" or gpus > 0,
           f"torch {torch.__version__}, {gpus} GPU(s)" + (f": {torch.cuda.get_device_name(0)}" if gpus else ""))
    last = max(gpus - 1, 0)

    if args.platform == "cuda":
        from workbench.platform.probes.nvidia import NvidiaProbe

        try:  # every GPU by physical id, with a visible-devices variable that renumbers them for this process
            os.environ["CUDA_VISIBLE_DEVICES"] = str(last)
            roles = {i: ("trainer" if i == last else "server") for i in range(gpus)}
            samples = NvidiaProbe(roles).sample()
            smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout.split("\n")
            totals = {int(line.split(",")[0]): float(line.split(",")[1]) for line in smi if line.strip()}
            same = all(abs(s["mem_total_mb"] - totals[int(s["device"].split(":")[1])]) < 2 for s in samples)
            record("NVIDIA probe by physical id", len(samples) == gpus and same,
                   "; ".join(f"{s['device']} {s['role']} {s['util_pct']:.0f}% {s['mem_used_mb']:.0f}/"
                             f"{s['mem_total_mb']:.0f} MB" for s in samples) + f" (nvidia-smi totals {totals})")
        except Exception as exc:
            record("NVIDIA probe by physical id", False, f"{type(exc).__name__}: {exc}")
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)

    runs = out / "runs"
    overrides = [f"devices.platform={args.platform}", "server.mode=off", f"devices.trainer=[{last}]",
                 "devices.server=[0]",
                 f"trainer.max_steps={args.steps}", f"trainer.save_steps={args.steps}", f"monitor.runs_dir={runs}",
                 "monitor.sample_interval_s=0.5", "devices.env.WORKBENCH_DEVICE_CHECK=trainer-role"]
    if args.platform == "cuda":
        overrides += ["model.dtype=bfloat16", "trainer.bf16=true"]
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "workbench", "train", "--recipe", "smoke", *overrides],
                          capture_output=True, text=True, timeout=480)
    (out / "train.log").write_text(done.stdout + done.stderr)
    seconds = time.time() - started
    record("workbench train (TRL generate, bf16)", done.returncode == 0,
           f"exit {done.returncode} in {seconds:.0f}s" + ("" if done.returncode == 0 else
                                                          ": " + (done.stdout + done.stderr)[-800:]))
    train = next(runs.glob("*/train"), None)
    if done.returncode == 0 and train is not None:
        metrics = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses = [m["loss"] for m in metrics if "loss" in m]
        record("GRPO steps", len(losses) == args.steps and all(math.isfinite(x) for x in losses),
               f"{len(losses)} steps, losses {[round(x, 4) for x in losses]}")
        (rank,) = json.loads((train / "ranks.json").read_text())
        visible = rank["env"].get("CUDA_VISIBLE_DEVICES")
        placed = single_trainer_placed(rank, args.platform, last)
        # on one GPU the trainer's card is 0 whether or not it was placed: only two or more GPUs prove placement
        proven = "" if gpus >= 2 or args.platform == "cpu" else " (one GPU: card 0 either way, placement not proven)"
        record("single trainer placed", placed, f"device {rank['device']}, physical card {rank['card']}, "
               f"CUDA_VISIBLE_DEVICES={visible}, pid {rank['pid']} (parent {rank['parent_pid']})" + proven)
        samples = [json.loads(line) for line in (train / "devices.jsonl").read_text().splitlines() if line.strip()]
        mine = [s for s in samples if s.get("role") == "trainer"]
        errors = [s["error"] for s in samples if "error" in s]
        record("device samples of the trainer's card", bool(mine) and not errors,
               f"{len(mine)} trainer samples, peak {max((s['mem_used_mb'] for s in mine), default=0):.0f} MB, "
               f"{len(errors)} error line(s)" + (f": {errors[0]}" if errors else ""))
        record("final model saved", (train / "final" / "model.safetensors").exists(), str(train / "final"))
    (out / "device_check.json").write_text(json.dumps({"platform": args.platform, "results": results}, indent=2))
    failed = [r["check"] for r in results if not r["ok"]]
    print(f"device check: {len(results) - len(failed)}/{len(results)} passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
