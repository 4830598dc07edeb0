"""Per-step snapshots at real sizes (issue 28): the cap checked from the model before training, the
checksum, large shards through the agent's store and the buddy."""

from __future__ import annotations

import types

import pytest
import torch

from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memstate import MemStateServer, snapshot_fit_error, snapshot_need
from elastic.common.config import ConfigError
from elastic.worker.inprocess import InProcess
from elastic.worker.session import WorkerSession

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

MIB = 1 << 20


@pytest.fixture
def store():
    server = MemStateServer(max_bytes=64 * MIB)
    yield server
    server.close()


def test_the_cap_counts_two_steps_of_every_local_shard_and_the_buddys():
    assert snapshot_need(10 * MIB, 8) == 2 * 16 * 10 * MIB
    assert snapshot_fit_error(2 * MIB, 8, 64 * MIB) is None  # 2 x 16 x 2 MiB = 64 MiB: fits exactly
    line = snapshot_fit_error(3 * MIB, 8, 64 * MIB)
    assert line is not None and "\n" not in line
    assert line.startswith("agent.inprocess.snapshot_mib: per-step snapshots need 96 MiB")
    assert "64 MiB allowed" in line and "agent.inprocess.snapshots: false" in line


def _inprocess(client: MemStateClient, snapshots_on: bool = True) -> InProcess:
    inproc = InProcess.__new__(InProcess)  # only the snapshot-size check's parts
    inproc.client, inproc.snapshots_on, inproc.fit_bytes = client, snapshots_on, 0
    inproc.round = types.SimpleNamespace(joining=False)
    return inproc


