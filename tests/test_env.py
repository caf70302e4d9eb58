"""The environment check: for real on this CPU machine, and on fake Ascend hosts (fake npu-smi, CANN files)."""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from workbench import envcheck as env
from workbench import recipe

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "npu-smi"
GOOD_ROW = {"python": "3.11.7", "torch": "2.10.0", "torch_npu": "2.10.0.post4", "vllm": "0.23.0",
            "vllm_ascend": "0.23.0.post1", "trl": "1.16.0", "transformers": "4.57.1", "accelerate": "1.10.1"}


def test_real_check_passes_on_this_machine_within_a_minute(workbench_cmd, tmp_path):
    started = time.time()
    out = subprocess.run([*workbench_cmd, "env", f"monitor.runs_dir={tmp_path}"], capture_output=True, text=True,
                         timeout=120)
    assert time.time() - started < 60
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  gloo all-reduce" in out.stdout and "sum [3.0] (expected 3)" in out.stdout
    (saved,) = tmp_path.glob("*-env/env.json")
    data = json.loads(saved.read_text())
    assert data["ok"] and data["platform"] == "cpu"
    names = {c["name"]: c["status"] for c in data["checks"]}
    assert names["gloo all-reduce"] == "pass" and names["device split"] == "pass"
    assert names["server KV cache (CPU)"] == "pass"


