"""Collective self-test: every rank all-reduces a known tensor and checks the sum, timed.

It exposes network, routing and shared-memory faults in a minute instead of as an HCCL timeout hours into a run.
Run under torch.distributed.run; `workbench env` does this for you with the platform's backend:

    python -m torch.distributed.run --nproc_per_node 2 -m workbench.platform.collective --backend gloo --out result.json
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "hccl"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, default=1 << 20, help="elements in the all-reduced tensor")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    elif args.backend == "hccl":
        import torch_npu  # noqa: F401

        torch.npu.set_device(local)
        device = f"npu:{local}"
    started = time.perf_counter()
    dist.init_process_group(args.backend)
    init_s = time.perf_counter() - started
    tensor = torch.full((args.size,), float(rank + 1), device=device)
    dist.all_reduce(tensor)  # warm-up: the first call also builds the communicator
    tensor.fill_(float(rank + 1))
    started = time.perf_counter()
    dist.all_reduce(tensor)
    if device != "cpu":
        getattr(torch, device.split(":")[0]).synchronize()
    reduce_s = time.perf_counter() - started
    expected = world * (world + 1) / 2
    ok = bool(torch.all(tensor == expected).item())
    results = [None] * world
    dist.all_gather_object(results, {"rank": rank, "ok": ok, "value": float(tensor[0].item())})
    if rank == 0:
        tmp = args.out + ".partial"
        with open(tmp, "w") as f:
            json.dump({"backend": args.backend, "world_size": world, "expected": expected, "ranks": results,
                       "ok": all(r["ok"] for r in results), "init_seconds": init_s, "allreduce_seconds": reduce_s,
                       "megabytes": args.size * 4 / 1e6}, f)
        os.replace(tmp, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
