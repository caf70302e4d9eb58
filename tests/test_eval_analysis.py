"""Base vs trained per problem (workbench/evaluation/analysis.py): the counting rules on hand-built evaluations,
the arithmetic categories, the recipe key, the saved file and the report section, and the counts of a real
evaluation of two models through the server matching its summaries."""
import json
import re

import pytest

from workbench import recipe
from workbench.errors import WorkbenchError
from workbench.evaluation import analysis
from workbench.evaluation.evaluate import Evaluation, Sample, Summary
from workbench.rundir import RunDir
from workbench.tasks import arithmetic
from workbench.tasks.task import Task


# --- the arithmetic categories -------------------------------------------------------------------------------

@pytest.mark.parametrize("a,op,b,carry", [
    (47, "+", 35, True),    # 7+5=12: carry
    (42, "+", 35, False),   # 2+5=7
    (55, "+", 62, False),   # 5+2=7; the tens overflow (117) is not a units carry
    (15, "+", 15, True),    # 5+5=10 exactly
    (82, "-", 35, True),    # 2<5: borrow
    (87, "-", 35, False),
    (30, "-", 10, False),   # 0-0
    (31, "-", 19, True),
    (44, "-", 44, False),
])
def test_carry_and_borrow_on_known_problems(a, op, b, carry):
    problem = arithmetic.Problem(a, op, b, 0)
    assert problem.needs_carry is carry
    assert problem.categories == {"operation": "addition" if op == "+" else "subtraction", "carry": carry,
                                  "phrasing": "bare"}


def test_carry_agrees_with_the_working_line_for_every_problem():
    """The working line spells a carry as a third term in the tens step (4+3+1, 8-1-3): the flag says the same."""
    for p in [p for part in arithmetic.splits(seed=0).values() for p in part]:
        tens_step = p.working.split(", ")[1].split("=")[0]
        assert (len(re.split(r"[+-]", tens_step)) == 3) is p.needs_carry, p.working


def test_rows_carry_their_categories_without_changing_the_problems():
    rows = arithmetic.rows("heldout", seed=0)
    # the first held-out problem for seed 0, as before the categories were added (cached tiny models rely on it)
    assert rows[0]["id"] == "arith-heldout-33p47" and rows[0]["answer"] == "80"
    assert rows[0]["prompt"] == [{"role": "user", "content": "Tom has 33 apples and buys 47. How many apples does "
                                                             "he have now?"}]
    assert {r["phrasing"] for r in rows} == set(arithmetic.PHRASING_NAMES)
    for r in rows:
        assert set(arithmetic.CATEGORIES) <= set(r)
        assert r["operation"] == ("addition" if "p" in r["id"].rsplit("-", 1)[1] else "subtraction")
        template = arithmetic.PHRASINGS[arithmetic.PHRASING_NAMES.index(r["phrasing"])]
        assert r["prompt"][0]["content"].startswith(template.split("{")[0])
        assert isinstance(r["carry"], bool)
    # the recipe path (eval rows) keeps them
    tiny = recipe.load("cpu-tiny")
    assert Task.build(tiny).eval_rows(tiny.eval)[0]["carry"] is True  # 33 + 47: 3+7=10


# --- the counting rules on hand-built evaluations ------------------------------------------------------------

def _evaluation(right: dict[str, dict[str, list]], tokens: int = 30) -> Evaluation:
    """right: label -> problem id -> per-repeat correctness (True / False / None for an errored sample), in the
    arithmetic held-out ids so that the categories resolve. Summaries computed the way evaluate_server does."""
    rows = {r["id"]: r for r in arithmetic.rows("heldout", seed=0, limit=40)}
    samples, summaries = [], []
    for label, problems in right.items():
        repeats = len(next(iter(problems.values())))
        per_repeat = []
        for repeat in range(repeats):
            for pid, marks in problems.items():
                samples.append(Sample(label, repeat, pid, rows[pid]["prompt"][-1]["content"], rows[pid]["answer"],
                                      response=f"{label} answer {repeat}", correct=marks[repeat],
                                      completion_tokens=tokens, finish_reason="stop",
                                      error="boom" if marks[repeat] is None else None))
            per_repeat.append(sum(bool(m[repeat]) for m in problems.values()) / len(problems))
        summaries.append(Summary(label, "", len(problems), repeats, accuracy_per_repeat=per_repeat,
                                 accuracy_mean=sum(per_repeat) / repeats))
    return Evaluation(summaries, samples)


