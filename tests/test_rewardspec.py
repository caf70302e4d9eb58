"""Rewards a recipe names as module:function with arguments and weights: parsed, imported and checked at load, probed
on training rows before training, bound and named for TRL. (The CLI's messages for bad specs are in bad_inputs.py;
a smoke run that trains with a reward from outside the package is in test_groups.py.)"""
from __future__ import annotations

import pytest

from workbench.errors import WorkbenchError
from workbench.tasks import rewardspec

MODULE = """
def brevity(prompts, completions, limit=10, **kwargs):
    return [max(0.0, 1.0 - len(c[-1]["content"]) / limit) for c in completions]

def positional_only(prompts, completions):
    return [0.0] * len(completions)

def needs_key(prompts, completions, key, **kwargs):
    return [0.0] * len(completions)

def nan_scores(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def one_short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)

NOT_A_FUNCTION = 3
"""
ROWS = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "id": "a"},
        {"prompt": [{"role": "user", "content": "What is 7 - 4?"}], "answer": "3", "id": "b"}]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory with a rewards module, as the working directory."""
    (tmp_path / "lab_rewards.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_required_parameter_is_a_column_of_the_rows_or_refused(project):
    """A parameter without a default may be a data column (TRL passes every column): the probe on the training rows
    decides, before training."""
    (spec,) = rewardspec.specs({"lab_rewards:needs_key": 1.0})
    row = {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2", "id": "r1"}
    rewardspec.probe(spec, [{**row, "key": "k"}])  # the column is there: called, and passes
    with pytest.raises(WorkbenchError, match=r"requires \['key'\], which is neither in its args nor a column of "
                                             r"the training rows \(they have: answer, id\)"):
        rewardspec.probe(spec, [row])


def test_forms_parse_to_names_weights_functions_and_args():
    specs = rewardspec.parse({"correctness": 1.0, "pkg.mod:brevity": 0.5,
                              "short": {"function": "pkg.mod:brevity", "weight": 0.2, "args": {"limit": 4}}})
    assert [(s.name, s.weight, s.function, s.args) for s in specs] == [
        ("correctness", 1.0, "correctness", {}), ("brevity", 0.5, "pkg.mod:brevity", {}),
        ("short", 0.2, "pkg.mod:brevity", {"limit": 4})]


def test_module_function_from_the_working_directory_is_bound_with_its_args(project):
    (spec,) = rewardspec.specs({"short": {"function": "lab_rewards:brevity", "weight": 0.2, "args": {"limit": 4}}})
    fn = spec.callable()
    assert fn.__name__ == "short"  # TRL logs rewards/short/mean
    completions = [[{"role": "assistant", "content": c}] for c in ("", "ab", "abcdef")]
    assert fn(prompts=[None] * 3, completions=completions, answer=["1"] * 3) == [1.0, 0.5, 0.0]


def test_a_file_path_works_from_anywhere(project, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    (spec,) = rewardspec.specs({f"{project / 'lab_rewards.py'}:brevity": 1.0})
    assert spec.callable()([None], [[{"role": "assistant", "content": "abcde"}]]) == [0.5]


@pytest.mark.parametrize("rewards, message", [
    ({"no_such_mod:fn": 1.0}, "cannot import module 'no_such_mod'"),
    ({"lab_rewards:missing": 1.0}, "lab_rewards has no 'missing'"),
    ({"lab_rewards:NOT_A_FUNCTION": 1.0}, "is a int, not a function"),
    ({"lab_rewards:positional_only": 1.0}, "does not have TRL's reward signature (no **kwargs)"),
    ({"x": {"function": "lab_rewards:brevity", "args": {"limt": 3}}}, "rewards.x.args has ['limt']"),
    ({"x": {"function": "lab_rewards:brevity", "wieght": 3}}, "unknown key(s) ['wieght']"),
    ({"x": {"function": "lab_rewards:brevity", "weight": "high"}}, "rewards.x.weight is 'high'"),
    ({"x": "lab_rewards:brevity"}, "expected a weight or a mapping"),
    ({"a:brevity": 1.0, "b:brevity": 1.0}, "would both log as rewards/brevity/mean"),
    ({"lenght": 1.0}, "unknown reward 'lenght'"),
    ({"missing_file.py:fn": 1.0}, "no file missing_file.py"),
])
def test_bad_specs_are_one_clear_error_each(project, rewards, message):
    found = rewardspec.problems(rewards)
    assert len(found) == 1 and message in str(found[0]), found
    assert found[0].fix  # every message says what to do


@pytest.mark.parametrize("name, message", [
    ("nan_scores", "returned nan"), ("one_short", "returned list of length 3 for 4 completions")])
def test_probe_rejects_a_bad_return_before_training(project, name, message):
    (spec,) = rewardspec.specs({f"lab_rewards:{name}": 1.0})
    with pytest.raises(WorkbenchError, match=message.replace("(", r"\(").replace("[", r"\[")):
        rewardspec.probe(spec, ROWS)


def test_probe_passes_good_rewards_and_the_builtins(project):
    for spec in rewardspec.specs({"correctness": 1.0, "format": 0.2, "lab_rewards:brevity": 0.1}):
        rewardspec.probe(spec, ROWS)


def test_recipe_load_reports_reward_problems_with_the_others(project):
    from workbench import recipe

    with pytest.raises(WorkbenchError) as info:
        recipe.load("smoke", ["rewards.lab_rewards:positional_only=0.1", "trainer.learning_rate=-1"])
    assert "reward signature" in str(info.value) and "learning_rate" in str(info.value)


def test_trainer_weights_follow_the_specs(project):
    from workbench import recipe
    from workbench.training.config import trainer_arguments

    r = recipe.load("smoke", ["rewards.short={function: lab_rewards:brevity, weight: 0.3, args: {limit: 5}}"])
    args = trainer_arguments(recipe.resolve(r, platform="cpu"), "/tmp/x")
    assert args["reward_weights"] == [1.0, 0.2, 0.3]


def test_an_edited_module_is_imported_afresh(project):
    """The reward lab is for iterating: a changed rewards module is what the next call uses, in the same process."""
    (first,) = rewardspec.specs({"lab_rewards:brevity": 1.0})
    assert first.callable()([None], [[{"role": "assistant", "content": "ab"}]]) == [0.8]
    (project / "lab_rewards.py").write_text(MODULE.replace("1.0 - len(", "1.0 - 2 * len("))
    (second,) = rewardspec.specs({"lab_rewards:brevity": 1.0})
    assert second.callable()([None], [[{"role": "assistant", "content": "ab"}]]) == [0.6]
