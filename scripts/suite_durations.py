"""Where the test suite's time goes, from a run's JUnit XML: seconds per file and the slowest tests (set-up, call
and teardown together: the first test to ask for a shared fixture pays for building it). The tables of
tests/README.md come from here.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" make test
    python scripts/suite_durations.py /tmp/suite.xml [--slowest 25]
"""
from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def durations(path: str) -> list[tuple[float, str, str, str]]:
    """(seconds, file, test, outcome) for every test case of the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").removeprefix("tests.")
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        out.append((float(case.get("time") or 0.0), f"{module}.py", case.get("name", ""), outcome))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", help="the JUnit XML pytest wrote (--junitxml)")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    args = parser.parse_args()
    cases = durations(args.junit)
    total = sum(t for t, *_ in cases)
    per_file: dict[str, list] = collections.defaultdict(list)
    for seconds, file, _, outcome in cases:
        per_file[file].append((seconds, outcome))
    outcomes = collections.Counter(outcome for *_, outcome in cases)
    print(f"{len(cases)} tests, {total / 60:.1f} min in tests ({', '.join(f'{n} {o}' for o, n in outcomes.items())})\n")
    print("| file | tests | seconds | share |\n|---|---|---|---|")
    for file, rows in sorted(per_file.items(), key=lambda kv: -sum(t for t, _ in kv[1])):
        seconds = sum(t for t, _ in rows)
        print(f"| {file} | {len(rows)} | {seconds:.0f} | {100 * seconds / total:.1f}% |")
    print(f"\n| the {args.slowest} slowest tests | seconds |\n|---|---|")
    for seconds, file, name, _ in sorted(cases, reverse=True)[:args.slowest]:
        print(f"| {file}::{name} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