IDS = [r["id"] for r in arithmetic.rows("heldout", seed=0, limit=40)]
TINY = recipe.load("cpu-tiny", ["eval.num_samples=40"])


def test_one_repeat_counts_are_whole_problems_and_match_the_summaries():
    base = [True, True, False, False, True, False, None, True]
    trained = [True, False, True, False, True, True, True, False]
    ev = _evaluation({"base": {i: [b] for i, b in zip(IDS, base)}, "trained": {i: [t] for i, t in zip(IDS, trained)}})
    df = analysis.per_problem(ev, TINY)
    counts = analysis.outcome_counts(df)
    # by hand: (T,T) x2 -> both right; (T,F) x2 -> broken; (F,T) x2 + (None,T) -> fixed; (F,F) -> both wrong
    assert counts == {"n": 8, "both_right": 2, "broken": 2, "fixed": 3, "both_wrong": 1, "base_correct": 4,
                      "trained_correct": 5, "net": 1}
    base_summary, trained_summary = ev.summaries
    assert counts["both_right"] + counts["broken"] == round(base_summary.accuracy_mean * 8)
    assert counts["both_right"] + counts["fixed"] == round(trained_summary.accuracy_mean * 8)
    assert list(df["outcome"]) == ["both_right", "broken", "fixed", "both_wrong", "both_right", "fixed", "fixed",
                                   "broken"]
    assert df.attrs["models"] == ["base", "trained"] and df.attrs["note"] == ""
    fixed = analysis.examples(df, "fixed", k=2)
    assert list(fixed["id"]) == [IDS[2], IDS[5]]
    assert list(fixed["base_response"]) == ["base answer 0"] * 2 and fixed["trained"].tolist() == [1.0, 1.0]


def test_repeats_count_expected_outcomes_that_add_up_to_the_summaries():
    base = {IDS[0]: [True, True, False], IDS[1]: [False, False, False], IDS[2]: [True, True, True],
            IDS[3]: [True, False, False]}
    trained = {IDS[0]: [True, True, True], IDS[1]: [True, False, False], IDS[2]: [False, True, True],
               IDS[3]: [True, None, True]}
    ev = _evaluation({"base": base, "trained": trained})
    df = analysis.per_problem(ev, TINY)
    assert df["base"].tolist() == pytest.approx([2 / 3, 0, 1, 1 / 3])
    assert df["trained"].tolist() == pytest.approx([1, 1 / 3, 2 / 3, 2 / 3])
    # problem 0: b=2/3, t=1 -> fixed 1/3, both right 2/3; problem 3: b=1/3, t=2/3 -> fixed 4/9, broken 1/9
    assert df.loc[0, "fixed"] == pytest.approx(1 / 3) and df.loc[0, "both_right"] == pytest.approx(2 / 3)
    assert df.loc[3, "fixed"] == pytest.approx(4 / 9) and df.loc[3, "broken"] == pytest.approx(1 / 9)
    counts = analysis.outcome_counts(df)
    b_summary, t_summary = ev.summaries
    assert counts["both_right"] + counts["broken"] == pytest.approx(b_summary.accuracy_mean * 4)
    assert counts["both_right"] + counts["fixed"] == pytest.approx(t_summary.accuracy_mean * 4)
    assert sum(counts[o] for o in analysis.OUTCOMES) == pytest.approx(4)
    assert counts["net"] == pytest.approx((t_summary.accuracy_mean - b_summary.accuracy_mean) * 4)
    # majority labels: 2/3 right counts as right, 1/3 as wrong
    assert list(df["outcome"]) == ["both_right", "both_wrong", "both_right", "fixed"]
    # the most certain fixed problem first
    assert analysis.examples(df, "fixed", k=1)["id"].tolist() == [IDS[3]]


