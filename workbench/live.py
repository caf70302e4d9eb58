"""The live dashboard: follow a training run from a notebook while another process trains.

    proc = live.start_training(recipe, run_dir)      # `workbench train` in a subprocess, logging to run_dir/train.log
    dash = live.Dashboard(run_dir, process=proc)
    dash.follow()                                      # blocks until the run ends; the Stop button works meanwhile

The training runs in its own process and the dashboard only tails the run directory (metrics.jsonl,
devices.jsonl, rollout.jsonl, the completions TRL logs), so the kernel stays responsive and a multi-process run
(`accelerate launch`) is followed the same way. While the cell runs, widget events are processed between refreshes
(jupyter-ui-poll), which is what lets the Stop button act: it writes run_dir/STOP, and the trainer checkpoints and
ends after its current step. When the run ends, a static figure, the summary table and the advisor's findings are
left in the cell output as plain PNG and HTML, so papermill's executed notebook and its HTML export show them.
"""
from __future__ import annotations

import contextlib
import html
import os
import subprocess
import sys
import time
from pathlib import Path

from workbench import advisor, figures
from workbench.metrics import request_stop
from workbench.recipe import Recipe
from workbench.rundata import RunData


def start_training(recipe: Recipe, run_dir: Path, extra_env: dict | None = None) -> subprocess.Popen:
    """`workbench train` on the recipe as resolved in run_dir/recipe.yaml, in a subprocess; output to train.log."""
    from workbench.rundir import write_atomic

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
    log = open(run_dir / "train.log", "ab")
    cmd = [sys.executable, "-m", "workbench", "train", "--recipe", str(run_dir / "recipe.yaml"),
           "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=os.getcwd())


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    """The headline numbers of a run, as (name, value) rows."""
    rows = data.train_metrics
    prog = data.progress()
    out = [("steps", f"{prog['step']}" + (f" / {prog['max_steps']}" if prog["max_steps"] else ""))]
    if rows:
        first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]

        def avg(part, key):
            values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
            return sum(values) / len(values) if values else None

        for key, label in (("reward", "reward"), ("kl", "KL"), ("entropy", "entropy"),
                           ("completions/mean_length", "completion length"), ("frac_reward_zero_std",
                                                                             "groups with no signal")):
            a, b = avg(first, key), avg(last, key)
            if a is not None:
                out.append((f"{label} (first → last fifth)", f"{a:.3g} → {b:.3g}"))
        phases = [(key, f"  {label}") for key, label in figures.PHASES]
        for key, label in [("time/step", "step time (s)"), *phases, ("rollout/tokens_per_second", "rollout tokens/s")]:
            value = avg(rows, key)
            if value is not None:
                out.append((label, f"{value:.3g}"))
    summary = data.train_summary or {}
    monitor = summary.get("monitor") or {}
    if monitor.get("wall_seconds"):
        out.append(("sampler CPU time", f"{monitor['cpu_seconds']:.2f}s over {monitor['wall_seconds']:.0f}s "
                                        f"({monitor['core_share']:.2%} of a core)"))
    if summary.get("stopped_early_at") is not None:
        out.append(("stopped early", f"at step {summary['stopped_early_at']} (STOP)"))
    return out


