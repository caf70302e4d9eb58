import pytest

from workbench.tasks import rewards
from workbench.errors import WorkbenchError


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_correctness_scores_answer_tag_and_is_separate_from_format():
    completions = ["47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer>",  # right, well formed
                   "<answer>81</answer>",  # wrong, well formed
                   "the answer is 82",  # no answer: wrong, badly formed
                   "82 <answer>82</answer> and more text"]  # right, badly formed
    gold = ["82"] * 4
    assert rewards.score("correctness", completions, answer=gold) == [1.0, 0.0, 0.0, 1.0]
    assert rewards.score("format", completions) == [1.0, 1.0, 0.0, 0.0]


def test_chat_completions_and_none_without_gold():
    assert rewards.score("correctness", [chat("<answer>7</answer>")], answer=["7"]) == [1.0]
    assert rewards.score("correctness", [chat("<answer>7</answer>")], answer=[None]) == [None]
    assert rewards.score("correctness", ["<answer>7</answer>"]) == [None]


def test_unparseable_gold_cannot_be_scored():
    assert rewards.score("correctness", ["\\boxed{5}"], answer=["\\frac{"]) == [None]


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("#### 1,234", "1,234"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("nothing here", None),
])
def test_extract_answer(text, expected):
    assert rewards.extract_answer(text) == expected


def test_math_verify_equivalences():
    assert rewards.answers_match("0.5", "\\frac{1}{2}") is True
    assert rewards.answers_match("\\frac{1}{2}", "\\frac{2}{4}") is True
    assert rewards.answers_match("1234", "1,234") is True
    assert rewards.answers_match("12", "13") is False


def test_digits_gives_partial_credit_by_place_value():
    """A dropped carry (176 written 116) keeps two of three digits; a misplaced one (141 written 1410) none."""
    answers = ["<answer>176</answer>", "<answer>116</answer>", "<answer>76</answer>", "<answer>1760</answer>",
               "no answer", "<answer>-176</answer>", "<answer>176.5</answer>", "<answer>1,176</answer>"]
    got = rewards.score("digits", answers, answer=["176"] * len(answers))
    assert got == [1.0, 2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0, 0.75]
    assert rewards.score("digits", ["<answer>5</answer>"], answer=["1/2"]) == [None]  # not an integer gold
    assert rewards.score("digits", ["<answer>-9</answer>"], answer=["-19"]) == [0.5]


def test_registry_names_and_unknown_reward():
    assert rewards.get("correctness").__name__ == "correctness"
    assert rewards.get("format").__name__ == "format"
    with pytest.raises(WorkbenchError, match="unknown reward 'corectness'.*correctness"):
        rewards.get("corectness")


def test_a_reward_that_raises_or_returns_nan_stops_with_its_name_and_sample():
    from workbench.tasks.rewards import REGISTRY, RewardFailure, guarded, register

    @register("flaky_for_test")
    def flaky(prompts, completions, answer=None, **kwargs):
        return [1 / 0 if "7" in c else float("nan") if "9" in c else 1.0 for c in completions]

    try:
        checked = guarded("flaky_for_test")
        assert checked.__name__ == "flaky_for_test"  # TRL names the metric after it
        assert checked([None, None], ["1", "2"], answer=["1", "2"]) == [1.0, 1.0]
        prompt = [{"role": "user", "content": "What is 3 + 4?"}]
        with pytest.raises(RewardFailure, match=r"reward 'flaky_for_test' raised ZeroDivisionError.*sample 1: "
                                                r"prompt 'What is 3 \+ 4\?', completion '7'"):
            checked([prompt, prompt], ["1", "7"], answer=["7", "7"])
        with pytest.raises(RewardFailure, match=r"returned nan for sample 0.*completion '9'"):
            checked([prompt], ["9"], answer=["7"])
        assert guarded("correctness")([None], ["<answer>7</answer>"], answer=["7"]) == [1.0]
    finally:
        REGISTRY.pop("flaky_for_test", None)