def test_a_tie_over_two_repeats_counts_as_wrong_in_the_label_only():
    ev = _evaluation({"base": {IDS[0]: [True, False]}, "trained": {IDS[0]: [True, True]}})
    df = analysis.per_problem(ev, TINY)
    assert df.loc[0, "outcome"] == "fixed"
    assert analysis.outcome_counts(df) == {"n": 1, "fixed": 0.5, "broken": 0, "both_right": 0.5, "both_wrong": 0,
                                           "base_correct": 0.5, "trained_correct": 1, "net": 0.5}


def test_breakdowns_sum_to_the_totals_per_category_and_length():
    rng = __import__("random").Random(3)
    base = {i: [rng.random() < 0.4] for i in IDS}
    trained = {i: [rng.random() < 0.6] for i in IDS}
    ev = _evaluation({"base": base, "trained": trained})
    df = analysis.per_problem(ev, TINY)
    counts = analysis.outcome_counts(df)
    assert df.attrs["categories"] == ["operation", "carry", "phrasing"]
    for by in ["operation", "carry", "phrasing", analysis.LENGTH, ["operation", "carry"]]:
        table = analysis.breakdown(df, by)
        assert table["n"].sum() == 40
        assert table["fixed"].sum() == counts["fixed"] and table["broken"].sum() == counts["broken"]
        assert (table["net"] == table["fixed"] - table["broken"]).all()
    by_op = analysis.breakdown(df, "operation").set_index("operation")
    additions = [i for i in IDS if "p" in i.rsplit("-", 1)[1]]
    assert by_op.loc["addition", "n"] == len(additions)
    assert by_op.loc["addition", "base_accuracy"] == pytest.approx(sum(base[i][0] for i in additions) / len(additions))
    with pytest.raises(WorkbenchError, match=r"no column \['level'\].*operation, carry, phrasing, response_length"):
        analysis.breakdown(df, "level")


def test_length_buckets_are_ordered_and_truncation_has_its_own():
    import pandas as pd

    tokens = pd.Series([10, 11, 12, 20, 21, 22, 30, 31, 48, 48])
    truncated = pd.Series([0, 0, 0, 0, 0, 0, 0, 0, 1, 1.0])
    buckets = analysis.length_buckets(tokens, truncated)
    assert list(buckets.cat.categories) == ["10–12 tokens", "20–21 tokens", "22–31 tokens", "truncated"]
    assert buckets.tolist()[-2:] == ["truncated", "truncated"] and buckets.cat.ordered
    same = analysis.length_buckets(pd.Series([7.0, 7.0]), pd.Series([0.0, 0.0]))
    assert same.tolist() == ["7 tokens", "7 tokens"]


def test_other_labels_compare_the_first_two_and_say_so():
    marks = {i: [True] for i in IDS[:3]}
    ev = _evaluation({"ckpt-100": marks, "ckpt-200": marks, "ckpt-300": marks})
    first, second, note = analysis.compared_models(ev)
    assert (first, second) == ("ckpt-100", "ckpt-200")
    assert "first two evaluated" in note and "not compared here: ckpt-300" in note
    pipeline = _evaluation({"trained": marks, "extra": marks, "base": marks})
    assert analysis.compared_models(pipeline) == ("base", "trained", "also evaluated, not compared here: extra")
    one = analysis.analyse(_evaluation({"tiny-policy": marks}), TINY)
    assert one.models == [] and "1 model (tiny-policy): nothing to compare" in one.note
    assert "No per-problem comparison" in one.markdown()
    with pytest.raises(WorkbenchError, match="nothing to compare"):
        analysis.per_problem(_evaluation({"tiny-policy": marks}), TINY)


