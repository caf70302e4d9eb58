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


def _honest(name: str, r: dict, where: str) -> None:
    """What a results file or a kept arm must be: a commit of this history, measured on a clean tree, naming the
    code git says that commit ran (and that code's date). Not checked: whether the code changed since (a label,
    `--status`, never a failure)."""
    assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]), (where, r["commit"])
    assert r.get("clean", True), f"{where} was measured on a tree with uncommitted changes"
    known = git("merge-base", "--is-ancestor", r["commit"], "HEAD")
    assert known.returncode == 0, f"{where} measured {r['commit'][:10]}, not in this history"
    assert r["code"] == measure.code_commit(name, r["commit"]), \
        f"{where} names code {r['code'][:10]}; git says {r['commit'][:10]} ran {measure.code_commit(name, r['commit'])[:10]}"
    if "code_date" in r:
        assert r["code_date"] == measure.commit_date(r["code"]), f"{where}: code date {r['code_date']} is not git's"


def test_every_results_file_and_kept_arm_measured_this_history_on_the_code_it_names():
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        # not a pass: the check cannot run, and says so in the test report (xfail, never a silent skip)
        pytest.xfail("a shallow clone holds no history to check the results files' commits against "
                     "(git fetch --unshallow)")
    results = measure.load_results()
    assert set(results) <= set(measure.MEASURED), sorted(results)
    for name, r in results.items():
        _honest(name, r, f"docs/results/{name}.json")
        assert "code_date" in r, f"docs/results/{name}.json has no code_date"
    for name in measure.ARMED:
        for label, piece in measure.pieces_of(name).items():
            _honest(name, piece, f"docs/results/pieces/{name}/{label}.json")


def test_a_hand_edited_code_commit_fails_the_check(monkeypatch):
    """Editing a results file's `code` (or its commit) by hand is caught: the check above can fail."""
    results = measure.load_results()
    name, r = next(iter(results.items()))
    with pytest.raises(AssertionError, match="names code"):
        _honest(name, {**r, "code": "0" * 40}, "edited")
    with pytest.raises(AssertionError, match="not in this history"):
        _honest(name, {**r, "commit": "1" * 40}, "edited")


def test_a_changed_setting_labels_its_results_stale_and_a_fresh_file_fresh():
    """The protocol's seeds and the head-to-heads' arms live in scripts/measure.py, not in the code MEASURED names:
    `--status` says when a file ran other settings than the script has now, as it says when the code changed."""
    results = measure.load_results()
    name = "protocol"
    r = results[name]
    lines = {line.split(":")[0]: line for line in measure.status_lines({name: r})}
    later = measure.later_changes(name, r["commit"])
    assert (" - stale: " in lines[name]) == bool(later) or r["command"] != measure.current_command(name)
    edited = {name: {**r, "command": r["command"] + " trainer.max_steps=1"}}
    line = next(x for x in measure.status_lines(edited) if x.startswith(f"{name}:"))
    assert " - stale: " in line, line
    if not later:
        assert "other settings" in line, line


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


