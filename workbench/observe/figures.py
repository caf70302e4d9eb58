"""The training figure: one matplotlib figure with every curve a GRPO run needs, for the dashboard and the report.

    fig = figures.training_figure(rundata.load("runs/<id>"))
    png = plots.png_bytes(fig)

Panels: reward (total and per reward function), KL (the drift from the start, TRL's beside it), entropy, completion length (mean, max, clipped ratio),
learning signal (reward std, groups with no signal), step-time breakdown, device utilization per role, device
memory per role, and the server's concurrency with its generation throughput. A panel with no data says so
instead of drawing an empty axis.
"""
from __future__ import annotations

from collections import defaultdict

from workbench.plots import plt
from workbench.training.drift import KEY as DRIFT_KEY
from workbench.training.groups import zero_spread_key

# the phases that add up to a step: the trainer's wait for rollouts (all of the generation when synchronous, the
# part the step did not cover when async; runs from before the split logged only time/generation)
PHASES = [("time/rollout_wait", "waiting for rollouts"), ("time/weight_sync", "weight sync"), ("time/reward", "reward"),
          ("time/scoring", "log-probs & rest"), ("time/optimisation", "optimisation")]


def phase(row: dict, key: str) -> float:
    if key == "time/rollout_wait" and key not in row:
        return row.get("time/generation", 0.0)
    return row.get(key, 0.0)
ROLE_COLORS = {"server": "tab:blue", "trainer": "tab:orange"}


