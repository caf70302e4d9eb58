"""One self-contained HTML report per run: `runs/<id>/report.html`, to open in a browser or send to a colleague.

    workbench report runs/<id>          # rebuild it at any time, also for a run that crashed
    report.build(run)                   # run: a RunDir (or its path) -> Path of report.html

Everything is read from the run directory (nothing from memory), so a crashed or stopped run gets a report of
what it wrote. No external URL anywhere: CSS is inline, figures are base64 PNGs, links point to files inside the
run directory. Sections: outcome, stages, evaluation before vs after, base vs trained per problem (fixed, broken,
breakdowns by category and response length), training curves and summary, step-time
breakdown, advisor findings, sample completions, GRPO groups, smoke checks, serving sweep, offline generation, environment
and versions, the resolved recipe.
"""
from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

from workbench import plots, recipe
from workbench.evaluation import analysis
from workbench.evaluation.evaluate import Evaluation
from workbench.evaluation.sweep import HEADER as SWEEP_HEADER, Sweep
from workbench.observe import advisor, figures, views
from workbench.observe.rundata import RunData
from workbench.rundir import RunDir, TrainDir, write_atomic
from workbench.secrets import redact, scrub, secret_values
from workbench.serving.offline import OfflineResult
from workbench.training.smoke import SmokeChecks

