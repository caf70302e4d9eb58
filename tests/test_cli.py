import subprocess
import sys

import pytest

from workbench.cli import build_parser, main

COMMANDS = [a.dest for a in build_parser()._subparsers._group_actions[0]._choices_actions]


def run(cmd, *args, env=None):
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env)


def test_console_script_and_module_entry_point(workbench_cmd):
    for cmd in (workbench_cmd, [sys.executable, "-m", "workbench"]):
        out = run(cmd, "--help")
        assert out.returncode == 0
        for name in COMMANDS:
            assert name in out.stdout


# words each command's description must have: its own behaviour (stop, tag and lab once showed other modules')
OWN_WORDS = {"stop": "STOP file", "tag": "tag.json", "lab": "JupyterLab", "plan": "node", "compare": "side by side"}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_subcommand_explains_itself(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n", 2)[1]
    assert len(description) > 40  # a description paragraph, not just usage
    assert OWN_WORDS.get(name, "").lower() in " ".join(description.split()).lower(), description


@pytest.mark.parametrize("argv", [["recipe", "show", "--check", "smoke"], ["recipe", "--check", "show", "smoke"],
                                  ["recipe", "show", "smoke", "--check"]])
def test_recipe_show_takes_check_in_any_place(argv, capsys):
    assert main(argv) == 0
    assert "# placement: trainer on" in capsys.readouterr().out


def test_recipe_show_ascend_builds_grpo_config(workbench_cmd, clean_env):
    out = run(workbench_cmd, "recipe", "show", "ascend-910b-8card", "trainer.learning_rate=2e-6", "--check",
              env=clean_env)
    assert out.returncode == 0, out.stderr
    assert "served_model_name: policy-7b" in out.stdout
    assert "learning_rate: 2.0e-06" in out.stdout
    assert "built trl.GRPOConfig for platform 'npu'" in out.stdout


def test_recipe_list(workbench_cmd):
    out = run(workbench_cmd, "recipe", "list")
    assert out.returncode == 0
    names = [line.split()[0] for line in out.stdout.strip().splitlines()]
    assert names == ["ascend-910b-2node", "ascend-910b-8card", "ascend-910b-8card-rm", "cpu-tiny", "cpu-tiny-async",
                     "cpu-tiny-rm", "cuda-1gpu", "cuda-2gpu", "cuda-2gpu-rm", "cuda-8gpu", "smoke"]


@pytest.mark.parametrize("args,pattern", [
    (["recipe", "show", "nope"], "recipe 'nope' does not exist"),
    (["recipe", "show", "cpu-tiny", "trainer.lr=1"], "unknown recipe key 'trainer.lr'"),
    (["tiny-model", "--recipe", "cpu-tiny", "model.tiny.pretrain_steps=ten"], "expected int"),
])
def test_bad_input_exits_2_with_one_line(workbench_cmd, args, pattern):
    out = run(workbench_cmd, *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0]


def test_run_refuses_unknown_stages_before_any_work(workbench_cmd, tmp_path):
    bad = run(workbench_cmd, "run", "--stages", "env,deploy", f"monitor.runs_dir={tmp_path}")
    assert bad.returncode == 2 and "unknown stage(s) ['deploy']" in bad.stderr and "offline" in bad.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing half-written
