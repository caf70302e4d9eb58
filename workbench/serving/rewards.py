"""Learned rewards on the inference service: reward-model and judge engines beside the policy server, and the
reward functions that score a step's completions through them.

    from workbench.serving import rewards
    with rewards.RewardEngines(rr, log_dir=run.train.path) as engines:     # managed engines started, attached verified
        fns = [rewards.Scorer(rr, spec, engines.restarter(spec.name)) for spec in rr.task.reward_specs
               if spec.is_learned]                                      # TRL reward functions: fn(prompts, completions)

A `kind: model` reward is a sequence-classification checkpoint served by vLLM with `--runner pooling`, asked on
`POST /pooling` with the prompt and completion as chat messages (vLLM applies the reward model's chat template, as
the model saw them in training) and `use_activation` set from `score:` (logit or probability; vLLM's default is the
head's activation, so it is always said). A `kind: judge` reward is a chat model asked with its template on
`/v1/chat/completions`, greedily; its answer parsed to a number (number | yes_no | regex:...), optionally scaled
from `scale:` to 0..1. A judge named `policy-base` is the LoRA policy server's base model, asked by the server's
own name without an adapter: the frozen base, with no second copy of the weights.

A managed engine is a second vLLM process on the server role's devices (CPU: its cores, with its own KV space; a
card: its own `gpu_memory_utilization`, planned with the policy's by `workbench plan`), started, health-checked and
stopped by the same VLLMServer that runs the policy server, never with the weight-update endpoints (nothing is
pushed to it). `engine.mode: attach` uses one someone else serves (verified, keyed by `engine.api_key_env`).

A step's requests go out together (`concurrency` in flight; vLLM batches them in its engine). A request that fails
(refused, reset, an HTTP error, past `timeout_s`) or a judge answer that does not parse is a failed completion:
scored None and never a silent zero. The trainer then counts them over every rank (`reward/<name>/failed`),
drops the failed completions' groups (no advantage; workbench/training/scoring.py) or stops the run, as
`on_failure` and `max_failures` say (`Scorer.account`). An engine that stops answering /health is restarted (up to
`engine.max_restarts`) and the step's failed requests are sent once more.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import requests

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved
from workbench.recipe.resolve import looks_like_hub_id, reward_model_path, server_url
from workbench.recipe.resolve import Role
from workbench.records import append_event
from workbench.tasks.rewards import RewardFailure, completion_text
from workbench.tasks.rewardspec import LearnedReward, RewardSpec

PORT_OFFSET = 10  # a managed engine's default port: the policy server's + 10 + the reward's index among them
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def learned_specs(rr: Resolved) -> list[RewardSpec]:
    return [s for s in rr.task.reward_specs if s.is_learned]


def engine_specs(rr: Resolved) -> list[RewardSpec]:
    """The learned rewards that have an engine of their own (every one but a policy-base judge)."""
    return [s for s in learned_specs(rr) if not s.learned.on_policy_server]


def engine_resolved(rr: Resolved, spec: RewardSpec) -> Resolved:
    """The engine's own resolved recipe: the policy server's section with this engine's name, port, sizes and
    model; no adapters, no weight sync, on the server role's devices."""
    learned, e = spec.learned, spec.learned.engine
    names = [s.name for s in engine_specs(rr)]
    index = names.index(spec.name) if spec.name in names else len(names)  # a spec of no recipe: after them
    recipe = copy.deepcopy(rr.recipe)
    s = recipe.server
    recipe.peft = {}
    managed = e.managed
    recipe.server = dataclasses.replace(
        s, mode="managed" if managed else "attach", url=None if managed else e.url,
        port=e.port if e.port is not None else s.port + PORT_OFFSET + index,
        served_model_name=e.served_model_name or f"reward-{spec.name}",
        # the policy's parallel sizes: the engine spreads over the same server cards, an equal share of each
        max_model_len=e.max_model_len or s.max_model_len, dtype=e.dtype or s.dtype,
        gpu_memory_utilization=e.gpu_memory_utilization if e.gpu_memory_utilization is not None else 0.0,
        kv_cache_space_gib=e.kv_cache_space_gib, api_key_env=e.api_key_env if not managed else s.api_key_env,
        startup_timeout_s=e.startup_timeout_s or s.startup_timeout_s,
        max_restarts=e.max_restarts if e.max_restarts is not None else s.max_restarts,
        weight_sync="none", extra_args=[], max_num_seqs=None, max_num_batched_tokens=None,
        runner="pooling" if learned.kind == "model" else "generate", env={**s.env, **e.env})
    env = dict(rr.server.env)
    env.update(e.env)
    if rr.platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(e.kv_cache_space_gib)
    key = os.environ.get(recipe.server.api_key_env) if recipe.server.api_key_env else None
    # an attached engine's model is its owner's: a name here, not a path this machine must have
    model = reward_model_path(rr.recipe, learned) if managed else learned.model
    return dataclasses.replace(rr, recipe=recipe, source=None, model_path=model,
                               weight_sync="none", server_url=server_url(recipe), api_key=key,
                               server=Role(f"reward:{spec.name}", rr.server.devices, env))


