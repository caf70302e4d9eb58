"""The live dashboard: follow a training from a notebook while another process trains.

    proc = launch.start_training(run)                 # `workbench train` in a subprocess (workbench.training.launch)
    dash = dashboard.Dashboard(run.train, process=proc)
    data = await dash.run()                           # in a notebook cell: until the run ends; Stop works meanwhile
    dash.follow()                                     # the same, blocking (a script: no widget events)

The training runs in its own process and the dashboard only tails the run directory (metrics.jsonl,
devices.jsonl, rollout.jsonl, the completions TRL logs), so the kernel stays responsive and a multi-process run
(`accelerate launch`) is followed the same way. The notebook awaits `run()`: while an async cell awaits, ipykernel
(7.4+, pinned) dispatches the widgets' comm messages, so the Stop button acts while the run trains — it writes
run_dir/STOP, and the trainer checkpoints and ends after its current step. (A blocking loop never lets the kernel read
the click; jupyter-ui-poll's way around that called a kernel method ipykernel 7.1 removed.) Until the first step is
logged the status shows the start-up (server, model) with the training log's latest line. When the run ends, the
live widget is replaced by a line saying so, and a static figure, the summary table and the advisor's findings
stay in the cell output as plain PNG and HTML, so papermill's executed notebook and its HTML export show them.
"""
from __future__ import annotations

import os
import subprocess
import time

from workbench import plots
from workbench.observe import advisor, figures
from workbench.observe.rundata import RunData
from workbench.observe.views import completions_html, events_html, findings_html, fmt_seconds, summary_rows, table_html
from workbench.rundir import TrainDir


