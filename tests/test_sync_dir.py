"""The reload adapter's directories (issue 14, nothing lost, nothing leaked): a given `server.sync_dir` is private,
holds only the workbench's own files, and loses nothing else; the private RAM-disk directory goes with the adapter.

No server: a fake client answers the two calls the adapter makes (/server_info at connect, /collective_rpc per push).
"""
from __future__ import annotations

import stat

import pytest
import torch

from workbench.errors import WorkbenchError
from workbench.serving import sync


class FakeClient:
    """Stands in for SyncingVLLMClient: records what the adapter asks of the server."""

    base_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def get_server_info(self) -> dict:
        self.calls.append("server_info")
        return {}

    def _post(self, url: str, **kwargs) -> dict:
        self.calls.append(url.rsplit("/", 1)[-1])
        return {"results": [None]}


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_given_sync_dir_is_made_private_and_removed_when_ours(tmp_path):
    given = tmp_path / "nested" / "sync"
    adapter = sync.ReloadSync(given)
    client = FakeClient()
    adapter.connect(client, None)
    assert given.is_dir() and _mode(given) == 0o700
    assert client.calls == ["server_info"]
    adapter.push(client, [], iter([("w", torch.ones(3))]))
    assert sorted(p.name for p in given.iterdir()) == [sync.ReloadSync.FILE]
    adapter.close(client)
    assert not given.exists()  # made by the adapter and empty after close
    assert (tmp_path / "nested").is_dir()  # only the directory it was given, not the parents


@pytest.mark.parametrize("foreign", ["other.safetensors", "config.json"])
def test_given_sync_dir_with_foreign_files_is_refused_and_left_alone(tmp_path, foreign):
    given = tmp_path / "shared"
    given.mkdir()
    (given / foreign).write_text("not the workbench's")
    adapter = sync.ReloadSync(given)
    client = FakeClient()
    with pytest.raises(WorkbenchError, match=rf"{given}.*{foreign}.*point server.sync_dir at an empty directory"):
        adapter.connect(client, None)
    assert client.calls == []  # refused before the server is asked anything
    assert (given / foreign).read_text() == "not the workbench's"
    adapter.close(client)
    assert (given / foreign).exists() and given.is_dir()


def test_refusal_names_at_most_five_foreign_files(tmp_path):
    for i in range(7):
        (tmp_path / f"f{i}.bin").write_bytes(b"x")
    with pytest.raises(WorkbenchError) as caught:
        sync.ReloadSync(tmp_path).connect(FakeClient(), None)
    message = str(caught.value)
    assert "f4.bin" in message and "f5.bin" not in message and "and 2 more" in message
    assert len(list(tmp_path.iterdir())) == 7


def test_own_stale_files_are_replaced_and_close_removes_only_ours(tmp_path):
    given = tmp_path / "shared"
    given.mkdir()
    given.chmod(0o755)
    (given / sync.ReloadSync.FILE).write_bytes(b"an earlier run's weights")
    (given / (sync.ReloadSync.FILE + ".partial")).write_bytes(b"a killed run's half write")
    adapter = sync.ReloadSync(given)
    client = FakeClient()
    adapter.connect(client, None)
    assert list(given.iterdir()) == []  # our own leftovers only: removed
    adapter.push(client, [], iter([("w", torch.zeros(2))]))
    assert client.calls == ["server_info", "collective_rpc"]
    # files someone put there while the run went on: not ours, whatever their name
    (given / "notes.txt").write_text("keep me")
    (given / (sync.ReloadSync.FILE + ".bak")).write_bytes(b"keep me too")
    adapter.close(client)
    assert sorted(p.name for p in given.iterdir()) == ["model.safetensors.bak", "notes.txt"]
    assert _mode(given) == 0o755  # an existing directory keeps its mode; the adapter did not make it


def test_own_ram_disk_directory_is_private_and_removed_on_close():
    adapter = sync.ReloadSync()
    own = adapter.directory
    assert own.is_dir() and _mode(own) == 0o700
    client = FakeClient()
    adapter.connect(client, None)
    adapter.push(client, [], iter([("w", torch.ones(1))]))
    assert (own / sync.ReloadSync.FILE).exists()
    adapter.close(client)
    assert not own.exists()
