"""A gloo stand-in for vllm-ascend's HCCL weight-transfer engine: the contract tests' way of running the whole
HCCL weight-sync flow on the CPU, with everything but HCCL itself real.

vllm-ascend 0.23.0's `HCCLWeightTransferEngine` (recorded in tests/fixtures/vllm-ascend-0.23.0/hccl_engine.py) is
two things:

* the server side, a vLLM `WeightTransferEngine` created in each worker (vllm-ascend puts it under the "nccl"
  backend name), which joins the trainer's group and receives the tensors the trainer broadcasts;
* the trainer side, two static methods the workbench's `HcclSync` calls: `trainer_init(init_info) -> group` and
  `trainer_send_weights(iterator, trainer_args)`.

This module has both, with the same dataclass fields and signatures (tests/test_contract.py compares them with the
recorded file by AST), over a gloo process group on a TCPStore instead of `StatelessProcessGroup` + HCCL:

    GlooTrainerEngine.trainer_init({...})              # in the trainer, as HcclSync(engine=GlooTrainerEngine) does
    server_engine_class()                              # in the server's worker: the vLLM engine class, built for
                                                       # the installed vLLM (0.23.0's or 0.32.0's interface)

The trainer side imports nothing but torch (the trainer's vLLM, if any, is not the server's); gloo_plugin.py
registers the server side inside the server's processes.
"""
from __future__ import annotations

import datetime
import ipaddress
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# vllm-ascend's packed_tensor.py values (the same as vLLM's)
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2
# A rank that never arrives (a trainer that died) fails the group after this long instead of HCCL's 30 minutes.
TIMEOUT_S = float(os.environ.get("WORKBENCH_GLOO_TIMEOUT_S", "120"))


@dataclass
class GlooWeightTransferInitInfo:
    """Initialization info (the fields of HCCLWeightTransferInitInfo)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooTrainerSendWeightsArgs:
    """Arguments of trainer_send_weights (the fields of HCCLTrainerSendWeightsArgs)."""

    group: Any
    src: int = 0
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool = False
    stream: Any | None = None  # HCCL: torch.npu.Stream | None; gloo has no streams
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS  # gloo's broadcast is synchronous: one buffer at a time


@dataclass
class GlooWeightTransferUpdateInfo:
    """Update info (the fields of HCCLWeightTransferUpdateInfo)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # vLLM 0.23.0's base class validates its own (keyword-only) fields
            parent()
        num_params = len(self.names)
        if len(self.dtype_names) != num_params:
            raise ValueError(f"`dtype_names` should be of the same size as `names`: "
                             f"got {len(self.dtype_names)} and {len(self.names)}")
        if len(self.shapes) != num_params:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {len(self.names)}")


class GlooCommunicator:
    """What PyHcclCommunicator is to HCCL: `broadcast(tensor, src, stream=None)` within a group of its own (a gloo
    process group on a TCPStore that rank 0, the trainer, hosts at master_address:master_port)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = TIMEOUT_S) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        if _is_loopback(master_address):  # both ends on this machine: keep gloo's own sockets on loopback too
            options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            options._devices = [ProcessGroupGloo.create_default_device()]
        self.group = ProcessGroupGloo(PrefixStore("workbench-gloo-weight-transfer", self.store), rank, world_size,
                                      options)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self.group = None
        self.store = None


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def packed_broadcast_producer(iterator: Iterator[tuple[str, torch.Tensor]], group: GlooCommunicator, src: int,
                              post_iter_func: Callable, buffer_size_bytes: int) -> None:
    """vLLM's packing rule: tensors are concatenated as bytes until a buffer holds more than buffer_size_bytes."""
    pending: list[torch.Tensor] = []
    size = 0
    for item in iterator:
        data = _as_bytes(post_iter_func(item))
        pending.append(data)
        size += data.numel()
        if size > buffer_size_bytes:
            group.broadcast(torch.cat(pending), src=src)
            pending, size = [], 0
    if pending:
        group.broadcast(torch.cat(pending), src=src)


def packed_broadcast_consumer(iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]],
                              group: GlooCommunicator, src: int,
                              post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
                              buffer_size_bytes: int) -> None:
    """The receiving half: cuts the same buffers from the announced names, dtypes and shapes."""
    chunk: list[tuple[str, list[int], torch.dtype, int]] = []
    size = 0

    def receive() -> None:
        # A fresh buffer per chunk: vLLM's layerwise reload keeps the tensors it is given until a layer is complete.
        packed = torch.empty(size, dtype=torch.uint8)
        group.broadcast(packed, src=src)
        tensors, offset = [], 0
        for name, shape, dtype, nbytes in chunk:
            piece = packed[offset:offset + nbytes]
            if offset % dtype.itemsize:  # after a tensor of a narrower dtype: copy to an aligned buffer
                piece = piece.clone()
            tensors.append((name, piece.view(dtype).view(tuple(shape))))
            offset += nbytes
        post_unpack_func(tensors)

    for name, (shape, dtype) in iterator:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, list(shape), dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            receive()
            chunk, size = [], 0
    if chunk:
        receive()


