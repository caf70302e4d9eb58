"""Weight sync, for real on the CPU (reload, none) and against a recording fake of vllm-ascend's engine (hccl).

The trainings here push into the session's shared server (conftest's tiny_server): conftest's `restored_server`
puts the base model's weights back after each such test and checks that the server answers as the base model
again, so the tests that only read that server see what it started with, in any order.

Exact sync is asserted at EXACT (1e-4 nats a token): the reload adapter moves float32 weights bit for bit, and what is
left between the server's and the trainer's log-probs is kernel rounding (about 1e-6 here), far below the
canary's warning level (2e-3) and its stop level (2e-2)."""
import json
import math
import os
from pathlib import Path

import pytest
import requests
import torch

from conftest import CURVE_SAMPLES, EXACT, served_during
from conftest import mean_abs as _mean_abs
from conftest import model_logprobs as _model_logprobs
from workbench import recipe
from workbench.serving import sync
from workbench.serving.client import sequence_logprobs
from workbench.training.callbacks import JsonlMetrics
from workbench.training.trainer import build_trainer


@pytest.fixture
def closing():
    """Trainers built in this process: their clients closed at the end (the reload adapter's copy of the weights in
    RAM goes with them), as `workbench train` closes its own."""
    built = []
    yield built
    for trainer in built:
        trainer.vllm_generation.vllm_client.close_communicator()


def _trainer(server_recipe, tiny_model_dir, tmp_path, weight_sync, closing=None, **overrides):
    # sync mechanics, not learning: full rate from step 1 (no warm-up) and TRL's server-vs-trainer log-prob check on
    r = recipe.load(server_recipe, {"trainer.learning_rate": 3e-3, "trainer.logging_steps": 1,
                                    "trainer.warmup_steps": 0, "trainer.lr_scheduler_type": "constant",
                                    "trainer.vllm_importance_sampling_correction": True,
                                    "trainer.save_strategy": "no", "trainer.log_completions": False, **overrides})
    trainer = build_trainer(recipe.resolve(r, platform="cpu"), str(tiny_model_dir), tmp_path / "out", weight_sync)
    trainer.add_callback(JsonlMetrics(tmp_path / "metrics.jsonl"))
    if closing is not None:
        closing.append(trainer)
    return trainer


def _fixed_sequence(trainer) -> list[int]:
    tok = trainer.processing_class
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 47 + 35?"}], add_generation_prompt=True,
                                     tokenize=False)
    return tok(prompt + "47 + 35: 7+5=12, 4+3+1=8. <answer>82</answer><|im_end|>", add_special_tokens=False)["input_ids"]


def test_reload_sync_puts_the_trained_weights_on_the_server(restored_server, server_recipe, server_rr, tiny_model_dir,
                                                            tmp_path, closing):
    tiny_server = restored_server
    trainer = _trainer(server_recipe, tiny_model_dir, tmp_path, sync.ReloadSync(tmp_path / "sync"), closing,
                       **{"trainer.max_steps": 1})
    ids = _fixed_sequence(trainer)
    before = _model_logprobs(trainer.model, ids)
    params_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, params_before[n]) for n, p in trainer.model.named_parameters())
    trainer.vllm_generation.sync_weights()  # the push TRL makes before the next generation
    after = _model_logprobs(trainer.model, ids)
    served = sequence_logprobs(server_rr, ids, url=tiny_server.url)
    assert _mean_abs(served, after) < EXACT, "server does not hold the trainer's weights"
    assert _mean_abs(served, before) > 0.1, "the step did not move the weights enough to tell"
    assert _mean_abs(before, after) > 0.1
    # every push was timed and sized: 1.27M float32 parameters (tied embeddings sent once)
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["sync/count"] == 1 and logged["sync/seconds"] > 0  # the step's push, logged with the step
    ((seconds, moved),) = trainer.weight_sync.records  # the manual push above, not yet logged
    # float32: every parameter once, plus the tied lm_head written out under its own name
    expected = 4 * (sum(p.numel() for p in trainer.model.parameters()) + trainer.model.lm_head.weight.numel())
    assert seconds > 0 and moved == expected
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["model.safetensors"]
    assert trainer.weight_sync.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def _logp_difference(path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]


