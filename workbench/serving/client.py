"""Talking to a vLLM server over HTTP: served models, verification against the recipe, chat, log-probs, /metrics.

    from workbench.serving import client
    client.verify(rr)                               # the served name is right and its context fits the recipe
    client.chat(rr, "What is 12 + 34?")
    client.sequence_logprobs(rr, token_ids)        # the server's log-probs of a sequence (teacher forcing)

Every call takes the resolved recipe, which carries the URL and the bearer header: no second copy of either.
A URL that is not a vLLM server, a missing key or a wrong served name each get one clear error line.
"""
from __future__ import annotations

import requests

from workbench.errors import WorkbenchError
from workbench.recipe import Resolved


def served_models(rr: Resolved, url: str | None = None, timeout: float = 10.0) -> list[dict]:
    """The /v1/models entries of a server, or a clear error when the URL is not a vLLM server."""
    url = url or rr.server_url
    try:
        response = requests.get(f"{url}/v1/models", headers=rr.headers, timeout=timeout)
    except requests.RequestException as exc:
        raise WorkbenchError(f"no server answers at {url} ({exc.__class__.__name__})",
                             "start it, or fix server.url / server.port") from None
    if response.status_code == 401:
        key_env = rr.recipe.server.api_key_env
        if key_env:
            raise WorkbenchError(f"the server at {url} refused the key in ${key_env} (server.api_key_env): HTTP 401",
                                 f"set {key_env} to the key the server was started with (its --api-key / "
                                 "VLLM_API_KEY)")
        raise WorkbenchError(f"the server at {url} wants an API key (HTTP 401) and server.api_key_env is not set",
                             "set server.api_key_env to the name of the variable holding the server's key")
    try:
        data = response.json()["data"]
        assert isinstance(data, list) and all("id" in m for m in data)
    except Exception:
        raise WorkbenchError(f"{url} is not a vLLM server (GET /v1/models answered HTTP {response.status_code} "
                             "without a model list)", "point server.url at a vLLM OpenAI-compatible server") from None
    return data


def check_key(rr: Resolved) -> None:
    """The key the recipe names is there: server.api_key_env set means its variable holds a key (a managed server
    would start without one, an attached one would answer 401 mid-start). An attached server is asked too, so a
    wrong key is one line here, not an error after the model is built."""
    key_env = rr.recipe.server.api_key_env
    if key_env and not rr.api_key:
        raise WorkbenchError(f"server.api_key_env names ${key_env}, which is not set (or empty) in this environment",
                             f"export {key_env}=<the server's key> before starting, or drop server.api_key_env")
    if rr.recipe.server.attached:
        served_models(rr)  # a missing or wrong key: one line naming server.api_key_env


LORA_PREFIX = "wbl."  # the workbench's adapter names on a server: wbl.<run tag>.s<step>.t<unix time>


def adapter_pushed_at(name: str) -> float | None:
    """When a workbench adapter was pushed (from its name); None for any other model or adapter name."""
    if not name.startswith(LORA_PREFIX):
        return None
    last = name.rsplit(".", 1)[-1]
    return float(last[1:]) if last.startswith("t") and last[1:].isdigit() else None


def is_stale(name: str, stale_s: float, now: float) -> bool:
    """A workbench adapter not re-pushed for `stale_s` (its run is gone): the one rule for freeing a slot."""
    pushed = adapter_pushed_at(name)
    return pushed is not None and now - pushed >= stale_s


