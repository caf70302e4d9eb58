"""Device probes and device ids: recipe ids are physical ids (nvidia-smi's GPU numbers, Ascend's logical chip ids),
whatever the sampling process's own visible-devices variable says; a probe that cannot start is a warning in the
run's records, never a dead trainer rank; a platform that has device nodes but no usable torch says so."""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from workbench import recipe, records
from workbench.errors import WorkbenchError
from workbench.platform import detect
from workbench.platform.probes import ascend, nvidia
from workbench.rundir import TrainDir
from workbench.training import monitor
from workbench.training.monitor import Monitor, device_roles

NPU_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "npu-smi"
SERVER, TRAINER = [0, 1, 2, 3], [4, 5, 6, 7]


def _recipe(platform: str, **more):
    overrides = {"devices.platform": platform, "devices.server": SERVER, "devices.trainer": TRAINER,
                 "server.tensor_parallel_size": 4, **more}
    return recipe.load("cpu-tiny", overrides)


# --- NVIDIA: recipe ids are NVML's (PCI bus order) ids ------------------------------------------------------------

class ScriptedNvml:
    """NVML as the driver numbers GPUs: all of them, in PCI bus order, whatever CUDA_VISIBLE_DEVICES says.
    GPU i has i+1 GiB in use, (i+1) x 10 % utilization, 100 + i W, 30 + i C; one MIG instance on GPU 7."""
    NVML_TEMPERATURE_GPU = 0
    COUNT = 8

    class Handle:
        def __init__(self, index: int, mig: bool = False):
            self.index, self.mig = index, mig

    class NotSupported(Exception):
        pass

    def __init__(self):
        self.inits = 0

    @staticmethod
    def uuid(i: int) -> str:
        return f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}"

    MIG = "MIG-11111111-2222-3333-4444-555555555555"

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return self.COUNT

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < self.COUNT:
            raise ValueError(f"NVML_ERROR_INVALID_ARGUMENT ({i})")
        return self.Handle(i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid == self.MIG:
            return self.Handle(7, mig=True)
        for i in range(self.COUNT):
            if uuid == self.uuid(i):
                return self.Handle(i)
        raise ValueError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetUUID(self, h):
        return self.MIG if h.mig else self.uuid(h.index)

    def nvmlDeviceGetMemoryInfo(self, h):
        used = (h.index + 1) * 2**30 // (4 if h.mig else 1)
        return types.SimpleNamespace(used=used, total=80 * 2**30 // (4 if h.mig else 1))

    def nvmlDeviceGetUtilizationRates(self, h):
        if h.mig:
            raise self.NotSupported("NVML_ERROR_NOT_SUPPORTED")  # as NVML answers for a MIG instance
        return types.SimpleNamespace(gpu=(h.index + 1) * 10)

    def nvmlDeviceGetPowerUsage(self, h):
        return (100 + h.index) * 1000

    def nvmlDeviceGetTemperature(self, h, kind):
        return 30 + h.index


def _expected(i: int, role: str) -> tuple:
    return (f"gpu:{i}", role, ScriptedNvml.uuid(i), float((i + 1) * 10), float((i + 1) * 1024), 81920.0,
            100.0 + i, 30.0 + i)


def test_nvidia_probe_reads_the_physical_gpus_whatever_the_process_sees(monkeypatch):
    """The sampler runs in the trainer (CUDA_VISIBLE_DEVICES=4,5,6,7); the server's cards 0-3 are not in that list,
    and NVML numbers every GPU of the machine anyway: each sample is the physical GPU's figures."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    probe = nvidia.NvidiaProbe(device_roles(_recipe("cuda")), nvml=ScriptedNvml())
    samples = probe.sample()
    assert [(s["device"], s["role"], s["uuid"], s["util_pct"], s["mem_used_mb"], s["mem_total_mb"], s["power_w"],
             s["temp_c"]) for s in samples] == \
        [_expected(i, "server") for i in SERVER] + [_expected(i, "trainer") for i in TRAINER]
    assert probe.warnings == []


@pytest.mark.parametrize("visible", ["GPU-00000004-aaaa-bbbb-cccc-000000000004,MIG-1/2/3", "", "7,5"])
def test_nvidia_probe_ignores_the_process_visible_devices(monkeypatch, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    samples = nvidia.NvidiaProbe({0: "server", 4: "trainer"}, nvml=ScriptedNvml()).sample()
    assert [(s["device"], s["mem_used_mb"]) for s in samples] == [("gpu:0", 1024.0), ("gpu:4", 5120.0)]


def test_nvidia_probe_takes_gpu_and_mig_uuids(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    roles = {ScriptedNvml.uuid(2): "server", ScriptedNvml.MIG: "trainer", 0: "trainer"}
    samples = nvidia.NvidiaProbe(roles, nvml=ScriptedNvml()).sample()
    by_device = {s["device"]: s for s in samples}
    assert by_device["gpu:0"]["mem_used_mb"] == 1024.0
    gpu2 = by_device[f"gpu:{ScriptedNvml.uuid(2)}"]
    assert (gpu2["role"], gpu2["mem_used_mb"], gpu2["util_pct"]) == ("server", 3072.0, 30.0)
    mig = by_device[f"gpu:{ScriptedNvml.MIG}"]
    # a MIG instance reports memory, not utilization: None, never a made-up zero
    assert (mig["role"], mig["mem_used_mb"], mig["mem_total_mb"], mig["util_pct"]) == ("trainer", 2048.0, 20480.0,
                                                                                         None)


def test_nvidia_probe_refuses_ids_nvml_does_not_know(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with pytest.raises(WorkbenchError, match=r"GPU 9.*NVML sees 8"):
        nvidia.NvidiaProbe({0: "server", 9: "trainer"}, nvml=ScriptedNvml())
    with pytest.raises(WorkbenchError, match="GPU-nope"):
        nvidia.NvidiaProbe({"GPU-nope": "server"}, nvml=ScriptedNvml())


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST"])
def test_nvidia_probe_warns_when_cuda_does_not_number_gpus_as_nvml(monkeypatch, order):
    if order is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    probe = nvidia.NvidiaProbe({0: "server"}, nvml=ScriptedNvml())
    assert len(probe.warnings) == 1 and "CUDA_DEVICE_ORDER" in probe.warnings[0]
    assert probe.sample()[0]["mem_used_mb"] == 1024.0  # still samples: NVML's GPU 0


def test_cuda_roles_number_gpus_in_pci_bus_order():
    rr = recipe.resolve(_recipe("cuda"), platform="cuda", versions={})
    for role, ids in ((rr.server, "0,1,2,3"), (rr.trainer, "4,5,6,7")):
        assert role.env["CUDA_VISIBLE_DEVICES"] == ids and role.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    own = recipe.resolve(_recipe("cuda", **{"devices.env": {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}}),
                         platform="cuda", versions={})
    assert own.server.env["CUDA_DEVICE_ORDER"] == own.trainer.env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    npu = recipe.resolve(_recipe("npu"), platform="npu", versions={"vllm": "0.23.0", "vllm_ascend": "0.23.0"})
    assert "CUDA_DEVICE_ORDER" not in npu.server.env and "CUDA_DEVICE_ORDER" not in npu.trainer.env


# --- Ascend: recipe ids are logical chip ids over the whole machine ---------------------------------------------

def _eight_chip_table() -> str:
    """The recorded 910B2C table (npu-smi 25.0.rc1.1) with its chip block repeated for NPUs 0-7, NPU i using
    1000 + i MB of HBM: the layout of an 8-card host, one chip per NPU."""
    lines = (NPU_FIXTURES / "info-910b2c-narrow.txt").read_text().splitlines(keepends=True)
    head, block = lines[:6], lines[6:9]
    out = head[:]
    for i in range(8):
        npu_row, chip_row, rule = block
        npu_row = npu_row.replace("| 0     910B2C", f"| {i}     910B2C")
        chip_row = chip_row.replace("3455 / 65536", f"{1000 + i} / 65536")
        out += [npu_row, chip_row, rule]
    return "".join(out)


def test_ascend_probe_maps_recipe_ids_whatever_the_process_sees(monkeypatch):
    """The sampler runs in the trainer (ASCEND_RT_VISIBLE_DEVICES=4,5,6,7) and the recipe's server has 0-3: the
    samples are chips 0-7 of the table, not renumbered inside the process's visible list."""
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    table = _eight_chip_table()
    probe = ascend.AscendProbe(device_roles(_recipe("npu")), runner=lambda *a: table)
    samples = probe.sample()
    assert [(s["device"], s["role"], s["npu"], s["mem_used_mb"]) for s in samples] == \
        [(f"npu:{i}", "server" if i < 4 else "trainer", i, 1000 + i) for i in range(8)]
    assert probe.warnings == []


def test_ascend_probe_notes_when_table_order_may_not_be_the_logical_order():
    """NPU ids that are not 0..N-1 with one chip each: the table's order is the best guess, and the probe says so."""
    table = _eight_chip_table().replace("| 1     910B2C", "| 9     910B2C")
    probe = ascend.AscendProbe({0: "server", 1: "trainer"}, runner=lambda *a: table)
    assert [s["npu"] for s in probe.sample()] == [0, 9]
    assert len(probe.warnings) == 1 and "npu-smi info -m" in probe.warnings[0]


# --- a probe that cannot start is a warning ------------------------------------------------------------------------

class _Scraper:
    def __init__(self):
        self.calls = 0

    def scrape(self):
        self.calls += 1
        return {"time": time.time(), "running": 1.0}


def _monitor(tmp_path, monkeypatch, for_platform) -> tuple[Monitor, TrainDir]:
    monkeypatch.setattr(monitor.probes, "for_platform", for_platform)
    rr = recipe.resolve(_recipe("cuda", **{"monitor.sample_interval_s": 0.05}), platform="cuda", versions={})
    train_dir = TrainDir(tmp_path / "train")
    train_dir.path.mkdir()
    m = Monitor(rr, train_dir)
    m.scraper = _Scraper()  # the server's /metrics, without a server
    return m, train_dir


def _run(m: Monitor) -> None:
    m.start()
    deadline = time.time() + 10
    while m.scraper.calls < 4 and time.time() < deadline:
        time.sleep(0.02)
    m.stop()


@pytest.mark.parametrize("where", ["construction", "first sample"])
def test_a_probe_that_cannot_start_is_a_warning_not_a_dead_rank(tmp_path, monkeypatch, where):
    def no_nvml(*args, **kwargs):
        raise WorkbenchError("NVML did not initialise (Driver Not Loaded)", "check the NVIDIA driver")

    class Unreadable:
        kind, warnings = "gpu", []

        def sample(self):
            raise WorkbenchError("devices lists GPU 7, but NVML sees 4", "use GPU ids 0..3")

    m, train_dir = _monitor(tmp_path, monkeypatch, no_nvml if where == "construction" else lambda *a, **k: Unreadable())
    _run(m)  # does not raise: training would go on
    devices = [json.loads(line) for line in train_dir.devices.read_text().splitlines()]
    assert len(devices) == 1 and set(devices[0]) == {"time", "error"}
    cause = "NVML did not initialise" if where == "construction" else "NVML sees 4"
    assert cause in devices[0]["error"]
    rollout = records.read_jsonl(train_dir.rollout)
    assert len(rollout) >= 3 and all(r["running"] == 1.0 for r in rollout)  # the scraper kept sampling
    (event,) = records.read_jsonl(train_dir.events, normalised=False)
    assert event["kind"] == "probe_warning" and "without device samples" in event["message"]
    assert m.overhead()["errors"] == 1

    # what the dashboard and the report show of it
    from workbench.observe import views
    from workbench.observe.rundata import load

    data = load(train_dir)
    assert ("events", "1 probe warning") in views.summary_rows(data)
    shown = views.events_html(data.events)
    assert "probe_warning" in shown and cause in shown


def test_a_probe_warning_is_recorded_and_sampling_goes_on(tmp_path, monkeypatch):
    class Warned:
        kind, warnings = "gpu", ["CUDA_DEVICE_ORDER is FASTEST_FIRST: ids may name other cards"]

        def sample(self):
            return [{"time": time.time(), "role": "server", "device": "gpu:0", "util_pct": 5.0}]

    m, train_dir = _monitor(tmp_path, monkeypatch, lambda *a, **k: Warned())
    _run(m)
    devices = records.read_jsonl(train_dir.devices)
    assert len(devices) >= 3 and not any("error" in d for d in devices)
    (event,) = records.read_jsonl(train_dir.events, normalised=False)
    assert event["kind"] == "probe_warning" and "FASTEST_FIRST" in event["message"]


# --- platform detection: device nodes without a usable torch are not silently the CPU ---------------------------

def _fake_torch(monkeypatch, **cuda):
    torch = types.ModuleType("torch")
    torch.__version__ = cuda.pop("version", "2.10.0+cu128")
    torch.version = types.SimpleNamespace(cuda=cuda.pop("cuda_build", "12.8"))
    torch.cuda = types.SimpleNamespace(**cuda)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


@pytest.fixture
def nvidia_nodes(monkeypatch):
    monkeypatch.delenv("WORKBENCH_PLATFORM", raising=False)
    monkeypatch.setattr(detect, "_has_nodes", lambda pattern: "nvidia" in pattern)
    monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name, *a: None)  # no torch_npu
    monkeypatch.setattr(detect, "_warned", set(), raising=False)


def test_usable_cuda_is_cuda_without_a_warning(nvidia_nodes, monkeypatch, capsys):
    _fake_torch(monkeypatch, is_available=lambda: True)
    assert detect.detect_platform() == "cuda" and capsys.readouterr().err == ""


def test_cuda_nodes_with_a_driver_torch_cannot_use_warn_once(nvidia_nodes, monkeypatch, capsys):
    def unavailable():
        import warnings
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return False

    _fake_torch(monkeypatch, is_available=unavailable)
    assert detect.detect_platform() == "cpu"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/dev/nvidia" in err[0] and "driver on your system is too old" in err[0]
    assert "nvidia-smi" in err[0] and "CUDA 12.8" in err[0] and "devices.platform=cpu" in err[0]
    assert detect.detect_platform() == "cpu" and capsys.readouterr().err == ""  # once per process


def test_cuda_nodes_with_a_cpu_only_torch_or_a_broken_one_warn(nvidia_nodes, monkeypatch, capsys):
    _fake_torch(monkeypatch, is_available=lambda: False, cuda_build=None, version="2.10.0+cpu")
    assert detect.detect_platform() == "cpu"
    assert "CPU-only build" in capsys.readouterr().err

    def broken():
        raise RuntimeError("libcudart.so.12: cannot open shared object file")

    _fake_torch(monkeypatch, is_available=broken)
    assert detect.detect_platform() == "cpu"
    assert "libcudart.so.12" in capsys.readouterr().err


def test_npu_nodes_with_a_failing_torch_npu_warn(monkeypatch, capsys):
    monkeypatch.delenv("WORKBENCH_PLATFORM", raising=False)
    monkeypatch.setattr(detect, "_warned", set(), raising=False)
    monkeypatch.setattr(detect, "_has_nodes", lambda pattern: "davinci" in pattern)
    monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name, *a: object())
    _fake_torch(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    assert detect.detect_platform() == "cpu"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/dev/davinci" in err[0] and "torch_npu" in err[0] and "set_env.sh" in err[0]


def test_no_device_nodes_is_the_cpu_in_silence(monkeypatch, capsys):
    monkeypatch.delenv("WORKBENCH_PLATFORM", raising=False)
    monkeypatch.setattr(detect, "_has_nodes", lambda pattern: False)
    assert detect.detect_platform() == "cpu" and capsys.readouterr().err == ""