def table_html(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td><td style='text-align:left'>"
                   f"{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def findings_html(findings: list[advisor.Finding]) -> str:
    if not findings:
        return f"<p>Advisor: none of its {len(advisor.RULES)} rules found a problem in the recorded data.</p>"
    items = "".join(f"<li><b>{html.escape(f.title)}</b> ({f.severity})<br>evidence: {html.escape(f.evidence)}"
                    f"<br>try: {html.escape(f.suggestion)}</li>" for f in findings)
    return f"<p>Advisor:</p><ul>{items}</ul>"


def completions_html(samples: list[dict]) -> str:
    if not samples:
        return "<p>No completions logged yet (trainer.log_completions).</p>"
    head = "<tr><th>step</th><th>prompt</th><th>completion</th><th>rewards</th></tr>"
    body = ""
    for s in samples:
        rewards = ", ".join(f"{k} {v:.2f}" for k, v in s.items()
                            if k not in ("step", "prompt", "completion") and v is not None)
        body += (f"<tr><td>{s['step']}</td><td style='text-align:left'>{html.escape(s['prompt'][-120:])}</td>"
                 f"<td style='text-align:left'><code>{html.escape(s['completion'][:200])}</code></td>"
                 f"<td>{html.escape(rewards)}</td></tr>")
    return f"<table>{head}{body}</table>"


class Dashboard:
    def __init__(self, run_dir: Path | str, process: subprocess.Popen | None = None, refresh_s: float = 5.0,
                 completions_shown: int = 4):
        self.data = RunData(run_dir)
        self.process = process
        self.refresh_s = refresh_s
        self.completions_shown = completions_shown
        self._widgets = None
        self._drawn_rows = -1
        self._drawn_at = 0.0

    # --- widgets ------------------------------------------------------------------------------------------------
    def _build(self):
        import ipywidgets as w

        self.progress = w.IntProgress(value=0, min=0, max=max(1, self.data.max_steps() or 1), description="step")
        self.status = w.HTML()
        self.stop_button = w.Button(description="Stop (checkpoint first)", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        self.curves, self.advice, self.samples = w.Output(), w.HTML(), w.HTML()
        tabs = w.Tab(children=[self.curves, self.advice, self.samples])
        for i, name in enumerate(("curves", "advisor", "completions")):
            tabs.set_title(i, name)
        self._widgets = w.VBox([w.HBox([self.progress, self.status, self.stop_button]), tabs])
        return self._widgets

    def _on_stop(self, _button=None) -> None:
        request_stop(self.data.run_dir, "Stop button")
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
        if self.process is not None and self.process.poll() not in (None, 0):
            state = f"exited with {self.process.returncode} (see train.log)"
        self.status.value = (f"&nbsp;{state} · {_fmt_seconds(prog['seconds_per_step'])}/step · "
                             f"ETA {_fmt_seconds(prog['eta_seconds'])}")
        rows = len(self.data.metrics)
        # A redraw costs 0.5-0.8 s of CPU (nine panels): only for a new training log, and not more often than
        # every 3 refreshes, or on a 2-core machine the dashboard would slow the run it watches.
        due = time.time() - self._drawn_at >= 3 * self.refresh_s or prog["finished"]
        if rows != self._drawn_rows and due:
            self._drawn_rows, self._drawn_at = rows, time.time()
            png = figures.png_bytes(figures.training_figure(self.data))
            self.curves.outputs = ()  # replaced, not appended: one current figure
            self.curves.append_display_data(Image(data=png))
            self.advice.value = findings_html(advisor.advise(self.data))
            self.samples.value = completions_html(self.data.latest_completions(self.completions_shown))

    def _running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return not self.data.finished

    def follow(self, timeout_s: float | None = None) -> RunData:
        """Show the widgets, refresh until the run ends (or timeout_s), then leave the static summary."""
        from IPython.display import display

        display(self._build())
        started = time.time()
        try:
            os.nice(10)  # a viewer: on a machine the run fills (2 CPU cores), the trainer and server come first
        except OSError:
            pass
        try:
            from jupyter_ui_poll import ui_events
            poller = ui_events()
        except Exception:  # outside a kernel (or without the package): refresh without processing clicks
            poller = None
        with (poller if poller is not None else contextlib.nullcontext()) as poll:
            while self._running() and (timeout_s is None or time.time() - started < timeout_s):
                self._update()
                next_at = time.time() + self.refresh_s
                while time.time() < next_at and self._running():
                    if poll is not None:
                        poll(10)  # widget events, e.g. the Stop button
                    time.sleep(0.5)
        self._update()
        self.finish()
        return self.data

    def finish(self) -> None:
        """The static record of the run in the cell output (PNG + HTML): what papermill and nbconvert keep."""
        from IPython.display import HTML, Image, display

        self.data.refresh()
        display(Image(data=figures.png_bytes(figures.training_figure(self.data))))
        display(HTML(table_html(summary_rows(self.data))))
        display(HTML(findings_html(advisor.advise(self.data))))
        display(HTML(completions_html(self.data.latest_completions(self.completions_shown))))
        if self.process is not None and self.process.returncode not in (None, 0):
            tail = (self.data.run_dir / "train.log").read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"training exited with status {self.process.returncode}; last lines of "
                               f"{self.data.run_dir / 'train.log'}:\n" + "\n".join(tail))
