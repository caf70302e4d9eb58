"""Weight sync: how the trainer's new weights reach the vLLM server after each optimizer step.

TRL 1.16's server mode moves weights over NCCL only, so on Ascend or the CPU the server would keep sampling from
the initial policy. Four adapters, chosen by `server.weight_sync` (`auto`: nccl on CUDA, hccl on Ascend, reload
elsewhere):

    nccl    TRL's own path: vLLM's NCCL weight-transfer engine (CUDA).
    hccl    vllm-ascend's HCCL weight-transfer engine, the same flow over HCCL (Ascend). Cannot run here: it is
            tested against a fake engine that records calls (tests/test_sync.py).
    reload  device-independent: the parameters are written atomically as one safetensors file to a directory on a
            RAM disk, the server reloads them (`POST /collective_rpc reload_weights`), then the prefix cache is
            reset. Works on the CPU; the fallback everywhere the server can read the trainer's files.
    none    no sync, loudly: rollouts come from the initial weights and are off-policy.

The adapters plug into TRL's `VLLMClient` (see `SyncingVLLMClient`); TRL still gathers the parameters (PEFT
merging, DeepSpeed/FSDP), decides when to sync (once per optimizer step, before generation) and resets the prefix
cache. Every push is timed; `WeightSync.records` keeps (seconds, bytes) for the monitor.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from trl.generation.vllm_client import VLLMClient

from workbench.errors import WorkbenchError

logger = logging.getLogger("workbench.sync")

Metadata = list[tuple[str, str, list[int]]]
NamedParams = Iterator[tuple[str, torch.Tensor]]


class _Counted:
    """Passes (name, tensor) pairs through, adding up their bytes for the sync log."""

    def __init__(self, named_params: NamedParams) -> None:
        self.named_params = named_params
        self.bytes = 0

    def __iter__(self):
        for name, tensor in self.named_params:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


class WeightSync:
    """One way of moving weights to the server. Subclasses implement `connect` and `send`."""

    name = "base"

    def __init__(self) -> None:
        self.records: list[tuple[float, int]] = []  # (seconds, bytes) per push

    def connect(self, client: "SyncingVLLMClient", device) -> None:
        pass

    def send(self, client: "SyncingVLLMClient", metadata: Metadata, named_params: NamedParams) -> int:
        """Push the weights; return the number of bytes moved."""
        raise NotImplementedError

    def close(self, client: "SyncingVLLMClient") -> None:
        pass

    def push(self, client: "SyncingVLLMClient", metadata: Metadata, named_params: NamedParams) -> None:
        started = time.perf_counter()
        moved = self.send(client, metadata, named_params)
        seconds = time.perf_counter() - started
        self.records.append((seconds, moved))
        logger.info("weight sync (%s): %.1f MB in %.3f s", self.name, moved / 1e6, seconds)

    def drain(self) -> list[tuple[float, int]]:
        """The pushes since the last drain (the trainer logs them with each log line)."""
        out, self.records = self.records, []
        return out


class NoSync(WeightSync):
    name = "none"

    def connect(self, client, device) -> None:
        warnings.warn("server.weight_sync is 'none': the server keeps sampling from the initial weights, so every "
                      "rollout after the first step is off-policy (watch sampling/sampling_logp_difference grow)",
                      stacklevel=2)

    def send(self, client, metadata, named_params) -> int:
        # Every rank must walk the iterator (it gathers sharded parameters collectively).
        for _ in named_params:
            pass
        return 0


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Names of tied parameters that named_parameters() leaves out, mapped to the name it keeps.

    A tied model (Qwen2.5 up to 3B, the tiny model) yields `model.embed_tokens.weight` but not `lm_head.weight`.
    """
    canonical: dict[int, str] = {}
    for name, param in model.named_parameters():
        canonical.setdefault(id(param), name)
    return {name: canonical[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
            if canonical[id(param)] != name}


class ReloadSync(WeightSync):
    """Safetensors on a RAM disk + `reload_weights` over /collective_rpc: no collective communication at all.

    vLLM's layer-wise reload re-creates each layer's tensors, which unties tied weights: an lm_head that is not in
    the file keeps the *initial* embedding while the input embedding moves on (measured: logprobs off by 0.16 nats
    a token after one step at lr 3e-3). So tied aliases (`aliases`, see `tied_aliases`) are written out explicitly.
    """

    name = "reload"
    FILE = "model.safetensors"

    def __init__(self, directory: str | Path | None = None, aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.aliases = dict(aliases or {})
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="workbench-sync-", dir=base))
        self.directory.mkdir(parents=True, exist_ok=True)

    def connect(self, client, device) -> None:
        # vLLM loads every *.safetensors in the directory: a stale file from another run would be loaded too.
        for stale in list(self.directory.glob("*.safetensors")) + list(self.directory.glob("*.index.json")):
            stale.unlink()
        client.get_server_info()  # raises with a clear hint when the server lacks VLLM_SERVER_DEV_MODE=1

    def send(self, client, metadata, named_params) -> int:
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_params}
        for alias, source in self.aliases.items():
            if source in tensors and alias not in tensors:
                tensors[alias] = tensors[source].clone()  # safetensors refuses shared storage
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        # Written under a name vLLM ignores, then renamed: the server never sees half a file.
        partial = self.directory / (self.FILE + ".partial")
        save_file(tensors, str(partial))
        os.replace(partial, self.directory / self.FILE)
        result = client._post(f"{client.base_url}/collective_rpc",
                              json={"method": "reload_weights", "kwargs": {"weights_path": str(self.directory)}})
        if "results" not in result:
            raise WorkbenchError(f"reload_weights answered {result!r}", "check the server log for the reload error")
        return moved

    def close(self, client) -> None:
        for leftover in self.directory.glob(self.FILE + "*"):
            leftover.unlink(missing_ok=True)


