"""The tiny model: seeded builds, the cache, the shipped build (the same starting model on every machine) and the
tokenizer's chat template."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench import recipe, tinymodel
from workbench.errors import WorkbenchError

SMALL = ["model.tiny.pretrain_steps=8", "model.tiny.eval_size=8", "model.tiny.batch_size=8"]


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_build_is_deterministic_and_seeded(tmp_path):
    r = recipe.load("cpu-tiny", SMALL)
    a = tinymodel.ensure(r, root=tmp_path / "a", log=lambda *_: None)
    b = tinymodel.ensure(r, root=tmp_path / "b", log=lambda *_: None)
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
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written build left behind


def test_default_tiny_model_follows_format_but_is_often_wrong(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = tinymodel.info(tiny_model_dir)
    held = info["heldout"]
    assert held["n"] == 300
    assert 0.30 <= held["accuracy"] <= 0.70, held["accuracy"]  # room for GRPO either way
    assert held["format_rate"] >= 0.9
    assert 1.0e6 < info["parameters"] < 1.6e6
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
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


def _release():
    r = recipe.load("cpu-tiny")
    shipped = tinymodel.RELEASE_DIR / tinymodel.model_dir(r).name
    assert (shipped / tinymodel.CHECKSUMS).is_file(), "the default recipe's tiny model is not shipped"
    return r, shipped


def test_the_shipped_model_is_installed_whole_and_checked(tmp_path, monkeypatch):
    """The default recipe's model comes from the package (no build: the same weights on every CPU); a cached copy
    that differs (an earlier local build) is replaced; a shipped file that fails its checksum is refused in one
    line and leaves nothing behind."""
    r, shipped = _release()
    lines = []
    t0 = time.time()
    path = tinymodel.ensure(r, root=tmp_path, log=lines.append)
    assert time.time() - t0 < 5 and "installed from the release" in lines[-1]
    for name in (shipped / tinymodel.CHECKSUMS).read_text().split()[1::2]:
        assert (path / name).read_bytes() == (shipped / name).read_bytes()
    assert tinymodel.ensure(r, root=tmp_path, log=lines.append) == path and "reused" in lines[-1]

    (path / "model.safetensors").write_bytes(b"a local build")
    tinymodel.ensure(r, root=tmp_path, log=lines.append)
    assert "replacing" in lines[-2] and (path / "model.safetensors").read_bytes() == \
        (shipped / "model.safetensors").read_bytes()
    # the entry every stage uses (ensure_model) also replaces an earlier local build in the data directory
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path / "data"))
    rr = recipe.resolve(r)
    (tmp_path / "data").mkdir()
    shutil.copytree(path, rr.model_path)
    (Path(rr.model_path) / "model.safetensors").write_bytes(b"an earlier local build")
    assert tinymodel.ensure_model(rr, log=lines.append) == rr.model_path
    assert (Path(rr.model_path) / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()

    broken = tmp_path / "release"
    shutil.copytree(shipped, broken / shipped.name)
    with open(broken / shipped.name / "tokenizer.json", "a") as f:
        f.write(" ")
    monkeypatch.setattr(tinymodel, "RELEASE_DIR", broken)
    with pytest.raises(WorkbenchError, match="tokenizer.json .* does not match its checksum.*--force"):
        tinymodel.ensure(r, root=tmp_path / "fresh", log=lines.append)
    assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())


def test_the_shipped_model_scores_what_it_records_at_every_cpu_kernel_level(tiny_model_dir):
    """What a newcomer's demo starts from: the shipped weights score the recorded held-out accuracy in process
    under torch's portable kernels and under this CPU's own (avx2/avx512): builds follow the kernel level
    (training is chaotic), the scoring of one set of weights does not."""
    r, shipped = _release()
    assert tiny_model_dir.name == shipped.name  # the suite's own tiny model is the shipped one
    recorded = tinymodel.info(shipped)["heldout"]["accuracy"]
    script = ("import sys, json, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
              "from workbench import recipe, tinymodel; from workbench.tasks import arithmetic; "
              "d = recipe.load('cpu-tiny').data; "
              "rows = arithmetic.rows('heldout', seed=d.seed, heldout_size=d.heldout_size, "
              "validation_size=d.validation_size)[:300]; p = sys.argv[1]; "
              "out = tinymodel.greedy_accuracy(AutoModelForCausalLM.from_pretrained(p), "
              "AutoTokenizer.from_pretrained(p), rows); "
              "print(json.dumps([torch.backends.cpu.get_cpu_capability(), out['accuracy']]))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # torch's portable kernels, in a process of their own
    out = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    capability, portable = json.loads(out.stdout.strip().splitlines()[-1])
    assert capability == "DEFAULT"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.tasks import arithmetic

    d = r.data  # and this CPU's own kernels (avx2, avx512), in this process
    rows = arithmetic.rows("heldout", seed=d.seed, heldout_size=d.heldout_size, validation_size=d.validation_size)
    own = tinymodel.greedy_accuracy(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                    AutoTokenizer.from_pretrained(tiny_model_dir), rows[:300])["accuracy"]
    assert (portable, own) == (recorded, recorded), (torch.backends.cpu.get_cpu_capability(), portable, own)
