"""HTML views of a training: the summary table, advisor findings and sample completions, as plain HTML strings.

    from workbench.observe import views
    views.table_html(views.summary_rows(data))      # data: observe.rundata.RunData

Shared by the live dashboard (notebook 04) and the report, so both show the same numbers the same way.
"""
from __future__ import annotations

import html

from workbench.observe import advisor, figures
from workbench.platform import limits
from workbench.observe.rundata import RunData
from workbench.training.drift import KEY as DRIFT_KEY
from workbench.training.dynamic import PROMPTS_PER_KEPT, UNFILLED, ZERO_SPREAD_GENERATED
from workbench.training.groups import zero_spread_key


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 10:  # a step time: 1.7 s is not "1s"
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def curve_rows(points: list[dict], metrics: list[dict]) -> list[tuple[str, str]]:
    """The learning curve in two rows: start → best (its step) → last, and what scoring it cost the training."""
    if not points:
        return []
    best = max(points, key=lambda p: (p["accuracy"], -p["step"]))  # the earliest of equal scores
    split = points[0].get("split", "validation")
    out = [(f"{split} accuracy during training (start → best → last)",
            f"{points[0]['accuracy']:.1%} (step {points[0]['step']}) → {best['accuracy']:.1%} (step {best['step']}) "
            f"→ {points[-1]['accuracy']:.1%} (step {points[-1]['step']}), {len(points)} points of {points[0]['n']}")]
    per_step = [r["time/eval_curve"] for r in metrics if isinstance(r.get("time/eval_curve"), (int, float))]
    step = [r["time/step"] for r in metrics if isinstance(r.get("time/step"), (int, float))]
    seconds = sum(p.get("seconds", 0.0) for p in points)
    cost = f"{seconds:.1f}s in all"
    if per_step and step and sum(step):
        cost += f", {sum(per_step) / sum(step):.1%} of the step time"
    out.append(("learning curve's cost", cost))
    return out


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    """The headline numbers of a run, as (name, value) rows."""
    rows = data.train_metrics
    prog = data.progress()
    out = [("steps", f"{prog['step']}" + (f" / {prog['max_steps']}" if prog["max_steps"] else ""))]
    if rows:
        first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]

        def avg(part, key):
            if key == "time/rollout_wait":  # runs from before the wait was split from the generation
                part = [{key: figures.phase(r, key)} for r in part if "time/step" in r]
            values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
            return sum(values) / len(values) if values else None

        for key, label in (("reward", "reward"), ("kl", "KL"), ("entropy", "entropy"),
                           ("completions/mean_length", "completion length"),
                           (zero_spread_key(rows), "groups with no signal")):
            a, b = avg(first, key), avg(last, key)
            if a is not None:
                out.append((f"{label} (first → last fifth)", f"{a:.3g} → {b:.3g}"))
        a, b = avg(first, ZERO_SPREAD_GENERATED), avg(last, ZERO_SPREAD_GENERATED)
        if a is not None:  # dynamic sampling (training/dynamic.py): what was generated, before the refill
            out.append(("generated groups with no signal (first → last fifth)", f"{a:.3g} → {b:.3g}"))
            out.append(("prompts generated per prompt trained", f"{avg(rows, PROMPTS_PER_KEPT):.3g} (dynamic "
                                                                 f"sampling; {avg(rows, UNFILLED):.0%} of slots "
                                                                 "left without signal)"))
        drift = [(r["step"], r[DRIFT_KEY]) for r in rows if isinstance(r.get(DRIFT_KEY), (int, float))]
        if drift:  # logged every monitor.drift_every steps: the newest point, and the largest so far
            step, value = drift[-1]
            out.append(("KL from the start (probes)", f"{value:.3g} at step {step} (max {max(v for _, v in drift):.3g})"))
        phases = [(key, f"  {label}") for key, label in figures.PHASES]
        for key, label in [("time/step", "step time (s)"), *phases, ("rollout/tokens_per_second", "rollout tokens/s"),
                           ("rollout/staleness", "rollout staleness (steps)")]:
            value = avg(rows, key)
            if value is not None:
                out.append((label, f"{value:.3g}"))
        # training/gauge.py: a CPU's cores measured when training began, or an accelerator's datasheet peaks
        noun, gemm = limits.basis(data.limits)
        for key, label in (("gauge/generation", f"generation, share of the server {noun}' decode ceiling"),
                           ("gauge/optimisation", f"optimisation, share of the trainer {noun}' {gemm}")):
            value = avg(rows, key)
            if value is not None:
                out.append((label, f"{value:.0%}"))
    out += curve_rows(data.eval_curve, rows)
    summary = data.train_summary or {}
    monitor = summary.get("monitor") or {}
    if monitor.get("wall_seconds"):
        out.append(("sampler CPU time", f"{monitor['cpu_seconds']:.2f}s over {monitor['wall_seconds']:.0f}s "
                                        f"({monitor['core_share']:.2%} of a core)"))
    cost = data.gauge_cost
    if cost and summary.get("train_seconds"):
        out.append(("roofline gauge's cost", f"{cost['cpu_seconds']:.2f} CPU-s measuring the limits before the first "
                                            f"step ({cost['cpu_seconds'] / summary['train_seconds']:.2%} of a core "
                                            "over the training)"))
    adapter = summary.get("adapter") or {}
    if adapter:
        out.append(("LoRA adapter", f"rank {adapter.get('rank')}, {adapter.get('bytes', 0) / 1e6:.2f} MB a push, "
                                    f"named {adapter.get('prefix')}* on the server"))
    shared = adapter.get("shared_with") or sorted({e["adapter"].rsplit(".s", 1)[0] + ".s" for e in data.events
                                                   if e.get("kind") == "server_shared" and e.get("adapter")})
    if shared:
        out.append(("server shared with", ", ".join(f"{p}*" for p in shared)))
    if summary.get("stopped_early_at") is not None:
        out.append(("stopped early", f"at step {summary['stopped_early_at']} (STOP)"))
    if data.canary:
        worst = max(data.canary, key=lambda c: c["gap_mean"])
        out.append(("weight-parity canary", f"{len(data.canary)} checks, latest {data.canary[-1]['gap_mean']:.2g}, "
                                            f"worst {worst['gap_mean']:.2g} nats/token (step {worst['step']})"))
    kinds = [e.get("kind") for e in data.events]
    if kinds:
        out.append(("events", ", ".join(f"{kinds.count(k)} {k.replace('_', ' ')}" for k in dict.fromkeys(kinds))))
    for role, trend in advisor.memory_trend(data.devices).items():
        out.append((f"{role} memory (RSS)", f"{trend['start_mb']:.0f} → {trend['end_mb']:.0f} MB "
                                            f"({trend['slope_mb_per_hour']:+.0f} MB/h)"))
    for rank in data.ranks():
        cores = f", cores {rank['cores']}" if str(rank.get("device", "")).startswith("cpu") else ""
        # the physical card (nvidia-smi's / npu-smi's number), not the index inside the rank's visible devices
        card = f" (card {rank['card']})" if rank.get("card") is not None else ""
        out.append((f"trainer rank {rank['rank']}", f"{rank['device']}{card}{cores}, pid {rank['pid']}"))
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


def events_html(events: list[dict]) -> str:
    """The run's events (server faults and restarts, resumes, canary alarms), oldest first."""
    if not events:
        return ""
    import time as _time

    rows = "".join(f"<tr><td>{_time.strftime('%H:%M:%S', _time.localtime(e.get('time', 0)))}</td>"
                   f"<td>{html.escape(str(e.get('step', '')))}</td><td>{html.escape(e.get('kind', ''))}</td>"
                   f"<td style='text-align:left'>{html.escape(e.get('message', ''))}</td></tr>" for e in events)
    return f"<table><tr><th>time</th><th>step</th><th>event</th><th>what happened</th></tr>{rows}</table>"


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