def engine_problems(rr: Resolved) -> list[WorkbenchError]:
    """What would stop a reward engine from starting, found before any model build or server start (the training's
    preflight): the model's location (tiny-rm only on the tiny base; a directory that exists, or a hub id) and a
    managed engine's port free and its exposure allowed. Every problem, one line each."""
    from workbench.serving import launch

    problems: list[WorkbenchError] = []
    for spec in engine_specs(rr):
        where = f"rewards.{spec.name}"
        try:
            if spec.learned.model == "tiny-rm" and not rr.is_tiny:
                raise WorkbenchError(f"{where}.model is tiny-rm, which is built on the tiny base model, and this "
                                     "recipe's model is not tiny",
                                     f"set {where}.model to a reward model of your own (a directory or hub id)")
            err = engine_resolved(rr, spec)  # a directory that is not there, or not a model, is refused here
            if err.recipe.server.managed:
                launch.check_exposure(err)
                try:
                    launch.check_port_free(err.recipe.server.host, err.recipe.server.port)
                except WorkbenchError as exc:
                    raise WorkbenchError(exc.cause, f"stop that process, or give the engine a free port with "
                                                    f"{where}.engine.port=<port>") from None
        except WorkbenchError as exc:
            problems.append(WorkbenchError(exc.cause if exc.cause.startswith(where) else f"{where}: {exc.cause}",
                                           exc.fix))
    return problems


class RewardEngines:
    """The recipe's reward engines for one training: managed ones started (and stopped with this), attached ones
    verified. `restarter(name)` restarts one (the trainer's scorer calls it when the engine stops answering)."""

    def __init__(self, rr: Resolved, log_dir: Path | None = None, events: Path | None = None, log=print,
                 quiet: bool = True):
        from workbench.serving.server import VLLMServer

        self.rr, self.events, self.log = rr, events, log
        self.servers: dict[str, VLLMServer] = {}
        for spec in engine_specs(rr):
            err = engine_resolved(rr, spec)
            self.servers[spec.name] = VLLMServer(err, err.model_path, log_dir, quiet=quiet, name=f"reward-{spec.name}")
        self._lock = threading.Lock()

    def start(self) -> "RewardEngines":
        try:
            for name, srv in self.servers.items():
                if srv.recipe.server.managed and not Path(srv.model_path).is_dir() and \
                        not looks_like_hub_id(srv.model_path):
                    raise WorkbenchError(f"rewards.{name}: the reward model {srv.model_path} is not built",
                                         "build it first: workbench reward-model --recipe <the recipe>")
                srv.start()
                self.log(f"reward engine {name!r}: {srv.url} serving {srv.recipe.server.served_model_name!r}"
                         + (f", started in {srv.startup_seconds:.0f}s" if srv.startup_seconds else " (attached)"))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()

    def __enter__(self) -> "RewardEngines":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def restarts(self) -> dict[str, int]:
        return {name: srv.restarts for name, srv in self.servers.items()}

    def restarter(self, name: str) -> Callable[[], float | None] | None:
        """A callable that restarts engine `name` (None for an attached one or a judge on the policy server)."""
        srv = self.servers.get(name)
        if srv is None or not srv.recipe.server.managed:
            return None

        def restart() -> float | None:
            with self._lock:
                if srv.restarts >= srv.recipe.server.max_restarts:
                    raise WorkbenchError(f"the reward engine {name!r} died again after {srv.restarts} restart(s)",
                                         f"read its log ({srv.log_path}); raise rewards.{name}.engine.max_restarts")
                seconds = srv.restart()
            if self.events is not None:
                append_event(self.events, "reward_engine_restart", f"reward engine {name!r} restarted in "
                             f"{seconds:.0f}s", reward=name, seconds=seconds, restarts=srv.restarts)
            return seconds

        return restart


