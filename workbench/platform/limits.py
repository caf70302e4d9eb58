"""The machine's limits, measured on a role's cores, and how far a training is from them (a roofline gauge).

    from workbench.platform import limits
    measured = limits.measure({"server": [0], "trainer": [1]})   # copy bandwidth, float32 GEMM throughput (CPU)
    limits.decode_ceiling(shape, measured["server"])              # the most tokens/s those cores could decode
    limits.optimisation_share(shape, tokens, seconds, measured["trainer"])

A decode step reads every weight once for all the sequences in flight and spends about 2 FLOPs per parameter per
token, so a server cannot decode faster than min(in flight x read bandwidth / bytes read per step, GEMM FLOP/s / (2 x
parameters)); the KV cache each sequence reads is added to the bytes. An optimisation step costs about 6 FLOPs per
parameter per token (forward and backward): its share of the cores' GEMM throughput is those FLOPs over its seconds.
Only completion tokens are counted (prompt lengths are not logged), so that share is a lower bound. Read bandwidth
(a sum over a buffer) is the decode's limit; copy bandwidth (bytes copied, read and write not added up) a weight
push's.

Measured on the CPU. An accelerator's limits are its datasheet's (datasheets.yaml, matched by the driver's device
name; the recipe's devices.peak_memory_gb_s and devices.peak_tflops win), in the same form, for the role's cards:

    sheet = limits.datasheet(limits.device_name("cuda"), memory_gb_s=None, tflops=None)   # None: unknown card
    limits.from_datasheet(sheet, cards=4)       # HBM bandwidth as read, half of it as copy, dense bf16 as GEMM
Used by `workbench bench` (experiments/bench.py) and, at the start of every CPU training, by the trainer
(training/gauge.py: the gauge/* metrics, the dashboard's and the report's rows, the advisor).
"""
from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DATASHEETS = Path(__file__).with_name("datasheets.yaml")


@contextlib.contextmanager
def on_cores(cores: list[int]) -> Iterator[None]:
    """This process on `cores` with as many torch threads; its cores and threads restored afterwards."""
    import torch

    saved_cores, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_cores)
        torch.set_num_threads(saved_threads)


@dataclass(frozen=True)
class Shape:
    """What the ceilings need of a model and of the bench's step."""

    parameters: int
    bytes_per_parameter: int
    layers: int
    kv_heads: int
    head_dim: int
    in_flight: int  # sequences decoded together (the step's completions)
    context: float  # mean tokens of context a decode step attends to

    @classmethod
    def from_config(cls, config: dict, parameters: int, bytes_per_parameter: int, in_flight: int,
                    context: float) -> "Shape":
        """From a Hugging Face config (config.json's keys; grouped-query attention and an explicit head_dim
        honoured)."""
        heads = config["num_attention_heads"]
        return cls(parameters=parameters, bytes_per_parameter=bytes_per_parameter,
                   layers=config["num_hidden_layers"], kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads, in_flight=in_flight,
                   context=context)

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache one sequence reads to decode one token: keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_parameter * self.context


