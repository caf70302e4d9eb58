"""The launch scripts `workbench plan --emit shell|slurm` writes (the end of workbench/plan.py), run by bash with
stand-ins for the cluster's programs (srun, scontrol, ip, curl) and for `workbench` itself, which records what
each node was asked to run. Each node must run exactly the `start:` line `workbench plan` prints for it, with the
overridden interface, ports and addresses; the server step is stopped when the batch script ends."""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.cli import main

# the cluster's programs, as far as the scripts use them; each node's address on the interface `ip` is asked about
SRUN = """#!/bin/bash
nodes=""
while [[ $1 == --* ]]; do case $1 in --nodelist=*) nodes=${1#--nodelist=};; esac; shift; done
IFS=, read -ra list <<<"$nodes"
if [ ${#list[@]} -eq 1 ]; then exec env SLURMD_NODENAME="${list[0]}" SLURM_PROCID=0 "$@"; fi
i=0
for n in "${list[@]}"; do env SLURMD_NODENAME="$n" SLURM_PROCID=$i "$@" & i=$((i + 1)); done
wait
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && tr , '\\n' <<<"$3"
"""
IP = """#!/bin/bash
# ip -4 -o addr show dev IFACE: an address only on the interface the nodes share
[ "${@: -1}" = "$SHARED_IFACE" ] || { echo "Device \"${@: -1}\" does not exist." >&2; exit 1; }
case "$SLURMD_NODENAME" in nodeA) n=11;; nodeB) n=12;; nodeC) n=13;; esac
echo "2: $SHARED_IFACE    inet 192.0.2.$n/24 brd 192.0.2.255 scope global $SHARED_IFACE"
"""
# /health answers once the server's process runs (it writes server.pid after its record), waiting as long as
# --max-time 5 would; a server on another machine (SERVER_ELSEWHERE) is taken as up already
CURL = """#!/bin/bash
echo "${@: -1}" >> "$LOG_DIR/curl"
[ -n "${SERVER_ELSEWHERE:-}" ] && exit 0
for _ in $(seq 50); do [ -f "$LOG_DIR/server.pid" ] && exit 0; sleep 0.1; done
exit 28
"""
WORKBENCH = f"""#!{sys.executable}
import json, os, sys
with open(os.path.join(os.environ["LOG_DIR"], "workbench"), "a") as f:
    f.write(json.dumps({{"node": os.environ.get("SLURMD_NODENAME"), "argv": ["workbench", *sys.argv[1:]]}}) + "\\n")
if sys.argv[1] == "serve":  # a server serves until it is stopped
    open(os.path.join(os.environ["LOG_DIR"], "server.pid"), "w").write(str(os.getpid()))
    os.execvp("sleep", ["sleep", "120"])
"""