def _clone(tmp_path, *flags: str):
    target = tmp_path / ("shallow" if flags else "clone")
    done = subprocess.run(["git", "clone", "-q", *flags, f"file://{REPO}" if flags else str(REPO), str(target)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return target


def _status(where) -> str:
    import sys

    done = subprocess.run([sys.executable, "scripts/measure.py", "--status"], cwd=where, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr  # exit 0 whatever the figures' state
    return done.stdout


def test_a_comment_under_workbench_labels_the_figures_stale_and_names_that_commit(tmp_path):
    """In a clone, a commit that changes one comment under workbench/ is named by `--status` as the first later
    change of every measurement of the workbench's code; the measurement of the scripts' reload alone too."""
    clone = _clone(tmp_path)
    target = clone / "workbench" / "errors.py"
    target.write_text(target.read_text() + "\n# a comment\n")
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", *env, "commit", "-qam", "a comment only"], cwd=clone, check=True, timeout=60)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout.strip()
    # the status as this checkout's script computes it (the clone holds the last commit's)
    (clone / "scripts" / "measure.py").write_text((REPO / "scripts" / "measure.py").read_text())
    lines = {line.split(":")[0]: line for line in _status(clone).splitlines()}
    for name in measure.load_results():
        if name == "reload" or "workbench" in measure.MEASURED[name]:
            assert " - stale: " in lines[name], lines[name]
            assert (f"the first {head} a comment only" in lines[name]
                    or f"the latest {head} a comment only" in lines[name]), lines[name]


def test_a_shallow_clone_says_it_cannot_tell(tmp_path):
    clone = _clone(tmp_path, "--depth", "1")
    (clone / "scripts" / "measure.py").write_text((REPO / "scripts" / "measure.py").read_text())
    out = _status(clone)
    measured = [line for line in out.splitlines() if ": measured code" in line]
    assert measured and all("cannot tell whether it is fresh" in line for line in measured), out


def _two_arms():
    return measure.Armed(["protocol", "two arms"], [measure.Arm("a", ("a",)), measure.Arm("b", ("b",))],
                         name="variant", overrides=["x=1"])


def _at(code: str = "c" * 40) -> dict:
    return {"commit": "f" * 40, "code": code, "code_date": "2026-01-01", "machine": {"summary": "a box"},
            "versions": {"torch": "1"}}


def _training(seed: int) -> dict:
    return {"data_seed": 0, "seed": seed, "gain": 10.0 * seed, "base": 0.5, "trained": 0.5 + 0.1 * seed,
            "signal": 0.5, "signal_generated": 0.5, "train_seconds": 1.0, "generated_tokens": 100, "curve": None}


KILLED_ARM = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, "scripts")
import measure
sys.path.insert(0, "tests")
from test_results import _at, _training, _two_arms
pieces, root = Path(sys.argv[1]), Path(sys.argv[2])
def run(arm, root):
    if arm.label == "b":  # the second arm hangs until it is killed, in the middle of its training
        (root / "b-started").write_text("")
        time.sleep(600)
    return 3.0, _training(1)
measure.measure_armed("two", _two_arms(), root, _at(), run=run, pieces=pieces)
"""


def test_a_measurement_killed_in_its_second_arm_goes_on_with_that_arm_only(tmp_path):
    """Killing a measurement over arms in the middle keeps the arms it finished, writes no results and no half
    piece; run again on the same code it measures only the arm that was cut off; other code starts it afresh."""
    import signal
    import sys
    import time

    pieces, root = tmp_path / "pieces", tmp_path / "runs"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_ARM, str(pieces), str(root)], cwd=REPO)
    try:
        deadline = time.time() + 60
        while not (root / "b-started").exists():
            assert proc.poll() is None and time.time() < deadline, "the first arm did not finish"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(p.name for p in (pieces / "two").iterdir()) == ["a.json"]  # no temporary file, no piece of b
    assert measure.progress("two", pieces) is None  # not one of ARMED: no count to give
    ran: list[str] = []

    def run(arm, root):
        ran.append(arm.label)
        return 3.0, _training(2 if arm.label == "b" else 1)

    log: list[str] = []
    command, seconds, figures = measure.measure_armed("two", _two_arms(), root, _at(), run=run, pieces=pieces,
                                                      log=log.append)
    assert ran == ["b"], ran
    assert any("1 of 2 arms kept" in line for line in log), log
    arm = figures["arms"][0]
    assert [t["seed"] for t in arm["gains"]] == [1, 2] and arm["gain_mean"] == 15.0 and arm["name"] == "variant"
    assert [a["arm"] for a in figures["arms_measured"]] == ["a", "b"] and seconds == 6.0
    ran.clear()
    measure.measure_armed("two", _two_arms(), root, _at("d" * 40), run=run, pieces=pieces, log=log.append)
    assert ran == ["a", "b"], ran  # other code: afresh
    assert any("starting afresh" in line for line in log), log
    measure.drop_pieces("two", pieces)
    assert not (pieces / "two").exists()


def test_the_paired_difference_and_its_interval():
    """Paired by (base, seed): the mean difference, Student's t interval over the pairs (t quantiles checked
    against the table's 2.306 for 8 degrees of freedom and 4.303 for 2), and the words for zero inside or out."""
    assert measure.t_quantile(0.975, 8) == pytest.approx(2.306, abs=1e-3)
    assert measure.t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    plain = {"gains": [{"data_seed": 0, "seed": s, "gain": g} for s, g in ((1, 5.0), (2, 6.0), (3, 7.0))]}
    better = {"gains": [{"data_seed": 0, "seed": s, "gain": g} for s, g in ((1, 7.0), (2, 8.5), (3, 8.5))]}
    p = measure.paired(plain, better)
    assert p["mean"] == pytest.approx(2.0) and p["sd"] == pytest.approx(0.5) and p["n"] == 3
    assert p["ci"] == pytest.approx([2.0 - 4.303 * 0.5 / 3 ** 0.5, 2.0 + 4.303 * 0.5 / 3 ** 0.5], abs=1e-3)
    assert p["excludes_zero"] and "the interval excludes zero" in measure.paired_text("it", p)
    mixed = {"gains": [{"data_seed": 0, "seed": s, "gain": g} for s, g in ((1, 4.0), (2, 8.0), (3, 7.0))]}
    q = measure.paired(plain, mixed)
    assert not q["excludes_zero"] and "the interval includes zero" in measure.paired_text("it", q)
    assert measure.paired(plain, {"gains": plain["gains"][:1]}) is None  # one pair: no interval


def test_every_plus_minus_on_the_results_page_and_the_readme_block_says_what_it_is():
    """Each line with a ± names it: a sample sd over trainings, or a 95% interval beside it."""
    text = measure.results_page(measure.load_results()) + "\n" + measure.readme_block(measure.load_results())
    label = re.compile(r"sample (sd|std)|standard deviation")
    unlabelled, header = [], ""
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            header = line if not header else header  # a table's first row is its header
        else:
            header = "" if not line.startswith("|") else header
        if "±" in line and not label.search(line) and not (line.startswith("|") and label.search(header)):
            unlabelled.append(line[:120])
    assert unlabelled == [], unlabelled


# Figure-like words in docs/ that state no measurement: settings, hardware counts, the pinned model's recorded score.
NOT_MEASURED = {
    "docs/async-and-bench.md": {"5 s": "vLLM's default keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), a setting",
                                "600 s": "server.keep_alive_s's default, a setting"},
    "docs/reliability.md": {"5 s": "vLLM's default keep-alive, a setting",
                            "0.5 s": "tests/test_keepalive.py's proxy idle limit, a setting",
                            "6 s": "how long tests/test_keepalive.py leaves a connection idle, a setting"},
    "docs/evaluation.md": {"54.7%": "the tiny model's recorded accuracy (tinymodel.REFERENCE), checked by a test"},
    "docs/recipe-reference.md": {"10%": "the tiny model's cosine schedule ends at 10% of its rate, a setting"},
    "docs/recipes.md": {"8 ×": "8 prompts × 8 completions, and 8 × 910B cards: settings",
                        "4 ×": "4 TP ranks, a setting", "54.7%": "tinymodel.REFERENCE, as above"},
}


def _outside_blocks(text: str) -> str:
    return re.sub(re.escape(measure.BEGIN[:-4]) + r".*?" + re.escape(measure.END), "", text, flags=re.S)


def test_docs_state_measured_figures_only_in_blocks_the_results_files_render():
    """Every docs page's measured blocks are what the results files render; outside them, and outside the
    rendered results page, docs/ states no figure but the settings listed above (NOT_MEASURED)."""
    results = measure.load_results()
    for name, (page, block) in measure.DOC_BLOCKS.items():
        text = page.read_text()
        assert measure.with_block(text, block(results), name) == text, \
            f"{page.name}'s measured block differs from docs/results/*.json: python scripts/measure.py --render"
    found = {}
    for page in sorted((REPO / "docs").glob("*.md")):
        if page == measure.PAGE:
            continue
        rel = str(page.relative_to(REPO))
        hits = [m.group(0) for m in FIGURE.finditer(_outside_blocks(page.read_text()))]
        extra = [h for h in hits if h.replace(" ", "") not in {k.replace(" ", "") for k in NOT_MEASURED.get(rel, {})}]
        if extra:
            found[rel] = extra
    assert found == {}, f"figures in docs/ outside a rendered block: {found}"
    # and the check can fail: a hand-written figure in a page is found
    assert [m.group(0) for m in FIGURE.finditer(_outside_blocks("LoRA gains +3.8 points.\n"))] == ["3.8 points"]
