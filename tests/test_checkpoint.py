"""Single-process checkpoint tests (no process group): format, seams, retention, verify, publish."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from safetensors import safe_open
from torch import nn

from elastic.checkpoint.manager import CheckpointConfig, CheckpointCorrupt, CheckpointManager, select_for_deletion
from elastic.checkpoint.format import encode_safetensors
from elastic.checkpoint.load import _error_fields
from elastic.checkpoint.publish import EtcdCheckpointPublisher, LatestPublisher, publisher_from_env, read_latest
from elastic.control.keys import RunKeys
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage
from elastic.worker.faults import FaultHooks, write_fault
from elastic.common.events import EventLog, read_events
from elastic.control.store import EtcdStore
from elastic.common.env import ETCD_ENDPOINT_ENV, RUN_PREFIX_ENV

# DCP says so whenever it runs without a process group, which is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _trained(seed: int = 0, steps: int = 2) -> tuple[Model, torch.optim.Optimizer]:
    model = Model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        loss = model(torch.full((2, 6), float(i + 1))).sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model, optim


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _flat(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for key, value in st.items():
            out[f"o/{pid}/{key}"] = value.clone()
    return out


class RecordingStorage(LocalStorage):
    """Local files; blocks writes of ``gated`` steps until ``gate`` is set; records who deletes."""

    def __init__(self, gated: set[int] = frozenset()) -> None:
        self.gated = gated
        self.gate = threading.Event()
        self.remover_threads: list[str] = []

    def write_file(self, path, chunks, step):
        if step in self.gated:
            assert self.gate.wait(30), "gate never opened"
        return super().write_file(path, chunks, step)

    def remove_tree(self, path):
        self.remover_threads.append(threading.current_thread().name)
        super().remove_tree(path)


def _manager(tmp_path, storage=None, **cfg) -> tuple[CheckpointManager, EventLog]:
    events = EventLog(tmp_path / "events.jsonl", "test")
    config = CheckpointConfig(**{"interval_steps": 1, "keep_last": 2, **cfg})
    return CheckpointManager(config, tmp_path / "ckpt", "fp", events, storage=storage), events


def test_select_for_deletion_keeps_last_k_and_newest():
    assert select_for_deletion([1, 2, 3, 4], keep_last=2) == [1, 2]
    assert select_for_deletion([4, 3, 2, 1], keep_last=1) == [1, 2, 3]
    assert select_for_deletion([], keep_last=1) == []
    # The step just committed (after a rollback) and the newest both survive keep_last=1.
    assert select_for_deletion([5, 8, 7], keep_last=1, protect=[7]) == [5]
    assert select_for_deletion([3], keep_last=1) == []


def test_checkpoint_write_faults_come_from_the_run_fault_files_per_step_and_rank(tmp_path):
    write_fault(tmp_path, "disk", {"kind": "ckpt_write_error", "step": 3, "rank": 1})
    rank0, rank1 = FaultHooks(tmp_path, 0), FaultHooks(tmp_path, 1)
    assert not rank0.checkpoint_write_fails(3)  # another rank's fault
    assert not rank1.checkpoint_write_fails(4)  # another step
    assert rank1.checkpoint_write_fails(3)
    assert not rank1.checkpoint_write_fails(3)  # fired once: the replay after a restart runs clean


def test_injected_disk_full_is_a_real_partial_write(tmp_path):
    write_fault(tmp_path, "disk", {"kind": "ckpt_write_error", "step": 3, "rank": 1})
    storage = FaultInjectingStorage(LocalStorage(), FaultHooks(tmp_path, 1).checkpoint_write_fails)
    target = tmp_path / "f.bin"
    with pytest.raises(OSError) as info:
        storage.write_file(target, [b"x" * 100, b"y" * 100], step=3)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"x" * 50  # half of the first chunk reached the disk
    assert storage.write_file(target, [b"ok"], step=4) == 2  # other steps are untouched
    write_fault(tmp_path, "disk2", {"kind": "ckpt_write_error", "step": 3, "rank": 1})
    other_rank = FaultInjectingStorage(LocalStorage(), FaultHooks(tmp_path, 0).checkpoint_write_fails)
    assert other_rank.write_file(target, [b"ok"], step=3) == 2


def test_encoder_output_is_read_by_the_safetensors_library(tmp_path):
    tensors = [
        ("f32", torch.randn(3, 4)),
        ("bf16", torch.randn(5).to(torch.bfloat16)),
        ("i64 scalar", torch.tensor(7)),
        ("empty", torch.empty(0, 3)),
        ("bool", torch.tensor([True, False, True])),
        ("fp8", torch.randn(4).to(torch.float8_e4m3fn)),
        ("strided", torch.arange(12.0).reshape(3, 4).t()),
    ]
    header, views = encode_safetensors(tensors)
    assert len(header) % 8 == 0
    path = tmp_path / "x.safetensors"
    LocalStorage().write_file(path, [header, *views], step=0)
    with safe_open(str(path), framework="pt") as fh:
        assert list(fh.keys()) == sorted(k for k, _ in tensors)
        for key, want in tensors:
            got = fh.get_tensor(key)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


def test_writer_nice_applies_to_background_threads_only():
    from elastic.checkpoint.format import _lower_thread_priority

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    _lower_thread_priority(3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    seen = {}

    def background():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        _lower_thread_priority(3)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["delta"] == 3 or os.getpriority(os.PRIO_PROCESS, 0) + 3 > 19


def test_async_save_returns_before_persist_and_round_trips(tmp_path):
    storage = RecordingStorage(gated={2})
    mgr, events = _manager(tmp_path, storage)
    model, optim = _trained()
    want = _flat(model, optim)
    mgr.save(2, _state(model, optim), extra={"note": "two"})
    events.emit("test.save_returned")
    assert mgr.committed_steps() == []  # every write is still blocked
    # Mutating right after save() must not leak into the checkpoint (staging copied it).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    storage.gate.set()
    mgr.wait()
    assert mgr.committed_steps() == [2] and mgr.last_error is None
    kinds = [e["kind"] for e in read_events([tmp_path / "events.jsonl"])]
    assert kinds.index("checkpoint.staged") < kinds.index("test.save_returned") < kinds.index("checkpoint.committed")

    fresh_model, fresh_optim = _trained(seed=1, steps=1)
    state = _state(fresh_model, fresh_optim)
    step, extra = mgr.load_latest(state)
    fresh_model.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert step == 2 and extra == {"note": "two"}
    got = _flat(fresh_model, fresh_optim)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    mgr.close()
    mgr.close()  # idempotent


def test_retention_runs_on_background_thread_and_sync_mode(tmp_path):
    storage = RecordingStorage()
    mgr, _ = _manager(tmp_path, storage, keep_last=1, async_save=False)
    model, optim = _trained()
    for step in (1, 2, 3):
        path = mgr.save(step, _state(model, optim))
        assert (path / "COMMIT").exists()  # sync mode: committed when save() returns
    assert mgr.committed_steps() == [3]
    assert storage.remover_threads and all(n.startswith("ckpt-finalize") for n in storage.remover_threads)
    mgr.close()


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", "size mismatch in shard-00000.safetensors"),
        ("delete", "missing file manifest.json"),
        ("marker", "unreadable commit marker"),
        ("flip", "checksum mismatch in manifest.json"),
    ],
)
def test_verify_reports_damage_and_load_falls_back(tmp_path, damage, reason):
    mgr, _ = _manager(tmp_path)
    model, optim = _trained()
    mgr.save(1, _state(model, optim))
    mgr.save(2, _state(*_trained(steps=3)))
    mgr.wait()
    newest = tmp_path / "ckpt" / "step-00000002"
    if damage == "truncate":
        shard = newest / "shard-00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "delete":
        (newest / "manifest.json").unlink()
    elif damage == "marker":
        (newest / "COMMIT").write_text("{not json")
    else:
        manifest = newest / "manifest.json"
        text = manifest.read_text()
        manifest.write_text(text.replace('"step":2', '"step":3').replace('"step": 2', '"step": 3'))
        assert manifest.read_text() != text  # one changed byte, whichever spacing the writer used
    with pytest.raises(CheckpointCorrupt, match=reason):
        mgr.verify(2)
    state = _state(*_trained(seed=5, steps=1))
    step, _ = mgr.load_latest(state)
    assert step == 1
    skipped = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.skipped_corrupt"]
    assert [e["step"] for e in skipped] == [2] and reason in skipped[0]["reason"]
    mgr.close()


def test_stale_tmp_dirs_removed_at_start(tmp_path):
    (tmp_path / "ckpt" / ".step-00000009.tmp-deadbeef").mkdir(parents=True)
    (tmp_path / "ckpt" / ".step-00000009.tmp-deadbeef" / "shard-00000.safetensors").write_bytes(b"partial")
    mgr, _ = _manager(tmp_path)
    assert list((tmp_path / "ckpt").iterdir()) == []
    assert mgr.load_latest({"model": Model(0).state_dict()}) is None
    mgr.close()


def test_owned_manager_removes_only_its_own_stale_dirs(tmp_path):
    # Replica groups share a root: a group that starts must not remove a peer's save in progress.
    root = tmp_path / "ckpt"
    names = [".step-00000009.tmp-deadbeef-node1", ".step-00000009.tmp-deadbeef-node10",
             ".step-00000009.tmp-deadbeef-x-node1", ".step-00000008.old-cafef00d-node1", ".step-00000009.tmp-deadbeef"]
    for name in names:
        (root / name).mkdir(parents=True)
    events = EventLog(tmp_path / "events.jsonl", "t")
    mgr = CheckpointManager(CheckpointConfig(interval_steps=1), root, "fp", events, owner="node1")
    assert sorted(p.name for p in root.iterdir()) == sorted(names[1:3] + names[4:])
    model, optim = _trained()
    mgr.save(3, _state(model, optim))
    mgr.wait()
    assert (root / "step-00000003").is_dir() and mgr.last_committed == 3
    (start,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.save_start"]
    assert start["path"].endswith("-node1")  # its own save in progress carries its name
    mgr.close()
    plain, _ = _manager(tmp_path)  # one writer per root (normal mode): every stale directory goes
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]
    plain.close()


def test_etcd_publisher_and_env(etcd_endpoint, tmp_path):
    store = EtcdStore(etcd_endpoint)
    prefix = "/elastic/runs/r1"
    EtcdCheckpointPublisher(store, prefix, world_size=4)(12, "/ckpt/step-00000012")
    record = read_latest(store, prefix)
    assert record["step"] == 12 and record["path"] == "/ckpt/step-00000012" and record["world_size"] == 4
    assert record["ts"] > 0
    assert json.loads(store.get(RunKeys(prefix).checkpoint_latest).value)["step"] == 12

    assert publisher_from_env({}) is None
    assert publisher_from_env({ETCD_ENDPOINT_ENV: etcd_endpoint}) is None
    from_env = publisher_from_env({ETCD_ENDPOINT_ENV: etcd_endpoint, RUN_PREFIX_ENV: "/elastic/runs/r2"})
    mgr, _ = _manager(tmp_path)
    mgr.publisher = from_env
    mgr.save(3, _state(*_trained()))
    mgr.wait()
    assert read_latest(store, "/elastic/runs/r2")["step"] == 3
    assert read_latest(store, "/elastic/runs/r2")["path"].endswith("step-00000003")
    mgr.close()


def test_publish_failure_is_an_event_not_fatal(tmp_path):
    def broken(step, path):
        raise ConnectionError("etcd down")

    mgr, _ = _manager(tmp_path)
    mgr.publisher = broken
    mgr.save(1, _state(*_trained()))
    mgr.wait()
    assert mgr.committed_steps() == [1] and mgr.last_error is None
    failed = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.publish_failed"]
    assert failed and "etcd down" in failed[0]["error"]
    mgr.close()


def test_a_publish_that_hangs_never_holds_up_the_next_save(tmp_path):
    """etcd stopped (chaos soak, seed 1): rank 0's publish waited out the store's retries, the next
    save waited for it, every rank stopped, and the agents' hang timeout restarted the run from
    disk.  Publishing now runs beside the saves, newest record first; etcd back, the newest commit
    is published and an older one still unwritten is dropped, never written over it."""
    release, calls = threading.Event(), []

    def stalled(step, path):
        calls.append(step)
        if not release.wait(10):
            raise TimeoutError("etcd stopped")

    mgr, _ = _manager(tmp_path)
    mgr.publisher = stalled
    state = _state(*_trained())
    for step in (1, 2, 3):
        mgr.save(step, state)
    mgr._wait_inflight()
    assert mgr.committed_steps() == [2, 3]  # keep_last 2: the saves went on while step 1's publish hung
    waited = [e["waited_s"] for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.save_start"]
    assert max(waited) < 5, waited
    release.set()
    mgr.wait()
    published = [e["step"] for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.published"]
    assert calls == [1, 3] and published == [1, 3]  # step 2 was replaced before it was tried
    mgr.close()


def test_a_failed_publish_is_said_once_and_retried_until_written(tmp_path):
    failures = [ConnectionError("etcd down")] * 3
    written = []

    def flaky(step, path):
        if failures:
            raise failures.pop()
        written.append(step)

    events = EventLog(tmp_path / "events.jsonl", "test")
    latest = LatestPublisher(flaky, events.emit, _error_fields, retry_s=0.01)
    latest(7, "/ckpt/step-00000007")
    assert latest.flush(5.0) and written == [7]
    kinds = [(e["kind"], e["step"]) for e in read_events([tmp_path / "events.jsonl"])]
    assert kinds == [("checkpoint.publish_failed", 7), ("checkpoint.published", 7)]
    latest.close(1.0)


def test_checkpoint_that_verifies_but_cannot_load_is_skipped(tmp_path):
    """Checksums fine, but the newest checkpoint lacks the requested keys: reported, older one loaded."""
    mgr, _ = _manager(tmp_path)
    model, optim = _trained()
    want = _flat(model, optim)
    mgr.save(1, _state(model, optim))
    mgr.save(2, {"something_else": {"w": torch.ones(3)}})
    mgr.wait()
    mgr.verify(2)  # intact on disk
    fresh_model, fresh_optim = _trained(seed=3, steps=1)
    state = _state(fresh_model, fresh_optim)
    step, _ = mgr.load_latest(state)
    fresh_model.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert step == 1
    got = _flat(fresh_model, fresh_optim)
    assert all(torch.equal(got[k], want[k]) for k in want)
    skipped = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.skipped_corrupt"]
    assert [e["step"] for e in skipped] == [2] and skipped[0]["reason"].startswith("load failed")
    mgr.close()