def test_models_scored_on_different_problems_are_refused():
    ev = _evaluation({"base": {IDS[0]: [True], IDS[1]: [False]}, "trained": {IDS[0]: [True], IDS[2]: [True]}})
    with pytest.raises(WorkbenchError, match="scored on different problems"):
        analysis.per_problem(ev, TINY)


# --- the recipe key ------------------------------------------------------------------------------------------

def test_breakdown_key_is_checked_at_load():
    assert recipe.load("cpu-tiny").eval.breakdown == []
    assert recipe.load("cpu-tiny", ["eval.breakdown=[carry]"]).eval.breakdown == ["carry"]
    with pytest.raises(WorkbenchError, match=r"eval.breakdown names \['level'\], not categories of the arithmetic"):
        recipe.load("cpu-tiny", ["eval.breakdown=[level]"])
    with pytest.raises(WorkbenchError, match=r"eval.breakdown repeats \['carry'\]"):
        recipe.load("cpu-tiny", ["eval.breakdown=[carry, carry]"])
    only_carry = recipe.load("cpu-tiny", ["eval.breakdown=[carry]", "eval.num_samples=40"])
    marks = {i: [True] for i in IDS}
    df = analysis.per_problem(_evaluation({"base": marks, "trained": marks}), only_carry)
    assert df.attrs["categories"] == ["carry"] and "operation" not in df.columns


def _file_recipe(tmp_path, breakdown: str):
    records = [{"question": f"q{i}", "answer": str(i), "level": f"L{i % 3}", "topic": "x"} for i in range(6)]
    path, train = tmp_path / "problems.jsonl", tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    train.write_text("".join(json.dumps({**r, "question": f"t{i}"}) + "\n" for i, r in enumerate(records * 2)))
    return recipe.load("cpu-tiny", ["data.name=file", f"data.train={train}", f"data.test={path}",
                                    "data.validation_size=2", "eval.num_samples=6",
                                    f"eval.breakdown={breakdown}"])


def test_a_dataset_field_becomes_a_breakdown(tmp_path):
    r = _file_recipe(tmp_path, "[level]")
    ids = [row["id"] for row in Task.build(r).eval_rows(r.eval)]
    marks_b = {pid: [n % 2 == 0] for n, pid in enumerate(ids)}
    marks_t = {pid: [True] for pid in ids}
    samples = [Sample(label, 0, pid, "q", "a", correct=marks[pid][0], completion_tokens=5, finish_reason="stop")
               for label, marks in (("base", marks_b), ("trained", marks_t)) for pid in ids]
    ev = Evaluation([Summary("base", "", 6, 1), Summary("trained", "", 6, 1)], samples)
    df = analysis.per_problem(ev, r)
    assert df["level"].tolist() == ["L0", "L1", "L2", "L0", "L1", "L2"]
    table = analysis.breakdown(df, "level").set_index("level")
    assert table["n"].tolist() == [2, 2, 2] and table["fixed"].tolist() == [1, 1, 1]
    with pytest.raises(WorkbenchError, match=r"eval.breakdown names 'subject', which cannot be read.*no 'subject'"):
        analysis.per_problem(ev, _file_recipe(tmp_path, "[subject]"))
    with pytest.raises(WorkbenchError, match=r"names \['outcome'\], which the analysis computes itself"):
        _file_recipe(tmp_path, "[outcome]")


# --- saved, shown, reported ----------------------------------------------------------------------------------

