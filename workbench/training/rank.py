"""One trainer process: a rank under `accelerate launch`, or the single trainer `workbench train` starts with the
trainer role's environment; the run's recipe, the already running server, this process's share.

    accelerate launch --config_file RUN/train/accelerate.yaml -m workbench.training.rank --train-dir RUN/train
    python -m workbench.training.rank --train-dir RUN/train          # the single trainer (launch.trainer_processes)

Started by `workbench train` (workbench/training/train.py) after it has started the run's one server; the command
is also what a user re-runs by hand on each node. Every rank reads the training's recipe.yaml (its own, or the run's); the server's process id
comes in WORKBENCH_SERVER_PID (for the device sampler on the main rank).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from workbench.errors import WorkbenchError, exit_on_sigterm
from workbench.rundir import TrainDir, write_atomic


def _deepspeed_cpu_collectives(rr) -> None:
    """CPU ZeRO ranks use gloo's collectives, as DDP's do. DeepSpeed's CPU backend would otherwise build its
    shared-memory all-reduce op at the first start (deepspeed/comm/torch.py, build_shm_op): about a minute with
    the machine's C++ compiler, and a failed rank where there is none, for a speed-up that matters only for large
    CPU all-reduces. Marked unsupported, the op is skipped the way DeepSpeed skips it off Linux."""
    if rr.platform != "cpu" or rr.recipe.distributed.strategy != "deepspeed":
        return
    import deepspeed.ops  # lazy: deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main(argv: list[str] | None = None) -> int:
    from workbench import recipe, tinymodel  # lazy: yaml
    from workbench.training.train import run_trainer  # lazy: torch

    parser = argparse.ArgumentParser(prog="python -m workbench.training.rank")
    parser.add_argument("--train-dir", required=True)
    parser.add_argument("--resume-from", help="a checkpoint directory to continue from (workbench train --resume)")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # the parent's end (PR_SET_PDEATHSIG) or a kill: the sync's RAM-disk files are removed
    try:
        train_dir = TrainDir(args.train_dir)
        rr = recipe.resolve(recipe.load(str(train_dir.recipe)))
        model_path = tinymodel.ensure_model(rr)
        _deepspeed_cpu_collectives(rr)
        server_pid = int(os.environ["WORKBENCH_SERVER_PID"]) if os.environ.get("WORKBENCH_SERVER_PID") else None
        # the server belongs to `workbench train` on node 0 (when it manages one): the main rank asks it for restarts
        restart = None
        if rr.recipe.server.managed and rr.recipe.distributed.node_rank == 0:
            from workbench.training.recovery import RestartRequest  # lazy: requests

            restart = RestartRequest(train_dir, timeout=rr.recipe.server.startup_timeout_s + 60)
        reward_restart = {}
        if rr.recipe.distributed.node_rank == 0:  # the reward engines belong to `workbench train` on node 0 too
            from workbench.serving.rewards import engine_specs  # lazy: requests
            from workbench.training.recovery import RestartRequest

            reward_restart = {s.name: RestartRequest(train_dir, (s.learned.engine.startup_timeout_s
                                                      or rr.recipe.server.startup_timeout_s) + 60, reward=s.name)
                              for s in engine_specs(rr) if s.learned.engine.managed}
        run_trainer(rr, train_dir, model_path, server_pid=server_pid, server_url=rr.server_url, restart=restart,
                    resume_from=Path(args.resume_from) if args.resume_from else None, reward_restart=reward_restart)
    except WorkbenchError as exc:
        print(f"error (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr)
        if os.environ.get("RANK", "0") == "0":  # the parent raises it as it is (its class, cause and fix)
            write_atomic(TrainDir(args.train_dir).failure,
                         json.dumps({"kind": type(exc).__name__, "cause": exc.cause, "fix": exc.fix}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
