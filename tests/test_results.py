"""The README's figures are the measured ones (scripts/measure.py, `make measure`, docs/results/*.json).

The README states measured figures only inside its `<!-- measured:begin -->` block, which is rendered from the
results files, as docs/results.md is; a results file must name a commit of this history, measured on a clean tree,
and no later commit may have changed the code it measured (its figures would describe other code). The suite's own
timing is exempt from the last rule: it is measured by running the suite, always on the commit before the one that
records it.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO, script

measure = script("measure")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _outside_block(readme: str) -> str:
    start, end = readme.index(measure.BEGIN), readme.index(measure.END)
    return readme[:start] + readme[end + len(measure.END):]


def test_the_readme_block_and_the_results_page_are_what_the_files_render():
    results = measure.load_results()
    readme = measure.README.read_text()
    assert readme.count(measure.BEGIN) == 1 and readme.count(measure.END) == 1, "the README's measured block"
    assert measure.with_block(readme, measure.readme_block(results)) == readme, \
        "README.md's measured block differs from docs/results/*.json: python scripts/measure.py --render"
    assert measure.PAGE.read_text() == measure.results_page(results), \
        "docs/results.md differs from docs/results/*.json: python scripts/measure.py --render"


def test_every_results_file_measured_this_history_and_its_code_has_not_changed_since():
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the results files' commits are not in its history (clone without --depth)")
    results = measure.load_results()
    assert set(results) <= set(measure.MEASURED) | {"suite"}, sorted(results)
    stale = []
    for name, r in results.items():
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]), (name, r["commit"])
        assert r["clean"], f"docs/results/{name}.json was measured on a tree with uncommitted changes"
        known = git("merge-base", "--is-ancestor", r["commit"], "HEAD")
        assert known.returncode == 0, f"docs/results/{name}.json measured {r['commit'][:10]}, not in this history"
        if "code" in r:  # what head-to-head comparisons key on: it must be what git says, not a hand edit
            assert r["code"] == measure.code_commit(name, r["commit"]), \
                f"docs/results/{name}.json names code {r['code'][:10]}; git says {r['commit'][:10]} ran " \
                f"{measure.code_commit(name, r['commit'])[:10]}"
        if name == "suite":
            continue
        later = git("log", "--format=%h %s", f"{r['commit']}..HEAD", "--", *measure.MEASURED[name]).stdout.strip()
        if later:
            stale.append(f"{name} (measured {r['commit'][:10]}; changed since by: {later.splitlines()[0][:90]}"
                         f"{f' and {len(later.splitlines()) - 1} more' if len(later.splitlines()) > 1 else ''})")
    assert not stale, "results older than the code they measure: " + "; ".join(stale) + " - run `make measure`"


def test_a_protocol_results_file_ran_the_settings_its_measurement_runs_now():
    """The protocol's seeds and the variants' arms live in scripts/measure.py, not in the code MEASURED names: a
    changed setting must stale the file as a code change does."""
    results = measure.load_results()
    for name, args, env in (("protocol", measure.PROTOCOL_ARGS, None),
                            ("variants", measure.VARIANTS_ARGS, measure.VARIANTS_ENV),
                            ("choice", measure.CHOICE_ARGS, None)):
        if name in results:
            assert results[name]["command"] == measure.command_line(args, env), \
                f"docs/results/{name}.json ran other settings than scripts/measure.py has now: run `make measure`"


# A measured-looking figure: a percentage, a duration, a ratio, a spread, a points gain, a speed.
FIGURE = re.compile(r"\d+(?:\.\d+)?\s?(?:%|min\b|minutes\b|seconds\b|s\b(?![-_])|×|points\b|tok(?:ens)?/s\b|GB/s\b)"
                    r"|±\s?\d|\b\d+ passed\b", re.I)


def test_the_readme_states_measured_figures_only_in_its_block():
    from workbench import tinymodel

    # not a measurement of this code: the pinned tiny model's recorded base accuracy (workbench/tinymodel.py
    # REFERENCE; tests/test_tinymodel.py checks a fresh build against it)
    recorded = {f"{r['heldout_accuracy']:.1%}" for r in tinymodel.REFERENCE.values()}
    found = [m.group(0) for m in FIGURE.finditer(_outside_block(measure.README.read_text()))]
    assert [f for f in found if f.replace(" ", "") not in recorded] == [], \
        "figures outside the README's measured block: state them through scripts/measure.py or remove them"


def test_a_figure_outside_the_block_or_a_stale_block_is_caught(tmp_path):
    """The checks above can fail: a hand-written figure is found, and a block that differs from the files is not
    what they render."""
    results = {"demo": {"date": "2026-01-01 00:00 UTC", "machine": {"summary": "a box"}, "figures": {
        "minutes": 12.0, "base_accuracy": 0.5, "trained_accuracy": 0.6, "gain_points": 10.0, "n": 300, "curve": None}}}
    block = measure.readme_block(results)
    assert "50.0% → 60.0% (+10.0 points)" in block and "12 min" in block and "a box" in block
    readme = f"# x\n\n{block}\n\nThe demo gains +18.0 points in 13 min.\n"
    found = [m.group(0) for m in FIGURE.finditer(_outside_block(readme))]
    assert found == ["18.0 points", "13 min"]
    edited = readme.replace("60.0%", "61.0%")
    assert measure.with_block(edited, measure.readme_block(results)) != edited


def test_the_choices_recipe_trainings_are_checked_against_the_protocols_of_the_same_base_and_seed():
    """Under fixed seeds the recipe's test trainings in the choice repeat the protocol measurement's: the results
    page says whether they scored the same, and compares nothing across code or machines."""
    def result(gains: list[tuple[int, int, float]], chosen: str = "recipe", code: str = "a" * 40) -> dict:
        return {"commit": "0" * 40, "code": code, "machine": {"summary": "a box"},
                "figures": {"chosen": chosen, "test": {"gains": [{"data_seed": d, "seed": s, "trained": t}
                                                                  for d, s, t in gains]},
                            "gains": [{"data_seed": d, "seed": s, "trained": t} for d, s, t in gains]}}

    protocol = result([(0, 1, 0.60), (0, 2, 0.62), (1, 1, 0.50)])
    same = measure.repeats(result([(0, 1, 0.60), (1, 1, 0.50)]), protocol)
    assert "The recipe's 2 test training(s) here (training seed(s) 1)" in same
    assert same.endswith("the same test accuracy on all 2.")
    differ = measure.repeats(result([(0, 1, 0.60), (1, 1, 0.51)]), protocol)
    assert "**they differ** (base 1 seed 1: 51.0% here, 50.0% there)" in differ
    assert measure.repeats(result([(0, 1, 0.61)], code="b" * 40), protocol) is None  # other code
    assert measure.repeats(result([(0, 1, 0.61)], chosen="lr 1e-4"), protocol) is None  # another setting
    assert measure.repeats(result([(2, 1, 0.61)]), protocol) is None  # no training in common


def test_the_recipe_reference_is_the_schemas_with_every_key_explained():
    """docs/recipe-reference.md is what scripts/recipe_reference.py makes of the schema now, and it names every
    field of every section (read by dataclasses, not by the script's parser), each with what it does."""
    import dataclasses

    from workbench.recipe import schema

    page = script("recipe_reference").page()
    assert (REPO / "docs" / "recipe-reference.md").read_text() == page, \
        "docs/recipe-reference.md differs from the schema: python scripts/recipe_reference.py"

    def keys(cls, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            kind = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(kind):
                out += keys(kind, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")
        return out

    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \|.*\| ([^|]*) \|$", page, re.M)}
    expected = keys(schema.Recipe, "")
    assert set(expected) <= set(rows), sorted(set(expected) - set(rows))
    assert [k for k in expected if not rows[k].strip()] == [], "keys without a comment in workbench/recipe/schema.py"


def test_the_suites_figures_are_read_from_its_junit_xml(tmp_path):
    """What `make test` wrote (pytest's JUnit XML: one testsuite inside testsuites) is what docs/results/suite.json
    says: counts by outcome and the suite's own seconds."""
    junit = tmp_path / "suite.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" skipped="3" '
                     'tests="20" time="1503.68"><testcase classname="tests.test_x" name="test_a" time="1.0"/>'
                     '</testsuite></testsuites>')
    figures = measure.suite_figures(junit)
    assert (figures["tests"], figures["passed"], figures["failed"], figures["errors"], figures["skipped"]) == \
        (20, 14, 2, 1, 3)
    assert figures["seconds"] == pytest.approx(1503.68)


@pytest.mark.heavy  # a vLLM engine, in the script's process
@pytest.mark.timeout(300)
def test_the_reloads_parts_are_timed_inside_vllms_own_reload_in_the_servers_environment(tiny_model_dir, tmp_path):
    """scripts/reload_parts.py (`make measure --full`'s "reload") runs vLLM's own `reload_weights` on the tiny model
    with timers around vLLM's functions: every part is timed inside one reload, the named parts fit inside it, the
    process had a managed CPU server's allocator settings (serving/launch.py), and the results page names each part."""
    import sys

    out = tmp_path / "reload.json"
    done = subprocess.run([sys.executable, "scripts/reload_parts.py", "--size", "tiny", "--reloads", "2", "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    f = measure.reload_figures(out)
    m = f["median_seconds"]
    assert f["reloads"] == 2 and len(f["reload_seconds"]) == 2
    # every part timed, inside one reload: none negative (finalize is timed without the layers it processes)
    assert all(m[k] > 0 for k in ("read", "init", "process", "layers", "repack", "finalize", "cache")), m
    assert m["copies"] > 0 and m["rest"] >= 0, m
    assert "glibc.malloc.hugetlb=1" in f["env"]["GLIBC_TUNABLES"] and f["env"]["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert f["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0" and f["copy_gb_s"] > 0
    results = {"reload": {"command": "python scripts/reload_parts.py", "commit": "0" * 40, "date": "d",
                          "machine": {"summary": "a box"}, "versions": {}, "seconds": 60.0, "figures": f}}
    page = measure.results_page(results)
    assert all(f"| {what} | {m[key]:.3f} |" in page for key, what in measure.RELOAD_PARTS)
    assert f"**{m['reload']:.3f}**" in page


def test_the_curve_names_its_best_and_its_last_point():
    """The results page's learning curve: the best point and the last, said once when they are the same point."""
    curve = {"start": 0.55, "best": 0.71, "best_step": 300, "last": 0.71, "last_step": 300, "cost_share": 0.033}
    assert measure.curve_text(curve) == ("55.0% → best 71.0% at the last point (step 300)", "3.3%")
    earlier = {**curve, "best": 0.69, "best_step": 200, "last": 0.67, "last_step": 250, "cost_share": None}
    assert measure.curve_text(earlier) == ("55.0% → best 69.0% (step 200) → 67.0% (step 250)", "")
