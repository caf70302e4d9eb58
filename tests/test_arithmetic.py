import re

import pytest

from workbench.tasks import arithmetic
from workbench.errors import WorkbenchError


def test_splits_are_disjoint_complete_and_seeded():
    parts = arithmetic.splits(seed=0, heldout_size=300, validation_size=200)
    train, validation, heldout = parts["train"], parts["validation"], parts["heldout"]
    key = lambda p: (p.a, p.op, p.b)  # noqa: E731
    assert len(heldout) == 300 and len(validation) == 200
    assert len(train) + len(validation) + len(heldout) == len(arithmetic.all_triples()) == 12195
    keys = [{key(p) for p in part} for part in (train, validation, heldout)]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    again = arithmetic.splits(seed=0, heldout_size=300, validation_size=200)
    assert again["heldout"] == heldout and again["validation"] == validation and again["train"][:50] == train[:50]
    # the test split does not move when the validation split is resized (or turned off)
    assert arithmetic.splits(seed=0, heldout_size=300, validation_size=0)["heldout"] == heldout
    other = arithmetic.splits(seed=1, heldout_size=300)["heldout"]
    assert [key(p) for p in other] != [key(p) for p in heldout]


@pytest.mark.parametrize("seed", [0, 7])
def test_working_line_is_correct_arithmetic_for_every_problem(seed):
    parts = arithmetic.splits(seed=seed)
    for p in parts["train"] + parts["validation"] + parts["heldout"]:
        assert p.op == "+" or p.a >= p.b
        text = p.working
        assert text.endswith(f"<answer>{p.result}</answer>")
        # every "x+y=z" / "x-y-1=z" step in the working line is true
        for expr, value in re.findall(r"([\d+\-]+)=(\d+)", text):
            assert eval(expr) == int(value), (text, expr)  # noqa: S307 (digits and +/- only)
        assert str(p.a) in p.question and str(p.b) in p.question


def test_rows_have_the_common_columns_and_all_phrasings():
    rows = arithmetic.rows("train", limit=300)
    assert {"prompt", "answer", "id", "source", "target"} <= set(rows[0])
    assert rows[0]["prompt"][-1]["role"] == "user"
    assert len({r["id"] for r in rows}) == len(rows)
    used = {next(i for i, t in enumerate(arithmetic.PHRASINGS) if t.split("{")[0] in r["prompt"][0]["content"])
            for r in rows}
    assert used == {0, 1, 2}


def test_bad_split_and_size():
    with pytest.raises(WorkbenchError, match="train, validation, heldout"):
        arithmetic.rows("test")
    with pytest.raises(WorkbenchError, match="heldout_size"):
        arithmetic.splits(heldout_size=0)
    with pytest.raises(WorkbenchError, match="validation_size=12000.*leaves no training"):
        arithmetic.splits(heldout_size=300, validation_size=12000)
    with pytest.raises(WorkbenchError, match="validation split is empty.*data.validation_size"):
        arithmetic.rows("validation", validation_size=0)
