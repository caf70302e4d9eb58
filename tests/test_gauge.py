"""The roofline gauge on an accelerator (training/gauge.py, platform/limits.py): the card's datasheet peaks found by
the name its driver prints, the recipe's figures winning, the role's cards multiplied in, and the dashboard's, the
advisor's and the bench's words saying what the gauge compares against. The CPU's measured limits are tested on the
smoke run (tests/test_monitor.py) and the bench (tests/test_bench.py); no accelerator is here, so its name is given."""
from __future__ import annotations

import json

import pytest

from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.platform import limits


@pytest.mark.parametrize("name, memory, tflops", [
    # as torch.cuda.get_device_name / NVML print them (tests/test_env.py records the first two)
    ("NVIDIA H100 80GB HBM3", 3350, 989), ("NVIDIA H200", 4800, 989), ("NVIDIA H200 NVL", 4800, 835),
    ("NVIDIA H100 PCIe", 2000, 756), ("NVIDIA H100 NVL", 3900, 835),
    ("NVIDIA A100-SXM4-80GB", 2039, 312), ("NVIDIA A100 80GB PCIe", 1935, 312), ("NVIDIA A100-SXM4-40GB", 1555, 312),
    ("NVIDIA A100-PCIE-40GB", 1555, 312),
    # as npu-smi (tests/fixtures/npu-smi/info-910b2c-narrow.txt) and torch.npu print them
    ("910B2C", 1600, 354), ("Ascend910B2", 1600, 354),
])
def test_a_cards_datasheet_is_found_by_the_name_its_driver_prints(name, memory, tflops):
    sheet = limits.datasheet(name)
    assert (sheet.memory_gb_s, sheet.tflops, sheet.device) == (memory, tflops, name)
    assert "datasheet" in sheet.source or "verl" in sheet.source


def test_the_recipes_figures_win_and_an_unknown_card_has_none():
    assert limits.datasheet("910B4-1") is None  # a variant the table does not know: no guessed figures
    assert limits.datasheet("NVIDIA GH200 480GB") is None  # not an H200: other memory
    assert limits.datasheet("Ascend910B4", tflops=280.0) is None  # one figure is not a roofline
    mine = limits.datasheet("Ascend910B4", memory_gb_s=800.0, tflops=280.0)
    assert (mine.memory_gb_s, mine.tflops) == (800.0, 280.0)
    assert mine.source == "the recipe's devices.peak_memory_gb_s, devices.peak_tflops"
    capped = limits.datasheet("NVIDIA H200", tflops=700.0)
    assert (capped.memory_gb_s, capped.tflops) == (4800, 700.0)
    assert capped.source == "NVIDIA H200 SXM datasheet and the recipe's devices.peak_tflops"


def test_the_cards_of_a_role_add_up_and_a_copy_moves_half_the_bandwidth():
    four = limits.from_datasheet(limits.datasheet("NVIDIA H200"), cards=4)
    assert four["read"]["median"] == 4 * 4800 and four["copy"]["median"] == 4 * 2400
    assert four["gemm"]["median"] == 4 * 989e3  # GFLOP/s, as the CPU's measured GEMM
    # a 7B bf16 policy, 64 sequences of 600 tokens on 4 H200s: memory-bound at 64 x 19.2 TB/s / bytes per step
    shape = limits.Shape(parameters=7_000_000_000, bytes_per_parameter=2, layers=28, kv_heads=4, head_dim=128,
                         in_flight=64, context=600.0)
    ceiling = limits.decode_ceiling(shape, four)
    assert ceiling["memory"] == pytest.approx(64 * 19.2e12 / (14e9 + 64 * shape.kv_bytes_per_token))
    assert ceiling["bound"] == "memory" and ceiling["compute"] == pytest.approx(4 * 989e12 / 14e9)


@pytest.mark.parametrize("overrides, platform, message", [
    (["devices.peak_tflops=100"], "cpu", "devices.peak_tflops=100.0 on the CPU"),
    (["devices.peak_memory_gb_s=0"], "cuda", "devices.peak_memory_gb_s=0.0: a card's peak must be above 0"),
])
def test_peaks_that_cannot_apply_are_refused_at_load(overrides, platform, message):
    name = "cpu-tiny" if platform == "cpu" else "cuda-2gpu"
    with pytest.raises(WorkbenchError, match=message):
        recipe.resolve(recipe.load(name, overrides), platform=platform)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=256))


