"""The default task: two-digit addition and subtraction, asked in plain words, answered with a working line.

Every problem is a triple (a, op, b) with 10 <= a, b <= 99 and a >= b for subtraction: 12,195 in all. A seeded
permutation of that finite set puts the first `heldout_size` triples in the held-out (test) split, the next
`validation_size` in the validation split and the rest in train, so no two splits can share a problem, whatever
the phrasing. The phrasing is drawn per problem from the same seed. Train is all that GRPO and the tiny model's
pre-training ever see; validation is for choosing settings (`workbench protocol`); the held-out split is what a
result is reported on, once the settings are chosen.

The target spells the digit-by-digit working before the answer, which is what lets a 1M-parameter model learn it:

    47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer>
    82 - 35: 12-5=7, 8-1-3=4. <answer>47</answer>

Rows have the columns every workbench dataset has: `prompt` (chat messages), `answer` (gold string), `id`,
`source`; arithmetic rows also carry `target` (the full worked completion, for pre-training the tiny model) and
the problem's categories (CATEGORIES), for the evaluation analysis's breakdowns (workbench.evaluation.analysis):
`operation` ("addition" | "subtraction"), `carry` (True when the units column needs a carry, or a borrow for
subtraction: the "+1" / "-1" step of the working line) and `phrasing` (which template worded it, PHRASING_NAMES).
They are read off the problem after it is drawn, so the problems, their text and their answers for a seed are the
same as without them.

    python -m workbench.arithmetic          # prints a few rows of each split
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from workbench.errors import WorkbenchError

PHRASINGS = (
    "What is {a} {op} {b}?",
    "Tom has {a} apples and {verb} {b}. How many apples does he have now?",
    "A shelf holds {a} books and {b} books are {moved}. How many books are on the shelf?",
)
_VERBS = {"+": ("buys", "added"), "-": ("gives away", "taken off")}
PHRASING_NAMES = ("bare", "apples", "books")  # one short name per template in PHRASINGS, same order
CATEGORIES = ("operation", "carry", "phrasing")  # the category columns of every row


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int
    phrasing: int

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        verb, moved = _VERBS[self.op]
        return PHRASINGS[self.phrasing].format(a=self.a, op=self.op, b=self.b, verb=verb, moved=moved)

    @property
    def needs_carry(self) -> bool:
        """Whether the units column carries into the tens (addition) or borrows from them (subtraction)."""
        a0, b0 = self.a % 10, self.b % 10
        return a0 + b0 >= 10 if self.op == "+" else a0 < b0

    @property
    def categories(self) -> dict:
        """The problem's category columns (CATEGORIES), as its rows carry them."""
        return {"operation": "addition" if self.op == "+" else "subtraction", "carry": self.needs_carry,
                "phrasing": PHRASING_NAMES[self.phrasing]}

    @property
    def working(self) -> str:
        """The digit-by-digit working line, ending with the tagged answer."""
        a1, a0, b1, b0 = self.a // 10, self.a % 10, self.b // 10, self.b % 10
        if self.op == "+":
            units = a0 + b0
            carry = units // 10
            tens = a1 + b1 + carry
            tens_expr = f"{a1}+{b1}+1" if carry else f"{a1}+{b1}"
            steps = f"{a0}+{b0}={units}, {tens_expr}={tens}"
        else:
            borrow = a0 < b0
            units = a0 + 10 * borrow - b0
            tens = a1 - borrow - b1
            units_expr = f"{a0 + 10}-{b0}" if borrow else f"{a0}-{b0}"
            tens_expr = f"{a1}-1-{b1}" if borrow else f"{a1}-{b1}"
            steps = f"{units_expr}={units}, {tens_expr}={tens}"
        return f"{self.a} {self.op} {self.b}: {steps}. <answer>{self.result}</answer>"

    def row(self, split: str) -> dict:
        return {
            "prompt": [{"role": "user", "content": self.question}],
            "answer": str(self.result),
            "target": self.working,
            "id": f"arith-{split}-{self.a}{'p' if self.op == '+' else 'm'}{self.b}",
            "source": "arithmetic",
            **self.categories,
        }


def all_triples() -> list[tuple[int, str, int]]:
    triples = [(a, "+", b) for a in range(10, 100) for b in range(10, 100)]
    triples += [(a, "-", b) for a in range(10, 100) for b in range(10, a + 1)]
    return triples


SPLITS = ("train", "validation", "heldout")


def splits(seed: int = 0, heldout_size: int = 300, validation_size: int = 300) -> dict[str, list[Problem]]:
    """The problems of each split (SPLITS); disjoint by construction, identical for the same arguments. A held-out
    split of the same seed and size is the same whatever the validation size."""
    triples = all_triples()
    if not 0 < heldout_size < len(triples):
        raise WorkbenchError(f"heldout_size={heldout_size} is outside 1..{len(triples) - 1}",
                             "choose a held-out size smaller than the 12,195 possible problems")
    if validation_size < 0 or heldout_size + validation_size >= len(triples):
        raise WorkbenchError(f"validation_size={validation_size} with heldout_size={heldout_size} leaves no "
                             f"training problems of the {len(triples)}",
                             "choose a validation size of 0 or more whose sum with the held-out size is under 12,195")
    rng = random.Random(seed)
    rng.shuffle(triples)
    problems = [Problem(a, op, b, rng.randrange(len(PHRASINGS))) for a, op, b in triples]
    cut = heldout_size + validation_size
    return {"train": problems[cut:], "validation": problems[heldout_size:cut], "heldout": problems[:heldout_size]}


def rows(split: str, seed: int = 0, heldout_size: int = 300, limit: int | None = None,
         validation_size: int = 300) -> list[dict]:
    """Rows of one split (SPLITS), in the split's seeded order."""
    if split not in SPLITS:
        raise WorkbenchError(f"unknown arithmetic split {split!r}", f"use one of: {', '.join(SPLITS)}")
    chosen = splits(seed, heldout_size, validation_size)[split]
    if not chosen:
        raise WorkbenchError(f"the arithmetic {split} split is empty (data.validation_size=0)",
                             "set data.validation_size to the number of problems to keep for choosing settings")
    return [p.row(split) for p in chosen[:limit]]


if __name__ == "__main__":
    for split in SPLITS:
        for r in rows(split, limit=3):
            print(split, r["prompt"][0]["content"], "->", r["target"])
