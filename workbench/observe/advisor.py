"""The advisor: rules over a run's recorded data that name the bottleneck, with evidence and the knob to turn.

    findings = advisor.advise(rundata.load("runs/<id>"))     # or advise(metrics=[...], devices=[...], ...)
    for f in findings: print(f.text())
    workbench advise runs/<id>

Each rule reads the records the run left (metrics.jsonl, devices.jsonl, rollout.jsonl, the resolved recipe) and
returns a Finding or None. None also when the data a rule needs is missing: a rule never guesses. The thresholds
are the field's rules of thumb (practitioners' reports of 8-card GRPO runs), kept here as named constants so a reader can argue with them.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from workbench.platform import limits
from workbench.training.drift import KEY as DRIFT_KEY
from workbench.training.dynamic import PROMPTS_PER_KEPT, UNFILLED, ZERO_SPREAD_GENERATED
from workbench.training.groups import ZERO_SPREAD_TOP, zero_spread_key

IDLE_SERVER_UTIL_PCT = 35.0      # server devices busier than this are not "idle"
GENERATION_BOUND_SHARE = 0.40    # generation this share of the step: the trainer waits for rollouts
LOW_CONCURRENCY_FRACTION = 0.5   # requests in flight below this share of a generation batch
LONG_TAIL_MAX_OVER_MEAN = 2.0    # per step, the longest completion vs the mean
CLIPPED_RATIO = 0.05             # share of completions cut at max_completion_length
STEP_TIME_CV = 0.30              # coefficient of variation of the step time
KL_SPIKE_FACTOR = 4.0            # a KL this many times its running median
KL_SPIKE_MIN = 0.05
ZERO_STD_FRACTION = 0.5          # groups in which every completion got the same reward: no signal
REWARD_DROP = 0.7                # the last third's reward below this share of the best window
SYNC_SHARE = 0.15                # weight sync this share of the step
DRIFT_RISE = 10.0                # the canary's gap, last third vs first third
SAMPLER_GAP_MIN = 1e-3           # nats/token: TRL's sampler-trainer gap worth a finding when it rises DRIFT_RISE-fold
MOVED_KL = 0.5                   # nats/token from the start on the probes: far for a run whose reward did not rise
STILL_KL = 1e-3                  # ... and so little that the updates are not moving the policy at all
REWARD_GAIN = 0.01               # the reward's last third over its first third that counts as a rise
RSS_GROWTH = 0.10                # a role's resident memory, end vs start of the run
FAR_FROM_CEILING = 0.25          # gauge/generation below this: the server decodes far under its cores' ceiling
RSS_GROWTH_MIN_MB = 200.0
LEARNED_RISE_SD = 0.5            # a learned reward's last third over its first, in its own standard deviations
VERIFIED_REWARDS = ("correctness",)  # rule rewards that verify the answer (format only checks its shape)


@dataclass
class Finding:
    rule: str
    severity: str  # "warning" | "info"
    title: str
    evidence: str
    suggestion: str

    def text(self) -> str:
        return f"[{self.severity}] {self.title}\n  evidence: {self.evidence}\n  try: {self.suggestion}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunRecords:
    """What the rules read; rundata.RunData provides the same attributes."""
    metrics: list[dict]
    devices: list[dict]
    rollout: list[dict]
    recipe: dict | None = None
    events: list[dict] = field(default_factory=list)
    canary: list[dict] = field(default_factory=list)
    limits: dict = field(default_factory=dict)  # the gauge's limits per role (limits.json; limits.basis)


def _series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _thirds(values: list[float]) -> tuple[list[float], list[float]]:
    n = max(1, len(values) // 3)
    return values[:n], values[-n:]


def _trainer(records) -> dict:
    return ((records.recipe or {}).get("trainer") or {})


def _role_util(records, role: str) -> list[float]:
    out = []
    for row in records.devices:
        if row.get("role") != role or "error" in row:
            continue
        value = row.get("proc_util_pct", row.get("util_pct"))  # on the CPU: what the role's processes use
        if isinstance(value, (int, float)):
            out.append(float(value))
    return out


def idle_server(records) -> Finding | None:
    server, trainer = _role_util(records, "server"), _role_util(records, "trainer")
    if len(server) < 5:
        return None
    s_mean, t_mean = statistics.fmean(server), _mean(trainer)
    if s_mean >= IDLE_SERVER_UTIL_PCT:
        return None
    optimisation = _mean(_series(records.metrics, "time/optimisation"))
    step = _mean(_series(records.metrics, "time/step"))
    generation = _mean(_series(records.metrics, "time/generation"))
    share = f", optimisation {optimisation / step:.0%} of each step" if optimisation and step else ""
    if generation and step:  # the same number `workbench bench` turns into rollout efficiency
        share += f"; the server generated during {min(1.0, generation / step):.0%} of each step"
    trainer_txt = f" while trainer devices average {t_mean:.0f}%" if t_mean is not None else ""
    overlap = ("" if _rollout_mode(records) == "async" else
               "overlap generation with training (rollout.mode: async, one step stale: `workbench bench` measures "
               "the gain on this machine), ")
    return Finding(
        "idle_server", "warning", "Inference devices are mostly idle",
        f"server devices average {s_mean:.0f}% utilization over {len(server)} samples{trainer_txt}{share}",
        f"the trainer side is the bottleneck: {overlap}move devices from devices.server to devices.trainer (or a "
        "smaller server tensor_parallel_size), or raise trainer.steps_per_generation so one rollout feeds several "
        "optimizer steps")


def _rollout_mode(records) -> str:
    return ((records.recipe or {}).get("rollout") or {}).get("mode", "sync")


def low_concurrency(records) -> Finding | None:
    # what the trainer waited for: the whole generation when synchronous, only the uncovered part when async
    generation = _series(records.metrics, "time/rollout_wait") or _series(records.metrics, "time/generation")
    step = _series(records.metrics, "time/step")
    running = [r["running"] for r in records.rollout if isinstance(r.get("running"), (int, float)) and r["running"] > 0]
    if not generation or not step or len(running) < 3:
        return None
    share = statistics.fmean(generation) / statistics.fmean(step)
    trainer = _trainer(records)
    batch = int(trainer.get("per_device_train_batch_size", 0)) * int(trainer.get("steps_per_generation") or 1)
    in_flight = statistics.fmean(running)
    if share < GENERATION_BOUND_SHARE or not batch or in_flight >= LOW_CONCURRENCY_FRACTION * batch:
        return None
    return Finding(
        "low_concurrency", "warning", "The trainer waits for rollouts the server runs few at a time",
        f"generation is {share:.0%} of each step; the server had {in_flight:.1f} requests in flight on average "
        f"while busy, for a generation batch of {batch} completions",
        "send more completions per generation (trainer.per_device_train_batch_size, trainer.steps_per_generation); "
        "check server.max_num_seqs and the KV cache (waiting requests, preemptions in rollout.jsonl)")


def long_tail(records) -> Finding | None:
    means, maxes = _series(records.metrics, "completions/mean_length"), _series(records.metrics, "completions/max_length")
    clipped = _series(records.metrics, "completions/clipped_ratio")
    steps = _series(records.metrics, "time/step")
    if len(means) < 3 or len(means) != len(maxes):
        return None
    ratio = statistics.median(m / a for m, a in zip(maxes, means) if a > 0)
    clip = _mean(clipped) or 0.0
    cv = statistics.pstdev(steps) / statistics.fmean(steps) if len(steps) >= 3 and statistics.fmean(steps) else 0.0
    reasons = []
    if ratio >= LONG_TAIL_MAX_OVER_MEAN:
        reasons.append(f"the longest completion of a step is {ratio:.1f}x the mean (median over {len(means)} logs)")
    if clip >= CLIPPED_RATIO:
        reasons.append(f"{clip:.0%} of completions hit max_completion_length")
    if cv >= STEP_TIME_CV and reasons:
        reasons.append(f"step time varies by {cv:.0%} (coefficient of variation)")
    if not reasons:
        return None
    limit = _trainer(records).get("max_completion_length")
    typical = statistics.median(maxes)
    return Finding(
        "long_tail", "warning", "Long-tail completions stretch the steps",
        "; ".join(reasons),
        (f"cap trainer.max_completion_length nearer the typical longest completion (~{typical:.0f} tokens"
         + (f", now {limit}" if limit else "") + "), set trainer.mask_truncated_completions=true so cut answers do "
         "not teach, and raise the server's max_num_batched_tokens so long and short sequences share batches"))


def kl_spikes(records) -> Finding | None:
    kl = _series(records.metrics, "kl")
    if len(kl) < 5:
        return None
    spikes = []
    for i in range(3, len(kl)):
        median = statistics.median(kl[:i])
        if kl[i] > KL_SPIKE_MIN and kl[i] > KL_SPIKE_FACTOR * max(median, 1e-6):
            spikes.append((i, kl[i], median))
    if not spikes:
        return None
    steps = [records.metrics[i].get("step") for i, *_ in spikes][:5]
    worst = max(spikes, key=lambda s: s[1])
    beta = _trainer(records).get("beta")
    return Finding(
        "kl_spikes", "warning", "KL to the reference spikes",
        f"{len(spikes)} log points with KL over {KL_SPIKE_FACTOR:g}x its running median (steps {steps}); worst "
        f"{worst[1]:.3g} vs median {worst[2]:.3g}",
        "lower trainer.learning_rate (or raise trainer.beta" + (f", now {beta}" if beta is not None else "")
        + "); clip gradients harder (trainer.max_grad_norm)")


def no_signal(records) -> Finding | None:
    """Most groups without reward spread. Under dynamic sampling the batch that trains is refilled, so the share
    read is the generated one (training/dynamic.py), and the finding says what the refills cost."""
    dynamic = any(ZERO_SPREAD_GENERATED in r for r in records.metrics)
    key = ZERO_SPREAD_GENERATED if dynamic else zero_spread_key(records.metrics)
    zero = _series(records.metrics, key)
    if len(zero) < 3:
        return None
    _, last = _thirds(zero)
    share = statistics.fmean(last)
    if share < ZERO_STD_FRACTION:
        return None
    gens = _trainer(records).get("num_generations")
    top = _series(records.metrics[-len(last):], ZERO_SPREAD_TOP)
    if not top:
        which = "if the rewards are all high, use harder prompts; if all low, easier ones or a shaped reward"
    elif statistics.fmean(top) >= 0.5:
        which = (f"{statistics.fmean(top):.0%} of them are all at the batch's best reward (solved): use harder "
                 "prompts (or drop solved ones)")
    else:
        which = (f"{1 - statistics.fmean(top):.0%} of them are all below the batch's best reward (failed alike): "
                 "use easier prompts or a shaped reward")
    fix = ("raise trainer.num_generations" + (f" (now {gens})" if gens else "") + " or trainer.temperature for "
           f"more varied completions; {which}")
    if not dynamic:
        return Finding(
            "no_signal", "warning", "Most groups carry no learning signal",
            f"in the last third of the run {share:.0%} of prompt groups gave every completion the same reward "
            f"({key}): GRPO's advantage is zero for them",
            fix + "; or set rollout.dynamic_sampling: true to replace them with groups of further prompts (more "
            "generation per step)")
    tail = records.metrics[-len(last):]
    cost = statistics.fmean(_series(tail, PROMPTS_PER_KEPT) or [1.0])
    unfilled = statistics.fmean(_series(tail, UNFILLED) or [0.0])
    return Finding(
        "no_signal", "warning", "Most generated groups carry no learning signal",
        f"in the last third of the run {share:.0%} of the generated groups had no reward spread; dynamic sampling "
        f"generated {cost:.2g} prompts per prompt trained and left {unfilled:.0%} of the batch's groups without "
        "signal",
        fix + ("; raise rollout.refill_cap to fill the rest (each refill is generation)" if unfilled > 0 else ""))


def reward_unstable(records) -> Finding | None:
    reward, std = _series(records.metrics, "reward"), _series(records.metrics, "reward_std")
    if len(reward) < 6:
        return None
    window = max(2, len(reward) // 6)
    rolling = [statistics.fmean(reward[i:i + window]) for i in range(len(reward) - window + 1)]
    best = max(rolling)
    first, last = _thirds(reward)
    last_mean = statistics.fmean(last)
    lr = _trainer(records).get("learning_rate")
    if best > 0 and last_mean < REWARD_DROP * best:
        return Finding(
            "reward_drop", "warning", "Reward fell after its peak",
            f"reward in the last third {last_mean:.3g}, best window {best:.3g}: the policy is unlearning",
            "lower trainer.learning_rate" + (f" (now {lr:g})" if isinstance(lr, (int, float)) else "")
            + ", raise trainer.beta to hold it near the reference, and check whether one reward (format?) is being "
            "satisfied at the expense of the other")
    if std:
        std_first, std_last = _thirds(std)
        if (statistics.fmean(last) <= statistics.fmean(first) + 0.01
                and statistics.fmean(std_last) >= 0.95 * statistics.fmean(std_first)):
            return Finding(
                "reward_flat", "info", "Reward is not improving and its spread is not shrinking",
                f"reward {statistics.fmean(first):.3g} -> {statistics.fmean(last):.3g} (first vs last third); "
                f"reward_std {statistics.fmean(std_first):.3g} -> {statistics.fmean(std_last):.3g}",
                "train longer, or raise trainer.learning_rate a little if KL stays small; check that the rewards "
                "score what you mean on a few completions")
    return None


def _learned_rewards(records) -> list[str]:
    rewards = (records.recipe or {}).get("rewards") or {}
    return [name for name, value in rewards.items()
            if isinstance(value, dict) and value.get("kind") in ("model", "judge")]


def reward_hacking(records) -> Finding | None:
    """A learned reward (a reward model or a judge) that rises while the verified accuracy does not: the policy is
    learning to please the scorer, not to get answers right."""
    learned = _learned_rewards(records)
    if not learned:
        return None
    verified = next((f"rewards/{n}/mean" for n in VERIFIED_REWARDS
                     if len(_series(records.metrics, f"rewards/{n}/mean")) >= 6), None)
    if verified is None:
        if any(len(_series(records.metrics, f"rewards/{n}/mean")) for n in VERIFIED_REWARDS) or \
                len(records.metrics) < 6:
            return None  # logged, but too few points to read a trend; or too short a run to say
        return Finding("reward_unverified", "info", "A learned reward trains without a verified one beside it",
                       f"rewards {', '.join(learned)} are learned, and no rule reward "
                       f"({', '.join(VERIFIED_REWARDS)}) is logged", "add `correctness: 0.0` to the rewards: it is "
                       "scored and logged (rewards/correctness/mean) without training on it, so reward hacking shows")
    right_first, right_last = _thirds(_series(records.metrics, verified))
    for name in learned:
        values = _series(records.metrics, f"rewards/{name}/mean")
        if len(values) < 6:
            continue
        first, last = _thirds(values)
        spread = statistics.pstdev(values) or 1e-9
        rise = (statistics.fmean(last) - statistics.fmean(first)) / spread
        right = statistics.fmean(right_last) - statistics.fmean(right_first)
        if rise > LEARNED_RISE_SD and right <= REWARD_GAIN:
            return Finding(
                "reward_hacking", "warning", f"Reward hacking: {name} rises, the verified accuracy does not",
                f"rewards/{name}/mean {statistics.fmean(first):.3g} -> {statistics.fmean(last):.3g} (first vs last "
                f"third, {rise:.1f} of its standard deviations), {verified} {statistics.fmean(right_first):.3g} -> "
                f"{statistics.fmean(right_last):.3g}",
                f"the policy pleases {name} without getting more answers right: give the verified rule weight "
                f"(rewards.correctness), lower rewards.{name}.weight, or retrain the reward model on this policy's "
                "completions; read the completions its score likes most (workbench report)")
    return None


def policy_drift(records) -> Finding | None:
    """The policy's KL from its starting weights (drift/kl_start, logged whatever beta is) against the reward: far
    from the start with no reward gain is a policy changing without learning; no movement at all, updates too small
    to matter."""
    drift, reward = _series(records.metrics, DRIFT_KEY), _series(records.metrics, "reward")
    if len(drift) < 3 or len(reward) < 6:
        return None
    first, last = _thirds(reward)
    gain = statistics.fmean(last) - statistics.fmean(first)
    if gain > REWARD_GAIN:
        return None
    lr = _trainer(records).get("learning_rate")
    now = f" (now {lr:g})" if isinstance(lr, (int, float)) else ""
    if drift[-1] >= MOVED_KL:
        return Finding(
            "policy_drift", "warning", "The policy moved far from its start without a reward gain",
            f"KL from the start {drift[-1]:.3g} nats/token on the probes (max {max(drift):.3g}); reward "
            f"{statistics.fmean(first):.3g} -> {statistics.fmean(last):.3g} (first vs last third)",
            f"lower trainer.learning_rate{now} or set trainer.beta > 0 to hold it near the start; read the "
            "completions: a reward being met off-task moves the policy without raising the score you want")
    if max(drift) < STILL_KL:
        return Finding(
            "policy_still", "info", "The policy is not moving",
            f"KL from the start at most {max(drift):.3g} nats/token on the probes, and the reward flat "
            f"({statistics.fmean(first):.3g} -> {statistics.fmean(last):.3g})",
            f"raise trainer.learning_rate{now}; check that groups have reward spread (no signal, no gradient)")
    return None


def sync_share(records) -> Finding | None:
    sync_s, step = _series(records.metrics, "time/weight_sync"), _series(records.metrics, "time/step")
    if not sync_s or not step:
        return None
    share = statistics.fmean(sync_s) / statistics.fmean(step)
    if share < SYNC_SHARE:
        return None
    return Finding(
        "sync_share", "warning", "Weight sync takes a large share of each step",
        f"weight sync {statistics.fmean(sync_s):.3g}s of a {statistics.fmean(step):.3g}s step ({share:.0%})",
        "use a collective sync where the hardware has one (server.weight_sync: nccl on CUDA, hccl on Ascend), put "
        "server.sync_dir on /dev/shm for reload, or raise trainer.steps_per_generation to sync less often")


def weight_drift(records) -> Finding | None:
    """The weight-parity canary: an alarm, or a gap that keeps rising while still under the alarm level."""
    gaps = [c for c in records.canary if c.get("reason") == "scheduled"]
    alarms = [c for c in records.canary if c.get("level") in ("warn", "stop")]
    if alarms:
        worst = max(alarms, key=lambda c: c["gap_mean"])
        return Finding(
            "weight_drift", "warning", "The server's weights drift from the trainer's",
            f"{len(alarms)} canary check(s) over the warning level; worst {worst['gap_mean']:.3g} nats/token at "
            f"step {worst['step']} ({worst['level']})",
            "the server is not sampling from the weights being trained: check server.weight_sync and the server "
            "log (a reload that fails quietly, a sleep-mode wake-up that restores old weights)")
    values = _series(gaps, "gap_mean")
    if len(values) >= 6:
        first, last = _thirds(values)
        if statistics.fmean(first) > 0 and statistics.fmean(last) > DRIFT_RISE * statistics.fmean(first):
            return Finding(
                "weight_drift", "info", "The weight-parity gap is rising",
                f"canary gap {statistics.fmean(first):.2g} → {statistics.fmean(last):.2g} nats/token (first → last "
                "third of the checks), still under the warning level",
                "watch it; a sync that loses precision (a lower-precision transfer, a missing tied weight) grows so")
    return None


def sampler_drift(records) -> Finding | None:
    """Signs of a sampler that left the trainer, without the canary (off, or a run from before it): TRL's own
    per-token log-prob gap between the sampler and the trainer (logged with vllm_importance_sampling_correction)
    rising through the run, and pushes that moved no bytes while the recipe syncs weights."""
    server = (records.recipe or {}).get("server", {})
    syncs = server.get("weight_sync", "auto") != "none" and server.get("mode") not in ("colocate", "off")
    empty = [int(r["step"]) for r in records.metrics
             if r.get("sync/count", 0) > 0 and r.get("sync/megabytes", 1) == 0 and "step" in r]
    if syncs and empty:
        return Finding(
            "sampler_drift", "warning", "Weight pushes moved no bytes",
            f"{len(empty)} log point(s) whose pushes carried 0 MB (steps {empty[:5]}"
            f"{'...' if len(empty) > 5 else ''}) while server.weight_sync is {server.get('weight_sync', 'auto')}",
            "the server samples from weights the trainer no longer has: check which parameters the sync sends "
            "(a LoRA adapter with no target modules, a ZeRO-3 shard that was not gathered) and the server log")
    gap = _series(records.metrics, "sampling/sampling_logp_difference/mean")
    if len(gap) >= 6:
        first, last = _thirds(gap)
        before, after = statistics.fmean(first), statistics.fmean(last)
        if after >= SAMPLER_GAP_MIN and after > DRIFT_RISE * max(before, 1e-12):
            return Finding(
                "sampler_drift", "warning", "The sampler's log-probs drift away from the trainer's",
                f"TRL's sampler − trainer gap {before:.2g} → {after:.2g} nats/token (first → last third of the run)",
                "the server is sampling from other weights than the trainer's (a sync that fails quietly, an "
                "adapter not applied) or the rollouts are ever staler: run with monitor.canary_every > 0 to tell "
                "which, check server.weight_sync and rollout.mode")
    return None


def server_faults(records) -> Finding | None:
    faults = [e for e in records.events if e.get("kind") == "server_fault"]
    if not faults:
        return None
    restarts = sum(1 for e in records.events if e.get("kind") == "server_restart")
    lost = [e for e in records.events if e.get("kind") == "server_lost"]
    return Finding(
        "server_faults", "warning", "The sampling server failed during training",
        f"{len(faults)} fault(s), {restarts} restart(s){', then the run stopped' if lost else ''}; first: "
        f"{faults[0].get('message', '')[:160]}",
        "read the server logs kept beside the run (vllm-server-*.before-restart-N.log): out of memory → lower "
        "server.gpu_memory_utilization or max_num_seqs; a hang → lower server.request_timeout_s to notice it sooner")


def memory_trend(devices: list[dict]) -> dict[str, dict]:
    """Per role, its processes' resident memory at the start and end of the run and the slope (MB per hour), from
    the device samples (one value per sample time: every core of a role repeats it)."""
    by_role: dict[str, dict[float, float]] = {}
    for row in devices:
        if isinstance(row.get("mem_used_mb"), (int, float)) and row.get("kind") == "cpu":
            by_role.setdefault(row["role"], {})[row["time"]] = float(row["mem_used_mb"])
    out = {}
    for role, series in by_role.items():
        points = sorted(series.items())
        if len(points) < 4:
            continue
        times, values = [t for t, _ in points], [v for _, v in points]
        n = max(1, len(values) // 10)
        start, end = statistics.median(values[:n]), statistics.median(values[-n:])
        hours = (times[-1] - times[0]) / 3600
        slope = statistics.linear_regression(times, values).slope * 3600 if len(set(times)) > 1 else 0.0
        out[role] = {"start_mb": start, "end_mb": end, "hours": hours, "slope_mb_per_hour": slope}
    return out


def memory_growth(records) -> Finding | None:
    grown = {role: t for role, t in memory_trend(records.devices).items()
             if t["end_mb"] - t["start_mb"] > max(RSS_GROWTH_MIN_MB, RSS_GROWTH * t["start_mb"])}
    if not grown:
        return None
    evidence = "; ".join(f"{role} {t['start_mb']:.0f} → {t['end_mb']:.0f} MB over {t['hours']:.2g} h "
                         f"({t['slope_mb_per_hour']:+.0f} MB/h)" for role, t in grown.items())
    return Finding("memory_growth", "warning", "Resident memory keeps growing", evidence,
                   "a long run will run out of memory at this slope: check what grows (python -X tracemalloc), "
                   "cap the glibc arenas (MALLOC_ARENA_MAX=2) and compare the slope")


def far_from_limits(records) -> Finding | None:
    """The trainer waits for rollouts while the server decodes far under what its cores or cards could for that
    batch (gauge/generation: training/gauge.py, the cores' measured limits or the cards' datasheet peaks)."""
    share = _series(records.metrics, "gauge/generation")
    step = _series(records.metrics, "time/step")
    # the wait for rollouts; runs from before it was logged apart waited for the whole (synchronous) generation
    wait = _series(records.metrics, "time/rollout_wait") or _series(records.metrics, "time/generation")
    if len(share) < 3 or not step or not wait:
        return None
    median, waited = statistics.median(share), statistics.fmean(wait) / statistics.fmean(step)
    if median >= FAR_FROM_CEILING or waited < GENERATION_BOUND_SHARE:
        return None
    training = _series(records.metrics, "gauge/optimisation")
    noun, gemm = limits.basis(records.limits)
    sheet = noun == "cards"
    also = f"; the optimisation at {statistics.median(training):.0%} of the trainer {noun}' {gemm}" \
        if training else ""
    where = ("check that the server's cards are not shared with another process" if sheet else
             "check the server's thread binding and core count (devices.server, VLLM_CPU_OMP_THREADS_BIND) and that "
             "nothing else runs on its cores")
    return Finding(
        "far_from_limits", "warning", f"Rollouts wait on a server that decodes far below its {noun}' ceiling",
        f"the generation ran at {median:.0%} of the server {noun}' {'datasheet ' if sheet else ''}decode ceiling "
        f"(median over {len(share)} steps) "
        f"while the trainer waited for rollouts {waited:.0%} of each step{also}",
        f"the server is not limited by its {noun}: decode more sequences at once (more prompts per step, "
        f"trainer.num_generations, or rollout.mode: async), {where}")


RULES: dict[str, Callable] = {fn.__name__: fn for fn in
                              (idle_server, low_concurrency, long_tail, kl_spikes, no_signal, reward_unstable,
                               reward_hacking, policy_drift, sync_share, weight_drift, sampler_drift, server_faults, memory_growth,
                               far_from_limits)}


def advise(records=None, *, metrics=None, devices=None, rollout=None, recipe=None) -> list[Finding]:
    if records is None:
        records = RunRecords(metrics or [], devices or [], rollout or [], recipe)
    elif not isinstance(records, RunRecords):  # a rundata.RunData: only the per-step lines are metrics
        records = RunRecords(list(getattr(records, "train_metrics", records.metrics)), records.devices,
                             records.rollout, records.recipe, list(getattr(records, "events", [])),
                             list(getattr(records, "canary", [])), dict(getattr(records, "limits", {}) or {}))
    findings = []
    for rule in RULES.values():
        finding = rule(records)
        if finding is not None:
            findings.append(finding)
    return findings