def receive_weights(update_info, group: GlooCommunicator | None,
                    load_weights: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
    """HCCLWeightTransferEngine.receive_weights, on gloo."""
    if group is None:
        raise RuntimeError("gloo weight transfer not initialized. Call init_transfer_engine() first.")
    metadata = [(name, (shape, getattr(torch, dtype_name)))
                for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
    if update_info.packed:
        packed_broadcast_consumer(iter(metadata), group, 0, load_weights, update_info.packed_buffer_size_bytes)
    else:
        for name, (shape, dtype) in metadata:
            weight = torch.empty(shape, dtype=dtype)
            group.broadcast(weight, src=0)
            load_weights([(name, weight)])
            del weight


class GlooTrainerEngine:
    """The trainer side: HCCLWeightTransferEngine's static methods, same signatures, on gloo."""

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]],
        trainer_args: dict[str, Any] | GlooTrainerSendWeightsArgs,
    ) -> None:
        args = GlooTrainerSendWeightsArgs(**trainer_args) if isinstance(trainer_args, dict) else trainer_args
        post_iter_func = args.post_iter_func or (lambda item: item[1])
        if args.packed:
            packed_broadcast_producer(iterator, args.group, args.src, post_iter_func, args.packed_buffer_size_bytes)
        else:
            for item in iterator:
                args.group.broadcast(post_iter_func(item).detach().to("cpu").contiguous(), src=args.src)

    @staticmethod
    def trainer_init(
        init_info: GlooWeightTransferInitInfo | dict,
    ) -> GlooCommunicator:
        if isinstance(init_info, dict):
            master_address, master_port, world_size = (init_info["master_address"], init_info["master_port"],
                                                       init_info["world_size"])
        else:
            master_address, master_port, world_size = init_info.master_address, init_info.master_port, init_info.world_size
        return GlooCommunicator(master_address, master_port, 0, world_size)  # the trainer is always rank 0


def server_engine_class() -> type:
    """The server side: a vLLM WeightTransferEngine for the vLLM installed here (the factory's loader signature).

    vLLM 0.23.0 (vllm-ascend 0.23.0's base): `__init__(config, parallel_config, model)`, `receive_weights(update_info,
    load_weights)`; the worker runs the layerwise reload around the update. From vLLM 0.28 on the engine owns the
    update: `__init__(config, vllm_config, device, model)`, `start_weight_update()`, `receive_weights(update_info)`
    loading into `self.model`, `finish_weight_update()` (as vLLM's own NCCL engine does).
    """
    import contextlib
    import inspect
    from dataclasses import dataclass as make_dataclass

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    engine_owns_update = "vllm_config" in inspect.signature(WeightTransferEngine.__init__).parameters
    # As HCCL's dataclasses, subclasses of the installed vLLM's bases (0.23.0's worker reads `update_kind` from it).
    @make_dataclass
    class InitInfo(GlooWeightTransferInitInfo, WeightTransferInitInfo):
        pass

    @make_dataclass
    class UpdateInfo(GlooWeightTransferUpdateInfo, WeightTransferUpdateInfo):
        pass

    def _mtp_check_off():
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:
            return contextlib.nullcontext()
        return disable_mtp_completeness_check()

    class GlooWeightTransferEngine(WeightTransferEngine):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, config, *args) -> None:
            super().__init__(config, *args)
            self.model_update_group: GlooCommunicator | None = None

        def init_transfer_engine(self, init_info) -> None:
            # HCCLWeightTransferEngine.init_transfer_engine: unique rank across data-parallel groups, offset by the trainer
            dp_rank = self.parallel_config.data_parallel_index
            rank = dp_rank * self.parallel_config.world_size + self.parallel_config.rank + init_info.rank_offset
            self.model_update_group = GlooCommunicator(init_info.master_address, init_info.master_port, rank,
                                                       init_info.world_size)

        if engine_owns_update:
            def start_weight_update(self) -> None:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)

            def finish_weight_update(self) -> None:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)

            def receive_weights(self, update_info) -> None:
                with _mtp_check_off():
                    receive_weights(update_info, self.model_update_group, self.model.load_weights)
        else:
            def receive_weights(self, update_info, load_weights) -> None:
                receive_weights(update_info, self.model_update_group, load_weights)

        def shutdown(self) -> None:
            if self.model_update_group is not None:
                self.model_update_group.destroy()
                self.model_update_group = None

        trainer_send_weights = staticmethod(GlooTrainerEngine.trainer_send_weights)
        trainer_init = staticmethod(GlooTrainerEngine.trainer_init)

    return GlooWeightTransferEngine
