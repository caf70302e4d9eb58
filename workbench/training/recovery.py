"""Surviving a server that dies or hangs during training: restart it, push the current weights, prove it, go on.

    recovery = Recovery(rr, train_dir, restart=srv.restart)          # one process: the server is ours
    recovery = Recovery(rr, train_dir, restart=RestartRequest(train_dir))  # a rank: `workbench train` owns it
    client.recovery = recovery                                       # workbench.serving.sync.SyncingVLLMClient

A request that fails (connection refused or reset, a timeout after server.request_timeout_s) while /health does not
answer is a server fault. The trainer's main rank then has the server restarted with the same recipe (bounded by
server.max_restarts), reconnects the weight sync, pushes the weights it holds now, runs the weight-parity canary
(workbench/training/canary.py) to prove the server has them, and repeats the failed request. Each fault and
restart is a line of the run's events.jsonl, shown by the dashboard and the report.

When that is impossible (restarts used up, or sharded parameters with server.max_restarts 0) the run ends with
ServerLost, which says how to resume from the last checkpoint. With sharded parameters (ZeRO-3/FSDP) a push needs
every rank, and the others are waiting in a collective by then: the main rank pushes its host copy of the last
push instead (workbench/training/trainer.py, `_keeping`).

With several trainer ranks the server belongs to the `workbench train` process, not to the rank that notices the
fault: the rank writes a restart request into the training directory and `serve_restart_requests` (run by
`workbench train` while it waits for the ranks) restarts the server and answers.
"""
from __future__ import annotations

import time
from typing import Callable

import requests
import urllib3

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.records import append_event
from workbench.rundir import TrainDir
from workbench.serving.server import answer_restart, ask_restart


class ServerLost(WorkbenchError):
    """The server could not be brought back: the run stops (resumable from its last checkpoint)."""


def resume_hint(train_dir: TrainDir) -> str:
    return f"fix the server's cause (its log is in {train_dir.path}), then resume: workbench train --resume {train_dir.path.parent}"


def timed_out(exc: BaseException) -> bool:
    """A request that timed out. requests raises its Timeout for a connect or header timeout, but a read timeout while
    the body streams arrives as ConnectionError wrapping urllib3's ReadTimeoutError (requests/models.py iter_content)."""
    if isinstance(exc, requests.Timeout):
        return True
    cause = exc.args[0] if isinstance(exc, requests.ConnectionError) and exc.args else None
    return isinstance(cause, urllib3.exceptions.ReadTimeoutError) or "Read timed out" in str(exc)


def server_healthy(url: str, headers: dict | None = None, timeout: float = 5.0) -> bool:
    try:
        return requests.get(f"{url}/health", headers=headers, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


class Recovery:
    """Restart, reconnect, re-push, prove: bounded by server.max_restarts for the whole run."""

    def __init__(self, rr: Resolved, train_dir: TrainDir, restart: Callable[[], float | None], log=print) -> None:
        self.rr = rr
        self.train_dir = train_dir
        self.restart = restart
        self.log = log
        self.max_restarts = rr.recipe.server.max_restarts
        self.restarts = 0
        self.repush: Callable[[], None] | None = None  # set by the generation backend; None when it cannot alone
        self.after: Callable[[str], None] | None = None  # the canary, run once the weights are back
        self.step: Callable[[], int] = lambda: -1
        self._busy = False

    def is_fault(self, exc: BaseException) -> bool:
        """A timeout is a hung server; any other failure counts only when /health no longer answers."""
        if timed_out(exc):
            return True
        if isinstance(exc, WorkbenchError) and not isinstance(exc, ServerLost) and "answered HTTP 5" not in str(exc):
            return False  # our own checks (a refused reset, a bad reload answer from a live server)
        return not server_healthy(self.rr.server_url, self.rr.headers)

    def handle(self, client, what: str, exc: BaseException) -> None:
        """Called with the failure of `what`; returns once the server is back with the current weights (the caller
        repeats its request), raises the original error when it was not a server fault, ServerLost when it gives up."""
        if self._busy or not self.is_fault(exc):
            raise exc
        step = self.step()
        kind = "Timeout" if timed_out(exc) else type(exc).__name__  # one word for a hang, however requests wraps it
        cause = f"{kind}: {str(exc)[:200]}"
        append_event(self.train_dir.events, "server_fault", f"{what} failed at step {step}: {cause}", step=step)
        self.log(f"server fault during {what} at step {step} ({cause})")
        if self.repush is None:
            self._lost(step, f"the server failed during {what} ({cause}) and the weights are sharded over the ranks, "
                             "so the main rank cannot push them to a new server alone")
        if self.restarts >= self.max_restarts:
            self._lost(step, f"the server failed during {what} ({cause}) after {self.restarts} restart(s) "
                             f"(server.max_restarts={self.max_restarts})")
        self._busy = True  # a failure inside the recovery is not recovered recursively
        try:
            started = time.time()
            self.restarts += 1
            self.log(f"restarting the server ({self.restarts}/{self.max_restarts})")
            try:
                self.restart()
                client.weight_sync.reconnect(client, client.device)
                self.repush()
            except Exception as again:
                self._lost(step, f"the restart after the fault during {what} failed: {type(again).__name__}: "
                                 f"{str(again)[:300]}")
            seconds = time.time() - started
            append_event(self.train_dir.events, "server_restart",
                         f"server restarted and the step-{step} weights pushed again in {seconds:.0f}s "
                         f"(restart {self.restarts} of at most {self.max_restarts})", step=step, seconds=round(seconds, 1))
            self.log(f"server back after {seconds:.0f}s with the current weights; continuing")
            if self.after is not None:
                self.after("after restart")
        finally:
            self._busy = False

    def _lost(self, step: int, why: str) -> None:
        append_event(self.train_dir.events, "server_lost", why, step=step)
        raise ServerLost(why, resume_hint(self.train_dir))


class RestartRequest:
    """A rank's way of asking `workbench train` (which owns the server) for a restart; waits for the answer.
    `reward`: the engine of that learned reward instead of the policy server (serving/rewards.py)."""

    def __init__(self, train_dir: TrainDir, timeout: float, reward: str | None = None) -> None:
        self.train_dir = train_dir
        self.timeout = timeout
        self.files = (train_dir.reward_restart_files(reward) if reward is not None
                      else (train_dir.restart_request, train_dir.restart_answer))

    def __call__(self) -> float | None:
        return ask_restart(*self.files, self.timeout, "`workbench train`").get("seconds")


def serve_restart_requests(train_dir: TrainDir, restart: Callable[[], float | None] | None,
                           engines=None) -> bool:
    """Answer a pending restart request of a rank (called in `workbench train`'s wait loop), for the policy server
    and for each managed reward engine (`engines`: serving.rewards.RewardEngines); True when one was served."""
    served = answer_restart(train_dir.restart_request, train_dir.restart_answer, restart) if restart else False
    for name in (engines.servers if engines is not None else {}):
        again = engines.restarter(name)
        if again is not None:
            served = answer_restart(*train_dir.reward_restart_files(name), again) or served
    return served