def _xy(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _smooth(xs: list[float], ys: list[float], points: int = 120) -> tuple[list[float], list[float]]:
    """A moving average when there are many more samples than a panel can show: at 1 Hz the server and the
    trainer alternate within a step, and the raw trace is a solid band."""
    window = len(ys) // points
    if window < 2:
        return xs, ys
    out_x, out_y = [], []
    for i in range(0, len(ys) - window + 1, window):
        out_x.append(xs[i + window // 2])
        out_y.append(sum(ys[i:i + window]) / window)
    return out_x, out_y


def _by_role(rows: list[dict], key: str, start: float) -> dict[str, tuple[list[float], list[float]]]:
    """Per role, the per-timestamp mean of `key` over that role's devices, against seconds since start."""
    buckets: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        value = row.get(key)
        if "error" in row or not isinstance(value, (int, float)):
            continue
        buckets[row.get("role", "?")][round(row["time"] - start, 1)].append(float(value))
    return {role: _smooth(sorted(b), [sum(b[t]) / len(b[t]) for t in sorted(b)]) for role, b in buckets.items()}


def training_figure(data, title: str | None = None):
    metrics = data.train_metrics
    fig, axes = plt.subplots(3, 3, figsize=(15, 10.5))
    fig.suptitle(title or f"GRPO run {data.run_dir.name}", fontsize=13)
    ax = axes.flat

    # reward, total and per function
    x, y = _xy(metrics, "reward")
    if x:
        ax[0].plot(x, y, label="total", color="black", lw=2)
        for key in sorted({k for r in metrics for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
            ax[0].plot(*_xy(metrics, key), label=key.split("/")[1], lw=1.2)
        ax[0].legend(fontsize=8)
        ax[0].set_title("reward (mean per completion)")
        points = getattr(data, "eval_curve", [])
        if points:  # the learning curve on a second axis: the held-out score of the served weights at each step
            twin = ax[0].twinx()
            twin.plot([p["step"] for p in points], [p["accuracy"] for p in points], "o-", color="tab:green", lw=1.5,
                      label=f"{points[0].get('split', 'validation')} accuracy")
            best = max(points, key=lambda p: (p["accuracy"], -p["step"]))
            twin.plot([best["step"]], [best["accuracy"]], "*", color="tab:green", ms=12)
            twin.set_ylim(0, 1)
            twin.set_ylabel("accuracy (learning curve)", fontsize=8)
            twin.legend(fontsize=8, loc="lower right")
    else:
        _empty(ax[0], "no reward logged yet")

    # KL: the workbench's drift from the starting weights on the probes (any beta), TRL's KL to its reference
    # model beside it (beta > 0 only)
    drawn = False
    for key, label, style in ((DRIFT_KEY, "from the start (probes)", "o-"), ("kl", "TRL's, to the reference", "-")):
        x, y = _xy(metrics, key)
        if x:
            ax[1].plot(x, y, style, color="tab:red" if key == "kl" else "tab:brown", ms=3, label=label)
            drawn = True
    if drawn:
        ax[1].set_title("KL (nats/token)")
        ax[1].legend(fontsize=8)
    else:
        _empty(ax[1], "no KL logged (monitor.drift_every = 0 and beta = 0)")
    x, y = _xy(metrics, "entropy")
    if x:
        ax[2].plot(x, y, color="tab:purple")
        ax[2].set_title("entropy (nats/token)")
    else:
        _empty(ax[2], "no entropy logged")

    x, y = _xy(metrics, "completions/mean_length")
    if x:
        ax[3].plot(x, y, label="mean")
        ax[3].plot(*_xy(metrics, "completions/max_length"), label="max", ls="--")
        ax[3].set_title("completion length (tokens)")
        cx, cy = _xy(metrics, "completions/clipped_ratio")
        if cx:
            twin = ax[3].twinx()
            twin.plot(cx, cy, color="tab:gray", lw=1, label="clipped ratio")
            twin.set_ylim(0, 1)
            twin.set_ylabel("clipped ratio", fontsize=8)
        ax[3].legend(fontsize=8, loc="lower right")
    else:
        _empty(ax[3], "no completion lengths logged yet")

    x, y = _xy(metrics, "reward_std")
    if x:
        ax[4].plot(x, y, label="reward std")
        ax[4].plot(*_xy(metrics, zero_spread_key(metrics)), label="groups with no signal")
        ax[4].legend(fontsize=8)
        ax[4].set_title("learning signal")
    else:
        _empty(ax[4], "no reward spread logged yet")

    steps = [r["step"] for r in metrics if "time/step" in r]
    if steps:
        stacks = [[phase(r, key) for r in metrics if "time/step" in r] for key, _ in PHASES]
        ax[5].stackplot(steps, *stacks, labels=[label for _, label in PHASES], alpha=0.85)
        ax[5].legend(fontsize=7, loc="upper left")
        ax[5].set_title("step time breakdown (s/step)")
    else:
        _empty(ax[5], "no step times logged yet")

    start = min((r["time"] for r in data.devices + data.rollout if "time" in r), default=0.0)
    for panel, key, title_text in ((ax[6], "util", "device utilization per role (%)"),
                                   (ax[7], "mem_used_mb", "device memory per role (MiB)")):
        if key == "util":  # on the CPU, what the role's own processes use; elsewhere the device counter
            series = _by_role(data.devices, "proc_util_pct", start) or _by_role(data.devices, "util_pct", start)
        else:
            series = _by_role(data.devices, key, start)
        if series:
            for role, (tx, ty) in sorted(series.items()):
                panel.plot(tx, ty, label=role, color=ROLE_COLORS.get(role))
            panel.legend(fontsize=8)
            panel.set_title(title_text)
            panel.set_xlabel("seconds", fontsize=8)
            if key == "util":
                panel.set_ylim(0, 105)
        else:
            _empty(panel, "no device samples")

    rows = [r for r in data.rollout if "running" in r]
    if rows:
        # at 1 Hz the requests come and go within a step: averaged over ~40 points, running as a shaded area and
        # waiting as a line, the generation rate on its own axis, one legend for all three
        t = [r["time"] - start for r in rows]
        tx, running = _smooth(t, [r["running"] for r in rows], points=40)
        handles = [ax[8].fill_between(tx, running, step="mid", alpha=0.35, color="tab:blue", label="running")]
        handles += ax[8].plot(*_smooth(t, [r.get("waiting", 0) for r in rows], points=40), color="tab:orange",
                              label="waiting")
        ax[8].set_ylim(bottom=0)
        ax[8].set_ylabel("requests", fontsize=8)
        ax[8].set_title("server requests in flight")
        ax[8].set_xlabel("seconds", fontsize=8)
        rates = [(ti, r["generation_tokens_per_s"]) for ti, r in zip(t, rows) if "generation_tokens_per_s" in r]
        if rates:
            twin = ax[8].twinx()
            handles += twin.plot(*_smooth([p[0] for p in rates], [p[1] for p in rates], points=40),
                                 color="tab:green", lw=1, label="tokens/s")
            twin.set_ylim(bottom=0)
            twin.set_ylabel("generated tokens/s", fontsize=8)
        ax[8].legend(handles=handles, fontsize=8, loc="upper left")
    else:
        _empty(ax[8], "no server metrics")

    for panel in list(ax)[:6]:
        if panel.has_data():
            panel.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    return fig
