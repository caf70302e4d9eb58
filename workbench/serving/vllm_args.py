"""How vLLM's own `vllm serve` parser reads a server command line: the values a server would run with, so that
serving/launch.check_extra_args can compare what server.extra_args changes with what the workbench sets and checks.

vLLM's parser takes flags in spellings a list of names misses: an unambiguous prefix (`--enable-chunked` for
`--enable-chunked-prefill`), underscores, `--flag=value`, dotted JSON keys, and a `--config` YAML file whose keys
become flags. The parser is built exactly as `vllm serve` builds it (FlexibleArgumentParser with the serve
subcommand's arguments), from the vLLM installed here, in a process of its own: vLLM's imports (and on the CPU build
the version lookup that serving/vllm_cpu answers) stay out of the workbench's process, and it runs only for a
recipe that has extra_args.

    python -m workbench.serving.vllm_args < request.json     # {"argvs": [[...], ...]} -> {"parsed": [...]} or {"error"}
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys


def _parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM releases before the module split
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")  # messages read "vllm: error: ..."
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)  # the serve subcommand exactly as `vllm serve` builds it
    return parser


def _parse_all(argvs: list[list[str]]) -> dict:
    parser = _parser()
    parsed = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                namespace = parser.parse_args(["serve", *argv])
        except SystemExit:  # argparse's error(): an unknown flag, a bad value, an ambiguous prefix
            lines = [line for line in err.getvalue().strip().splitlines() if line.strip()]
            return {"error": lines[-1] if lines else "vLLM's parser refused the arguments"}
        except Exception as exc:  # a --config file that is missing or not YAML, a JSON flag that does not parse
            return {"error": f"{type(exc).__name__}: {exc}"}
        parsed.append(json.loads(json.dumps(vars(namespace), default=str)))
    return {"parsed": parsed}


def parse(argvs: list[list[str]], env: dict[str, str] | None = None, timeout: float = 180) -> dict:
    """Each argv (the arguments after `vllm serve`) as vLLM's parser reads it: {"parsed": [namespace dicts]}, or
    {"error": the parser's own message} for the first it refuses."""
    out = subprocess.run([sys.executable, "-m", "workbench.serving.vllm_args"], input=json.dumps({"argvs": argvs}),
                         capture_output=True, text=True, env=env, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"reading vLLM's serve arguments failed (exit {out.returncode}): "
                           f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main() -> None:
    from workbench.serving.vllm_cpu import answer_version_lookup

    answer_version_lookup()  # the CPU build's distribution is vllm-cpu: vLLM's own lookup of "vllm" would fail
    request = json.loads(sys.stdin.read())
    with contextlib.redirect_stdout(sys.stderr):  # vLLM's import-time output stays off the answer
        answer = _parse_all(request["argvs"])
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
