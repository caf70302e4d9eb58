"""One vLLM server for several processes in turn: the stages of `workbench run`, the trainings of `workbench protocol`.

    shared = SharedServer(run.server.path, log)
    shared.open(rr, model_path)          # started, or the running one kept when its command line is the same
    with shared.answering():             # while a child process trains on it: its restart requests are carried out
        subprocess.call([... "workbench", "train", ...])   # its VLLMServer adopts the shared one (server.py)
    shared.close()

A server start is 20-60 s of imports and engine set-up on the CPU and minutes for a tensor-parallel model on
accelerators; a process that would start the same server (the same command line) adopts this one instead
(WORKBENCH_SHARED_SERVER, which child processes inherit). A training pushes its own weights before its first
rollout, so what an earlier process left in the server does not matter; an evaluation loads every model it scores
(evaluation/evaluate.py). A recipe whose server differs (another model, other flags) gets a server of its own:
`open` stops the running one first, on the same port.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from workbench.recipe import Resolved
from workbench.serving import launch
from workbench.serving.server import SHARED_ENV, VLLMServer, serve_shared_requests


class SharedServer:
    """The shared server's owner: starts, swaps and stops it, names it in the environment, answers restarts."""

    def __init__(self, home: Path | str, log=print) -> None:
        self.home = Path(home)  # its log and the restart request/answer files
        self.log = log
        self.server: VLLMServer | None = None
        self.command: list[str] | None = None
        self.restarts = 0

    def serves(self, rr: Resolved, model_path: str) -> bool:
        """Whether the running server is the one `rr` would start for `model_path`."""
        return self.server is not None and self.command == launch.command(rr, str(model_path))

    def open(self, rr: Resolved, model_path: str) -> VLLMServer:
        """The server `rr` would start for `model_path`, running and named in the environment: the current one when
        it is that server, else a new one (the current one stopped first). Start-up errors are raised."""
        if self.serves(rr, model_path):
            return self.server
        self.close()
        self.home.mkdir(parents=True, exist_ok=True)
        srv = VLLMServer(rr, str(model_path), self.home, quiet=True, for_training=True).start()
        self.server, self.command = srv, launch.command(rr, str(model_path))
        os.environ[SHARED_ENV] = json.dumps(srv.share(self.home))
        self.log(f"shared vLLM server: {srv.url}, up in {srv.startup_seconds:.0f}s (log: {srv.log_path})")
        return srv

    @contextlib.contextmanager
    def answering(self):
        """While a child process uses the server: answer its restart requests (a thread, every half second); a
        restarted server has a new process, which the next child learns from the environment."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(0.5):
                if self.server is not None and serve_shared_requests(self.server, self.home):
                    self.restarts += 1
                    os.environ[SHARED_ENV] = json.dumps(self.server.share(self.home))

        thread = threading.Thread(target=loop, name="shared-server", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)

    def close(self) -> None:
        os.environ.pop(SHARED_ENV, None)
        if self.server is not None:
            self.server.stop()
        self.server, self.command = None, None
