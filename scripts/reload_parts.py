"""Where the CPU server's reload time goes: vLLM's own `reload_weights`, run in this process and timed part by part.

    .venv/bin/python scripts/reload_parts.py                   # the bench's ~100M model (random weights), 5 reloads
    .venv/bin/python scripts/reload_parts.py --size tiny --reloads 10

A `reload` push is the workbench's write of one safetensors file on /dev/shm, then the server's
`POST /collective_rpc reload_weights` (serving/sync.py). `workbench bench` times both (sync/write_seconds,
sync/server_seconds). This script splits the second one: it builds the same model as the bench, starts vLLM's engine
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, on the server's core, with the server's CPU settings), writes the
model's weights with the push's own writer (serving/sync.py `ReloadSync`), and calls the worker's own
`reload_weights(weights_path=...)` with timers wrapped around vLLM's functions:

    read        the safetensors iterator (opening the file; its tensors are views of a memory map, so the bytes
                are first read by the copies below)
    init        `initialize_layerwise_reload` (each layer's tensors set aside for re-creation)
    layers      re-creating each layer's tensors (`materialize_layer`)
    copies      the weight loaders' copies into them and the copy back into the tensors the engine runs on
                (a layer's processing, `_layerwise_process`, less re-creation and repack)
    repack      `process_weights_after_loading` of every layer (on the CPU: the oneDNN/zentorch weight packing)
    finalize    `finalize_layerwise_reload`, less the layers it processes (the embedding and lm_head, whose padded
                vocabulary rows the loader fills without counting them: they count under the parts above)
    rest        what `model.load_weights` does besides (buffering each layer's weights until it is complete)
    cache       the prefix-cache reset a push ends with

and sets the bytes moved against the core's copy bandwidth measured here (workbench/platform/limits.py). A server's
reload call (what the bench times) adds the HTTP request and the API server's RPC to the engine core. Measurement
only: nothing of the workbench runs differently.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = "WORKBENCH_RELOAD_PARTS_CHILD"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="100m", help="a `workbench bench` size (default 100m)")
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--core", default="0", help="the core the server runs on (cpu-tiny: 0)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.reloads < 1:
        ap.error("--reloads must be at least 1")

    sys.path.insert(0, str(REPO))
    from workbench.experiments.bench import SIZES
    from workbench.recipe import load, resolve

    cores = [int(c) for c in args.core.split(",")]
    recipe = load("cpu-tiny", SIZES[args.size] + [f"devices.server={cores}"])
    if os.environ.get(CHILD) != "1":
        # again, in the environment a managed CPU server gets (serving/launch.py: its allocator settings, thread
        # binding, KV cache): glibc's tunables only apply from a process's start
        from workbench.serving import launch

        env = {**launch.environment(resolve(recipe), for_training=True), CHILD: "1"}
        raise SystemExit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its functions can be timed
    import torch

    from transformers import AutoModelForCausalLM

    from workbench import tinymodel
    from workbench.platform import limits
    from workbench.serving.sync import ReloadSync, tied_aliases

    os.sched_setaffinity(0, set(cores))  # the server's cores, as the server runs
    torch.set_num_threads(len(cores))
    model_dir = tinymodel.ensure(recipe)
    copy = limits.copy_bandwidth()  # the server's cores' copy rate (cpu-tiny gives it one)

    from vllm import LLM
    from vllm.model_executor.model_loader.reload import inplace, layerwise

    s = recipe.server
    llm = LLM(model=str(model_dir), dtype=s.dtype, enforce_eager=s.enforce_eager, max_model_len=s.max_model_len,
              seed=0, enable_prefix_caching=True)
    out_env = {k: os.environ.get(k) for k in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "VLLM_CPU_OMP_THREADS_BIND",
                                              "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")}

    times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def timed(name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            times[name] += time.perf_counter() - start

    def wrap(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            with timed(name):
                return original(*a, **k)
        setattr(owner, attr, wrapper)

    def wrap_exclusive(owner, attr: str, name: str, nested: str) -> None:
        """Time a function less what `nested` timed while it ran (finalize processes the layers that loading left
        incomplete: they count under `nested` only)."""
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            before, start = times[nested], time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                times[name] += time.perf_counter() - start - (times[nested] - before)
        setattr(owner, attr, wrapper)

    def wrap_iterator(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            iterator = iter(original(*a, **k))

            def timed_items():
                while True:
                    with timed(name):
                        item = next(iterator, None)
                    if item is None:
                        return
                    yield item
            return timed_items()
        setattr(owner, attr, wrapper)

    def reload_in_worker(worker, path: str) -> dict:
        model = worker.model_runner.get_model()
        # every quantisation method the model's layers use (on the CPU: unquantised linear and embedding)
        methods = {type(m.quant_method) for m in model.modules() if getattr(m, "quant_method", None) is not None}
        for cls in methods:
            if "process_weights_after_loading" in vars(cls) and not vars(cls).get("_timed"):  # not inherited
                wrap(cls, "process_weights_after_loading", "repack")
                cls._timed = True
        if not getattr(layerwise, "_timed", False):
            wrap(layerwise, "materialize_layer", "layers")
            wrap(layerwise, "_layerwise_process", "process")
            wrap(inplace, "initialize_layerwise_reload", "init")
            wrap_exclusive(inplace, "finalize_layerwise_reload", "finalize", "process")
            from vllm.model_executor.model_loader import get_model_loader
            loader_cls = type(get_model_loader(worker.vllm_config.load_config))
            wrap_iterator(loader_cls, "get_all_weights", "read")
            layerwise._timed = True
        times.clear()
        with timed("reload"):
            worker.reload_weights(weights_path=path)  # what /collective_rpc reload_weights calls
        return dict(times)

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    push = ReloadSync(aliases=tied_aliases(policy))  # its private RAM-disk directory, removed by close()
    rows = []
    try:
        for i in range(args.reloads + 1):  # the first reload is a warm-up (first-touch page faults of new layers)
            # the file a push writes: new the first time, rewritten in place after
            nbytes = push._write(policy.named_parameters())
            parts = llm.collective_rpc(reload_in_worker, args=(str(push.directory),))[0]
            start = time.perf_counter()
            llm.reset_prefix_cache()
            parts["cache"] = time.perf_counter() - start
            if i:
                rows.append(parts)
    finally:
        push.close()
    # nested: a layer's processing (when all its weights arrived, or in finalize for a layer loading left incomplete)
    # holds its re-creation, the loaders' copies into it, its repack and the copy back; the read (the iterator is
    # consumed by load_weights) is outside it, and finalize is timed without the processing it does. Per reload:
    # "copies" is the processing less re-creation and repack; "rest" is the reload less everything named
    # (load_weights' buffering of each layer's weights until the layer is complete, the name mapping)
    for r in rows:
        r["copies"] = r["process"] - r["layers"] - r["repack"]
        r["rest"] = r["reload"] - r["read"] - r["init"] - r["process"] - r["finalize"]
    keys = ("reload", "read", "init", "process", "layers", "copies", "repack", "finalize", "rest", "cache")
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    out = {"size": args.size, "megabytes": nbytes / 1e6, "reloads": len(rows), "median_seconds": med,
           "reload_seconds": [r["reload"] for r in rows], "torch_threads": torch.get_num_threads(), "env": out_env,
           "copy_bandwidth": copy}
    print(json.dumps(out, indent=1))
    mb = nbytes / 1e6
    print(f"\n{args.size}: {mb:.0f} MB, {len(rows)} reloads (median, s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
          + f"; the reload moves {mb / 1e3 / med['reload']:.2f} GB/s, the core copies {copy['median']:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
