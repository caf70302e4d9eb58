"""What must never reach a log, a report or a copied recipe: values of secret-looking variables.

    from workbench.secrets import redact, scrub
    redact({"HF_TOKEN": "hf_x", "HCCL_CONNECT_TIMEOUT": "1800"})   # {"HF_TOKEN": "<redacted>", ...}
    scrub(text)                          # every known secret value in text replaced by <redacted>

Secrets are found by name (a variable whose name has KEY, TOKEN, SECRET, ... in it) and then removed by value
too: a secret copied into another variable (`NOTE=uses hf_...`), a recipe's `server.env`, a log line or a report
is recognised wherever it appears. `secret_values` collects the values: those of secret-named variables in this
process's environment plus the mapping given (a recipe's env dicts).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"
# Shorter values are flags and switches (TOKENIZERS_PARALLELISM=false, HF_HUB_DISABLE_IMPLICIT_TOKEN=1): masking
# them everywhere would blank out every 'true' and '1' in a report, and they are not secrets.
MIN_SECRET_LENGTH = 6


def is_secret_name(name: str) -> bool:
    return any(word in str(name).upper() for word in SECRET_WORDS)


def secret_values(env: Mapping[str, Any] | None = None, names: Iterable[str] = ()) -> set[str]:
    """Values of secret-named variables in os.environ and in `env`, plus those of the variables `names` lists
    (e.g. server.api_key_env, whatever it is called); values under MIN_SECRET_LENGTH characters are left out."""
    values = set()
    for mapping in (os.environ, env or {}):
        for name, value in mapping.items():
            if is_secret_name(name) and isinstance(value, str):
                values.add(value)
    values.update(os.environ[name] for name in names if name and name in os.environ)
    return {v for v in values if len(v) >= MIN_SECRET_LENGTH and v != REDACTED}


def scrub(text: str, values: Iterable[str] | None = None) -> str:
    """`text` with every secret value (default: `secret_values()`) replaced by <redacted>, wherever it appears."""
    values = secret_values() if values is None else values
    # longest first: a secret that contains another is replaced whole
    for value in sorted(values, key=len, reverse=True):
        if value:
            text = text.replace(value, REDACTED)
    return text


def scrub_data(data: Any, values: Iterable[str] | None = None) -> Any:
    """`scrub` applied to every string (and string key) in nested dicts, lists and tuples: for JSON and YAML that are
    scrubbed before they are serialised (escaping could otherwise hide a value from a text scrub)."""
    values = list(secret_values() if values is None else values)
    if isinstance(data, str):
        return scrub(data, values)
    if isinstance(data, Mapping):
        return {scrub_data(k, values): scrub_data(v, values) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(scrub_data(v, values) for v in data)
    return data


def redact(mapping: Mapping, values: Iterable[str] | None = None) -> dict:
    """Values of names that look like secrets replaced, and so is any value that holds a known secret value
    (default: `secret_values(mapping)`), so they never reach a report."""
    values = list(secret_values(mapping) if values is None else values)
    return {k: (REDACTED if is_secret_name(k) or (isinstance(v, str) and any(s in v for s in values)) else v)
            for k, v in mapping.items()}
