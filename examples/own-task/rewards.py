"""A reward of one's own that reads a column of one's own data file (examples/own-task, docs/recipes.md).

TRL calls every reward function with the prompts, the completions and each column of the training rows as a
keyword argument, so the data file's `tolerance` column arrives here as `tolerance`: one value per completion.
"""
import re

ANSWER = re.compile(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>")


def near_miss(prompts, completions, answer, tolerance, **kwargs) -> list[float]:
    """Partial credit for a close answer: 1.0 at the gold answer, falling linearly to 0.0 at `tolerance` away
    (the row's own tolerance, wider for the problems that carry); 0.0 without an <answer> tag."""
    scores = []
    for completion, gold, width in zip(completions, answer, tolerance):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        found = ANSWER.search(text)
        if found is None:
            scores.append(0.0)
            continue
        miss = abs(float(found.group(1)) - float(gold))
        scores.append(max(0.0, 1.0 - miss / float(width)))
    return scores