class Scorer:
    """One learned reward as a TRL reward function: fn(prompts, completions, **columns) -> list[float | None].

    After each call, `failed_now` holds the indices it could not score (their completions' groups are dropped by
    the trainer); `account()` applies the failure policy to a step's count over every rank."""

    def __init__(self, rr: Resolved, spec: RewardSpec, restart: Callable | None = None):
        self.spec, self.learned = spec, spec.learned
        self.__name__ = spec.name  # TRL names the metrics rewards/<name>/mean after it
        if self.learned.on_policy_server:
            self.url, self.headers = rr.server_url, rr.headers
            self.model = rr.recipe.server.served_model_name  # the base model: no adapter named
        else:
            err = engine_resolved(rr, spec)
            self.url, self.headers, self.model = err.server_url, err.headers, err.recipe.server.served_model_name
        self.restart = restart
        self.failed_now: list[int] = []
        self.failed_total = 0
        self.requests_total = 0
        self.restarts = 0
        self.seconds = 0.0
        self.last_errors: list[str] = []
        self._session = threading.local()

    # -- one completion ----------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> dict:
        session = getattr(self._session, "s", None)
        if session is None:
            session = self._session.s = requests.Session()
        response = session.post(f"{self.url}{path}", json=body, headers=self.headers,
                                timeout=self.learned.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:160]}")
        return response.json()

    def score_one(self, prompt, completion, row: dict) -> float:
        """One completion's score, or an exception saying why there is none."""
        if self.learned.kind == "model":
            messages = (list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}])
            messages = messages + [{"role": "assistant", "content": completion_text(completion)}]
            out = self._post("/pooling", {"model": self.model, "messages": messages,
                                          "use_activation": self.learned.score == "probability"})
            value = out["data"][0]["data"]
            value = value[0] if isinstance(value, list) else value
            return float(value)
        text = self.learned.template.format(**{**{k: v for k, v in row.items() if k != "prompt"},
                                               "question": question_text(prompt),
                                               "completion": completion_text(completion)})
        out = self._post("/v1/chat/completions", {"model": self.model, "temperature": 0.0,
                                                  "max_tokens": self.learned.max_tokens,
                                                  "messages": [{"role": "user", "content": text}]})
        return parse_judgement(self.learned, out["choices"][0]["message"]["content"] or "")

    # -- a step's completions ----------------------------------------------------------------------------------
    def _score_all(self, indices: list[int], prompts, completions, rows: list[dict], scores: list
                   ) -> dict[int, Exception]:
        errors: dict[int, Exception] = {}

        def one(i: int) -> None:
            try:
                value = self.score_one(prompts[i], completions[i], rows[i])
                if not math.isfinite(value):
                    raise ValueError(f"the score is {value}")
                scores[i] = value
            except Exception as exc:  # every failure is one failed completion, counted by the caller
                errors[i] = exc

        workers = max(1, min(self.learned.concurrency, len(indices)))
        with ThreadPoolExecutor(workers, thread_name_prefix=f"reward-{self.spec.name}") as pool:
            list(pool.map(one, indices))
        return errors

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", headers=self.headers, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def __call__(self, prompts, completions, **columns) -> list[float | None]:
        started = time.perf_counter()
        n = len(completions)
        rows = [{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n} for i in range(n)]
        scores: list[float | None] = [None] * n
        errors = self._score_all(list(range(n)), prompts, completions, rows, scores)
        # answered, but not a score (a judge's unparsed answer, a non-finite value): no restart would change it
        unanswered = [i for i, e in errors.items() if not isinstance(e, ValueError)]
        if unanswered and self.restart is not None and not self.healthy():
            # the engine is gone: a new one, and this step's unanswered requests once more
            self.restart()
            self.restarts += 1
            retried = self._score_all(unanswered, prompts, completions, rows, scores)
            errors = {i: e for i, e in errors.items() if i not in unanswered} | retried
        self.failed_now = sorted(errors)
        self.last_errors = [f"{type(errors[i]).__name__}: {str(errors[i])[:160]}" for i in self.failed_now[:3]]
        self.requests_total += n
        self.seconds += time.perf_counter() - started
        # the model's own values: `normalize: batch` and the failure counts are the trainer's, over every rank's
        # gathered batch (training/scoring.py), not one rank's share of it
        return scores

    @property
    def batch_normalised(self) -> bool:
        return self.learned.kind == "model" and self.learned.normalize == "batch"

    def totals(self) -> dict:
        """This reward's run so far: requests sent (this process), completions failed (every rank), engine
        restarts, seconds spent scoring (this process)."""
        return {"requests": self.requests_total, "failed": self.failed_total, "restarts": self.restarts,
                "seconds": round(self.seconds, 2)}

    def restore(self, totals: dict) -> None:
        """The totals a checkpoint saved (training/scoring.FailureLedger): a resumed run counts on from them."""
        self.requests_total = int(totals.get("requests", 0))
        self.failed_total = int(totals.get("failed", 0))
        self.restarts = int(totals.get("restarts", 0))
        self.seconds = float(totals.get("seconds", 0.0))

    def account(self, failed: int) -> None:
        """A step's failed completions over every rank, against the recipe's policy: the run stops with the cause
        when `on_failure: stop` meets one, or when more than `max_failures` have failed in all."""
        self.failed_total += failed
        if not failed:
            return
        why = "; ".join(self.last_errors) or "see the reward engine's log"
        where = f"rewards.{self.spec.name}"
        if self.learned.on_failure == "stop":
            raise RewardFailure(f"{where}: {failed} completion(s) could not be scored this step ({why}) and "
                                "on_failure is stop", f"fix the engine, or set {where}.on_failure: drop_group")
        if self.failed_total > self.learned.max_failures:
            raise RewardFailure(f"{where}: {self.failed_total} completions could not be scored in this run, over "
                                f"max_failures={self.learned.max_failures} (last: {why})",
                                f"fix the engine or the judge's parser, or raise {where}.max_failures")


