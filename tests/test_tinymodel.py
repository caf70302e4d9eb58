import json
import time

import pytest
import torch
from safetensors.torch import load_file

from workbench import recipe, tinymodel
from workbench.errors import WorkbenchError

SMALL = ["model.tiny.pretrain_steps=8", "model.tiny.eval_size=8", "model.tiny.batch_size=8"]


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_build_is_the_same_whatever_the_callers_kernels_and_threads(tmp_path, monkeypatch):
    """The build runs pinned (tinymodel.PINNED_ENV): a caller with other torch kernels, threads and MKL path gets
    the same weights and tokenizer; a digest that differs from the reference is said, not hidden."""
    r = recipe.load("cpu-tiny", SMALL)
    key = tinymodel.model_dir(r).name
    lines: list[str] = []
    monkeypatch.setitem(tinymodel.REFERENCE, key, {"weights_sha256": "0" * 64, "heldout_accuracy": 0.5,
                                                   "torch": "x"})
    a = tinymodel.ensure(r, root=tmp_path / "a", log=lines.append)
    assert tinymodel.info(a)["reference"]["matches"] is False
    assert any(line.startswith("warning: these weights differ from the reference build") for line in lines), lines
    for name, value in {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                        "MKL_CBWR": "AUTO", "GLIBC_TUNABLES": ""}.items():
        monkeypatch.setenv(name, value)  # unpinned, these two builds differ (avx2 vs default kernels)
    monkeypatch.setitem(tinymodel.REFERENCE, key, {"weights_sha256": tinymodel.info(a)["weights_sha256"],
                                                   "heldout_accuracy": 0.5, "torch": "x"})
    lines.clear()
    b = tinymodel.ensure(r, root=tmp_path / "b", log=lines.append)
    assert tinymodel.info(b)["reference"]["matches"] is True and not [x for x in lines if "warning" in x]
    assert tinymodel.info(b)["pinned"] == tinymodel.PINNED_ENV
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    other = tinymodel.ensure(recipe.load("cpu-tiny", SMALL + ["model.tiny.seed=1"]), root=tmp_path / "a",
                             log=lambda *_: None)
    assert other != a
    assert not torch.equal(_weights(other)["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])


def test_same_settings_reuse_the_cache(tmp_path):
    r = recipe.load("cpu-tiny", SMALL)
    path = tinymodel.ensure(r, root=tmp_path, log=lambda *_: None)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    lines = []
    t0 = time.time()
    assert tinymodel.ensure(r, root=tmp_path, log=lines.append) == path
    assert time.time() - t0 < 2
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert "reused" in lines[0]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no half-written build left behind


def test_two_processes_asking_at_once_build_once(tmp_path):
    """Two processes that need the same tiny model at the same time (two notebooks, two test workers): one builds
    it, the other waits and reuses that build (a second build would replace the directory under the first one's
    readers)."""
    import subprocess
    import sys

    code = ("import sys; from workbench import recipe, tinymodel; "
            f"tinymodel.ensure(recipe.load('cpu-tiny', {SMALL!r}), root=__import__('pathlib').Path(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted("building" if "building tiny model" in out else "reused" if "tiny model reused" in out else out
                  for out in outs)
    assert said == ["building", "reused"], outs
    (built,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert tinymodel.info(built)["weights_sha256"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_default_tiny_model_follows_format_but_is_often_wrong(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = tinymodel.info(tiny_model_dir)
    held = info["heldout"]
    assert held["n"] == 300
    assert 0.30 <= held["accuracy"] <= 0.70, held["accuracy"]  # room for GRPO either way
    assert held["format_rate"] >= 0.9
    assert 1.0e6 < info["parameters"] < 1.6e6
    assert info["seconds"]["total"] < 300  # one thread, beside the weaker build: 141 s on the 2-core box
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # the weights of the recorded reference build of these settings (tinymodel.REFERENCE; CI builds on its own CPU): the
    # base every machine's demo starts from
    reference = tinymodel.REFERENCE[tiny_model_dir.name]
    assert tinymodel.weights_digest(model) == reference["weights_sha256"]
    assert held["accuracy"] == pytest.approx(reference["heldout_accuracy"], abs=5e-4)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    # digits are single tokens, so the model can see carries
    assert tok.tokenize("4567") == ["4", "5", "6", "7"]


def test_resolved_model_path_and_errors(tmp_path, tiny_model_dir, cpu_recipe):
    rr = recipe.resolve(cpu_recipe)
    assert rr.is_tiny and rr.model_path == str(tiny_model_dir)
    assert tinymodel.ensure_model(rr, log=lambda *_: None) == str(tiny_model_dir)  # cached: nothing built
    with pytest.raises(WorkbenchError, match="does not exist.*model.path"):
        recipe.resolve(recipe.load("cpu-tiny", ["model.path=/nowhere/model"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkbenchError, match="has no config.json"):
        recipe.resolve(recipe.load("cpu-tiny", [f"model.path={tmp_path / 'empty'}"]))
    # a hub id is passed through for the loaders to fetch
    hub = recipe.resolve(recipe.load("cpu-tiny", ["model.path=Qwen/Qwen2.5-0.5B"]))
    assert hub.model_path == "Qwen/Qwen2.5-0.5B" and not hub.is_tiny
    assert tinymodel.ensure_model(hub) == "Qwen/Qwen2.5-0.5B"


def test_ensure_model_builds_a_missing_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    rr = recipe.resolve(recipe.load("cpu-tiny", SMALL))
    assert rr.model_path == str(tmp_path / "tiny-model" / tinymodel.model_dir(rr.recipe).name)
    assert not (tmp_path / "tiny-model").exists()  # resolving does not build
    assert tinymodel.ensure_model(rr, log=lambda *_: None) == rr.model_path
    assert tinymodel.info(rr.model_path)["heldout"]["n"] == 8


def test_tokenizer_without_chat_template_is_refused(tmp_path, tiny_model_dir):
    import shutil

    copy = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    for extra in copy.glob("chat_template.*"):
        extra.unlink()
    tinymodel.check_tokenizer(str(tiny_model_dir))
    with pytest.raises(WorkbenchError, match="no chat template"):
        tinymodel.check_tokenizer(str(copy))


def test_the_cache_key_follows_the_builders_code_not_its_comments():
    """A change to how the tiny model is built (its builders, its data) is another model: a new cache key, never
    the old model handed back. A comment or docstring edit, or code outside the build, keeps the key."""
    import importlib

    resolve = importlib.import_module("workbench.recipe.resolve")  # the module (the package exports its function)
    from workbench import paths

    source = (paths.PACKAGE / "tinymodel.py").read_text()
    data = (paths.PACKAGE / "tasks" / "arithmetic.py").read_text()
    now = resolve.builder_digest()
    assert resolve.builder_digest({"tinymodel.py": source, "tasks/arithmetic.py": data}) == now
    assert "def build_model(tokenizer, tiny: TinyModelConfig):" in source
    changed = source.replace("def build_model(tokenizer, tiny: TinyModelConfig):",
                             "def build_model(tokenizer, tiny: TinyModelConfig):\n    tiny = tiny", 1)
    assert resolve.builder_digest({"tinymodel.py": changed}) != now
    assert resolve.builder_digest({"tasks/arithmetic.py": data + "\nEXTRA = 1\n"}) != now  # the data's module too
    commented = source.replace("def build_model(tokenizer, tiny: TinyModelConfig):",
                               "# a comment\ndef build_model(tokenizer, tiny: TinyModelConfig):\n    \"\"\"A docstring.\"\"\"", 1)
    assert resolve.builder_digest({"tinymodel.py": commented}) == now
    outside = source.replace("def info(path: Path) -> dict:", "def info(path: Path) -> dict:\n    path = path", 1)
    assert outside != source and resolve.builder_digest({"tinymodel.py": outside}) == now
    # and the key carries it: the same settings under other builders are another directory
    from workbench.recipe.schema import TinyModelConfig

    key = resolve.settings_key(TinyModelConfig(), 0, 300, 300)
    resolve._installed_builder_digest.cache_clear()
    real = resolve._installed_builder_digest
    try:
        resolve._installed_builder_digest = lambda: resolve.builder_digest({"tinymodel.py": changed})
        assert resolve.settings_key(TinyModelConfig(), 0, 300, 300) != key
    finally:
        resolve._installed_builder_digest = real