def lora_server(url: str, headers: dict, rank: int, timeout: float = 30.0) -> dict | None:
    """What a server says of its LoRA settings (`/server_info?config_format=json`, a development endpoint):
    {'max_lora_rank', 'slots'}; an error line when it serves no LoRA, loads none at run time, or takes a lower rank;
    None when it does not tell (a release without the JSON form: the recipe's values are all there is)."""
    try:
        response = requests.get(f"{url}/server_info", params={"config_format": "json"}, headers=headers,
                                timeout=timeout)
        info = response.json() if response.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return None
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        return None
    lora = config.get("lora_config")
    if not lora:
        raise WorkbenchError(f"the server at {url} was started without LoRA (--enable-lora), so it cannot load the "
                             "run's adapter", "start it from a recipe with a peft: section (managed, or `workbench "
                             "serve --for-training`), or choose another server.weight_sync")
    if str((info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("1", "true"):
        raise WorkbenchError(f"the server at {url} serves LoRA but loads no adapter at run time "
                             "(VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set)",
                             "restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the workbench sets it for the servers "
                             "it starts for training)")
    limit = int(lora.get("max_lora_rank") or 0)
    if limit and rank > limit:
        raise WorkbenchError(f"peft.r={rank} is above the server's --max-lora-rank {limit}",
                             f"lower peft.r to {limit} or less, or restart the server with server.max_lora_rank "
                             f"of {rank} or more")
    return {"max_lora_rank": limit, "slots": int(lora.get("max_cpu_loras") or lora.get("max_loras") or 0)}


def check_lora_room(rr: Resolved, need: int = 2, own: str | None = None) -> None:
    """Before a LoRA run takes a slot on an attached (shared) server: it loads adapters at run time, of this rank,
    and has `need` slots free once the adapters of dead runs (not re-pushed for server.lora_stale_s) are counted
    out. One clear line otherwise, before any model is built."""
    import time

    s = rr.recipe.server
    told = lora_server(rr.server_url, rr.headers, rr.recipe.lora_rank)
    slots = (told or {}).get("slots") or s.lora_slots
    now = time.time()
    held = [m["id"] for m in served_models(rr) if m.get("parent")]
    live = [n for n in held if n != own and not is_stale(n, s.lora_stale_s, now)]
    if len(live) + need > slots:
        raise WorkbenchError(
            f"the server at {rr.server_url} holds {len(live)} adapter(s) of other runs "
            f"({', '.join(live[:4])}{' ...' if len(live) > 4 else ''}) and has {slots} LoRA slots; a run needs {need}",
            "wait for a run to finish, start the shared server with more server.lora_slots, or lower "
            "server.lora_stale_s so that dead runs' adapters are freed sooner")


def served_entry(rr: Resolved, url: str | None = None) -> dict:
    """The /v1/models entry of the recipe's served name, or an error listing the names the server does serve."""
    url = url or rr.server_url
    models = served_models(rr, url)
    names = [m["id"] for m in models]
    wanted = rr.recipe.server.served_model_name
    entry = next((m for m in models if m["id"] == wanted), None)
    if entry is None:
        raise WorkbenchError(f"the server at {url} does not serve {wanted!r}; it serves {names}",
                             f"set server.served_model_name to one of {names} (requests naming another model get 404)")
    return entry


def verify(rr: Resolved, url: str | None = None) -> dict:
    """Check that the server serves the recipe's model name with a context that fits; returns its /v1/models entry."""
    url = url or rr.server_url
    recipe = rr.recipe
    entry = served_entry(rr, url)
    wanted = recipe.server.served_model_name
    if entry.get("owned_by") != "vllm" or "max_model_len" not in entry:
        raise WorkbenchError(f"{url} serves {wanted!r} but is not a vLLM server (no max_model_len in /v1/models)",
                             "training needs vLLM's extra endpoints: point server.url at a vLLM server")
    needed = recipe.data.max_prompt_length + recipe.max_completion_length
    if entry["max_model_len"] < needed:
        raise WorkbenchError(
            f"the server's max_model_len is {entry['max_model_len']}, below max prompt ({recipe.data.max_prompt_length})"
            f" + completion ({recipe.max_completion_length}) = {needed} tokens",
            f"restart it with --max-model-len {needed} or more (server.max_model_len), or shorten the lengths")
    if recipe.server.managed and entry["max_model_len"] != recipe.server.max_model_len:
        raise WorkbenchError(f"the server reports max_model_len {entry['max_model_len']}, the recipe asked for "
                             f"{recipe.server.max_model_len}", "check server.extra_args for a conflicting flag")
    return entry


def sequence_logprobs(rr: Resolved, token_ids: list[int], url: str | None = None, model: str | None = None
                      ) -> list[float]:
    """The server's log-probability of each token of `token_ids` after the first (teacher forcing, temperature 1),
    under `model` (an adapter's name on a LoRA server; default the served model). Unanswered after
    server.request_timeout_s, the server counts as hung (the canary asks after every push)."""
    body = {"model": model or rr.recipe.server.served_model_name, "prompt": [token_ids], "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0}
    response = requests.post(f"{url or rr.server_url}/v1/completions", json=body, headers=rr.headers,
                             timeout=rr.recipe.server.request_timeout_s)
    if response.status_code != 200:
        raise WorkbenchError(f"prompt_logprobs request failed with HTTP {response.status_code}: {response.text[:200]}",
                             "check the server log")
    positions = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(pos[str(tok)]["logprob"]) for pos, tok in zip(positions, token_ids[1:])]




def chat(rr: Resolved, content: str, max_tokens: int = 48, temperature: float = 0.0, url: str | None = None,
         **extra) -> dict:
    """One chat completion against the served name; returns the OpenAI response body."""
    body = {"model": rr.recipe.server.served_model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": temperature, **extra}
    response = requests.post(f"{url or rr.server_url}/v1/chat/completions", json=body, headers=rr.headers, timeout=120)
    if response.status_code != 200:
        raise WorkbenchError(f"chat completion failed with HTTP {response.status_code}: {response.text[:300]}",
                             "check the server log")
    return response.json()


def tokenized_length(rr: Resolved, messages: list[dict], url: str | None = None) -> int:
    """Tokens of a chat prompt as the server counts them (chat template and generation prompt included)."""
    url = url or rr.server_url
    body = {"model": rr.recipe.server.served_model_name, "messages": messages, "add_generation_prompt": True}
    response = requests.post(f"{url}/tokenize", json=body, headers=rr.headers, timeout=30)
    if response.status_code != 200:
        raise WorkbenchError(f"{url}/tokenize answered HTTP {response.status_code}: {response.text[:200]}",
                             "evaluate through a vLLM server (it tokenizes for the length preflight)")
    return int(response.json()["count"])


def metrics_text(rr: Resolved, url: str | None = None, timeout: float = 10.0) -> str:
    """The server's Prometheus /metrics page."""
    response = requests.get(f"{url or rr.server_url}/metrics", headers=rr.headers, timeout=timeout)
    response.raise_for_status()
    return response.text
