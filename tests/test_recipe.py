import dataclasses

import pytest
import yaml

from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.recipe import trl_fields
from workbench.training import config as training_config


def grpo_config(r, output_dir, platform=None):
    """The real trl.GRPOConfig for a loaded recipe, resolved (on `platform` when given, else the recipe's own)."""
    return training_config.grpo_config(recipe.resolve(r, platform=platform), output_dir)


@pytest.mark.parametrize("name", ["cpu-tiny", "cpu-tiny-async", "smoke", "ascend-910b-8card"])
def test_shipped_recipes_load_and_build_a_real_grpo_config(name, tmp_path):
    from trl import GRPOConfig

    r = recipe.load(name)
    assert r.name == name and r.description
    config = grpo_config(r, str(tmp_path))
    assert isinstance(config, GRPOConfig)
    assert config.use_vllm and config.vllm_mode == "server"
    assert config.vllm_server_base_url == f"http://127.0.0.1:{r.server.port}"
    assert config.reward_weights == [1.0, 0.2]


def test_ascend_recipe_is_the_field_configuration(tmp_path):
    r = recipe.load("ascend-910b-8card")
    assert r.devices.platform == "npu"
    assert r.devices.server == [0, 1, 2, 3] and r.devices.trainer == [4, 5, 6, 7]
    assert r.server.tensor_parallel_size == 4 and r.server.max_model_len == 1024
    assert r.devices.env["HCCL_CONNECT_TIMEOUT"] == "1800"
    config = grpo_config(r, str(tmp_path))
    assert (config.learning_rate, config.beta, config.num_generations, config.max_completion_length) == (1e-6, 0.01, 4, 512)
    assert config.bf16 and not config.use_cpu and config.gradient_checkpointing
    assert config.per_device_train_batch_size == 2 and config.gradient_accumulation_steps == 4


def test_smoke_extends_cpu_tiny():
    smoke, base = recipe.load("smoke"), recipe.load("cpu-tiny")
    assert smoke.data.train_size == 16 and smoke.trainer["num_generations"] == 2 and smoke.trainer["max_steps"] == 3
    assert smoke.server == base.server and smoke.rewards == base.rewards and smoke.model == base.model
    # keys the child does not set are inherited
    assert smoke.trainer["learning_rate"] == base.trainer["learning_rate"]


def test_cpu_platform_turns_off_bf16(tmp_path):
    config = grpo_config(recipe.load("cpu-tiny"), str(tmp_path), platform="cpu")
    assert config.use_cpu and not config.bf16


def test_overrides_from_cli_words_and_papermill_dict():
    r = recipe.load("cpu-tiny", ["trainer.learning_rate=5e-6", "server.port=8011", "devices.server=[1]",
                                 "data.instruction=Answer with digits"])
    assert r.trainer["learning_rate"] == 5e-6 and r.server.port == 8011 and r.devices.server == [1]
    assert r.data.instruction == "Answer with digits"
    r2 = recipe.load("cpu-tiny", {"trainer.beta": 0.0, "model.tiny.pretrain_steps": 10})
    assert r2.trainer["beta"] == 0.0 and r2.model.tiny.pretrain_steps == 10


def test_recipe_from_a_yaml_path_round_trips(tmp_path):
    r = recipe.load("smoke")
    path = tmp_path / "mine.yaml"
    path.write_text(r.to_yaml())
    again = recipe.load(str(path))
    assert dataclasses.replace(again, name=r.name) == r
    assert yaml.safe_load(r.to_yaml())["trainer"]["num_generations"] == 2


