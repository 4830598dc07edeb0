"""In-process recovery, the parts that need no processes: snapshot capture/restore (same world and
resharded), the agents' buddy ring, peer-loss detection.  Generation rounds: test_generation_rounds.py."""

from __future__ import annotations

import pytest
import torch

from elastic.agent.inprocess import ring_successor
from elastic.checkpoint.snapshot import SHARD, Snapshot, SnapshotRing, _full, capture, restore
from elastic.worker.inprocess import RecoveryUnavailable, _agree, is_peer_failure

def _shards(full: torch.Tensor, world: int) -> list[dict]:
    return [{SHARD: chunk.clone(), "shape": list(full.shape)} for chunk in torch.chunk(full, world, dim=0)]


def test_shards_of_the_old_world_join_into_the_full_tensor():
    full = torch.arange(33 * 2, dtype=torch.float32).reshape(33, 2)
    trees = [{"w": shard, "step": 7} for shard in _shards(full, 4)]
    joined = _full(trees)
    assert torch.equal(joined["w"], full) and joined["step"] == 7
    broken = [{"w": {SHARD: t["w"][SHARD], "shape": [40, 2]}} for t in trees]
    with pytest.raises(Exception, match="join to"):
        _full(broken)


def test_restore_into_a_fresh_state_same_world_and_from_other_world_sizes():
    full = torch.randn(10, 3)
    snap = capture({"app": {"w": full, "step": 5}}, step=5, gen=0, rank=0, world=1, extra={"seed": torch.tensor([3])})
    target = {"app": {"w": torch.zeros(10, 3), "step": 0}}
    restore(target, [snap], rank=0, world=1)
    assert torch.equal(target["app"]["w"], full) and target["app"]["step"] == 5
    assert not torch.equal(snap.tree["app"]["w"], torch.zeros(10, 3))  # the snapshot was a copy
    ring = SnapshotRing(depth=2)
    for step in (1, 2, 3):
        ring.add(Snapshot(step, 0, 0, 1, {}))
    assert ring.get(1) is None and ring.newest().step == 3 and ring.get(2) is not None


def test_captures_reuse_only_buffers_the_ring_let_go():
    ring, w = SnapshotRing(depth=2), torch.zeros(4, 2, requires_grad=True)
    buffers = []
    for step in (1, 2, 3, 4, 5):
        with torch.no_grad():
            w.fill_(step)
        snap = capture({"app": {"w": w, "lr": [0.1 * step]}}, step=step, gen=0, rank=0, world=1, ring=ring)
        ring.add(snap)
        buffers.append(snap.packed)
    # Three buffers turn: step 1's leaves the ring when step 3 is added, and takes step 4's copy.
    assert len({id(b) for b in buffers[:3]}) == 3 and buffers[3] is buffers[0] and buffers[4] is buffers[1]
    for step in (4, 5):  # the kept snapshots still hold their own values
        tree = ring.get(step).tree["app"]
        assert torch.equal(tree["w"], torch.full((4, 2), float(step))) and tree["lr"] == [0.1 * step]
    assert not ring.get(5).tree["app"]["w"].requires_grad
    other = capture({"app": {"w": torch.zeros(2, 2)}}, step=6, gen=1, rank=0, world=1, ring=ring)
    assert all(other.packed is not b for b in buffers)  # a new layout (new world): a new buffer


def test_a_packed_snapshot_goes_over_the_wire_as_the_generic_encoding_does():
    from elastic.checkpoint.memory import decode_state, encode_state
    from elastic.checkpoint.snapshot import to_bytes

    state = {"app": {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64), "flag": torch.tensor(True),
                     "empty": torch.zeros(0, 4), "groups": [{"lr": 0.5, "params": ["w", "b"]}]}}
    snap = capture(state, step=2, gen=0, rank=0, world=1, extra={"seed": torch.tensor([3])})
    packed = b"".join(bytes(c) for c in to_bytes(snap))
    generic = b"".join(bytes(c) for c in encode_state(snap.tree, snap.extra))
    assert len(packed) == len(generic)
    tree, extra = decode_state(bytearray(packed))
    assert extra == snap.extra and tree["app"]["groups"] == [{"lr": 0.5, "params": ["w", "b"]}]
    for key in ("w", "b", "flag", "empty"):
        assert torch.equal(tree["app"][key], state["app"][key]) and tree["app"][key].dtype == state["app"][key].dtype


def test_agreement_takes_the_newest_step_every_old_rank_holds():
    assert _agree({0: {4, 5}, 1: {4}, 2: {4, 5}}, [0, 1, 2]) == 4
    with pytest.raises(RecoveryUnavailable, match=r"missing ranks \[2\]"):
        _agree({0: {4, 5}, 1: {4}}, [0, 1, 2])


