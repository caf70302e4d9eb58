"""Weight sync: how the trainer's new weights reach the vLLM server after each optimizer step.

    from workbench.serving import sync
    adapter = sync.make(rr)        # rr.weight_sync: 'auto' already resolved by the recipe

TRL 1.16's server mode moves weights over NCCL only, so on Ascend or the CPU the server would keep sampling from
the initial policy. Four adapters, chosen by `server.weight_sync` (`auto`: nccl on CUDA, hccl on Ascend, reload
elsewhere):

    nccl    TRL's own path: vLLM's NCCL weight-transfer engine (CUDA).
    hccl    vllm-ascend's HCCL weight-transfer engine, the same flow over HCCL (Ascend). HCCL cannot run here:
            tests/test_sync.py records the engine calls, tests/test_contract.py runs the whole flow against real
            vLLM 0.23.0 / 0.32.0 servers with a gloo engine of the same interface.
    reload  device-independent: the parameters are written atomically as one safetensors file to a directory on a
            RAM disk, the server reloads them (`POST /collective_rpc reload_weights`), then the prefix cache is
            reset. Works on the CPU; the fallback everywhere the server can read the trainer's files.
    none    no sync, loudly: rollouts come from the initial weights and are off-policy.

The adapters plug into TRL's `VLLMClient` (see `SyncingVLLMClient`); TRL still gathers the parameters (PEFT
merging, DeepSpeed/FSDP), decides when to sync (once per optimizer step, before generation) and resets the prefix
cache. Every push is timed; `WeightSync.records` keeps (seconds, bytes) for the monitor.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch
from trl.generation.vllm_client import VLLMClient

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from workbench.serving.client import LORA_PREFIX, adapter_pushed_at, is_stale, lora_server
from workbench.serving.launch import is_loopback

logger = logging.getLogger("workbench.serving.sync")

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
        self.parts: dict[str, float] = {}  # the push in progress: seconds of each part an adapter times
        self.part_records: list[dict[str, float]] = []

    def connect(self, client: "SyncingVLLMClient", device) -> None:
        pass

    def send(self, client: "SyncingVLLMClient", metadata: Metadata, named_params: NamedParams) -> int:
        """Push the weights; return the number of bytes moved."""
        raise NotImplementedError

    def close(self, client: "SyncingVLLMClient") -> None:
        pass

    def reconnect(self, client: "SyncingVLLMClient", device) -> None:
        """Connect to a restarted server (the recovery calls this; the old server is gone)."""
        self.connect(client, device)

    def push(self, client: "SyncingVLLMClient", metadata: Metadata, named_params: NamedParams) -> None:
        started = time.perf_counter()
        self.parts = {}
        moved = self.send(client, metadata, named_params)
        seconds = time.perf_counter() - started
        self.records.append((seconds, moved))
        if self.parts:
            self.part_records.append(dict(self.parts))
        logger.info("weight sync (%s): %.1f MB in %.3f s%s", self.name, moved / 1e6, seconds,
                    "".join(f", {k} {v:.3f} s" for k, v in self.parts.items()))

    def drain(self) -> list[tuple[float, int]]:
        """The pushes since the last drain (the trainer logs them with each log line)."""
        out, self.records = self.records, []
        return out

    def drain_parts(self) -> dict[str, float]:
        """The mean seconds of each timed part of the pushes since the last drain (adapters that time parts)."""
        out, self.part_records = self.part_records, []
        names = dict.fromkeys(k for parts in out for k in parts)
        return {k: sum(p.get(k, 0.0) for p in out) / len(out) for k in names}


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


SYNC_PREFIX = "workbench-sync-"


def remove_stale_sync_dirs(base: Path) -> list[Path]:
    """Remove the RAM-disk weight directories of workbench processes that no longer run (a killed run's)."""
    removed = []
    for path in base.glob(f"{SYNC_PREFIX}*"):
        pid = path.name[len(SYNC_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue  # a name of another form, or a live process's own directory
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ReloadSync(WeightSync):
    """Safetensors on a RAM disk + `reload_weights` over /collective_rpc: no collective communication at all.

    vLLM's layer-wise reload re-creates each layer's tensors, which unties tied weights: an lm_head that is not in
    the file keeps the *initial* embedding while the input embedding moves on (measured: logprobs off by 0.16 nats
    a token after one step at lr 3e-3). So tied aliases (`aliases`, see `tied_aliases`) are written out explicitly.

    A given directory (`server.sync_dir`) is made 0700 when missing and must hold nothing but the adapter's own files
    (`OWN_FILES`; a stale copy from an earlier run is replaced): anything else is refused at `connect`, never deleted.
    `close` removes the adapter's files, and the directory too when the adapter made it and it is empty.
    """

    name = "reload"
    FILE = "model.safetensors"
    OWN_FILES = (FILE, FILE + ".partial")  # every name the adapter writes; nothing else in a given sync_dir is its own
    SHOWN = 5  # foreign files named in the refusal

    def __init__(self, directory: str | Path | None = None, aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.aliases = dict(aliases or {})
        self.given = Path(directory) if directory else None
        self._made_given = False  # the given directory did not exist: the adapter made it (and removes it, if empty)
        self._own: Path | None = None  # the RAM-disk directory this adapter made (and removes)
        self._cleanup = None
        self._layout: dict[str, tuple[torch.dtype, tuple, int]] | None = None  # the last whole write, for _InPlace
        self._file_id: tuple[int, int] | None = None

    @property
    def directory(self) -> Path:
        """Where the weights go: the given sync_dir, or a directory of this process on the RAM disk, made on first
        use (only the rank that pushes makes one: the others never write). Both are private (0700): they hold a
        full copy of the policy's weights."""
        if self.given is not None:
            if not self.given.is_dir():
                self._make_given()
            return self.given
        if self._own is None:
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
            remove_stale_sync_dirs(base)
            self._own = Path(tempfile.mkdtemp(prefix=f"{SYNC_PREFIX}{os.getpid()}-", dir=base))
            # a full copy of the weights in RAM must not outlive the process, whatever ends it short of SIGKILL
            # (a SIGKILLed run's directory is removed by the next start, see remove_stale_sync_dirs)
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._own), True)
        return self._own

    def _make_given(self) -> None:
        try:
            self.given.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            if not self.given.is_dir():
                raise WorkbenchError(f"server.sync_dir {self.given} exists and is not a directory",
                                     "point server.sync_dir at an empty directory, or leave it unset to use a "
                                     "private RAM-disk directory") from None
            return  # made by someone else meanwhile: theirs, never removed by close()
        os.chmod(self.given, 0o700)  # mkdir's mode is masked by the umask; this is the mode, whatever the umask
        self._made_given = True

    def check_given(self, directory: Path) -> None:
        """A given sync_dir holds the adapter's own files only. vLLM loads every *.safetensors in the directory it
        reloads from, so any other weights file would be loaded too; and the workbench deletes only what it wrote,
        so it refuses the directory instead of clearing it."""
        # .nfs* files are an NFS client's placeholders for a deleted file still open (our previous weights, held by
        # a server): nobody can remove them, vLLM ignores them, and they vanish when the server lets go
        foreign = sorted(p.name for p in directory.iterdir()
                         if p.name not in self.OWN_FILES and not p.name.startswith(".nfs"))
        if foreign:
            shown = ", ".join(foreign[:self.SHOWN]) + (f" and {len(foreign) - self.SHOWN} more"
                                                       if len(foreign) > self.SHOWN else "")
            raise WorkbenchError(f"server.sync_dir {directory} holds files the workbench did not write ({shown}): the "
                                 "server would load any weights among them, and the workbench deletes only its own",
                                 "point server.sync_dir at an empty directory, or leave it unset to use a private "
                                 "RAM-disk directory")
        for name in self.OWN_FILES:  # an earlier run's weights (a killed run's partial write): ours to remove
            (directory / name).unlink(missing_ok=True)

    def connect(self, client, device) -> None:
        directory = self.directory
        if self.given is not None:
            self.check_given(directory)
        client.get_server_info()  # raises with a clear hint when the server lacks VLLM_SERVER_DEV_MODE=1

    def send(self, client, metadata, named_params) -> int:
        started = time.perf_counter()
        moved = self._write(named_params)
        written = time.perf_counter()
        result = client._post(f"{client.base_url}/collective_rpc",
                              json={"method": "reload_weights", "kwargs": {"weights_path": str(self.directory)}})
        if "results" not in result:
            raise WorkbenchError(f"reload_weights answered {result!r}", "check the server log for the reload error")
        # write: gathering and writing the bytes (ours); server: the reload call, from request to answer (the
        # server's: reading the file, re-creating each layer and repacking its weights for the CPU kernels)
        self.parts = {"write": written - started, "server": time.perf_counter() - written}
        return moved

    def _write(self, named_params: NamedParams) -> int:
        """Every tensor written while the iterator holds it as it is: TRL merges a PEFT adapter into the weights
        before the first tensor and unmerges it after the last, in place, so a tensor kept for later (on the CPU,
        the live parameter itself) would be written unmerged. In place (`_InPlace`) each tensor goes to the file as
        it comes; otherwise, or from the first tensor that does not fit the file, each is copied as it comes and
        the whole file written at the end. A tied alias goes with its source. Returns the bytes moved."""
        aliases: dict[str, list[str]] = {}
        for alias, source in self.aliases.items():
            aliases.setdefault(source, []).append(alias)
        yielded: set[str] = set()
        copies: dict[str, torch.Tensor] = {}
        in_place = self._in_place()
        try:
            for name, t in named_params:  # gathers, when sharded
                yielded.add(name)
                t = t.detach()
                tied = [a for a in aliases.get(name, ()) if a not in yielded]
                if in_place is not None and not all(in_place.put(n, t) for n in (name, *tied)):
                    copies.update(in_place.read_back())  # what it wrote so far, as the file holds it
                    in_place.close()
                    in_place = None
                if in_place is None:
                    copies[name] = t.to("cpu", copy=True).contiguous()
                    copies.update({a: copies[name] for a in tied})
            if in_place is not None and not in_place.complete():  # fewer tensors than the file holds
                copies.update(in_place.read_back())
                in_place.close()
                in_place = None
            written = dict(in_place.done) if in_place is not None else copies
        finally:
            if in_place is not None:
                in_place.close()
        if in_place is None:
            self._write_whole(copies)
        return sum(t.numel() * t.element_size() for t in written.values())

    def _in_place(self) -> "_InPlace | None":
        """The last whole file, open for a rewrite where it lies, when it is still the one this adapter wrote (on a
        RAM disk only: a shared filesystem might show a remote server a mix of two pushes)."""
        if self._layout is None:
            return None
        path = self.directory / self.FILE
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return None
        st = os.fstat(fd)  # the file opened, not the name checked: a rename in between cannot fool it
        if (st.st_dev, st.st_ino) != self._file_id:
            os.close(fd)
            return None
        return _InPlace(fd, path, self._layout)

    def _write_whole(self, tensors: dict[str, torch.Tensor]) -> None:
        """A new file, written under a name vLLM ignores, then renamed: the server never sees half a file. Its
        layout (where each tensor's bytes lie) is kept for the next pushes' rewrite in place."""
        from safetensors.torch import save_file

        seen: set[int] = set()
        unshared = {}
        for name, t in tensors.items():  # safetensors refuses tensors sharing storage (a tied alias)
            unshared[name] = t.clone() if t.data_ptr() in seen else t
            seen.add(t.data_ptr())
        partial = self.directory / (self.FILE + ".partial")
        save_file(unshared, str(partial))
        os.replace(partial, self.directory / self.FILE)
        self._layout = None
        if on_ram_disk(self.directory):
            offsets = _data_offsets(self.directory / self.FILE)
            self._layout = {name: (t.dtype, tuple(t.shape), offsets[name]) for name, t in tensors.items()}
            self._file_id = _file_id(self.directory / self.FILE)

    def close(self, client=None) -> None:
        self._layout = self._file_id = None
        if self._cleanup is not None:  # our own directory: gone with everything in it
            self._cleanup()
            self._own, self._cleanup = None, None
        elif self.given is not None:  # the user's directory: only what we wrote
            for name in self.OWN_FILES:
                (self.given / name).unlink(missing_ok=True)
            if self._made_given:  # made by us: removed too, unless something else was put in it meanwhile
                try:
                    self.given.rmdir()
                    self._made_given = False
                except OSError:
                    pass


class _InPlace:
    """A rewrite of the last whole file where its bytes lie: the same names, dtypes and shapes, one pwrite per tensor
    from its own memory (no new file, no page allocation, no serialisation; about 3x faster than a new file on a RAM
    disk). Safe because the server reads the file only inside the reload call, made after the last byte, and copies
    what it reads into its own tensors (tests/test_sync.py checks that with a real server)."""

    def __init__(self, fd: int, path: Path, layout: dict[str, tuple[torch.dtype, tuple, int]]) -> None:
        self.fd, self.path, self.layout = fd, path, layout
        self.done: dict[str, torch.Tensor] = {}  # name -> the tensor written (for the byte count)

    def put(self, name: str, t: torch.Tensor) -> bool:
        """Write `t` where `name` lies (again, for a tied alias that is also yielded under its own name); False,
        nothing written, when it does not fit the file."""
        entry = self.layout.get(name)
        if entry is None or (t.dtype, tuple(t.shape)) != entry[:2]:
            return False
        host = t.to("cpu").contiguous()
        view = memoryview(host.reshape(-1).view(torch.uint8).numpy())  # bytes (numpy has no bfloat16)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], entry[2] + done)
        self.done[name] = t
        return True

    def complete(self) -> bool:
        return self.done.keys() == self.layout.keys()

    def read_back(self) -> dict[str, torch.Tensor]:
        """What was written so far, as copies read from the file (for a whole write after a misfit)."""
        from safetensors import safe_open

        with safe_open(str(self.path), "pt") as f:
            return {name: f.get_tensor(name).clone() for name in self.done}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def on_ram_disk(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (local memory): the mount with the longest prefix of its real path."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # \040 is a space
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return False
    return kind == "tmpfs"


def _data_offsets(path: Path) -> dict[str, int]:
    """Where each tensor's bytes begin in a safetensors file: 8 bytes of header length, the JSON header, the data."""
    import json
    import struct

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def adapter_name(tag: str, step: int, when: float | None = None) -> str:
    """A versioned adapter name: one run's tag, the optimizer step it holds, and when it was pushed (how a run that
    shares the server sees another's adapter go stale: client.adapter_pushed_at)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in tag)[:80]
    return f"{LORA_PREFIX}{safe}.s{step}.t{int(time.time() if when is None else when)}"


class LoraSync(ReloadSync):
    """Adapter-only sync through vLLM's runtime LoRA (`--enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).

    After each optimizer step the main rank writes the adapter (and only the adapter: peft's state dict, about 1% of
    the model's bytes) as a new directory on the RAM disk, renamed into place whole, loads it with
    `POST /v1/load_lora_adapter` under a new versioned name (`adapter_name`), points the client's generation
    requests at that name and unloads the previous version. Nothing of the base weights moves, and the prefix cache
    needs no reset: vLLM keys cached blocks by the adapter's name and path (v1/core/kv_cache_utils.py), so no
    request under the new name reuses a block computed under the old one, and the other runs sharing the server keep
    their cache. The load endpoints are under /v1: the server's API key guards them.

    Several runs may share one server: each run's names carry its own tag, a run only unloads its own adapters, and
    an adapter of another run that was not re-pushed for `stale_s` (its run died) is unloaded to free its slot.
    """

    name = "lora"
    FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)  # peft's names: what vLLM's LoRA loader reads

    def __init__(self, directory: str | Path | None = None, tag: str = "", slots: int = 4,
                 stale_s: float = 1800.0, base_name: str = "policy", rank: int = 0) -> None:
        super().__init__(None)  # the adapter versions live in a private directory (in a given sync_dir: below it)
        self.parent = Path(directory) if directory else None
        # unique on a shared server: two runs of one recipe started in the same second on two hosts differ here
        self.tag = f"{tag or os.uname().nodename}-{os.urandom(2).hex()}"
        self.slots = slots
        self.stale_s = stale_s
        self.base_name = base_name
        self.rank = rank
        self.current: str | None = None  # the version the server holds for this run
        self.unloaded: list[str] = []  # adapters of other runs this run unloaded as stale (for the run's events)
        self.others_seen: list[str] = []  # name prefixes of the other runs whose adapters shared the server
        self.events: Path | None = None  # the run's events.jsonl: a server_shared event when another run shows up

    @property
    def directory(self) -> Path:
        if self._own is None:
            base = self.parent if self.parent is not None else (
                Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
            base.mkdir(parents=True, exist_ok=True)
            if self.parent is None:  # this machine's RAM disk: a dead pid here is a dead run of this machine. A given
                remove_stale_sync_dirs(base)  # sync_dir may be shared over NFS with trainer hosts whose pids differ
            self._own = Path(tempfile.mkdtemp(prefix=f"{SYNC_PREFIX}{os.getpid()}-", dir=base))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._own), True)
        return self._own

    @property
    def prefix(self) -> str:
        """What every adapter name of this run starts with."""
        return adapter_name(self.tag, 0, 0).rsplit(".s0.", 1)[0] + ".s"

    def adapters(self, client) -> list[str]:
        """The adapters the server holds now (its /v1/models entries with a parent)."""
        data = client._get(f"{client.base_url}/v1/models").get("data", [])
        return [m["id"] for m in data if m.get("parent")]

    def connect(self, client, device) -> None:
        self.check_server(client)
        client.model = self.base_name  # until the first push: the zero-initialised adapter is the base model
        self.free_slots(client, need=2)

    def reconnect(self, client, device) -> None:
        """A restarted server holds no adapter: this run needs one slot for its current version (the recovery then
        loads it: reload_current), two when it has pushed none yet."""
        self.check_server(client)
        self.free_slots(client, need=1 if self.current else 2, holding=False)

    def check_server(self, client) -> None:
        """The server loads adapters at run time, of this rank (client.lora_server); its slot count wins over the
        recipe's (a shared server was started by another recipe)."""
        told = lora_server(client.base_url, client._auth, self.rank)
        if told and told["slots"]:
            self.slots = told["slots"]

    def free_slots(self, client, need: int, holding: bool = True) -> None:
        """Unload the stale adapters of dead runs; refuse, in one line, when the server still has no room for `need`
        more (beside this run's current version, when the server holds it: `holding`)."""
        now = time.time()
        held = self.adapters(client)
        for name in held:
            if name == self.current or not is_stale(name, self.stale_s, now):
                continue
            if self._unload(client, name):
                self.unloaded.append(name)
                logger.warning("unloaded the adapter %s: not re-pushed for %.0f s (server.lora_stale_s=%.0f), its "
                               "run is gone", name, now - adapter_pushed_at(name), self.stale_s)
        others = [n for n in self.adapters(client) if n != self.current]
        self._note_others(others)
        if len(others) + (1 if self.current and holding else 0) + need > self.slots:
            raise WorkbenchError(
                f"the server at {client.base_url} holds {len(others)} adapter(s) of other runs "
                f"({', '.join(others[:4])}{' ...' if len(others) > 4 else ''}) and has {self.slots} LoRA slots "
                f"(server.lora_slots); this run needs {need}",
                "wait for a run to finish, start the shared server with more server.lora_slots, or lower "
                "server.lora_stale_s so that dead runs' adapters are freed sooner")

    def _note_others(self, names: list[str]) -> None:
        from workbench.records import append_event

        for name in names:
            other = name.rsplit(".s", 1)[0] + ".s" if name.startswith(LORA_PREFIX) else name
            if other == self.prefix or other in self.others_seen:
                continue
            self.others_seen.append(other)
            if self.events is not None:
                append_event(self.events, "server_shared", f"the server also serves another run's adapter ({name})",
                             adapter=name)

    # Load and unload go out without the client's session: it retries a 500 three times and then raises urllib3's
    # RetryError, which hides vLLM's answer (0.32 answers 500 for an adapter its engine refuses: DoRA, bias, rank).
    def _unload(self, client, name: str) -> bool:
        import requests

        response = requests.post(f"{client.base_url}/v1/unload_lora_adapter", json={"lora_name": name},
                                 headers=client._auth, timeout=60)
        if response.status_code in (200, 404):  # 404: already gone (another run freed it, or a restarted server)
            return response.status_code == 200
        raise WorkbenchError(f"unloading the adapter {name} answered HTTP {response.status_code}: "
                             f"{response.text[:200]}", "check the server log")

    def _load(self, client, name: str, path: Path) -> None:
        import requests

        response = requests.post(f"{client.base_url}/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": str(path)},
                                 headers=client._auth, timeout=client_timeout(client))
        if response.status_code == 404 and "load_lora_adapter" in response.url and "Not Found" in response.text:
            raise WorkbenchError(f"the server at {client.base_url} has no runtime LoRA endpoints",
                                 "start it with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (a managed "
                                 "server with a peft: recipe, or `workbench serve --for-training` with one)")
        if response.status_code != 200:
            raise WorkbenchError(f"loading the adapter {name} answered HTTP {response.status_code}: "
                                 f"{response.text[:300]}", "check the server log (rank above --max-lora-rank, "
                                 "target modules the model lacks, no free slot)")

    def push_adapter(self, client, tensors: dict[str, torch.Tensor], config: dict, step: int) -> None:
        """Write the adapter as a new version, load it, point generation at it, unload the previous one."""
        import json

        from safetensors.torch import save_file

        started = time.perf_counter()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        moved = sum(t.numel() * t.element_size() for t in tensors.values())
        name = adapter_name(self.tag, step)
        if name == self.current:  # two pushes of one step within a second: same content, nothing to do
            return
        partial = self.directory / (name + ".partial")
        partial.mkdir()
        save_file(tensors, str(partial / self.FILES[0]))
        (partial / self.FILES[1]).write_text(json.dumps(config, indent=1, default=_jsonable))
        target = self.directory / name
        os.replace(partial, target)  # the server never sees half an adapter
        self.free_slots(client, need=1)
        self._load(client, name, target)
        previous, self.current = self.current, name
        client.model = name  # TRL's generation requests name client.model
        if previous is not None:
            self._unload(client, previous)
            shutil.rmtree(self.directory / previous, ignore_errors=True)
        seconds = time.perf_counter() - started
        self.records.append((seconds, moved))
        logger.info("weight sync (lora): %s, %.2f MB in %.3f s", name, moved / 1e6, seconds)

    def reload_current(self, client) -> None:
        """Load this run's current version again, under a fresh name (its push time now): after a server restart
        (the new server holds no adapter), or when the server no longer knows it (another run's restart of a shared
        server, or its stale rule after a long pause of this run)."""
        if self.current is None:
            client.model = self.base_name
            return
        step = int(self.current.rsplit(".s", 1)[1].split(".", 1)[0])
        name = adapter_name(self.tag, step)
        if name != self.current:
            os.replace(self.directory / self.current, self.directory / name)
        self._load(client, name, self.directory / name)
        self.current = client.model = name

    def is_gone(self, exc: BaseException) -> bool:
        """The server answered that this run's current adapter does not exist (HTTP 404 naming it)."""
        text = str(exc)
        return self.current is not None and "HTTP 404" in text and self.current in text

    def send(self, client, metadata, named_params) -> int:
        raise WorkbenchError("the lora weight sync pushes the adapter only (push_adapter), not named parameters",
                             "train with a peft: section, or choose another server.weight_sync")

    def close(self, client=None) -> None:
        if client is not None and self.current is not None:
            try:  # a finished run frees its slot on a shared server at once
                self._unload(client, self.current)
            except Exception as exc:  # the server may be gone already; the stale rule frees the slot then
                logger.warning("could not unload the adapter %s at the end: %s", self.current, exc)
            self.current = None
        super().close(client)


def _jsonable(value):
    """peft's config holds sets (target_modules) and enums: as peft's own save_pretrained writes them."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", str(value))


def client_timeout(client) -> float:
    """The request timeout the client was built with (server.request_timeout_s), else 600 s."""
    request = client.session.request
    return float(getattr(request, "keywords", {}).get("timeout") or 600.0)


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

    def reconnect(self, client, device) -> None:
        # the dead server's group may still hold the group port (its store, a socket in TIME_WAIT): a new port
        self.close(client)
        client.group_port = unused_port(client.group_port)
        self.connect(client, device)


class HcclSync(WeightSync):
    """vllm-ascend's HCCL weight-transfer engine, driven like TRL drives NCCL.

    The server runs `--weight-transfer-config '{"backend": "nccl"}'` (vllm-ascend puts its HCCL engine under that
    name; compat.hccl_backend_name()); the trainer joins the workers' group as rank 0 (`trainer_init`), announces
    each update over HTTP (`/start_weight_update`, `/update_weights`) while it broadcasts the tensors
    (`trainer_send_weights`, packed), and closes with `/finish_weight_update`. `engine` is vllm-ascend's
    `HCCLWeightTransferEngine` class (injectable: tests/test_sync.py records the calls, tests/test_contract.py runs
    the whole flow against real vLLM servers with a gloo engine of the same interface).

    Tied weights: the workers load the update layer by layer (vLLM's layerwise reload), which unties a tied lm_head
    as it does for ReloadSync, so each alias in `aliases` (see `tied_aliases`) is announced and sent right after its
    source (measured with vLLM 0.32: 0.07 nats/token off after one push without it).

    A parameter source that fails halfway (a gather that raises) must not leave the workers waiting in the
    collective for tensors that never come: what the source could not give is sent as zeros, the update is closed,
    and the source's error is raised. The server keeps serving (with a half-updated model) and takes the next push.
    """

    name = "hccl"

    def __init__(self, group_port: int = 51216, engine=None, master_address: str | None = None,
                 aliases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.group_port = group_port
        self.engine = engine
        self.master_address = master_address
        self.aliases = dict(aliases or {})
        self.group = None
        self.device: torch.device | None = None

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
                                 "start it with --weight-transfer-config '{\"backend\": \"nccl\"}' (server.weight_sync=hccl)")
        if isinstance(device, torch.device):
            self.device = device
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
        metadata, named_params = with_aliases(metadata, named_params, self.aliases)
        names, dtypes, shapes = (list(column) for column in zip(*metadata))
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": True}
        source = _Announced(named_params, metadata, self.device)
        counted = _Counted(source)
        client._post(f"{client.base_url}/start_weight_update", json={"is_checkpoint_format": True})
        # The workers block in the receive while they handle /update_weights: it runs beside the broadcast.
        answer = _in_background(client._post, f"{client.base_url}/update_weights", json={"update_info": update_info})
        try:
            engine.trainer_send_weights(iter(counted), {"group": self.group, "packed": True})
        except Exception as exc:
            # The collective itself failed (a failing source cannot get here): the workers may still wait in it,
            # and /update_weights' answer and /finish_weight_update would wait behind them.
            raise WorkbenchError(f"the weight broadcast to {client.base_url} failed ({exc})",
                                 "the transfer group is unusable: restart the server and the training") from exc
        try:
            answer.result()
        except Exception:
            self._finish(client, quiet=True)  # the worker has dropped the update: keep the server's own error
            raise
        # Always close the update: a worker left "update active" refuses every later /start_weight_update.
        self._finish(client, quiet=source.error is not None)
        if source.error is not None:
            raise source.error
        return counted.bytes

    @staticmethod
    def _finish(client, quiet: bool) -> None:
        try:
            client._post(f"{client.base_url}/finish_weight_update", json={})
        except Exception as exc:
            if not quiet:
                raise
            logger.warning("closing the failed weight update failed too: %s", exc)

    def close(self, client) -> None:
        destroy = getattr(self.group, "destroy", None)
        if callable(destroy):
            try:
                destroy()
            except Exception as exc:  # the peer is gone; what matters is that this side lets go
                logger.warning("closing the weight-transfer group: %s", exc)
        self.group = None

    def reconnect(self, client, device) -> None:
        # the trainer hosts the group's store at group_port: the dead server's group may still hold it (the old
        # communicator, a socket in TIME_WAIT), so the new group is made on a port that is free now
        self.close(client)
        self.group_port = unused_port(self.group_port)
        self.connect(client, device)


def _in_background(fn, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` on a daemon thread: a request that never returns (workers stuck in a failed collective)
    must not keep the trainer from exiting, as a ThreadPoolExecutor's thread would."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name="workbench-weight-update", daemon=True).start()
    return future


def with_aliases(metadata: Metadata, named_params: NamedParams, aliases: dict[str, str]
                 ) -> tuple[Metadata, NamedParams]:
    """Metadata and parameters with each tied alias announced and sent right after its source (same tensor)."""
    announced = {name for name, _, _ in metadata}
    after: dict[str, list[str]] = {}
    for alias, source in aliases.items():
        if alias not in announced and source in announced:
            after.setdefault(source, []).append(alias)
    if not after:
        return metadata, named_params
    extended = []
    for name, dtype, shape in metadata:
        extended.append((name, dtype, shape))
        extended += [(alias, dtype, shape) for alias in after.get(name, [])]

    def stream():
        for name, tensor in named_params:
            yield name, tensor
            for alias in after.get(name, []):
                yield alias, tensor

    return extended, stream()


class _Announced:
    """The parameters exactly as announced: the workers receive the announced bytes whatever the source does.

    The workers size their receive from the metadata; a source that raises, stops early or strays from the metadata
    would leave them waiting in the collective (HCCL's timeout is 30 minutes, and the server queues every other
    request behind it). From the first such fault on, the rest is sent as zeros and the fault is kept in `error`.
    """

    def __init__(self, named_params: NamedParams, metadata: Metadata, device: torch.device | None) -> None:
        self.named_params = named_params
        self.metadata = metadata
        self.device = device
        self.error: BaseException | None = None

    def __iter__(self):
        sent = 0
        try:
            for name, tensor in self.named_params:
                if sent == len(self.metadata):
                    raise WorkbenchError(f"the parameter source yielded {name!r} beyond the {len(self.metadata)} "
                                         "announced tensors", "announce every tensor the source yields")
                want_name, want_dtype, want_shape = self.metadata[sent]
                if (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) != (want_name, want_dtype,
                                                                                          list(want_shape)):
                    raise WorkbenchError(f"the parameter source yielded {name!r} {tensor.dtype} {list(tensor.shape)} "
                                         f"where {want_name!r} {want_dtype} {list(want_shape)} was announced",
                                         "yield the parameters in the order and form of the metadata")
                self.device = tensor.device
                yield name, tensor
                sent += 1
        except Exception as exc:
            self.error = exc
        if sent < len(self.metadata):
            if self.error is None:
                self.error = WorkbenchError(f"the parameter source yielded {sent} of the {len(self.metadata)} "
                                            "announced tensors", "announce only the tensors the source yields")
            logger.error("weight sync: the parameter source failed after %d of %d tensors (%s); sending zeros for "
                         "the rest so the server's workers can close the update", sent, len(self.metadata), self.error)
            for name, dtype, shape in self.metadata[sent:]:
                yield name, torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device or "cpu")


def unused_port(after: int) -> int:
    """The first port above `after` nothing on this machine listens on (a group port for a new connection)."""
    import socket

    for port in range(after + 1, min(after + 200, 65535)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise WorkbenchError(f"no free port among the 200 after {after} for the weight-transfer group",
                         "set trainer.vllm_group_port to a free range")


def trainer_address(rr: Resolved) -> str:
    """The address the server's workers reach the trainer's main rank at (it hosts the weight-transfer group):
    distributed.main_address when the recipe names a network address, else the address of this machine's interface
    that routes to the server (asked of the kernel, not guessed from the first interface)."""
    from urllib.parse import urlparse

    main = rr.recipe.distributed.main_address
    if main and not is_loopback(main):
        return main
    host = urlparse(rr.server_url).hostname or "127.0.0.1"
    if is_loopback(host):
        return "127.0.0.1"
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, urlparse(rr.server_url).port or 80))  # no packet is sent: the kernel picks the route
        return s.getsockname()[0]


def _local_ip() -> str:
    from vllm.utils.network_utils import get_ip

    return get_ip()


ADAPTERS = {"none": NoSync, "reload": ReloadSync, "lora": LoraSync, "nccl": NcclSync, "hccl": HcclSync}


def make(rr: Resolved, tag: str = "") -> WeightSync:
    """The adapter the resolved recipe names, with its settings (sync directory, weight-transfer group port; for
    lora the run's tag, which names its adapters on a shared server)."""
    method = rr.weight_sync
    sync_dir = rr.recipe.server.sync_dir
    group_port = int(rr.recipe.trainer.get("vllm_group_port", 51216))
    if method not in ADAPTERS:
        raise WorkbenchError(f"unknown weight sync {method!r}", f"use one of: {', '.join(ADAPTERS)}")
    if method == "reload":
        return ReloadSync(sync_dir)
    if method == "lora":
        s = rr.recipe.server
        return LoraSync(sync_dir, tag=tag, slots=s.lora_slots, stale_s=s.lora_stale_s, base_name=s.served_model_name,
                        rank=rr.recipe.lora_rank)
    if method == "hccl":
        return HcclSync(group_port, master_address=trainer_address(rr))
    return ADAPTERS[method]()


def _json_or_empty(response) -> dict:
    if response.status_code == 401:
        raise WorkbenchError(f"{response.request.method} {response.url} answered HTTP 401 (unauthorised)",
                             "the server wants the key named by server.api_key_env: set that variable to its key")
    if response.status_code != 200:
        raise WorkbenchError(f"{response.request.method} {response.url} answered HTTP {response.status_code}: "
                             f"{response.text[:300]}", "read the server log for the cause")
    if not response.content.strip():
        return {}
    return response.json()


# Requests that may be sent again when the server dropped their connection before any byte of an answer: they
# ask for nothing the server keeps (generation, reads, a prefix-cache reset), or repeat what it already holds
# (reloading the same weights file; a pooling or classification request). Not the NCCL weight-transfer calls: a
# repeated /update_weights would wait for a broadcast that is never sent again. Not the adapter loads and unloads:
# a second load of a name answers "already loaded", a second unload "not found".
RESENDABLE = ("/v1/completions", "/v1/chat/completions", "/reset_prefix_cache", "/collective_rpc", "/health",
              "/v1/models", "/server_info", "/get_world_size", "/metrics", "/pooling", "/classify", "/ping")
_resent = {"count": 0}
_resent_lock = threading.Lock()


def resent_requests() -> int:
    """How many requests this process has sent again after the server dropped their connection unanswered."""
    return _resent["count"]


def dropped_unanswered(error: BaseException | None) -> bool:
    """urllib3's error for a connection the server reset or closed before any byte of its answer arrived (vLLM's
    API server closes a keep-alive connection idle past VLLM_HTTP_TIMEOUT_KEEP_ALIVE; a request sent on it as it
    closes is reset). Not a timeout (the server may still be working on that request), nor a body cut mid-way
    (that is raised after the headers, outside the retries)."""
    import http.client

    from urllib3.exceptions import ProtocolError

    if not isinstance(error, ProtocolError):
        return False
    cause = error.args[1] if len(error.args) > 1 else error.__cause__
    return isinstance(cause, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)) and \
        not isinstance(cause, TimeoutError)


def resend_dropped_retry(resend: bool = True):
    """The trainer's retry policy: a refused connection is tried again (3 times, with back-off), an answer of 500,
    502 or 503 too; a read that timed out is not (a hung server is the recovery's to restart); a request of
    RESENDABLE whose connection was dropped unanswered is sent again, counted and logged. `resend=False`: the
    policy without that (what tests compare with)."""
    from urllib.parse import urlsplit

    from urllib3.util.retry import Retry

    class ResendDropped(Retry):
        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            path = urlsplit(url or "").path
            if resend and response is None and dropped_unanswered(error) and path in RESENDABLE:
                with _resent_lock:
                    _resent["count"] += 1
                    count = _resent["count"]
                logger.warning("the server dropped the connection of %s %s before answering (%s); sending it again "
                               "(%d request(s) re-sent so far)", method, path, error, count)
                # counted as a failed connection: nothing of it reached an answer
                from urllib3.exceptions import NewConnectionError

                error = NewConnectionError(None, f"dropped before any answer: {error}")
            return super().increment(method, url, response, error, _pool, _stacktrace)

    return ResendDropped(total=3, connect=3, read=0, status=3, status_forcelist=[500, 502, 503], backoff_factor=1,
                         allowed_methods=["POST", "GET"])


class SyncingVLLMClient(VLLMClient):
    """TRL's VLLMClient with the weight path replaced by a `WeightSync` adapter (and an optional API key).

    TRL calls `init_communicator` once while the trainer is built, `update_named_params` after each optimizer step
    and `reset_prefix_cache` after it; generation requests are TRL's own.
    """

    def __init__(self, *args, weight_sync: WeightSync, headers: dict[str, str] | None = None,
                 request_timeout: float | None = None, **kwargs):
        self.weight_sync = weight_sync
        self._auth = dict(headers or {})
        self.recovery = None  # set by the trainer: restarts a dead or hung server and re-pushes the weights
        self.device = None
        super().__init__(*args, **kwargs)
        self.session.headers.update(self._auth)  # TRL also calls self.session directly (/server_info)
        if request_timeout:
            # TRL's requests carry no timeout: a hung server would hang the run forever. A call's own timeout wins.
            self.session.request = functools.partial(self.session.request, timeout=request_timeout)
            # TRL's session retries a read that timed out five times with back-off (about 6 x the timeout + 62 s):
            # a hung server would be noticed an hour after server.request_timeout_s. A timed-out generation is not
            # sent again (the server may still be working on it); the recovery restarts a hung server instead.
            self._bound_retries()

    def _bound_retries(self) -> None:
        from requests.adapters import HTTPAdapter

        pool = self.session.get_adapter(self.base_url)._pool_maxsize
        retry = resend_dropped_retry()
        for prefix in ("http://", "https://"):
            self.session.mount(prefix, HTTPAdapter(max_retries=retry, pool_maxsize=pool))

    def _recovering(self, what: str, call):
        """`call()`; when it fails because the server died or hung, let `recovery` restart the server and
        re-push the weights, then try again (the recovery bounds the restarts and raises when it gives up). A LoRA
        run whose adapter the server no longer knows loads it again, once per call."""
        reloaded = False
        while True:
            try:
                return call()
            except Exception as exc:
                if not reloaded and isinstance(self.weight_sync, LoraSync) and self.weight_sync.is_gone(exc):
                    logger.warning("the server no longer holds this run's adapter %s; loading it again",
                                   self.weight_sync.current)
                    self.weight_sync.reload_current(self)
                    reloaded = True
                    continue
                if self.recovery is None:
                    raise
                self.recovery.handle(self, what, exc)  # re-raises what is not a server fault

    def generate(self, *args, **kwargs):
        return self._recovering("generation", lambda: self.generate_once(*args, **kwargs))

    def generate_once(self, prompts, *args, generation_kwargs: dict | None = None, **kwargs):
        """TRL's request without the recovery: for a request on another thread, whose failure is handled on the
        trainer's main thread (workbench/training/overlap.py). A list under `generation_kwargs["seed"]` holds one
        sampling seed per prompt (workbench/training/seeding.py): each prompt then goes in a request of its own,
        all at once, since vLLM's completions endpoint takes one seed per request."""
        seeds = (generation_kwargs or {}).get("seed")
        if not isinstance(seeds, (list, tuple)):
            return VLLMClient.generate(self, prompts, *args, generation_kwargs=generation_kwargs, **kwargs)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} sampling seeds for {len(prompts)} prompts")
        features = kwargs.pop("features", None)

        def one(i: int) -> dict:
            return VLLMClient.generate(self, [prompts[i]], *args, features=None if features is None else [features[i]],
                                       generation_kwargs={**generation_kwargs, "seed": seeds[i]}, **kwargs)

        # the server batches the requests as it would one request's prompts; the pool stays within TRL's connections
        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 64)),
                                thread_name_prefix="workbench-seeded") as pool:
            parts = list(pool.map(one, range(len(prompts))))
        out: dict[str, list] = {}
        for key in ("prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"):
            values = [part.get(key) for part in parts]
            out[key] = None if any(v is None for v in values) else [x for v in values for x in v]
        return out

    # vLLM's dev endpoints answer with JSON or, in some releases, an empty 200 (/reset_prefix_cache before 0.26,
    # /collective_rpc when no worker returns anything): both mean success; TRL's own helpers parse every body.
    # The key goes on each request too: TRL's __init__ asks /v1/models (through _get) before it returns, that is
    # before the session's headers can be set, and a keyed server answers that 401.
    def _get(self, url: str, **kwargs) -> dict:
        return _json_or_empty(self.session.get(url, **self._authorised(kwargs)))

    def _post(self, url: str, **kwargs) -> dict:
        return _json_or_empty(self.session.post(url, **self._authorised(kwargs)))

    def _authorised(self, kwargs: dict) -> dict:
        return {**kwargs, "headers": {**self._auth, **(kwargs.get("headers") or {})}}

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        self.device = device
        self.weight_sync.connect(self, device)

    def update_named_params(self, metadata: Metadata, named_params: NamedParams) -> None:
        named_params = iter(named_params)
        try:
            self.weight_sync.push(self, metadata, named_params)
        except Exception as exc:
            # read the rest of the stream: with sharded parameters each item is a gather that every rank joins, and
            # the others would wait in it forever; the trainer's keeper then holds the whole new weights
            for _ in named_params:
                pass
            if self.recovery is None:
                raise
            self.recovery.handle(self, "weight push", exc)  # a restart re-pushes the current weights itself

    def close_communicator(self) -> None:
        self.weight_sync.close(self)

    def reset_prefix_cache(self) -> None:
        # TRL ignores {"success": false}; a cache that still holds old-policy prefixes would silently go off-policy.
        # An empty body (vLLM < 0.26) is a success: it would have been a 4xx/5xx otherwise.
        for attempt in range(3):
            answer = self._recovering("prefix-cache reset", lambda: self._post(f"{self.base_url}/reset_prefix_cache"))
            if answer.get("success", True):
                return
            time.sleep(0.2 * (attempt + 1))
        raise WorkbenchError("the server refused to reset its prefix cache three times",
                             "check the server log; requests may still be running during the sync")