@pytest.mark.parametrize("override,pattern", [
    ("trainer.learnig_rate=1e-5", r"unknown recipe key 'trainer.learnig_rate'.*did you mean 'learning_rate'"),
    ("server.prot=8001", r"unknown recipe key 'server.prot'.*did you mean 'port'"),
    ("sever.port=8001", r"unknown recipe section 'sever'.*did you mean 'server'"),
    ("server.port=eighty", r"server.port is 'eighty' \(str\), expected int"),
    ("server.enforce_eager=1", r"server.enforce_eager is 1 \(int\), expected bool"),
    ("devices.server=0", r"devices.server is 0 \(int\), expected list"),
    ("server.max_model_len=100", r"max_model_len=100 is smaller than .*64.*48.* = 112.*at least 112"),
    ("trainer.use_vllm=false", r"trainer.use_vllm is derived.*server.mode"),
    ("trainer.output_dir=/tmp/x", r"trainer.output_dir is derived"),
    ("rewards.lenght=0.1", r"unknown reward 'lenght'"),
    ("server.weight_sync=gloo", r"server.weight_sync is 'gloo'.*reload"),
    ("server.mode=attach", r"server.url is not set"),
    ("trainer.num_generations=3", r"GRPOConfig rejects"),
])
def test_bad_input_is_one_clear_line(override, pattern):
    with pytest.raises(WorkbenchError, match=pattern) as info:
        r = recipe.load("cpu-tiny", [override])
        grpo_config(r, "/tmp/unused", platform="cpu")
    message = str(info.value)
    assert "\n" not in message and "fix:" in message


def test_trainer_keys_are_read_from_trl_source_without_importing_it():
    import subprocess
    import sys

    # recipe.load checks trainer keys against TRL's source (ast), so loading a recipe never imports TRL/torch
    code = ("import sys; from workbench import recipe; recipe.load('cpu-tiny', ['trainer.beta=0.0']); "
            "print(sorted(m for m in ('trl', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    # and the names read from source are exactly the real GRPOConfig's fields
    from trl import GRPOConfig

    assert trl_fields.names() == {f.name for f in dataclasses.fields(GRPOConfig)}
    assert trl_fields.default("num_generations") == GRPOConfig.__dataclass_fields__["num_generations"].default


def test_missing_recipe_lists_available():
    with pytest.raises(WorkbenchError, match="'nope' does not exist.*ascend-910b-8card, ascend-910b-8card-rm, cpu-tiny, cpu-tiny-async, cpu-tiny-rm, "
                       "cuda-1gpu, cuda-2gpu, cuda-2gpu-rm, cuda-8gpu, smoke"):
        recipe.load("nope")


def test_overlapping_accelerator_devices_are_refused():
    from workbench.training.train import check_device_split

    # the recipe loads (the server node of a two-node run may serve with it); starting both on one node is refused
    overlapping = recipe.load("ascend-910b-8card", ["devices.trainer=[3,4,5,6]"])
    shared = r"devices.server \[0, 1, 2, 3\] and devices.trainer \[3, 4, 5, 6\] share card\(s\) \[3\]"
    with pytest.raises(WorkbenchError, match=shared) as info:
        check_device_split(recipe.resolve(overlapping))
    assert "\n" not in str(info.value) and "fix:" in str(info.value)
    check_device_split(recipe.resolve(recipe.load("ascend-910b-8card")))  # the shipped split is disjoint
    with pytest.raises(WorkbenchError, match="multiply to the number of server devices"):
        recipe.load("ascend-910b-8card", ["server.tensor_parallel_size=2"])


def test_invalid_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(WorkbenchError, match="not valid YAML"):
        recipe.load(str(bad))


def test_yes_no_stay_strings_true_false_are_booleans(tmp_path):
    r = recipe.load("cpu-tiny", ["trainer.save_strategy=no", "server.enforce_eager=true"])
    assert r.trainer["save_strategy"] == "no" and r.server.enforce_eager is True
    path = tmp_path / "r.yaml"
    path.write_text("extends: smoke\ntrainer:\n  save_strategy: no\n  bf16: false\n")
    loaded = recipe.load(str(path))
    assert loaded.trainer["save_strategy"] == "no" and loaded.trainer["bf16"] is False
    assert grpo_config(loaded, str(tmp_path), platform="cpu").save_strategy == "no"
