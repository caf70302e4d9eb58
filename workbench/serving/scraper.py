"""The Prometheus scraper: the vLLM server's `/metrics` page, parsed into rollout health (train/rollout.jsonl).

    record = scraper.parse(text)    # {"running": 32.0, "waiting": 0.0, "kv_cache_usage": 0.0078, ...}
    s = scraper.Scraper(url, headers); s.scrape()     # adds per-second rates since the last scrape

Parsed with prometheus_client's text parser. Names differ between vLLM releases (`kv_cache_usage_perc` was
`gpu_cache_usage_perc`); each field lists the names it accepts, and values are summed over labels (engines,
finish reasons). A page with none of the request gauges is not a vLLM metrics page: that raises, never zeros.

Generation apart from probes: a rollout asks for many tokens, a log-prob probe (the weight-parity canary, TRL's
sequence scoring) for one. vLLM's per-request histograms of the requested token budget tell them apart exactly:
`vllm:request_max_num_generation_tokens` counts each request once (a prompt with its n samples), and
`vllm:request_params_max_tokens` counts each sample; what falls in their first bucket (le="1.0") asked for one token.
So `generation_prompts` and `generation_sequences` are what the server generated for rollouts (or an evaluation),
`probe_requests` what it scored, whatever else shares the server.
"""
from __future__ import annotations

import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from workbench.errors import WorkbenchError

GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": ("vllm:num_preemptions", "vllm:num_preemptions_total"),
    "prompt_tokens": ("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens", "vllm:generation_tokens_total"),
    "requests_finished": ("vllm:request_success", "vllm:request_success_total"),
}
# field -> the histogram of requested tokens it is read from: one observation per request (a prompt and its n
# samples) or per sample. The field counts those that asked for more than one token; `probe_requests` the requests
# that asked for one.
HISTOGRAMS = {
    "generation_prompts": "vllm:request_max_num_generation_tokens",
    "generation_sequences": "vllm:request_params_max_tokens",
}
RATES = {"prompt_tokens": "prompt_tokens_per_s", "generation_tokens": "generation_tokens_per_s",
         "requests_finished": "requests_per_s", "preemptions": "preemptions_per_s"}


_WANTED = {name for names in {**GAUGES, **COUNTERS}.values() for name in names} | set(HISTOGRAMS.values())
_WANTED_SAMPLES = _WANTED | {f"{name}{suffix}" for name in _WANTED for suffix in ("_total", "_bucket", "_count")}


def _wanted_lines(text: str) -> str:
    """Only the families read here: vLLM's page is ~55 KB of histograms, and parsing all of it every second
    would be most of the sampler's cost (10 ms vs under 1 ms per scrape)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in _WANTED:
                keep.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in _WANTED_SAMPLES:
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for field, names in {**GAUGES, **COUNTERS}.items():
            if family.name not in names:
                continue
            total = sum(s.value for s in family.samples
                        if not s.name.endswith("_created") and not s.name.endswith("_bucket"))
            values[field] = values.get(field, 0.0) + total
        for field, name in HISTOGRAMS.items():
            if family.name == name:
                total, one = _count_and_first_bucket(family)
                values[field] = values.get(field, 0.0) + total - one
                if field == "generation_prompts":
                    values["probe_requests"] = values.get("probe_requests", 0.0) + one
    if "running" not in values:
        raise WorkbenchError("the /metrics page has no vllm:num_requests_running gauge",
                             "point the scraper at a vLLM server's /metrics (is this a vLLM server?)")
    return values


def _count_and_first_bucket(family) -> tuple[float, float]:
    """A histogram's sample count and how many fell at or below 1 (summed over engines and models)."""
    count = sum(s.value for s in family.samples if s.name.endswith("_count"))
    one = sum(s.value for s in family.samples if s.name.endswith("_bucket") and float(s.labels.get("le", "inf")) <= 1.0)
    return count, one


class Scraper:
    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 5.0):
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.last: tuple[float, dict] | None = None

    def scrape(self) -> dict:
        response = requests.get(self.url, headers=self.headers, timeout=self.timeout)
        response.raise_for_status()
        now = time.time()
        record = {"time": now, **parse(response.text)}
        if self.last is not None:
            then, before = self.last
            for counter, rate in RATES.items():
                if counter in record and counter in before and now > then:
                    record[rate] = max(0.0, record[counter] - before[counter]) / (now - then)
        self.last = (now, record)
        return record
