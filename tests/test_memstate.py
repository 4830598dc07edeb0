"""The in-memory fast path: the agent's cache over real loopback sockets, and CheckpointManager's
memory-first load (single process, real files, real DCP)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
from elastic.checkpoint.config import MemoryCacheConfig
from elastic.checkpoint.memory import MemoryLayoutMismatch, check_layout, decode_state, encode_state
from elastic.common.config import ConfigError, from_dict
from elastic.common.events import EventLog, read_events
from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memstate import (
    EntryMeta,
    MemStateCorrupt,
    MemStateRejected,
    MemStateServer,
    MemStateUnavailable,
    reject_reason,
    sha256_bytes,
)
from tests.test_checkpoint import _flat, _state, _trained

pytestmark = [pytest.mark.timeout(30), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _meta(data: bytes, **fields) -> EntryMeta:
    base = {"slot": 0, "rank": 0, "world_size": 2, "step": 8, "checkpoint_id": "abc", "fingerprint": "fp",
            "epoch": 0, "sha256": sha256_bytes(data), "nbytes": len(data)}
    return EntryMeta(**{**base, **fields})


@pytest.fixture
def server():
    srv = MemStateServer(max_bytes=1 << 20)
    yield srv
    srv.close()


@pytest.fixture
def client(server) -> MemStateClient:
    return MemStateClient(server.addr, server.token, timeout_s=5)


def test_put_get_replace_and_empty_slot(server, client):
    assert client.get(0) is None
    client.put(_meta(b"x" * 100), b"x" * 100)
    meta, data = client.get(0)
    assert (meta.step, meta.checkpoint_id, bytes(data)) == (8, "abc", b"x" * 100)
    client.put(_meta(b"y" * 10, slot=1, rank=1), b"y" * 10)
    client.put(_meta(b"z" * 50, step=12, checkpoint_id="def"), b"z" * 50)  # newer step replaces the slot
    meta, data = client.get(0)
    assert (meta.step, bytes(data)) == (12, b"z" * 50)
    assert server.cache.held_bytes() == 60  # the replaced entry is gone
    assert client.drop(1) and client.get(1) is None


def test_stale_push_rejected_but_a_newer_epoch_may_go_back(client):
    client.put(_meta(b"new", step=12), b"new")
    with pytest.raises(MemStateRejected, match="stale push"):
        client.put(_meta(b"old", step=8), b"old")
    assert client.get(0)[0].step == 12
    client.put(_meta(b"rolled", step=8, epoch=1), b"rolled")  # after a rollback: an older step, later epoch
    assert bytes(client.get(0)[1]) == b"rolled"


def test_corrupt_upload_and_corruption_at_rest_are_refused(server, client):
    with pytest.raises(MemStateRejected, match="corrupt upload"):
        client.put(_meta(b"good"), b"evil")
    assert client.get(0) is None
    client.put(_meta(b"good"), b"good")
    server.cache.get(0)[1][0] ^= 0xFF  # a bit flip in the agent's memory
    with pytest.raises(MemStateCorrupt):
        client.get(0)


def test_bad_token_size_limit_and_unreachable(server, client):
    with pytest.raises(MemStateRejected, match="bad token"):
        MemStateClient(server.addr, "wrong", 5).get(0)
    big = b"b" * ((1 << 20) + 1)
    with pytest.raises(MemStateRejected, match="exceeds the cache limit"):
        client.put(_meta(big), big)
    half = b"h" * (600 << 10)
    client.put(_meta(half), half)
    with pytest.raises(MemStateRejected, match="does not fit"):
        client.put(_meta(half, slot=1), half)
    with pytest.raises(ValueError, match="a worker's cache is its own node's"):
        MemStateClient("10.0.0.1:1", "t")
    port = int(server.addr.rpartition(":")[2])
    server.close()
    with pytest.raises(MemStateUnavailable):
        MemStateClient(f"127.0.0.1:{port}", server.token, 1).get(0)
    server.close = lambda: None  # fixture teardown: already closed


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"fingerprint": "other"}, "fingerprint mismatch"),
    ({"world_size": 4}, "world size 4, now 2"),
    ({"step": 4}, "step 4, newest committed is 8"),
    ({"checkpoint_id": "zzz"}, "checkpoint 'zzz'"),
    ({"slot": 1}, "slot 1"),
])
def test_reject_reason(change, reason):
    meta = dataclasses.replace(_meta(b""), **change)
    got = reject_reason(meta, step=8, checkpoint_id="abc", fingerprint="fp", world_size=2, slot=0)
    assert (got is None) if reason is None else (reason in got)


def test_config_errors_are_one_line_with_the_field_path():
    with pytest.raises(ConfigError, match=r"^checkpoint\.memory\.max_mib: must be >= 1$"):
        from_dict(CheckpointConfig, {"memory": {"max_mib": 0}}, "checkpoint")
    with pytest.raises(ConfigError, match=r"^checkpoint\.memory\.timeout_s: must be > 0$"):
        from_dict(CheckpointConfig, {"memory": {"timeout_s": 0}}, "checkpoint")
    with pytest.raises(ConfigError, match=r"^checkpoint\.memory\.enabled: expected true/false"):
        from_dict(CheckpointConfig, {"memory": {"enabled": "yes"}}, "checkpoint")


def test_layout_check_names_the_path():
    model, optim = _trained()
    chunks = encode_state({**_state(model, optim), "odd": [torch.tensor(True), torch.zeros(0), (1, "x")]}, b"ex")
    tree, extra = decode_state(bytearray(b"".join(chunks)))
    assert extra == b"ex" and tree["odd"][2] == (1, "x") and tree["odd"][0].dtype == torch.bool
    assert torch.equal(tree["model"]["a.weight"], model.a.weight)
    del tree["odd"]
    check_layout(_state(model, optim), tree)
    other, other_optim = _trained()
    other.a = torch.nn.Linear(6, 4)
    with pytest.raises(MemoryLayoutMismatch, match=r"/model/a\.weight: \(5, 6\)"):
        check_layout(_state(other, other_optim), tree)


def _manager(tmp_path, client, fingerprint="fp", **cfg) -> tuple[CheckpointManager, EventLog]:
    events = EventLog(tmp_path / "events.jsonl", "test")
    config = CheckpointConfig(interval_steps=1, keep_last=2, memory=MemoryCacheConfig(enabled=client is not None), **cfg)
    return CheckpointManager(config, tmp_path / "ckpt", fingerprint, events, memory_client=client), events


def _loaded(tmp_path) -> list[dict]:
    return [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] in ("checkpoint.loaded",
                                                                                "checkpoint.memory_miss")]


@pytest.mark.parametrize("async_save", [True, False])
def test_manager_loads_bitwise_from_memory(tmp_path, client, async_save):
    mgr, _ = _manager(tmp_path, client, async_save=async_save)
    model, optim = _trained(steps=3)
    want = _flat(model, optim)
    mgr.save(3, _state(model, optim), extra={"rng": torch.arange(4)})
    with torch.no_grad():  # training goes on after save(): the cached copy must not see it
        for p in model.parameters():
            p.add_(1.0)
    mgr.close()
    fresh, fresh_optim = _trained(seed=1, steps=1)
    state = _state(fresh, fresh_optim)
    step, extra = _manager(tmp_path, client)[0].load_latest(state)
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert step == 3 and torch.equal(extra["rng"], torch.arange(4))
    got = _flat(fresh, fresh_optim)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    (loaded,) = _loaded(tmp_path)
    assert loaded["loaded_from"] == "memory" and loaded["step"] == 3 and loaded["load_s"] >= 0


def test_manager_falls_back_to_disk_when_the_cache_is_not_for_the_committed_save(tmp_path, client):
    mgr, _ = _manager(tmp_path, client)
    model, optim = _trained(steps=2)
    mgr.save(2, _state(model, optim))
    mgr.close()
    # The same step saved again without the cache (a rollback's re-save): the cached entry is another checkpoint.
    model2, optim2 = _trained(seed=5, steps=2)
    want = _flat(model2, optim2)
    plain, _ = _manager(tmp_path, None)
    plain.save(2, _state(model2, optim2))
    plain.close()
    fresh, fresh_optim = _trained(seed=1, steps=1)
    state = _state(fresh, fresh_optim)
    assert _manager(tmp_path, client)[0].load_latest(state)[0] == 2
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    assert all(torch.equal(_flat(fresh, fresh_optim)[k], want[k]) for k in want)
    miss, loaded = _loaded(tmp_path)
    assert miss["kind"] == "checkpoint.memory_miss" and "checkpoint" in miss["reason"]
    assert loaded["loaded_from"] == "disk"


def test_foreign_fingerprint_in_the_cache_falls_back_to_disk(tmp_path, client):
    mgr, _ = _manager(tmp_path, client)
    model, optim = _trained(steps=2)
    mgr.save(2, _state(model, optim))
    mgr.close()
    meta, data = client.get(0)
    client.put(dataclasses.replace(meta, fingerprint="foreign"), data)
    fresh, fresh_optim = _trained(seed=1, steps=1)
    assert _manager(tmp_path, client)[0].load_latest(_state(fresh, fresh_optim))[0] == 2
    miss, loaded = _loaded(tmp_path)
    assert "fingerprint mismatch" in miss["reason"] and loaded["loaded_from"] == "disk"


def test_push_of_a_tensor_numpy_cannot_read_is_an_event_not_a_crash(tmp_path, client):
    """Before the fix a CUDA tensor in the live state (async save off) reached ``.numpy()`` and its
    TypeError escaped ``push``, killing the trainer.  A meta tensor raises the same TypeError on CPU."""
    from elastic.checkpoint.memory import MemoryFastPath

    events = EventLog(tmp_path / "events.jsonl", "test")
    fast = MemoryFastPath(client, "fp", events, None, slot=0, epoch=0)
    fast.push(3, "abc", {"model": {"w": torch.zeros(4, device="meta")}}, b"")
    (failed,) = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"].startswith("checkpoint.memory")]
    assert failed["kind"] == "checkpoint.memory_push_failed" and "meta" in failed["error"]
    fast.push(4, "abd", {"model": {"w": torch.arange(4.0)}}, b"")  # a host tensor still goes through
    assert client.get(0)[0].step == 4


def _snap(step: int, data: bytes):
    from elastic.checkpoint.checksum import digest_chunks
    from elastic.checkpoint.memstate import SnapMeta

    return SnapMeta(node="n0", slot=0, rank=0, world_size=1, epoch=0, gen=0, step=step,
                    checksum=digest_chunks([data])[0], nbytes=len(data))


def test_kept_connection_carries_every_push_and_survives_the_store_closing_it():
    server = MemStateServer(max_bytes=1 << 20, io_timeout_s=0.3)
    client = MemStateClient(server.addr, server.token, timeout_s=5, keep_alive=True)
    try:
        client.snap_put(_snap(1, b"a" * 64), b"a" * 64)
        kept = client._sock
        client.snap_put(_snap(2, b"b" * 64), b"b" * 64)
        assert client._sock is kept  # one connection for both pushes
        import time

        time.sleep(0.8)  # left idle past the store's I/O timeout: the store closed it
        client.snap_put(_snap(3, b"c" * 64), b"c" * 64)  # retried on a new connection
        assert client._sock is not kept
        meta, data = client.snap_get("n0", 0)
        assert (meta.step, bytes(data)) == (3, b"c" * 64)
        with pytest.raises(MemStateRejected):
            client.snap_put(_snap(4, b"d" * (2 << 20)), b"d" * (2 << 20))  # more than the store may hold
        assert client._sock is None  # a refusal drops the kept connection
        client.snap_put(_snap(5, b"e" * 64), b"e" * 64)
        assert client.snap_get("n0", 0)[0].step == 5
        client.snap_put(_snap(6, b"f" * 64), b"x" * 64)  # bytes that do not match their checksum: stored,
        with pytest.raises(MemStateCorrupt):  # but never read back
            client.snap_get("n0", 0, 6)
        assert bytes(client.snap_get("n0", 0, 5)[1]) == b"e" * 64
    finally:
        client.close()
        server.close()