def test_without_sync_rollouts_drift_off_policy(restored_server, server_recipe, tiny_model_dir, tmp_path, closing):
    steps = {"trainer.max_steps": 3, "trainer.learning_rate": 1e-3}
    with pytest.warns(UserWarning, match="off-policy"):
        off = _trainer(server_recipe, tiny_model_dir, tmp_path / "none", sync.NoSync(), closing, **steps)
    off.train()
    on = _trainer(server_recipe, tiny_model_dir, tmp_path / "reload", sync.ReloadSync(), closing, **steps)
    on.train()
    drift, kept = _logp_difference(tmp_path / "none" / "metrics.jsonl"), _logp_difference(tmp_path / "reload" / "metrics.jsonl")
    assert len(drift) == len(kept) == 3
    assert max(kept) < EXACT, kept
    assert drift[0] < EXACT  # step 1: the server still has the initial weights, which are the trainer's
    # from step 2 on the trainer has moved and the server has not: every step is off-policy
    assert min(drift[1:]) > 0.02 and min(drift[1:]) > 100 * max(kept), drift


class FakeHcclEngine:
    """Records what the trainer asks of vllm-ascend's HCCLWeightTransferEngine (static trainer API, as in
    vllm_ascend/distributed/weight_transfer/hccl_engine.py: trainer_init(init_info) -> communicator,
    trainer_send_weights(iterator, trainer_args))."""

    # Fields of HCCLWeightTransferInitInfo / HCCLWeightTransferUpdateInfo / HCCLTrainerSendWeightsArgs upstream.
    INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size"}
    UPDATE_FIELDS = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
    SEND_FIELDS = {"group", "src", "post_iter_func", "packed", "stream", "packed_buffer_size_bytes", "packed_num_buffers"}

    calls: list = []

    @classmethod
    def trainer_init(cls, init_info):
        assert set(init_info) <= cls.INIT_FIELDS
        cls.calls.append(("trainer_init", dict(init_info)))
        return "hccl-group"

    @classmethod
    def trainer_send_weights(cls, iterator, trainer_args):
        assert set(trainer_args) <= cls.SEND_FIELDS and trainer_args["group"] == "hccl-group"
        cls.calls.append(("send", [(name, tuple(t.shape)) for name, t in iterator], trainer_args["packed"]))


class RecordingClient:
    base_url = "http://127.0.0.1:1"

    def __init__(self):
        self.posts = []

    def _post(self, url, **kwargs):
        self.posts.append((url.rsplit("/", 1)[1], kwargs.get("json")))
        return {}

    def get_server_info(self):
        return {"weight_transfer_config": {"backend": "hccl"}}

    def get_world_size(self):
        return 4


