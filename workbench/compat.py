"""The Ascend version chain as data (compat.yaml): which vllm-ascend, vLLM, CANN, torch and torch_npu go together.

    python -m workbench.compat            # prints the recommended row
"""
from __future__ import annotations

from pathlib import Path

import yaml
from packaging.version import Version

MATRIX_FILE = Path(__file__).with_name("compat.yaml")


def matrix() -> dict:
    return yaml.safe_load(MATRIX_FILE.read_text())


def rows() -> list[dict]:
    return matrix()["rows"]


def row_for(vllm_ascend: str) -> dict | None:
    """The row of a vllm-ascend version; a post-release (0.23.0.post1) belongs to its release's row."""
    wanted = Version(vllm_ascend)
    for row in rows():
        have = Version(row["vllm_ascend"])
        if have == wanted or (wanted.is_postrelease and have.base_version == wanted.base_version and not have.pre):
            return row
    return None


def recommended() -> dict:
    row = row_for(matrix()["recommended"])
    assert row is not None, "compat.yaml: recommended names no row"
    return row


def in_trl_window(vllm: str) -> bool:
    window = matrix()["trl_vllm_window"]
    return Version(window["min"]) <= Version(Version(vllm).base_version) < Version(window["max_exclusive"])


if __name__ == "__main__":
    print(recommended())