class JudgementError(ValueError):
    """A judge's answer that does not parse to a score."""


def question_text(prompt) -> str:
    """The question a prompt asks: its last user message's text."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str((users or prompt)[-1].get("content", "")) if (users or prompt) else ""
    return str(prompt)


def parse_judgement(learned: LearnedReward, answer: str) -> float:
    """A judge's answer as its score, or JudgementError: the first number (number), yes/no (yes_no), or the
    pattern's group (regex:...); with `scale`, a number inside it mapped to 0..1, one outside it refused."""
    text = answer.strip()
    if learned.parser == "yes_no":
        word = re.match(r"\W*(yes|no)\b", text, re.IGNORECASE)
        if not word:
            raise JudgementError(f"no yes/no in {text[:60]!r}")
        return 1.0 if word.group(1).lower() == "yes" else 0.0
    if learned.pattern is not None:
        found = learned.pattern.search(text)
        raw = found.group(1) if found else None
    else:
        found = _NUMBER.search(text)
        raw = found.group(0) if found else None
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        value = None
    if value is None:
        raise JudgementError(f"no score in {text[:60]!r}")
    if learned.scale is not None:
        low, high = learned.scale
        if not low <= value <= high:
            raise JudgementError(f"{value:g} is outside the scale [{low:g}, {high:g}] in {text[:60]!r}")
        value = (value - low) / (high - low)
    return value


def describe(rr: Resolved) -> list[str]:
    """One line per reward for `workbench recipe show`: its kind, where it runs, and what memory it takes."""
    lines = []
    for spec in rr.task.reward_specs:
        head = f"rewards.{spec.name}: weight {spec.weight:g}, "
        if not spec.is_learned:
            lines.append(head + f"rule {spec.function}, in the trainer process (no memory of its own)")
            continue
        learned = spec.learned
        if learned.on_policy_server:
            lines.append(head + f"judge: the policy server's frozen base ({rr.recipe.server.served_model_name!r} "
                         f"without an adapter at {rr.server_url}), no memory of its own")
            continue
        err = engine_resolved(rr, spec)
        what = (f"reward model {err.model_path} ({learned.score}" + (", batch-normalised" if learned.normalize ==
                "batch" else "") + ")") if learned.kind == "model" else f"judge {err.model_path} ({learned.parser})"
        if not learned.engine.managed:
            lines.append(head + f"{what}, attached at {err.server_url} (someone else's engine)")
            continue
        if rr.platform == "cpu":
            weights = sum(f.stat().st_size for f in Path(err.model_path).glob("*.safetensors")) \
                if Path(err.model_path).is_dir() else None
            memory = (f"RAM: KV space {learned.engine.kv_cache_space_gib} GiB"
                      + (f" + weights {weights / 2**20:.1f} MiB" if weights is not None else " + its weights"))
        else:
            memory = f"gpu_memory_utilization {err.recipe.server.gpu_memory_utilization} of each server card"
        lines.append(head + f"{what}, its own engine at {err.server_url} on the server's devices "
                     f"{list(err.server.devices)}; {memory}")
    return lines
