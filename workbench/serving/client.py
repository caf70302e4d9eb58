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


def sequence_logprobs(rr: Resolved, token_ids: list[int], url: str | None = None) -> list[float]:
    """The server's log-probability of each token of `token_ids` after the first (teacher forcing, temperature 1).
    Unanswered after server.request_timeout_s, the server counts as hung (the canary asks after every push)."""
    body = {"model": rr.recipe.server.served_model_name, "prompt": [token_ids], "max_tokens": 1, "temperature": 1.0,
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