STYLE = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#1f2328}
h1{font-size:24px}h2{font-size:19px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d0d7de;padding:3px 8px;font-size:13px;
text-align:right;vertical-align:top}th{background:#f6f8fa}td.l,th.l{text-align:left}
pre{background:#f6f8fa;padding:10px;font-size:12px;overflow-x:auto}img{max-width:100%}
.ok{color:#1a7f37;font-weight:bold}.bad{color:#cf222e;font-weight:bold}.warn{color:#9a6700;font-weight:bold}
.headline{font-size:18px;background:#f6f8fa;padding:10px;border-left:4px solid #0969da}
"""
# Counts the figures the browser decoded: the report test reads these attributes from the rendered page.
CHECK_SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = document.querySelectorAll('img.figure'), ok = 0;
  imgs.forEach(function (i) { if (i.complete && i.naturalWidth > 0) ok++; });
  document.body.setAttribute('data-figures', imgs.length);
  document.body.setAttribute('data-figures-rendered', ok);
});
</script>"""


def _e(value) -> str:
    return html.escape(str(value))


def _img(png: bytes, alt: str) -> str:
    return f"<img class='figure' alt='{_e(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


def _img_file(path: Path, alt: str) -> str:
    return _img(path.read_bytes(), alt) if path.exists() else ""


class Raw(str):
    """A table cell that is already HTML."""


def _table(header: list[str], rows: list[list], left: int = 1) -> str:
    head = "".join(f"<th class='{'l' if i < left else ''}'>{_e(h)}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td class='{'l' if i < left else ''}'>{v if isinstance(v, Raw) else _e(v)}</td>"
                                    for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _json(path: Path):
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError:
        return None


def _outcome(run: dict | None, evaluation: Evaluation | None) -> str:
    parts = []
    if run:
        if run.get("failed_stage"):
            parts.append(f"<span class='bad'>stage '{_e(run['failed_stage'])}' failed</span>: "
                         f"{_e(run.get('error', ''))}")
        else:
            parts.append(f"<span class='ok'>all {len(run.get('stages', []))} stages passed</span>")
    pair = evaluation.gain() if evaluation else None
    if pair:
        base, trained = pair
        gain = 100 * (trained.accuracy_mean - base.accuracy_mean)
        parts.append(f"{_e(trained.split_label)} accuracy <b>{100 * base.accuracy_mean:.1f}% → {100 * trained.accuracy_mean:.1f}%"
                     f"</b> (<b>{gain:+.1f} points</b>) on {trained.n} problems × {trained.repeats}")
    return f"<p class='headline'>{' · '.join(parts) or 'no stage results recorded'}</p>"


def _stages(run: dict | None) -> str:
    if not run:
        return ""
    rows = []
    for stage in run.get("stages", []):
        info = run.get("results", {}).get(stage, {})
        page = info.get("html")  # relative: the link stays inside the run directory
        rows.append([stage, info.get("status", "not run"), info.get("seconds", ""),
                     Raw(f"<a href='{_e(page)}'>{_e(page)}</a>") if page else "", info.get("log", "")])
    return "<h2>Stages</h2>" + _table(["stage", "status", "seconds", "executed notebook (HTML)", "log"], rows, left=2)


def _evaluation(run: RunDir) -> tuple[str, Evaluation | None]:
    evaluation = Evaluation.load(run.eval)
    if not evaluation or not evaluation.summaries:
        return "", None
    rows = [[e.model, f"{e.n} × {e.repeats}", f"{100 * e.accuracy_mean:.1f}% ± {100 * e.accuracy_std:.1f}",
             f"{100 * e.pass_at_1:.1f}%", f"{e.mean_output_tokens:.1f}", f"{100 * e.truncation_rate:.1f}%",
             e.unscored, e.errors, f"{e.requests_per_second:.1f}"] for e in evaluation.summaries]
    out = ("<h2>Evaluation through the server</h2>"
           + _table(["model", "n × repeats", "accuracy", "pass@1", "mean output tokens", "truncated", "unscored",
                     "errors", "requests/s"], rows)
           + _img_file(run.eval.figure, "accuracy before vs after"))
    by_model: dict[str, list] = {}
    for s in evaluation.samples:
        by_model.setdefault(s.model, []).append(s)
    samples = [[model, s.prompt[-80:], s.response[:120], s.gold, "yes" if s.correct else "no"]
               for model, items in by_model.items() for s in items[:4]]
    if samples:
        out += "<h3>Sample answers</h3>" + _table(["model", "prompt", "response", "gold", "correct"], samples, left=3)
    return out, evaluation


def _per_problem(run: RunDir, evaluation: Evaluation | None) -> str:
    """Base vs trained problem by problem: the outcome counts and every breakdown in one table. From analysis.json
    (notebook 05 writes it), else computed from the samples and the run's recipe (a `workbench eval` run)."""
    found = analysis.Analysis.load(run.eval)
    if found is None and evaluation is not None and len(evaluation.summaries) > 1 and run.recipe.exists():
        try:
            found = analysis.analyse(evaluation, recipe.load(str(run.recipe)))
        except Exception:  # a recipe that no longer loads (a data file gone): the rest of the report still comes
            return ""
    if found is None or not found.models:
        return ""
    first, second = found.models
    expected = " (expected counts over the repeats)" if found.repeats > 1 else ""
    return (f"<h2>Base vs trained per problem</h2><p>{_e(second)} vs {_e(first)} on {found.counts['n']} problems"
            f"{expected}: fixed should far outnumber broken, with the gain spread across categories."
            + (f" {_e(found.note)}." if found.note else "") + "</p>"
            + _table(analysis.COUNTS_HEADER, [found.counts_row()], left=0)
            + _table(analysis.BREAKDOWN_HEADER, found.table_rows(), left=2))


def _training(train_dir: TrainDir) -> str:
    if not train_dir.exists():
        return ""
    data = RunData(train_dir)
    data.refresh()
    out = "<h2>Training</h2>"
    title = f"GRPO · {train_dir.path.parent.name}/{train_dir.path.name}"
    out += _img(plots.png_bytes(figures.training_figure(data, title=title)), "training curves")
    out += _table(["", "value"], [list(r) for r in views.summary_rows(data)], left=1)
    out += _curve(data)
    if data.events:  # interruptions, restarts, alarms: what happened to the run, in order
        out += "<h3>Events</h3>" + views.events_html(data.events)
    steps = [r for r in data.train_metrics if "time/step" in r]
    if steps:
        def mean(key):
            values = [figures.phase(r, key) for r in steps]
            return sum(values) / len(values)
        total = mean("time/step")
        rows = [[label, f"{mean(key):.3f}", f"{100 * mean(key) / total:.0f}%"] for key, label in figures.PHASES]
        rows.append(["whole step", f"{total:.3f}", "100%"])
        out += "<h3>Step-time breakdown (mean over the run)</h3>" + _table(["phase", "seconds/step", "share"], rows)
        out += _rollouts(data, steps)
    findings = advisor.advise(data)
    out += "<h2>Advisor</h2>"
    if findings:
        out += _table(["finding", "evidence", "suggested change"],
                      [[f"{f.title} ({f.severity})", f.evidence, f.suggestion] for f in findings], left=3)
    else:
        out += f"<p>None of the {len(advisor.RULES)} rules ({', '.join(advisor.RULES)}) found a problem.</p>"
    completions = data.latest_completions(6)
    if completions:
        out += "<h3>Latest training completions</h3>" + views.completions_html(completions)
    out += _groups(train_dir)
    summary = data.train_summary
    if summary is None:
        out += ("<p class='bad'>No train.json: the training did not finish (crashed or killed). The curves show every "
                "step it logged.</p>")
    return out


def _curve(data: RunData) -> str:
    """The learning curve's points: the served weights of each step scored during training (eval.every_steps)."""
    points = data.eval_curve
    if not points:
        return ""
    best = max(points, key=lambda p: (p["accuracy"], -p["step"]))
    kept = [p for p in points if p.get("best")]  # eval.keep_best: each new best replaced train/best

    def note(p: dict) -> str:
        return ("best" if p is best else "") + (" · kept in train/best" if kept and p is kept[-1] else "")

    rows = [[p["step"], f"{p['accuracy']:.1%}", f"{p.get('format_rate', float('nan')):.0%}",
             f"{p.get('generated_tokens', 0):,}", f"{p['seconds']:.1f}", note(p)] for p in points]
    return (f"<h3>Learning curve ({_e(points[0].get('split', 'validation'))}, {points[0]['n']} problems, during "
            f"training)</h3><p>Best at step {best['step']}: {best['accuracy']:.1%}; last (step {points[-1]['step']}): "
            f"{points[-1]['accuracy']:.1%}.</p>"
            + _table(["step", "accuracy", "format", "tokens generated so far", "seconds", ""], rows, left=0))


def _groups(train_dir: TrainDir) -> str:
    """From the group record: how many groups carried a learning signal over the run, and a few groups of the last
    recorded step as the trainer saw them (completions, each reward, advantage, length)."""
    from workbench.observe import groups  # pandas: only for a run that recorded groups

    if not groups.files(train_dir):
        return ""
    record = groups.load(train_dir)
    if record.empty:
        return ""
    table = groups.per_step(record)
    zero = float((table["zero_spread"] * table["groups"]).sum() / table["groups"].sum())
    first, last = table.iloc[0], table.iloc[-1]
    out = (f"<h3>GRPO groups</h3><p>{int(table['groups'].sum())} groups recorded over {len(table)} steps "
           f"(<code>{_e(train_dir.groups.relative_to(train_dir.path.parent))}/</code>; browse them with "
           f"<code>groups.inspector(run.train)</code> in notebook 04): <b>{100 * zero:.0f}%</b> had zero reward "
           f"spread, i.e. no learning signal (step {int(first['step'])}: {100 * first['zero_spread']:.0f}%, "
           f"step {int(last['step'])}: {100 * last['zero_spread']:.0f}%); "
           f"{100 * float(record['truncated'].mean()):.0f}% of completions were cut off.</p>")
    for title, rows in groups.illustrative(record):
        out += groups.group_html(rows, title, max_chars=240)
    return out


def _rollouts(data: RunData, steps: list[dict]) -> str:
    """How stale the batches were and how far the sampler's log-probs were from the trainer's: the price of async
    rollouts (and, when synchronous, a check that the sync is exact)."""
    def values(key):
        return [r[key] for r in steps if isinstance(r.get(key), (int, float))]

    mode = ((data.recipe or {}).get("rollout") or {}).get("mode", "sync")
    rows = []
    for key, label, fmt in (("rollout/staleness", "staleness (optimizer steps between sampler and trainer)", "{:.2f}"),
                            ("time/generation", "server generation (s/step)", "{:.3f}"),
                            ("time/rollout_wait", "trainer waited for it (s/step)", "{:.3f}"),
                            ("sampling/sampling_logp_difference/mean", "sampler − trainer log-prob gap (mean)", "{:.2e}"),
                            ("sampling/sampling_logp_difference/max", "sampler − trainer log-prob gap (max)", "{:.2e}"),
                            ("sampling/importance_sampling_ratio/min", "importance-sampling ratio (min)", "{:.3f}"),
                            ("sampling/importance_sampling_ratio/max", "importance-sampling ratio (max)", "{:.3f}")):
        found = values(key)
        if found:
            rows.append([label, fmt.format(sum(found) / len(found)), fmt.format(max(found) if "min" not in key
                                                                                 else min(found))])
    if not rows:
        return ""
    return (f"<h3>Rollouts ({_e(mode)})</h3>"
            + _table(["", "mean over the run", "worst step"], rows))


def _smoke(run: RunDir) -> str:
    checks = SmokeChecks.load(run.smoke)
    if not checks:
        return ""
    rows = [[c.name, "pass" if c.ok else "FAIL", c.detail] for c in checks.checks]
    return "<h2>Smoke run checks</h2>" + _table(["check", "result", "detail"], rows, left=3)


def _serving(run: RunDir) -> str:
    sweep = Sweep.load(run.serving)
    if not sweep:
        return ""
    return ("<h2>Serving: throughput vs concurrency</h2>" + _table(SWEEP_HEADER, sweep.rows())
            + _img_file(run.serving.figure, "throughput vs concurrency"))


def _offline(run: RunDir) -> str:
    data = OfflineResult.load(run.offline)
    if not data:
        return ""
    rows = [[r["question"][:70], r["completion"][:100], r["answer"], "yes" if r["correct"] else "no"]
            for r in data.rows[:6]]
    return (f"<h2>Offline generation (vLLM LLM.generate)</h2><p>{len(data.rows)} prompts: accuracy "
            f"{100 * data.accuracy:.0f}%, answer format {100 * data.format_rate:.0f}%, "
            f"{data.tokens_per_second:.0f} tokens/s, engine up in {data.init_seconds:.0f}s.</p>"
            + _table(["question", "completion", "gold", "correct"], rows, left=3))


def _environment(run: RunDir) -> str:
    out = "<h2>Environment and versions</h2>"
    environment = _json(run.environment)
    if environment:
        rows = [[k, v] for k, v in (environment.get("versions") or {}).items()]
        rows += [[k, v] for k, v in redact(environment.get("variables") or {}).items()]
        rows += [[k, environment[k]] for k in ("platform", "machine", "cpus", "memory_gib") if k in environment]
        out += _table(["", "value"], rows, left=2)
    env = _json(run.env_check)
    if env:
        rows = [[c["status"], c["group"], c["name"], c["found"], c["fix"]] for c in env.get("checks", [])]
        out += (f"<p>Environment check: {'<span class=ok>OK</span>' if env.get('ok') else '<span class=bad>FAILED</span>'}"
                f" on {_e(env.get('platform'))}</p>" + _table(["status", "group", "check", "found", "what to do"], rows,
                                                              left=5))
    return out if (environment or env) else ""


def _recipe(run: RunDir) -> str:
    if not run.recipe.exists():
        return ""
    return f"<h2>Recipe (resolved)</h2><pre>{_e(run.recipe.read_text())}</pre>"


def build(run: RunDir | Path | str) -> Path:
    """Write the run's report.html from what its directory holds; returns its path."""
    run = run if isinstance(run, RunDir) else RunDir.open(run)
    record = _json(run.record)
    evaluation, evals = _evaluation(run)
    body = [f"<h1>GRPO Workbench report · {_e(run.path.name)}</h1>",
            f"<p>Built {time.strftime('%Y-%m-%d %H:%M:%S')} from <code>{_e(run.path.resolve())}</code>.</p>",
            _outcome(record, evals), _stages(record), evaluation, _per_problem(run, evals), _training(run.train),
            _smoke(run), _serving(run), _offline(run), _environment(run), _recipe(run)]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>GRPO report {_e(run.path.name)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}{CHECK_SCRIPT}</body></html>")
    # Completions, logs and check findings quote whatever a stage printed: every known secret value goes, as it is
    # and as the page escapes it.
    values = secret_values(names=[_api_key_env(run)])
    return write_atomic(run.report, scrub(page, values | {_e(v) for v in values}))


def _api_key_env(run: RunDir) -> str:
    """The name of the variable that holds the run's API key (its value is a secret whatever the name)."""
    try:
        import yaml

        return ((yaml.safe_load(run.recipe.read_text()) or {}).get("server") or {}).get("api_key_env") or ""
    except Exception:  # no or a broken recipe copy: the report is still written
        return ""