def test_a_model_too_big_for_the_cap_stops_before_its_first_step(store, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    inproc = _inprocess(MemStateClient(store.addr, store.token, timeout_s=5))
    steps: list[int] = []
    run = types.SimpleNamespace(state=lambda: {"w": torch.zeros(MIB // 4 * 3)},  # 3 MiB of float32
                                step=steps.append, last_step=5)
    session = types.SimpleNamespace(inproc=inproc, _start=lambda build: (0, build(session)),
                                    screen_gate=lambda: None, events=None)
    with pytest.raises(ConfigError) as caught:
        WorkerSession.train(session, lambda s: run)
    assert steps == []  # refused before training
    assert str(caught.value).startswith("agent.inprocess.snapshot_mib: per-step snapshots need 96 MiB")
    assert "64 MiB allowed" in str(caught.value)
    inproc.check_fit({"w": torch.zeros(MIB // 4 * 2)})  # 2 MiB: fits, remembered
    assert inproc.fit_bytes == 2 * MIB


def test_snapshots_off_skip_the_cap_check(store, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    inproc = _inprocess(MemStateClient(store.addr, store.token, timeout_s=5), snapshots_on=False)
    inproc.check_fit({"w": torch.zeros(MIB * 4)})  # 16 MiB a shard, no snapshots: no refusal
    assert inproc.fit_bytes == 0


def test_the_checksum_names_its_algorithm_and_catches_one_changed_byte():
    from elastic.checkpoint.checksum import digest_chunks, verify
    import hashlib

    data = bytearray(range(256)) * 4096
    digest, nbytes = digest_chunks([memoryview(data)[:1000], memoryview(data)[1000:]])
    assert digest.startswith("xxh3_128:") and nbytes == len(data)
    assert digest == digest_chunks([data])[0]  # chunking does not change it
    assert verify(digest, data)
    data[123456] ^= 1
    assert not verify(digest, data)
    assert verify(hashlib.sha256(b"old").hexdigest(), b"old")  # an older sha256 digest still checks


def test_a_300_mb_shard_is_stored_replicated_to_the_buddy_and_restored_bitwise(tmp_path):
    from elastic.checkpoint.memclient import ClientPool
    from elastic.checkpoint.snapshot import SnapshotPusher, SnapshotRing, capture, from_bytes, restore
    from elastic.common.events import EventLog

    buddy = MemStateServer(max_bytes=1400 * MIB)
    agent = MemStateServer(max_bytes=1400 * MIB)
    pool = ClientPool(buddy.addr, buddy.token, 30.0)
    agent.replicate = pool.replicate
    client = MemStateClient(agent.addr, agent.token, timeout_s=30, keep_alive=True)
    pusher = SnapshotPusher(client, "n0", 3, 0, EventLog(None, "test"))
    ring = SnapshotRing(shared=True)
    state = {"w": torch.randn(300 * MIB // 4, generator=torch.Generator().manual_seed(0)), "step": 7}
    try:
        snap = capture(state, 7, 0, 3, 8, ring=ring)
        ring.add(snap)
        assert snap.packed.shared is not None  # the agent maps it: no bytes over the socket
        pusher.push(snap)
        pusher.wait()
        assert pusher.failures == 0 and pusher.last_pushed == 7
        expected = state["w"].clone()
        state["w"].fill_(0.5)  # the worker goes on; what was stored is the step-7 state
        from_agent = client.snap_get("n0", 3, 7)
        from_buddy = MemStateClient(buddy.addr, buddy.token, timeout_s=30, peer=True).snap_get("n0", 3, 7)
        assert from_agent[0].checksum == from_buddy[0].checksum and bytes(from_agent[1][:64]) == bytes(from_buddy[1][:64])
        fresh = {"w": torch.zeros(300 * MIB // 4), "step": 0}
        restore(fresh, [from_bytes(*from_buddy)], rank=3, world=8)
        assert torch.equal(fresh["w"], expected) and fresh["step"] == 7
    finally:
        client.close()
        pool.close()
        agent.close()
        buddy.close()


def test_a_changed_byte_in_a_stored_snapshot_is_refused_on_read():
    from elastic.checkpoint.memstate import MemStateCorrupt
    from elastic.checkpoint.snapshot import SnapshotPusher, SnapshotRing, capture
    from elastic.common.events import EventLog

    agent = MemStateServer(max_bytes=64 * MIB)
    client = MemStateClient(agent.addr, agent.token, timeout_s=5, keep_alive=True)
    pusher = SnapshotPusher(client, "n0", 0, 0, EventLog(None, "test"))
    ring = SnapshotRing(shared=True)
    try:
        snap = capture({"w": torch.arange(1000.0)}, 1, 0, 0, 1, ring=ring)
        pusher.push(snap)
        pusher.wait()
        snap.packed.flat[100] ^= 0xFF  # memory the agent maps changed at rest
        with pytest.raises(MemStateCorrupt, match="checksum"):
            client.snap_get("n0", 0, 1)
    finally:
        client.close()
        agent.close()


def test_the_copy_path_is_chosen_by_where_the_state_lives(monkeypatch):
    from elastic.checkpoint.snapshot import capture, copy_path, wait_copied

    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    on_host = torch.zeros(3)
    assert copy_path([on_host]) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert copy_path([on_host, on_gpu]) == "cuda"  # pinned buffer, side stream, event
    assert copy_path([on_host]) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert copy_path([on_gpu]) == "cpu"  # a CPU-only build: today's blocking copy
    snap = capture({"w": on_host}, 1, 0, 0, 1)
    assert snap.ready is None and not snap.packed.pinned  # the CPU path: copied when capture returns
    wait_copied(snap)  # nothing queued, nothing to wait for


def test_a_gpu_worker_captures_on_its_training_thread_and_never_defers():
    inproc = InProcess.__new__(InProcess)
    inproc.device = torch.device("cuda", 0)
    assert inproc._device_copy
    inproc.device = torch.device("cpu")
    assert not inproc._device_copy


def test_a_snapshot_in_shared_memory_pickles_as_a_plain_copy():
    import pickle

    from elastic.checkpoint.snapshot import SnapshotRing, capture

    snap = capture({"w": torch.arange(10.0), "n": 3}, 4, 0, 1, 2, ring=SnapshotRing(shared=True))
    assert snap.packed.shared is not None
    back = pickle.loads(pickle.dumps(snap))  # the restore's exchange between ranks pickles snapshots
    assert back.packed.shared is None and torch.equal(back.tree["w"], torch.arange(10.0)) and back.tree["n"] == 3


def test_shared_pushes_keep_one_unix_connection_and_survive_the_agent_closing_it():
    import time

    from elastic.checkpoint.snapshot import SnapshotPusher, SnapshotRing, capture
    from elastic.common.events import EventLog

    agent = MemStateServer(max_bytes=64 * MIB, io_timeout_s=0.3)
    client = MemStateClient(agent.addr, agent.token, timeout_s=5, keep_alive=True)
    pusher = SnapshotPusher(client, "n0", 0, 0, EventLog(None, "test"))
    ring = SnapshotRing(shared=True)
    try:
        for step in (1, 2):
            pusher.push(capture({"w": torch.full((100,), float(step))}, step, 0, 0, 1, ring=ring))
            pusher.wait()
        kept = client._usock
        assert kept is not None and client._sock is None  # shared pushes: the Unix socket only
        time.sleep(0.8)  # idle past the agent's I/O timeout: it closed the connection
        pusher.push(capture({"w": torch.full((100,), 3.0)}, 3, 0, 0, 1, ring=ring))
        pusher.wait()
        assert pusher.failures == 0 and client._usock is not kept
        assert [m.step for m in client.snap_list()] == [2, 3]  # two steps kept
        bad = MemStateClient(agent.addr, agent.token[:12] + "x" * 20, timeout_s=5, keep_alive=True)
        from elastic.checkpoint.memstate import MemStateRejected
        snap = capture({"w": torch.zeros(4)}, 4, 0, 0, 1, ring=ring)
        with pytest.raises(MemStateRejected, match="bad token"):  # the same socket, the wrong token
            bad.snap_put_shared(client.snap_list()[0], snap.packed.shared, 16, b"", b"")
        bad.close()
    finally:
        client.close()
        agent.close()


def test_an_unreachable_store_leaves_the_cap_unchecked_with_an_event(monkeypatch):
    from elastic.common.events import EventLog

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    server = MemStateServer(max_bytes=MIB)
    addr, token = server.addr, server.token
    server.close()
    inproc = _inprocess(MemStateClient(addr, token, timeout_s=1))
    emitted = []
    inproc.events = types.SimpleNamespace(emit=lambda kind, **fields: emitted.append(kind))
    inproc.check_fit({"w": torch.zeros(MIB)})  # no refusal: the pushes will report the store
    assert emitted == ["snapshot.fit_unchecked"] and inproc.fit_bytes == 0
