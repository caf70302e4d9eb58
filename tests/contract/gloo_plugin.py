"""vLLM general plugin of the contract tests: the "nccl" weight-transfer backend becomes the gloo stand-in for
vllm-ascend's HCCL engine, the way vllm-ascend's own patch swaps in HCCL
(vllm_ascend/patch/platform/patch_weight_transfer_engine.py: `WeightTransferEngineFactory._registry["nccl"] = ...`).

How it reaches the server and nothing else: vLLM loads every `vllm.general_plugins` entry point in each of its
processes (API server, engine core, workers) before the worker creates its engine. The entry point is declared by
workbench_contract_gloo-0.1.dist-info/ next to this file, which importlib.metadata finds only on sys.path: a server
started with tests/contract on PYTHONPATH gets the plugin; no environment has anything installed for it.
"""
from __future__ import annotations


def _cpu_synchronize() -> None:
    """vLLM's weight-update path ends with `torch.accelerator.synchronize()` (0.23.0: in the worker's update_weights;
    0.32.0: in the engine base class), which raises on a machine without an accelerator. On Ascend it waits for the
    NPU; on the CPU there is nothing asynchronous to wait for."""
    import torch

    real = torch.accelerator.synchronize
    if getattr(real, "_workbench_contract", False):
        return

    def synchronize(device=None) -> None:
        if torch.accelerator.current_accelerator() is None:
            return
        real(device)

    synchronize._workbench_contract = True
    torch.accelerator.synchronize = synchronize


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.logger import init_logger

    import gloo_engine

    _cpu_synchronize()
    WeightTransferEngineFactory._registry["nccl"] = gloo_engine.server_engine_class
    init_logger("vllm.workbench_contract").info("workbench contract plugin: weight-transfer backend 'nccl' -> gloo stand-in for vllm-ascend's HCCL engine")
