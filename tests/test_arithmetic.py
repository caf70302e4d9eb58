import re

import pytest

from workbench.tasks import arithmetic
from workbench.errors import WorkbenchError


def test_splits_are_disjoint_complete_and_seeded():
    train, heldout = arithmetic.splits(seed=0, heldout_size=300)
    key = lambda p: (p.a, p.op, p.b)  # noqa: E731
    assert len(heldout) == 300
    assert len(train) + len(heldout) == len(arithmetic.all_triples()) == 12195
    assert not {key(p) for p in train} & {key(p) for p in heldout}
    again_train, again_heldout = arithmetic.splits(seed=0, heldout_size=300)
    assert again_heldout == heldout and again_train[:50] == train[:50]
    _, other = arithmetic.splits(seed=1, heldout_size=300)
    assert [key(p) for p in other] != [key(p) for p in heldout]


@pytest.mark.parametrize("seed", [0, 7])
def test_working_line_is_correct_arithmetic_for_every_problem(seed):
    train, heldout = arithmetic.splits(seed=seed)
    for p in train + heldout:
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
    with pytest.raises(WorkbenchError, match="train.*heldout"):
        arithmetic.rows("validation")
    with pytest.raises(WorkbenchError, match="heldout_size"):
        arithmetic.splits(heldout_size=0)