def test_hccl_adapter_drives_the_engine_like_trl_drives_nccl():
    FakeHcclEngine.calls = []
    adapter = sync.HcclSync(group_port=51216, engine=FakeHcclEngine, master_address="10.0.0.1")
    client = RecordingClient()
    adapter.connect(client, torch.device("cpu"))
    assert client.posts == [("init_weight_transfer_engine", {"init_info": {
        "master_address": "10.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 5}})]
    assert FakeHcclEngine.calls[0] == ("trainer_init", client.posts[0][1]["init_info"])
    model = torch.nn.Linear(3, 2)
    metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
    adapter.push(client, metadata, iter(model.named_parameters()))
    assert [name for name, _ in client.posts[1:]] == ["start_weight_update", "update_weights", "finish_weight_update"]
    update = client.posts[2][1]["update_info"]
    assert set(update) <= FakeHcclEngine.UPDATE_FIELDS
    assert update == {"names": ["weight", "bias"], "dtype_names": ["float32", "float32"], "shapes": [[2, 3], [2]],
                      "packed": True}
    assert FakeHcclEngine.calls[1] == ("send", [("weight", (2, 3)), ("bias", (2,))], True)
    seconds, moved = adapter.records[-1]
    assert moved == 8 * 4 and seconds >= 0


def test_hccl_without_vllm_ascend_says_what_to_install():
    with pytest.raises(Exception, match="needs vllm-ascend.*ascend extra.*weight_sync=reload"):
        sync.HcclSync().connect(RecordingClient(), "cpu")


def test_smoke_run_through_the_server(smoke_run):
    run, url = smoke_run
    train_dir = run.train  # `workbench train` keeps its training files in RUN/train/
    logs = [json.loads(line) for line in train_dir.metrics.read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and "reward" in r and "kl" in r for r in steps)
    assert all(r["sync/count"] >= 1 and r["sync/seconds"] > 0 for r in steps)
    served = served_during(train_dir)  # the server's own counters: at the run's end less at its start
    # what the steps asked for: 2 prompts x 4 generations a step, 3 steps; apart from the canary's one-token probes
    # (4 probe sequences, checked after the first push only: canary_every is 10) and the learning curve's greedy
    # requests (one per problem, at each of the 3 pushes and at the push after the last step)
    curve = 4 * CURVE_SAMPLES
    assert (served["generation_prompts"] - curve, served["generation_sequences"] - curve) == (6, 24), served
    assert served["probe_requests"] == 4, served
    assert (train_dir.final / "model.safetensors").exists() and (train_dir.final / "tokenizer.json").exists()
    assert (train_dir.checkpoints / "checkpoint-3").is_dir()
    assert run.recipe.is_file()  # the run's recipe at its root, the training below it
    summary = json.loads(train_dir.summary.read_text())
    assert summary["steps"] == 3 and summary["weight_sync"] == "reload"
    # attached: the run started no server of its own and left the one it trained on serving
    assert not list(train_dir.path.glob("vllm-server-*.log"))
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_training_pins_to_trainer_cores_and_gives_them_back():
    import os

    from workbench.training.train import _pinned_to_trainer_cores

    before = os.sched_getaffinity(0)
    rr = recipe.resolve(recipe.load("cpu-tiny"), platform="cpu")
    with _pinned_to_trainer_cores(rr):
        assert os.sched_getaffinity(0) == set(rr.trainer.devices) and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before  # a later stage (the eval server) may use the server's cores again


def test_reload_directory_is_made_on_use_and_removed(tmp_path):
    """The adapter's RAM-disk copy of the weights never outlives it: made on first use (named by its process),
    removed by close(); a killed process's directory is removed by the next adapter; a given sync_dir keeps every
    file the workbench did not write."""
    import os
    import subprocess
    import sys

    adapter = sync.ReloadSync()
    assert adapter._own is None  # nothing made before use (ranks that never push make nothing)
    own = adapter.directory
    assert own.is_dir() and own.name.startswith(f"{sync.SYNC_PREFIX}{os.getpid()}-")
    (own / sync.ReloadSync.FILE).write_bytes(b"weights")
    adapter.close()
    assert not own.exists()

    # a process that made its directory and was SIGKILLed: the next start removes what it left
    child = subprocess.run([sys.executable, "-c", "import os, signal\nfrom workbench.serving import sync\n"
                            "adapter = sync.ReloadSync()\nprint(adapter.directory, flush=True)\n"
                            "os.kill(os.getpid(), signal.SIGKILL)"],
                           capture_output=True, text=True, timeout=120)
    left = Path(child.stdout.strip())
    assert left.is_dir()
    fresh = sync.ReloadSync()
    assert fresh.directory.is_dir() and not left.exists()
    fresh.close()

    given = tmp_path / "shared-sync"
    given.mkdir()
    (given / "notes.txt").write_text("keep me")
    mine = sync.ReloadSync(given)
    (mine.directory / sync.ReloadSync.FILE).write_bytes(b"weights")
    mine.close()
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]


def test_reload_rewrites_its_file_in_place_and_the_server_keeps_what_it_loaded(restored_server, server_rr,
                                                                               tiny_model_dir):
    """On a RAM disk the second push overwrites the first push's file where it lies (the same inode: no new file,
    no serialisation) and the server answers with the new weights exactly. Overwriting the file without a reload
    call changes nothing on the server: it copied what it read (the rewrite's safety rests on that), and it reads
    the file only inside the call. Each push is timed in two parts: our write, the server's reload call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("What is 47 + 35? <answer>82</answer>", add_special_tokens=False)["input_ids"]
    adapter = sync.ReloadSync(aliases=sync.tied_aliases(model))
    client = sync.SyncingVLLMClient(base_url=restored_server.url, weight_sync=adapter, headers=server_rr.headers)
    client.init_communicator()
    generator = torch.Generator().manual_seed(0)

    def moved() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def served() -> list[float]:
        client.reset_prefix_cache()
        return sequence_logprobs(server_rr, ids, url=restored_server.url)

    try:
        file = adapter.directory / sync.ReloadSync.FILE
        assert sync.on_ram_disk(adapter.directory)
        client.update_named_params([], iter(moved().items()))
        first = os.stat(file).st_ino
        assert _mean_abs(served(), _model_logprobs(model, ids)) < EXACT
        second = moved()
        client.update_named_params([], iter(second.items()))
        assert os.stat(file).st_ino == first and sorted(p.name for p in adapter.directory.iterdir()) == [file.name]
        expected = _model_logprobs(model, ids)
        assert _mean_abs(served(), expected) < EXACT, "the rewritten file did not reach the server"
        for parts in adapter.part_records:
            assert set(parts) == {"write", "server"} and all(v > 0 for v in parts.values())
        # a third set of weights written into the file, the server not asked to reload
        adapter._write(iter(moved().items()))  # the file only: no reload call
        assert os.stat(file).st_ino == first
        assert _mean_abs(served(), expected) < EXACT, "the server's weights follow the file it loaded from"
        assert _mean_abs(_model_logprobs(model, ids), expected) > 0.01  # the third set differs: the check can fail
    finally:
        client.close_communicator()


def test_reload_writes_each_tensor_as_the_iterator_holds_it(tmp_path, monkeypatch):
    """TRL merges a PEFT adapter into the live weights before the first tensor it yields and unmerges it after the
    last, in place: the file must hold the merged values, whether the push writes a new file, rewrites the last one
    in place, or starts in place and meets a tensor that does not fit (then what it wrote is read back). A tied
    alias is written with its source."""
    from safetensors.torch import load_file

    live = {"embed": torch.randn(3, 4), "proj": torch.randn(4, 4)}

    def merged_then_unmerged(extra: dict | None = None):
        for p in live.values():
            p.add_(1.0)  # merge
        snapshot = {k: v.clone() for k, v in live.items()}
        yield from live.items()
        yield from (extra or {}).items()
        for p in live.values():
            p.sub_(1.0)  # unmerge, after the last tensor
        return snapshot

    def push(adapter, extra=None) -> dict[str, torch.Tensor]:
        gen = merged_then_unmerged(extra)
        seen = {}

        def recording():
            try:
                while True:
                    name, t = next(gen)
                    seen[name] = t.clone()
                    yield name, t
            except StopIteration:
                return

        adapter._write(recording())
        return seen

    for ram in (True, False):
        if not ram:  # a disk or a shared filesystem: a new file every push
            monkeypatch.setattr(sync, "on_ram_disk", lambda path: False)
        # on a RAM disk: the adapter's own /dev/shm directory
        adapter = sync.ReloadSync(None if ram else tmp_path / "sync", aliases={"lm_head": "embed"})
        try:
            inodes = []
            for extra in (None, None, {"bias": torch.zeros(2)}):  # new file, in place (on a RAM disk), a misfit
                expected = push(adapter, extra)
                inodes.append(os.stat(adapter.directory / sync.ReloadSync.FILE).st_ino)
                back = load_file(adapter.directory / sync.ReloadSync.FILE)
                assert back.keys() == {*expected, "lm_head"}
                assert all(torch.equal(back[k], v) for k, v in expected.items()), "unmerged weights written"
                assert torch.equal(back["lm_head"], expected["embed"])
                assert (adapter._layout is not None) == ram  # the file's layout kept for a rewrite in place
            assert (inodes[1] == inodes[0]) == ram and inodes[2] != inodes[1]  # the misfit: a new file
        finally:
            adapter.close()


def test_reload_writes_a_new_file_when_the_layout_changes_or_off_a_ram_disk(tmp_path, monkeypatch):
    """A rewrite in place only for the same names, dtypes and shapes on a RAM disk; anything else is a new file,
    renamed into place. Either way the file holds exactly the tensors pushed (a tied alias included)."""
    from safetensors.torch import load_file

    def tensors(dtype=torch.float32, rows=3) -> dict[str, torch.Tensor]:
        embed = torch.randn(rows, 4).to(dtype)
        return {"embed": embed, "lm_head": embed, "norm": torch.randn(4).to(dtype)}

    def written(adapter, pushed) -> int:
        adapter._write(iter(pushed.items()))
        path = adapter.directory / sync.ReloadSync.FILE
        back = load_file(path)
        assert back.keys() == pushed.keys() and all(torch.equal(back[k], v) for k, v in pushed.items())
        return os.stat(path).st_ino

    ram = sync.ReloadSync()
    try:
        first = written(ram, tensors())
        assert written(ram, tensors()) == first  # in place
        assert written(ram, tensors(rows=5)) != first  # a new shape: a new file
        again = written(ram, tensors(rows=5))
        assert written(ram, tensors(torch.bfloat16, rows=5)) != again  # a new dtype: a new file
        changed = tensors(torch.bfloat16, rows=5)
        changed["extra"] = torch.zeros(2)
        assert written(ram, changed) != again
    finally:
        ram.close()
    assert sync.on_ram_disk(Path("/dev/shm")) and not sync.on_ram_disk(Path("/proc/self"))
    monkeypatch.setattr(sync, "on_ram_disk", lambda path: False)  # a disk or a shared filesystem (tmp_path may be either)
    disk = sync.ReloadSync(tmp_path / "sync")
    inodes = {written(disk, tensors()) for _ in range(3)}
    assert len(inodes) >= 2 and disk._layout is None  # a new file every push (the inode may be reused once freed)
    disk.close()