class Dashboard:
    def __init__(self, train_dir: TrainDir, process: subprocess.Popen | None = None, refresh_s: float = 5.0,
                 completions_shown: int = 4):
        self.data = RunData(train_dir)
        self.process = process
        self.refresh_s = refresh_s
        self.completions_shown = completions_shown
        self._widgets = None
        self._handle = None
        self._started = time.time()
        self._drawn_rows = -1
        self._drawn_at = 0.0

    # --- widgets ------------------------------------------------------------------------------------------------
    def _build(self):
        import ipywidgets as w

        self.progress = w.IntProgress(value=0, min=0, max=max(1, self.data.max_steps() or 1), description="step")
        self.status = w.HTML()
        self.stop_button = w.Button(description="Stop (checkpoint first)", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        self.curves, self.advice, self.samples, self.events = w.Output(), w.HTML(), w.HTML(), w.HTML()
        tabs = w.Tab(children=[self.curves, self.advice, self.samples, self.events])
        for i, name in enumerate(("curves", "advisor", "completions", "events")):
            tabs.set_title(i, name)
        self._widgets = w.VBox([w.HBox([self.progress, self.status, self.stop_button]), tabs])
        return self._widgets

    def _on_stop(self, _button=None) -> None:
        self.data.dir.request_stop("Stop button")
        self.stop_button.disabled = True
        self.stop_button.description = "stopping after this step…"

    def _update(self) -> None:
        from IPython.display import Image

        self.data.refresh()
        prog = self.data.progress()
        if prog["max_steps"]:
            self.progress.max = prog["max_steps"]
        self.progress.value = min(prog["step"], self.progress.max)
        state = "finished" if prog["finished"] else ("stopping" if self.data.stop_requested else "training")
        if not self.data.metrics and not prog["finished"]:  # the server and the model are still loading
            state = f"starting ({fmt_seconds(time.time() - self._started)}): {self._log_line()}"
        if self.process is not None and self.process.poll() not in (None, 0):
            state = f"exited with {self.process.returncode} (see train.log)"
        canary = self.data.canary[-1] if self.data.canary else None
        restarts = sum(1 for e in self.data.events if e.get("kind") == "server_restart")
        self.status.value = (f"&nbsp;{state} · {fmt_seconds(prog['seconds_per_step'])}/step · "
                             f"ETA {fmt_seconds(prog['eta_seconds'])}"
                             + (f" · canary {canary['gap_mean']:.1g} ({canary['level']})" if canary else "")
                             + (f" · {restarts} server restart(s)" if restarts else ""))
        self.events.value = events_html(self.data.events) or "<p>No events: no fault, restart or alarm.</p>"
        rows = len(self.data.metrics)
        # A redraw costs 0.5-0.8 s of CPU (nine panels): only for a new training log, and not more often than
        # every 3 refreshes, or on a 2-core machine the dashboard would slow the run it watches.
        due = time.time() - self._drawn_at >= 3 * self.refresh_s or prog["finished"]
        if rows != self._drawn_rows and due:
            self._drawn_rows, self._drawn_at = rows, time.time()
            png = plots.png_bytes(figures.training_figure(self.data))
            self.curves.outputs = ()  # replaced, not appended: one current figure
            self.curves.append_display_data(Image(data=png))
            self.advice.value = findings_html(advisor.advise(self.data))
            self.samples.value = completions_html(self.data.latest_completions(self.completions_shown))

    def _running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return not self.data.finished

    def _log_line(self) -> str:
        """The training log's latest line (what start-up is doing), escaped for the status line."""
        import html

        try:
            with open(self.data.dir.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.data.dir.log) - 2000))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return html.escape(lines[-1][:120]) if lines else "launching the training process"

    def _open(self) -> None:
        from IPython.display import display

        self._started = time.time()
        self._handle = display(self._build(), display_id=True)
        try:
            os.nice(10)  # a viewer: on a machine the run fills (2 CPU cores), the trainer and server come first
        except OSError:
            pass

    def _timed_out(self, timeout_s: float | None) -> bool:
        return timeout_s is not None and time.time() - self._started >= timeout_s

    def _pauses(self, timeout_s: float | None):
        """The refresh loop, for `run` and `follow` alike: shows the widgets, refreshes every refresh_s, and yields
        each pause between checks for the caller to sleep (awaiting or blocking)."""
        self._open()
        while self._running() and not self._timed_out(timeout_s):
            self._update()
            next_at = time.time() + self.refresh_s
            while time.time() < next_at and self._running():
                yield 0.25

    async def run(self, timeout_s: float | None = None) -> RunData:
        """Show the widgets and refresh until the run ends (or timeout_s), then leave the static summary. Await it
        in a cell (`data = await dashboard.run()`): while it sleeps the kernel handles the Stop button."""
        import asyncio

        for pause in self._pauses(timeout_s):
            await asyncio.sleep(pause)
        return self._close()

    def follow(self, timeout_s: float | None = None) -> RunData:
        """`run()` for a caller that cannot await (a script): the same refreshes, but in a notebook a click on Stop
        waits until this returns; use `await run()` there, or `workbench stop RUN` from a terminal."""
        for pause in self._pauses(timeout_s):
            time.sleep(pause)
        return self._close()

    def _close(self) -> RunData:
        """The run ended: the live widget gives way to one line (no Stop left to click, no second figure), then
        the static record."""
        from IPython.display import HTML

        self._update()
        prog = self.data.progress()
        ended = ("stopped early" if self.data.stop_requested else "ended") + f" at step {prog['step']}"
        if self._handle is not None:
            self._handle.update(HTML(f"<p><i>Run {ended}; its record follows.</i></p>"))
        if self._widgets is not None:
            self._widgets.close()
        self.finish()
        return self.data

    def finish(self) -> None:
        """The static record of the run in the cell output (PNG + HTML): what papermill and nbconvert keep."""
        from IPython.display import HTML, Image, display

        self.data.refresh()
        display(Image(data=plots.png_bytes(figures.training_figure(self.data))))
        display(HTML(table_html(summary_rows(self.data))))
        display(HTML(findings_html(advisor.advise(self.data))))
        if self.data.events:
            display(HTML(events_html(self.data.events)))
        display(HTML(completions_html(self.data.latest_completions(self.completions_shown))))
        if self.process is not None and self.process.returncode not in (None, 0):
            tail = self.data.dir.log.read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"training exited with status {self.process.returncode}; last lines of "
                               f"{self.data.dir.log}:\n" + "\n".join(tail))