class NcclSync(WeightSync):
    """TRL's own NCCL path, timed."""

    name = "nccl"

    def connect(self, client, device) -> None:
        VLLMClient.init_communicator(client, device)

    def send(self, client, metadata, named_params) -> int:
        counted = _Counted(named_params)
        VLLMClient.update_named_params(client, metadata, iter(counted))
        return counted.bytes

    def close(self, client) -> None:
        VLLMClient.close_communicator(client)


class HcclSync(WeightSync):
    """vllm-ascend's HCCL weight-transfer engine, driven like TRL drives NCCL.

    The server runs `--weight-transfer-config '{"backend": "hccl"}'`; the trainer joins the workers' group as rank
    0 (`trainer_init`), announces each update over HTTP (`/start_weight_update`, `/update_weights`) while it
    broadcasts the tensors (`trainer_send_weights`, packed), and closes with `/finish_weight_update`. `engine` is
    vllm-ascend's `HCCLWeightTransferEngine` class (injectable so tests can record the calls).
    """

    name = "hccl"

    def __init__(self, group_port: int = 51216, engine=None, master_address: str | None = None) -> None:
        super().__init__()
        self.group_port = group_port
        self.engine = engine
        self.master_address = master_address
        self.group = None

    def _engine(self):
        if self.engine is None:
            try:
                from vllm_ascend.distributed.weight_transfer.hccl_engine import HCCLWeightTransferEngine
            except ImportError as exc:
                raise WorkbenchError(f"the hccl weight sync needs vllm-ascend ({exc})",
                                     "install the ascend extra (one row of workbench/compat.yaml), or set "
                                     "server.weight_sync=reload") from None
            self.engine = HCCLWeightTransferEngine
        return self.engine

    def connect(self, client, device) -> None:
        engine = self._engine()
        if client.get_server_info().get("weight_transfer_config") is None:
            raise WorkbenchError(f"the server at {client.base_url} has no weight-transfer engine",
                                 "start it with --weight-transfer-config '{\"backend\": \"hccl\"}' (server.weight_sync=hccl)")
        if hasattr(torch, "npu") and isinstance(device, torch.device) and device.type == "npu" and device.index is not None:
            torch.npu.set_device(device)
        init_info = {"master_address": self.master_address or _local_ip(), "master_port": self.group_port,
                     "rank_offset": 1, "world_size": client.get_world_size() + 1}
        # The server blocks in the HCCL rendezvous while it answers, so the trainer must join concurrently.
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(client._post, f"{client.base_url}/init_weight_transfer_engine",
                                 json={"init_info": init_info})
            self.group = engine.trainer_init(init_info)
            answer.result()

    def send(self, client, metadata, named_params) -> int:
        engine = self._engine()
        names, dtypes, shapes = (list(column) for column in zip(*metadata))
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": True}
        counted = _Counted(named_params)
        client._post(f"{client.base_url}/start_weight_update", json={})
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(client._post, f"{client.base_url}/update_weights", json={"update_info": update_info})
            engine.trainer_send_weights(iter(counted), {"group": self.group, "packed": True})
            answer.result()
        client._post(f"{client.base_url}/finish_weight_update", json={})
        return counted.bytes

    def close(self, client) -> None:
        self.group = None


def _local_ip() -> str:
    from vllm.utils.network_utils import get_ip

    return get_ip()


ADAPTERS = {"none": NoSync, "reload": ReloadSync, "nccl": NcclSync, "hccl": HcclSync}


def make(method: str, sync_dir: str | None = None, group_port: int = 51216) -> WeightSync:
    if method not in ADAPTERS:
        raise WorkbenchError(f"unknown weight sync {method!r}", f"use one of: {', '.join(ADAPTERS)}")
    if method == "reload":
        return ReloadSync(sync_dir)
    if method == "hccl":
        return HcclSync(group_port)
    return ADAPTERS[method]()


class SyncingVLLMClient(VLLMClient):
    """TRL's VLLMClient with the weight path replaced by a `WeightSync` adapter (and an optional API key).

    TRL calls `init_communicator` once while the trainer is built, `update_named_params` after each optimizer step
    and `reset_prefix_cache` after it; generation requests are TRL's own.
    """

    def __init__(self, *args, weight_sync: WeightSync, api_key: str | None = None, **kwargs):
        self.weight_sync = weight_sync
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(*args, **kwargs)

    def _get(self, url: str, **kwargs) -> dict:
        kwargs["headers"] = {**self._auth, **kwargs.get("headers", {})}
        return super()._get(url, **kwargs)

    def _post(self, url: str, **kwargs) -> dict:
        kwargs["headers"] = {**self._auth, **kwargs.get("headers", {})}
        return super()._post(url, **kwargs)

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        self.weight_sync.connect(self, device)

    def update_named_params(self, metadata: Metadata, named_params: NamedParams) -> None:
        self.weight_sync.push(self, metadata, named_params)

    def close_communicator(self) -> None:
        self.weight_sync.close(self)

    def reset_prefix_cache(self) -> None:
        # TRL ignores {"success": false}; a cache that still holds old-policy prefixes would silently go off-policy.
        for attempt in range(3):
            answer = self._post(f"{self.base_url}/reset_prefix_cache")
            if answer is None or answer.get("success", True):
                return
            time.sleep(0.2 * (attempt + 1))
        raise WorkbenchError("the server refused to reset its prefix cache three times",
                             "check the server log; requests may still be running during the sync")
