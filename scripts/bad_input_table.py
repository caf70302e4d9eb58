"""Print the README's table of bad inputs and the message each gets, by running every case of tests/bad_inputs.py
through the CLI (the same cases tests/test_bad_input.py checks).

    python scripts/bad_input_table.py > /tmp/table.md      # about a minute on 2 cores
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from bad_inputs import CASES, expand, write_files  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        write_files(tmp)
        env = {**os.environ, "WORKBENCH_DATA": str(tmp / "data")}

        def one(case):
            args = expand(case[0], tmp, 8999)
            if args[0] in ("train", "eval", "run", "protocol") and "--resume" not in args:
                args = args + [f"monitor.runs_dir={tmp / 'runs'}"]
            out = subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True,
                                 env=env, cwd=tmp, timeout=300)
            text = out.stderr.strip().replace(str(tmp), "<tmp>")
            text = text[text.find("error:"):] if "error:" in text else text  # not vLLM's import-time warnings
            return " ".join(text.splitlines()), out.returncode

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(one, CASES))
    print("| input (`workbench train --recipe smoke ...` unless a command is shown) | exit | message |")
    print("|---|---|---|")
    for (args, _), (message, code) in zip(CASES, results):
        shown = " ".join(args[3:] if args[:3] == ["train", "--recipe", "smoke"] else args)
        message = message.removeprefix("error: ").replace("|", "\\|")
        print(f"| `{shown}` | {code} | {message} |")


if __name__ == "__main__":
    main()
