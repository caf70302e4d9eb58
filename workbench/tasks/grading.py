"""Grading answers: the extracted final answer of each response against the gold one, with a wall-clock bound.

    from workbench.tasks import grading
    grading.grade(["42", "\\frac{1}{2}"], ["... <answer>42</answer>", "... \\boxed{0.5}"])  # [("42", True), ("0.5", True)]

Used by the evaluation and the offline generation check. Plain numbers are compared inline; anything math-verify
must parse runs in a worker process that is killed when it overruns, so a pathological answer can neither hang
the caller nor leave a process behind.
"""
from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout

from workbench.tasks import rewards


def _match_in_child(gold: str, predicted: str) -> bool | None:
    return rewards.answers_match(gold, predicted)


def grade(golds: list[str], responses: list[str], timeout: float = 5.0) -> list[tuple[str | None, bool | None]]:
    """(extracted answer, correct) per response. Plain numbers are compared inline; anything math-verify must
    parse runs in a worker process with a wall-clock timeout, which works whatever thread calls this (math-verify's
    own timeouts need the main thread). A timeout or an unparseable gold gives None: cannot score."""
    extracted = [rewards.extract_answer(r) for r in responses]
    results: list[bool | None] = [None] * len(golds)
    slow = []
    for i, (gold, pred) in enumerate(zip(golds, extracted)):
        if pred is None:
            results[i] = False
        elif rewards.as_number(gold) is not None and rewards.as_number(pred) is not None:
            results[i] = rewards.answers_match(gold, pred)
        else:
            slow.append(i)
    if slow:
        pool = ProcessPoolExecutor(max_workers=2)
        overran = False
        try:
            futures = {i: pool.submit(_match_in_child, golds[i], extracted[i]) for i in slow}
            for i, future in futures.items():
                try:
                    results[i] = future.result(timeout=timeout)
                except FutureTimeout:
                    results[i] = None
                    overran = True
        finally:
            if overran:  # a worker stuck in a parse never returns: end it rather than wait on it
                for process in list(getattr(pool, "_processes", {}).values()):
                    process.kill()
            pool.shutdown(wait=True, cancel_futures=True)
    return list(zip(extracted, results))
