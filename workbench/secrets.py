"""What must never reach a log, a report or a copied recipe: values of secret-looking variables.

    from workbench.secrets import redact
    redact({"HF_TOKEN": "hf_x", "HCCL_CONNECT_TIMEOUT": "1800"})   # {"HF_TOKEN": "<redacted>", ...}
"""
from __future__ import annotations

SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)


def redact(mapping: dict) -> dict:
    """Values of names that look like secrets replaced, so they never reach a report."""
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in mapping.items()}