def test_peer_failures_are_told_from_bugs():
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43406: Connection reset by peer")
    assert is_peer_failure(lost)
    try:
        try:
            raise lost
        except RuntimeError as exc:
            raise ValueError("wrapped") from exc
    except ValueError as wrapped:
        assert is_peer_failure(wrapped)
    assert not is_peer_failure(RuntimeError("shape mismatch"))


def test_buddy_is_the_next_live_node_of_the_ring():
    nodes = {n: {"memstate": {"addr": f"127.0.0.1:{i}", "token": "t"}} for i, n in enumerate(["n0", "n1", "n3"])}
    nodes["n2"] = {"state": "RUNNING"}  # no store published: not a buddy
    assert ring_successor("n1", nodes)[0] == "n3"
    assert ring_successor("n3", nodes)[0] == "n0"  # wraps around
    assert ring_successor("n0", {"n0": nodes["n0"]}) is None


def test_snapshots_off_reaches_the_workers_environment():
    from elastic.agent.config import InProcessConfig
    from elastic.agent.inprocess import inprocess_env
    from elastic.common.env import WorkerEnv

    on = WorkerEnv.from_env(WorkerEnv(**inprocess_env(None, InProcessConfig())).to_env())
    off = WorkerEnv.from_env(WorkerEnv(**inprocess_env(None, InProcessConfig(snapshots=False))).to_env())
    assert (on.snapshots, off.snapshots) == ("1", "0")
    assert WorkerEnv(**inprocess_env(None, None)).snapshots == ""  # in-process recovery off: nothing said


def test_snapshot_ab_blocks_alternate_and_reach_the_workers():
    from elastic.agent.config import InProcessConfig
    from elastic.agent.inprocess import inprocess_env
    from elastic.common.config import ConfigError
    from elastic.common.env import WorkerEnv
    from elastic.worker.inprocess import ab_snapshot_step

    ab = WorkerEnv.from_env(WorkerEnv(**inprocess_env(None, InProcessConfig(snapshot_ab_block=3))).to_env())
    assert ab.snapshots == "ab:3"
    assert [s for s in range(1, 13) if ab_snapshot_step(s, 3)] == [1, 2, 3, 7, 8, 9]
    assert all(ab_snapshot_step(s, 0) for s in range(1, 13))
    assert InProcessConfig(snapshots=False, snapshot_ab_block=3).snapshots_env() == "0"
    with pytest.raises(ConfigError, match="snapshot_ab_block"):
        InProcessConfig(snapshot_ab_block=-1)


def test_one_push_thread_carries_every_snapshot_and_survives_a_push_that_raises(tmp_path, monkeypatch):
    from elastic.checkpoint import snapshot as snapshot_mod
    from elastic.checkpoint.memclient import MemStateClient
    from elastic.checkpoint.memstate import MemStateServer
    from elastic.common.events import EventLog, read_events

    server = MemStateServer(max_bytes=1 << 20)
    client = MemStateClient(server.addr, server.token, timeout_s=5, keep_alive=True)
    events = EventLog(tmp_path / "events.jsonl", "test")
    pusher = snapshot_mod.SnapshotPusher(client, "n0", 0, 0, events)
    state = {"w": torch.arange(6.0), "step": 0}
    try:
        pusher.push(capture(state, 1, 0, 0, 1))
        thread = pusher._thread
        pusher.push(capture(state, 2, 0, 0, 1))  # waits for the first, hands the second to the same thread
        pusher.wait()
        assert pusher._thread is thread and pusher.last_pushed == 2
        assert client.snap_get("n0", 0, 2)[0].step == 2

        def broken(snapshot, heads=None):
            raise KeyError("a bug in the encoder")

        monkeypatch.setattr(snapshot_mod, "to_bytes", broken)
        pusher.push(capture(state, 3, 0, 0, 1))
        pusher.wait()  # returns: the failure is counted, never left hanging
        assert pusher.failures == 1 and pusher.last_pushed == 2 and thread.is_alive()
        failed = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "snapshot.push_failed"]
        assert failed and failed[0]["step"] == 3 and "KeyError" in failed[0]["error"]
        monkeypatch.undo()
        pusher.push(capture(state, 4, 0, 0, 1))
        pusher.wait()
        assert pusher.last_pushed == 4 and pusher._thread is thread

        def unsupported():
            raise snapshot_mod.SnapshotError("cannot snapshot a DTensor placed (Replicate(),)")

        pusher.submit(unsupported)  # a deferred capture: its error reaches the training thread
        with pytest.raises(snapshot_mod.SnapshotError):
            pusher.wait_captured()
        pusher.wait()
        assert pusher.last_pushed == 4
        state["w"] += 1
        pusher.submit(lambda: capture(state, 5, 0, 0, 1))
        pusher.wait_captured()
        state["w"] += 1  # after the capture: not in the snapshot
        pusher.wait()
        meta, data = client.snap_get("n0", 0, 5)
        from elastic.checkpoint.memory import decode_state
        assert torch.equal(decode_state(data)[0]["w"], torch.arange(6.0) + 1)
    finally:
        client.close()
        server.close()