def test_saved_analysis_round_trips_and_the_report_shows_it(tmp_path):
    rng = __import__("random").Random(5)
    ev = _evaluation({"base": {i: [rng.random() < 0.4] for i in IDS},
                      "trained": {i: [rng.random() < 0.6] for i in IDS}})
    run = RunDir.at(tmp_path / "run", TINY)
    ev.save(run.eval)
    found = analysis.analyse(ev, TINY, stage=run.eval)
    assert run.eval.analysis.name == "analysis.json" and run.eval.analysis.exists()
    again = analysis.Analysis.load(run.eval)
    assert again == found
    assert again.frame()[list(analysis.OUTCOMES)].sum().to_dict() == {o: found.counts[o] for o in analysis.OUTCOMES}
    text = found.markdown()
    c = found.counts
    assert f"| 40 | {c['both_right']} | {c['fixed']} | {c['broken']} | {c['both_wrong']} |" in text
    assert "| carry | True |" in text and "| response length | " in text and "fixed (wrong → right)," in text
    from workbench.observe import report

    page = report.build(run).read_text()
    assert "Base vs trained per problem" in page and "<td class='l'>carry</td><td class='l'>True</td>" in page
    assert f"<td class=''>{c['fixed']}</td><td class=''>{c['broken']}</td>" in page
    # without analysis.json (a `workbench eval` run) the report computes it from the samples and recipe.yaml
    run.eval.analysis.unlink()
    assert f"<td class=''>{c['fixed']}</td><td class=''>{c['broken']}</td>" in report.build(run).read_text()
    assert not run.eval.analysis.exists()


# --- a real evaluation of two models through the server ------------------------------------------------------

def test_real_base_vs_trained_counts_match_the_summaries(two_model_eval, tmp_path):
    """conftest's `two_model_eval`: two models, each served and scored (two repeats, sampled so that a problem's
    repeats can disagree); the analysis of what was saved adds up to both summaries exactly."""
    run, r = two_model_eval
    ev = Evaluation.load(run.eval)
    base, trained = ev.summaries
    assert base.errors == trained.errors == 0
    answers = {(s.model, s.id, s.repeat): s.response for s in ev.samples}
    differ = sum(answers["base", s.id, s.repeat] != s.response for s in ev.samples if s.model == "trained")
    assert differ > 48  # of 96: two different models, not one served twice
    saved = RunDir(tmp_path).eval  # written apart: the shared evaluation's directory stays as the evaluation left it
    found = analysis.analyse(ev, r, stage=saved)
    c = found.counts
    assert found.models == ["base", "trained"] and c["n"] == 48 and found.repeats == 2
    assert c["fixed"] > 0 and c["broken"] >= 0
    assert c["both_right"] + c["broken"] == pytest.approx(base.accuracy_mean * 48, abs=1e-9)
    assert c["both_right"] + c["fixed"] == pytest.approx(trained.accuracy_mean * 48, abs=1e-9)
    assert sum(c[o] for o in analysis.OUTCOMES) == pytest.approx(48, abs=1e-9)
    for by, rows in found.breakdowns.items():
        assert sum(row["n"] for row in rows) == 48, by
        assert sum(row["fixed"] for row in rows) == pytest.approx(c["fixed"]), by
        assert sum(row["broken"] for row in rows) == pytest.approx(c["broken"]), by
    assert set(found.breakdowns) == {"operation", "carry", "phrasing", analysis.LENGTH}
    # one repeat alone: whole problems, exactly the per-repeat accuracies of the summaries
    first = Evaluation(ev.summaries, [s for s in ev.samples if s.repeat == 0])
    counts = analysis.outcome_counts(analysis.per_problem(first, r))
    assert all(isinstance(v, int) for v in counts.values())
    assert counts["both_right"] + counts["broken"] == round(base.accuracy_per_repeat[0] * 48)
    assert counts["both_right"] + counts["fixed"] == round(trained.accuracy_per_repeat[0] * 48)
    assert counts["n"] == sum(counts[o] for o in analysis.OUTCOMES) == 48
    assert analysis.Analysis.load(saved) == found