def _fake_host(tmp_path, npu_smi_file="info-910b2c-narrow.txt", cann="9.1.0", loaded=True):
    """An Ascend host in a directory: CANN version file, a fake npu-smi printing a recorded table."""
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    (toolkit / "lib64").mkdir()
    (toolkit / "aarch64-linux" / "ascend_toolkit_install.info").write_text(f"package_name=Ascend-cann-toolkit\nversion={cann}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npu_smi = bin_dir / "npu-smi"
    npu_smi.write_text(f"#!/bin/sh\ncat '{FIXTURES / npu_smi_file}'\n")
    npu_smi.chmod(0o755)
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if loaded:
        environ.update({"ASCEND_HOME_PATH": str(toolkit), "ASCEND_TOOLKIT_HOME": str(toolkit),
                        "LD_LIBRARY_PATH": f"{toolkit}/lib64:/usr/lib", "HCCL_CONNECT_TIMEOUT": "1800"})
    return environ


def _ascend_check(environ, versions, **overrides):
    r = recipe.load("ascend-910b-8card", {"devices.server": [0], "devices.trainer": [1],
                                          "server.tensor_parallel_size": 1, "distributed.processes": 1,
                                          **overrides})
    return env.check(recipe.resolve(r, platform="npu"), collective=False, platform="npu", environ=environ,
                     versions=versions, runner=env._run, devices=["910B2C", "910B2C"])


def test_fake_ascend_host_that_is_right(tmp_path):
    report = _ascend_check(_fake_host(tmp_path), GOOD_ROW)
    chain = report.find("Ascend version chain")
    assert chain.status == "pass" and "vllm-ascend 0.23.0 / vLLM 0.23.0" in chain.found and "CANN 9.1.0" in chain.found
    smi = report.find("npu-smi")
    assert smi.status == "pass" and smi.found.startswith("2 NPU(s), 2 chip(s): 910B2C") and "0.0=5%" in smi.found
    assert report.find("CANN loaded").status == "pass"
    assert report.find("HCCL_CONNECT_TIMEOUT").status == "pass"
    # the interface variables matter between nodes: not asked for on one host, a warning when unset on two
    assert "HCCL_SOCKET_IFNAME" not in {c.name for c in report.checks}
    multi = _ascend_check(_fake_host(tmp_path / "multi"), GOOD_ROW, **{"distributed.nodes": 2})
    assert multi.find("HCCL_SOCKET_IFNAME").status == "warn"


def test_mismatched_versions_name_the_row_and_each_change(tmp_path):
    drifted = {**GOOD_ROW, "torch_npu": "2.9.0", "vllm_ascend": "0.23.0", "vllm": "0.23.0"}
    report = _ascend_check(_fake_host(tmp_path, cann="9.0.1"), drifted)
    chain = report.find("Ascend version chain")
    assert chain.status == "fail"
    assert "closest row: vllm-ascend 0.23.0 " in chain.found
    assert "torch_npu 2.9.0 -> 2.10.0.post4" in chain.fix and "CANN 9.0.1 -> 9.1.0" in chain.fix
    assert not report.ok


def test_older_chain_is_matched_to_its_own_row(tmp_path):
    old = {**GOOD_ROW, "torch": "2.9.0", "torch_npu": "2.9.0.post1", "vllm": "0.18.0", "vllm_ascend": "0.18.0"}
    report = _ascend_check(_fake_host(tmp_path, cann="8.5.1"), old)
    chain = report.find("Ascend version chain")
    assert chain.status == "pass" and "vllm-ascend 0.18.0" in chain.found
    window = report.find("TRL vLLM window")
    assert window.status == "warn" and "0.18.0 is outside" in window.found


def test_cann_not_loaded(tmp_path):
    report = _ascend_check(_fake_host(tmp_path, loaded=False), GOOD_ROW)
    cann = report.find("CANN loaded")
    assert cann.status == "fail" and "ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME are not set" in cann.found
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in cann.fix
    assert report.find("HCCL_CONNECT_TIMEOUT").status == "pass"  # the recipe sets it for its own processes


def test_lib64_missing_from_ld_library_path(tmp_path):
    environ = _fake_host(tmp_path)
    environ["LD_LIBRARY_PATH"] = "/usr/lib"
    cann = _ascend_check(environ, GOOD_ROW).find("CANN loaded")
    assert cann.status == "fail" and "no Ascend lib64 in LD_LIBRARY_PATH" in cann.found


def test_npu_smi_missing_or_devices_missing(tmp_path):
    environ = _fake_host(tmp_path)
    environ["PATH"] = "/usr/bin:/bin"
    assert _ascend_check(environ, GOOD_ROW).find("npu-smi").status == "fail"
    report = _ascend_check(_fake_host(tmp_path / "b"), GOOD_ROW, **{"devices.server": [4, 5], "devices.trainer": [6, 7],
                                                                    "server.tensor_parallel_size": 2})
    present = report.find("recipe devices present")
    assert present.status == "fail" and "recipe uses NPUs [4, 5, 6, 7], npu-smi shows [0, 1]" in present.found


def test_unreadable_npu_smi_fails_loudly(tmp_path):
    environ = _fake_host(tmp_path)
    (Path(environ["PATH"].split(":")[0]) / "npu-smi").write_text("#!/bin/sh\necho 'something else entirely'\n")
    smi = _ascend_check(environ, GOOD_ROW).find("npu-smi")
    assert smi.status == "fail" and "unreadable npu-smi output" in smi.found


def test_ascend_recipe_on_this_cpu_machine_fails_with_a_fix():
    rr = recipe.resolve(recipe.load("ascend-910b-8card"))  # the recipe's own platform: npu
    report = env.check(rr, collective=False, platform="cpu", environ={"PATH": "/usr/bin"})
    platform = report.find("platform")
    assert platform.status == "fail" and "recipe wants 'npu', this machine runs 'cpu'" in platform.found
    assert "set_env.sh" in platform.fix


def test_collective_hang_becomes_a_clear_timeout():
    report = env.Report()
    env.run_collective(report, "cpu", 2, timeout=0.5)
    (c,) = report.checks
    assert c.status == "fail" and re.search(r"did not finish an all-reduce within \d+s \(a hang; all ended\)", c.found)
    assert "SOCKET_IFNAME" in c.fix


def test_html_and_text_rendering():
    report = env.Report(platform="cpu")
    report.add("versions", "pip check", "warn", "1 problem <x>", "fix it")
    assert "&lt;x&gt;" in report._repr_html_() and "WARN  pip check" in report.to_text() and "-> fix it" in report.to_text()


def test_kv_cache_that_does_not_fit_numa_node0():
    report = env.Report()
    env.check_resources(report, recipe.load("cpu-tiny", {"server.kv_cache_space_gib": 8}), "cpu",
                        node0_meminfo="Node 0 MemFree:        7000000 kB\n")
    kv = report.find("server KV cache (CPU)")
    assert kv.status == "fail" and "lower server.kv_cache_space_gib to 5" in kv.fix


def test_installed_torch_npu_and_vllm_ascend_are_read_and_checked(tmp_path, monkeypatch):
    """Fake torch_npu / vllm-ascend distributions (dist-info only) next to the real packages."""
    for name, version in (("torch_npu", "2.9.0"), ("vllm_ascend", "0.23.0")):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    versions = env.installed_versions()
    assert versions["torch_npu"] == "2.9.0" and versions["vllm_ascend"] == "0.23.0"
    report = env.Report()
    env.check_versions(report, versions, "cpu", cann="9.1.0")
    chain = report.find("Ascend version chain")
    assert chain.status == "fail" and "torch_npu 2.9.0 -> 2.10.0.post4" in chain.fix and "torch 2.13.0" in chain.fix


class _Nvml:
    """NVML as a driver answers: its version, and every GPU in PCI bus order."""

    def __init__(self, driver: str, names: list[str]):
        self.driver, self.names = driver, names

    def nvmlInit(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, handle):
        return self.names[handle].encode()  # older nvidia-ml-py answers bytes


def test_nvidia_driver_against_torchs_cuda_and_the_gpus_by_physical_id():
    report = env.Report(platform="cuda")
    names = env.check_nvidia(report, "13.0", nvml=_Nvml("575.57.08", ["NVIDIA H100 80GB HBM3"] * 2))
    assert names == ["NVIDIA H100 80GB HBM3"] * 2
    old = report.find("NVIDIA driver")
    assert old.status == "fail" and "R580" in old.found + old.fix
    report = env.Report(platform="cuda")
    assert len(env.check_nvidia(report, "13.0", nvml=_Nvml("580.159.03", ["NVIDIA H200"] * 8))) == 8
    assert report.find("NVIDIA driver").status == "pass"


def test_gpu_recipes_device_splits_on_an_nvidia_host(tmp_path):
    """The shipped GPU recipes against an 8-GPU host: their ids exist; colocate's one card is not an overlap."""
    gpus = ["NVIDIA H100 80GB HBM3"] * 8
    for name in ("cuda-1gpu", "cuda-2gpu", "cuda-8gpu"):
        report = env.Report(platform="cuda")
        env.check_platform(report, recipe.load(name), "cuda", gpus)
        assert report.find("device split").status == "pass", (name, report.find("device split").found)
    report = env.Report(platform="cuda")
    env.check_platform(report, recipe.load("cuda-2gpu", ["devices.trainer=[0]"]), "cuda", gpus)
    assert report.find("device split").status == "fail"


# --- where the model and the data come from -------------------------------------------------------------------

@pytest.fixture
def caches(monkeypatch, tmp_path):
    """Empty hub and datasets caches, whatever this machine holds."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


def sources(rr, reachable: bool, environ: dict | None = None) -> env.Report:
    report = env.Report(platform="cpu")
    env.check_sources(report, rr, environ or {}, reachable=lambda: reachable)
    return report


def test_sources_say_where_the_model_and_each_split_come_from_and_whether_they_are_here(caches, tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    hub = ["model.path=org/policy", "data.name=file", "data.train=" + str(tmp_path / "train.jsonl"),
           "data.test={hub: org/probs, split: test}"]
    rr = recipe.resolve(recipe.load("cpu-tiny", hub))
    offline = sources(rr, reachable=False)
    model, train, test = offline.find("model"), offline.find("data.train"), offline.find("data.test")
    assert model.status == "fail" and "not cached" in model.found and "HF_HUB_OFFLINE=1" in model.fix
    assert "HF_ENDPOINT" in model.fix and "model.path" in model.fix
    assert train.status == "pass" and "train.jsonl" in train.found
    assert test.status == "fail" and "org/probs" in test.found and "data.test: {path: FILE}" in test.fix
    assert "drawn by data.seed" in offline.find("data.validation").found  # carved from the training file
    # the model in the hub cache, the dataset in datasets' cache: all here, nothing reached
    snapshot = caches / "hub" / "models--org--policy" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (caches / "hub" / "models--org--policy" / "refs").mkdir()
    (caches / "hub" / "models--org--policy" / "refs" / "main").write_text("0" * 40)
    (caches / "datasets" / "org___probs").mkdir(parents=True)
    here = sources(rr, reachable=False)
    assert [here.find(n).status for n in ("model", "data.train", "data.validation", "data.test")] == ["pass"] * 4
    assert "cached" in here.find("model").found and "cached" in here.find("data.test").found


def test_sources_name_the_endpoint_a_download_comes_from_and_modelscope(caches):
    rr = recipe.resolve(recipe.load("cpu-tiny", ["model.path=org/policy"]))
    mirror = sources(rr, reachable=True, environ={"HF_ENDPOINT": "https://mirror.example"})
    assert mirror.find("model").status == "pass" and "from https://mirror.example" in mirror.find("model").found
    scope = sources(rr, reachable=True, environ={"VLLM_USE_MODELSCOPE": "true"})
    assert scope.find("model").status == "warn" and "modelscope download" in scope.find("model").fix
    (caches / "mine").mkdir()
    (caches / "mine" / "config.json").write_text("{}")
    local = recipe.resolve(recipe.load("cpu-tiny", [f"model.path={caches / 'mine'}"]))
    assert sources(local, reachable=False).find("model").found == f"local directory {caches / 'mine'}"
