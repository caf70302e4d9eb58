"""Print the bad-input table of docs/reliability.md (each input and the message it gets), by running every case of
tests/bad_inputs.py through the CLI (the same cases tests/test_bad_input.py checks).

    python scripts/bad_input_table.py > /tmp/table.md      # under a minute on 2 cores
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from bad_inputs import CASES, run_all  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        results = []
        for out in run_all(CASES, tmp, 8999):
            text = out["stderr"].strip().replace(str(tmp), "<tmp>")
            text = text[text.find("error:"):] if "error:" in text else text  # not vLLM's import-time warnings
            results.append((" ".join(text.splitlines()), out["code"]))
    print("| input (`workbench train --recipe smoke ...` unless a command is shown) | exit | message |")
    print("|---|---|---|")
    for (args, _), (message, code) in zip(CASES, results):
        shown = " ".join(args[3:] if args[:3] == ["train", "--recipe", "smoke"] else args)
        message = message.removeprefix("error: ").replace("|", "\\|")
        print(f"| `{shown}` | {code} | {message} |")


if __name__ == "__main__":
    main()