@pytest.fixture
def cluster(tmp_path):
    """A bin directory of stand-ins, a venv whose activate puts it first on PATH, and the log directory."""
    bin_dir, venv, logs = tmp_path / "bin", tmp_path / "venv", tmp_path / "logs"
    for d in (bin_dir, venv / "bin", logs):
        d.mkdir(parents=True)
    programs = {bin_dir / "srun": SRUN, bin_dir / "scontrol": SCONTROL, bin_dir / "ip": IP, bin_dir / "curl": CURL,
                venv / "bin" / "workbench": WORKBENCH}  # the cluster's on PATH; workbench in the venv only
    for path, text in programs.items():
        path.write_text(text)
        path.chmod(stat.S_IRWXU)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    (tmp_path / "set_env.sh").write_text("export ASCEND_HOME_PATH=/usr/local/Ascend/ascend-toolkit/latest\n")
    env = {**os.environ, "WORKBENCH_VENV": str(venv), "ASCEND_SET_ENV": str(tmp_path / "set_env.sh"),
           "LOG_DIR": str(logs), "SLURM_SUBMIT_DIR": str(tmp_path), "WORKBENCH_SERVER_KEY": "k-test",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, logs


def emitted(capsys, kind: str, recipe: str, overrides: list[str]) -> str:
    assert main(["plan", "--recipe", recipe, "--emit", kind, *overrides]) == 0
    return capsys.readouterr().out


def plan_starts(capsys, recipe: str, overrides: list[str]) -> list[list[str]]:
    """The `start:` line `workbench plan` prints for each node, in node order."""
    assert main(["plan", "--recipe", recipe, *overrides]) == 0
    text = capsys.readouterr().out
    return [shlex.split(line.split("start:", 1)[1]) for line in text.splitlines() if line.startswith("  start:")]


def recorded(logs: Path) -> list[dict]:
    return [json.loads(line) for line in (logs / "workbench").read_text().splitlines()]


def run_script(text: str, tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "launch.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)
    return subprocess.run(["bash", str(path), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


PORTS = ["server.port=8101", "distributed.main_port=29611", "trainer.vllm_group_port=51300"]
IFACE = ["devices.env.HCCL_SOCKET_IFNAME=ib1", "devices.env.GLOO_SOCKET_IFNAME=ib1"]


def test_the_slurm_script_runs_what_the_plan_prints_on_each_node_with_the_allocations_addresses(
        cluster, capsys, tmp_path):
    env, logs = cluster
    overrides = ["trainer.learning_rate=1e-6", *IFACE, *PORTS]
    text = emitted(capsys, "slurm", "ascend-910b-2node", overrides)
    assert "#SBATCH --nodes=2" in text and "show dev ib1" in text and "eth0" not in text
    assert "k-test" not in text and "10.0.0." not in text  # the key stays in the environment; no recipe address
    # an allocation larger than the recipe's nodes: the extra node runs nothing
    result = run_script(text, tmp_path, {**env, "SLURM_JOB_NODELIST": "nodeA,nodeB,nodeC", "SHARED_IFACE": "ib1"})
    assert result.returncode == 0, result.stderr
    # the addresses the allocation's nodes have on ib1 reach every node as overrides, after the others
    late = ["server.url=http://192.0.2.11:8101", "distributed.main_address=192.0.2.12"]
    server, trainer = plan_starts(capsys, "ascend-910b-2node", overrides + late)
    assert server[:3] == ["workbench", "serve", "--for-training"] and trainer[:2] == ["workbench", "train"]
    # the server's node starts in the background; the training starts once it answers: sorted by node
    assert sorted(recorded(logs), key=lambda r: r["node"]) == [{"node": "nodeA", "argv": server},
                                                               {"node": "nodeB", "argv": trainer}]
    assert (logs / "curl").read_text().split() == ["http://192.0.2.11:8101/health"]  # waited for the server
    pid = int((logs / "server.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the server step outlived the batch script"


def test_the_slurm_script_stops_with_the_cause_when_a_node_has_no_address_on_the_interface(
        cluster, capsys, tmp_path):
    env, logs = cluster
    text = emitted(capsys, "slurm", "ascend-910b-2node", [])  # eth0, which these nodes do not have
    result = run_script(text, tmp_path, {**env, "SLURM_JOB_NODELIST": "nodeA,nodeB", "SHARED_IFACE": "ib1"})
    assert result.returncode == 1 and not (logs / "workbench").exists()
    assert "no IPv4 address on eth0" in result.stderr and "HCCL_SOCKET_IFNAME" in result.stderr


def test_the_slurm_script_gives_each_training_node_its_rank(cluster, capsys, tmp_path):
    env, logs = cluster
    overrides = ["distributed.nodes=3", "distributed.processes=1", "devices.env.GLOO_SOCKET_IFNAME=ib1"]
    text = emitted(capsys, "slurm", "smoke", overrides)
    result = run_script(text, tmp_path, {**env, "SLURM_JOB_NODELIST": "nodeA,nodeB,nodeC", "SHARED_IFACE": "ib1"})
    assert result.returncode == 0, result.stderr
    starts = plan_starts(capsys, "smoke", overrides + ["distributed.main_address=192.0.2.11"])
    assert [s[-1] for s in starts] == [f"distributed.node_rank={n}" for n in range(3)]
    runs = sorted(recorded(logs), key=lambda r: r["node"])
    assert runs == [{"node": n, "argv": s} for n, s in zip(("nodeA", "nodeB", "nodeC"), starts)]
    assert not (logs / "curl").exists()  # node 0 starts its own server: nothing to wait for


def test_the_shell_script_runs_the_plans_start_line_on_the_node_named(cluster, capsys, tmp_path):
    env, logs = cluster
    overrides = ["server.url=http://192.168.7.1:8101", "distributed.main_address=192.168.7.2", *IFACE, *PORTS]
    text = emitted(capsys, "shell", "ascend-910b-2node", overrides)
    assert "192.168.7.1" in text and "192.168.7.2" in text and "10.0.0." not in text
    server, trainer = plan_starts(capsys, "ascend-910b-2node", overrides)
    result = run_script(text, tmp_path, {**env, "SERVER_ELSEWHERE": "1"}, "0")
    assert result.returncode == 0, result.stderr
    assert recorded(logs) == [{"node": None, "argv": trainer}]
    assert (logs / "curl").read_text().split() == ["http://192.168.7.1:8101/health"]
    (logs / "workbench").unlink()
    serving = subprocess.Popen(["bash", str(tmp_path / "launch.sh"), "server"], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (logs / "server.pid").exists():
            time.sleep(0.1)
        assert recorded(logs) == [{"node": None, "argv": server}]
    finally:
        serving.kill()
        serving.wait()
    result = run_script(text, tmp_path, env, "1")
    assert result.returncode == 2 and "use one of: server 0" in result.stderr


def test_the_plan_warns_when_the_servers_url_and_port_disagree(capsys):
    assert main(["plan", "--recipe", "ascend-910b-2node", "server.port=8101"]) == 0
    assert "server.url names port 8001 but the server node listens on server.port=8101" in capsys.readouterr().out
