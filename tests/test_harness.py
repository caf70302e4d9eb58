"""The suite's own machinery (tests/harness.py): how `make test` spreads the tests over its workers."""
from __future__ import annotations

import pytest

from harness import group_by_shared


class _Item:
    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = ["tmp_path", *fixtures]
        self.marks: list = []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)

    @property
    def group(self) -> str | None:
        (mark,) = self.marks or [None]
        return mark.args[0] if mark is not None else None


def test_tests_sharing_an_expensive_fixture_run_on_one_worker():
    """A chain of sharing (one test uses A and B, another B and C) makes one group, named after its most used
    fixture; a fixture shared with no other stays its own group; cheap fixtures group nothing."""
    items = [_Item("run_a", "run_b"), _Item("run_b", "run_c"), _Item("run_b"), _Item("run_d"), _Item("run_d"),
             _Item(), _Item("cheap")]
    group_by_shared(items, {"run_a", "run_b", "run_c", "run_d", "run_e"})
    assert [i.group for i in items] == ["run_b", "run_b", "run_b", "run_d", "run_d", None, None]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_group_names_do_not_follow_the_collection_order(order):
    """Every worker collects the same tests, but a group's name must not depend on which test came first."""
    pair = [_Item("run_c", "run_a"), _Item("run_b")]  # a tie: each fixture used by one test
    items = [pair[i] for i in order]
    group_by_shared(items, {"run_a", "run_b", "run_c"})
    assert pair[0].group == "run_a" and pair[1].group == "run_b"