def _spread(rates: list[float], **extra) -> dict:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "repeats": len(rates), **extra}


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> dict:
    """Memory copy bandwidth as torch copies it (its current threads), GB/s of bytes copied (read and write not
    added up): the ceiling of anything that moves weights through host memory."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: the pages are allocated outside the timing
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        rates.append(src.numel() * 4 / (time.perf_counter() - started) / 1e9)
    return _spread(rates, megabytes=megabytes, threads=torch.get_num_threads())


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> dict:
    """Memory read bandwidth as a torch sum reads a buffer (its current threads), GB/s: what a decode step, which
    reads every weight once, is limited by."""
    import torch

    src = torch.ones(megabytes * 2**20 // 4)
    src.sum()  # first touch outside the timing
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        src.sum()
        rates.append(src.numel() * 4 / (time.perf_counter() - started) / 1e9)
    return _spread(rates, megabytes=megabytes, threads=torch.get_num_threads())


def gemm_throughput(size: int = 1024, repeats: int = 5) -> dict:
    """float32 matrix-multiply GFLOP/s (size x size x size, torch's current threads): the compute ceiling."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: kernel selection, pages
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        rates.append(2 * size**3 / (time.perf_counter() - started) / 1e9)
    return _spread(rates, size=size, threads=torch.get_num_threads())


def measure(roles: dict[str, list[int]], megabytes: int = 256) -> dict:
    """Copy bandwidth and GEMM throughput on each role's cores (name -> core ids), with as many threads."""
    out = {}
    for name, cores in roles.items():
        with on_cores(cores):
            out[name] = {"cores": list(cores), "copy": copy_bandwidth(megabytes), "read": read_bandwidth(megabytes),
                         "gemm": gemm_throughput()}
    return out


def decode_ceiling(shape: Shape, server: dict) -> dict:
    """The most completion tokens/s the server's cores could decode for `shape`: the memory bound, the compute
    bound, and the lower of the two."""
    bytes_per_step = shape.parameters * shape.bytes_per_parameter + shape.in_flight * shape.kv_bytes_per_token
    memory = shape.in_flight * server["read"]["median"] * 1e9 / bytes_per_step
    compute = server["gemm"]["median"] * 1e9 / (2 * shape.parameters)
    return {"memory": memory, "compute": compute, "ceiling": min(memory, compute),
            "bound": "memory" if memory < compute else "compute"}


def optimisation_share(shape: Shape, tokens: float, seconds: float, cores: dict) -> float | None:
    """The share of the cores' GEMM throughput an optimisation used for `tokens` completion tokens in `seconds` (6
    FLOPs per parameter per token: forward and backward; prompt tokens not counted, so a lower bound)."""
    if not seconds or not tokens:
        return None
    return 6 * shape.parameters * tokens / seconds / (cores["gemm"]["median"] * 1e9)


# ----------------------------------------------------------------------------------------------------------------
# Accelerators: the datasheet's peaks where the gauge does not measure


@dataclass(frozen=True)
class Datasheet:
    device: str  # the name the driver reports
    memory_gb_s: float  # one card's memory bandwidth
    tflops: float  # one card's dense bf16/fp16 tensor throughput
    source: str


def device_name(platform: str) -> str:
    """The current device's name as its driver reports it (`NVIDIA H200`, `Ascend910B2`)."""
    import torch

    if platform == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.get_device_name(torch.npu.current_device())
    return torch.cuda.get_device_name(torch.cuda.current_device())


def datasheet(device: str, memory_gb_s: float | None = None, tflops: float | None = None) -> Datasheet | None:
    """The peaks of one card named `device`: datasheets.yaml's first matching row, each figure replaced by the
    recipe's where given; None when a figure is still missing (a card the table does not know)."""
    import yaml

    row = next((r for r in yaml.safe_load(DATASHEETS.read_text())
                if re.search(r["match"], device, re.IGNORECASE)), None) or {}
    memory, compute = memory_gb_s or row.get("memory_gb_s"), tflops or row.get("tflops")
    if not memory or not compute:
        return None
    mine = [name for name, value in (("devices.peak_memory_gb_s", memory_gb_s), ("devices.peak_tflops", tflops))
            if value]
    sources = [row["source"]] if len(mine) < 2 else []  # the table's row gave at least one figure
    if mine:
        sources.append(f"the recipe's {', '.join(mine)}")
    return Datasheet(device, float(memory), float(compute), " and ".join(sources))


def from_datasheet(sheet: Datasheet, cards: int) -> dict:
    """`cards` such cards' limits in measure()'s form: the memory bandwidth as read bandwidth, half of it as copy
    bandwidth (a copy reads and writes each byte it moves), the dense tensor throughput as the GEMM's."""
    def peak(value: float) -> dict:
        return {"median": value, "min": value, "max": value, "repeats": 0}

    return {"cards": cards, "device": sheet.device, "source": sheet.source,
            "read": peak(sheet.memory_gb_s * cards), "copy": peak(sheet.memory_gb_s * cards / 2),
            "gemm": peak(sheet.tflops * 1e3 * cards)}


def basis(measured: dict) -> tuple[str, str]:
    """What one role's limits are, for a sentence: ("cores", "GEMM throughput") when measured on the CPU, ("cards",
    "dense bf16 peak") when a datasheet's (from_datasheet: they carry their `source`). `measured` may also be
    limits.json's whole role -> limits mapping: any datasheet role makes it a datasheet's."""
    roles = measured.values() if "gemm" not in measured else [measured]
    if any(isinstance(r, dict) and "source" in r for r in roles):
        return "cards", "dense bf16 peak"
    return "cores", "GEMM throughput"


def owner(role: str, measured: dict) -> str:
    """Whose limits, for a sentence: `the server cores'` (measured) or `the server cards'` (a datasheet's); `both
    cores'` for the two roles' together."""
    noun = basis(measured)[0]
    if role == "both":
        return "both roles' cards'" if noun == "cards" else "both cores'"
    return f"the {role} {noun}'"