def test_a_single_trainer_on_a_gpu_is_gauged_against_its_cards_datasheet(tmp_path, monkeypatch):
    """cuda-2gpu (server on card 0, trainer on card 1) on H200s: limits.json holds both roles' datasheet peaks, each
    step's gauge/* are those peaks' shares, and the dashboard's rows and the advisor say cards and datasheet."""
    from workbench.observe import advisor, rundata, views
    from workbench.records import append_jsonl
    from workbench.rundir import TrainDir
    from workbench.training.gauge import Gauge

    monkeypatch.setattr(limits, "device_name", lambda platform: {"cuda": "NVIDIA H200"}[platform])
    rr = recipe.resolve(recipe.load("cuda-2gpu"), platform="cuda")
    assert rr.trainer_processes == 1
    train = TrainDir(tmp_path / "train")
    train.path.mkdir(parents=True)
    model = _llama()
    gauge = Gauge.for_recipe(rr, train, model, in_flight=64)
    saved = json.loads(train.limits.read_text())["limits"]
    cards = {role: len(list(getattr(rr, role).devices)) for role in ("server", "trainer")}
    for role in ("server", "trainer"):
        assert saved[role] == limits.from_datasheet(limits.datasheet("NVIDIA H200"), cards[role])
        assert saved[role]["source"] == "NVIDIA H200 SXM datasheet"
    breakdown = {"rollout/tokens_per_second": 5000.0, "rollout/completion_tokens": 20000.0,
                 "time/optimisation": 2.0}
    got = gauge.metrics(breakdown)
    ceiling = limits.decode_ceiling(gauge.shape, saved["server"])["ceiling"]
    assert got["gauge/generation"] == pytest.approx(5000 / ceiling)
    assert got["gauge/optimisation"] == pytest.approx(
        6 * gauge.shape.parameters * 20000 / 2.0 / (989e12 * cards["trainer"]))

    for step in range(1, 4):
        append_jsonl(train.metrics, {"step": step, "time": 1e9 + step, "loss": 0.1, "time/step": 1.0,
                                     "time/rollout_wait": 0.6, "time/generation": 0.6, "gauge/generation": 0.1,
                                     "gauge/optimisation": 0.3})
    data = rundata.load(train)
    rows = dict(views.summary_rows(data))
    assert rows["generation, share of the server cards' decode ceiling"] == "10%"
    assert rows["optimisation, share of the trainer cards' dense bf16 peak"] == "30%"
    finding = advisor.far_from_limits(advisor.RunRecords(data.train_metrics, [], [], None, limits=data.limits))
    assert finding.title == "Rollouts wait on a server that decodes far below its cards' ceiling"
    assert "of the trainer cards' dense bf16 peak" in finding.evidence and "VLLM_CPU" not in finding.suggestion


def test_a_card_without_figures_has_no_gauge_and_says_how_to_give_them(tmp_path, monkeypatch):
    from workbench.rundir import TrainDir
    from workbench.training import gauge

    monkeypatch.setattr(limits, "device_name", lambda platform: "Ascend910B4")
    rr = recipe.resolve(recipe.load("cuda-2gpu"), platform="cuda")
    said = []
    assert gauge.role_limits(rr, {"trainer": [1]}, log=said.append) is None
    assert said == ["gauge: no datasheet figures for 'Ascend910B4' (platform/datasheets.yaml): no gauge/* metrics; "
                    "give the card's devices.peak_memory_gb_s and devices.peak_tflops in the recipe"]
    given = recipe.resolve(recipe.load("cuda-2gpu", ["devices.peak_memory_gb_s=800", "devices.peak_tflops=280"]),
                           platform="cuda")
    train = TrainDir(tmp_path / "train")
    train.path.mkdir(parents=True)
    assert gauge.Gauge.for_recipe(given, train, _llama(), in_flight=8).measured["trainer"]["gemm"]["median"] == 280e3


def test_the_bench_names_the_cards_and_their_datasheet():
    from workbench.experiments import bench

    sheet = limits.datasheet("NVIDIA H200")
    lim = {"server": limits.from_datasheet(sheet, 1), "trainer": limits.from_datasheet(sheet, 1),
           "both": limits.from_datasheet(sheet, 2)}
    shape = {"parameters": 1_500_000_000, "bytes_per_parameter": 2, "layers": 28, "kv_heads": 2, "head_dim": 128,
             "in_flight": 64, "context": 600.0}
    r = bench.PathResult(size="1.5b", path="server", steps=4, step_seconds=20.0, tokens_per_step=20000,
                         breakdown={"time/optimisation": 3.0}, generation_tokens_per_second=4000.0,
                         training_tokens_per_second=1000.0, staleness=0.0, sampler_cpu_percent=None, train_dir="")
    line = bench.Bench("cuda-2gpu", 4, 1, {"summary": "x"}, [r], sizes={"1.5b": {"shape": shape}},
                       limits=lim).gauge_line(r)
    assert "of the server cards' decode ceiling" in line
    assert "of the trainer cards' dense bf16 peak (989 TFLOPS, NVIDIA H200 SXM datasheet; completion" in line


def test_a_trainer_that_generates_itself_on_a_gpu_counts_only_its_own_cards(monkeypatch):
    """colocate on an accelerator: vLLM runs in the trainer process, which sees only the trainer's cards (its
    visible-devices variable); on the CPU the same process may use both roles' cores."""
    from workbench.experiments import bench
    from workbench.training import gauge

    monkeypatch.setattr(limits, "device_name", lambda platform: "NVIDIA H100 80GB HBM3")
    rr = recipe.resolve(recipe.load("cuda-2gpu", ["server.mode=colocate"]), platform="cuda")
    assert rr.recipe.server.in_process and gauge.training_cores(rr) == list(rr.trainer.devices) == [1]
    lim = bench._limits(rr)
    assert lim["both"] == lim["trainer"] == limits.from_datasheet(limits.datasheet("NVIDIA H100 80GB HBM3"), 1)
    cpu = recipe.resolve(recipe.load("cpu-tiny", ["server.mode=colocate"]), platform="cpu")
    assert gauge.training_cores(cpu) == [0, 1]
