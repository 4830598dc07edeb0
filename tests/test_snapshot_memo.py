"""The capture's skeleton memo and the pusher's header cache: reused only while nothing changed."""

from __future__ import annotations

import torch

from elastic.checkpoint.memory import HeaderCache, decode_state
from elastic.checkpoint.snapshot import SnapshotRing, capture, to_bytes


def _state(n: int = 10) -> dict:
    weights = {f"w{i}": torch.full((3,), float(i)) for i in range(n)}
    moments = {f"w{i}": {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)} for i in range(n)}
    return {"model": weights, "optim": {"state": moments, "param_groups": [{"lr": 0.1}]}, "step": 1}


def _take(state: dict, ring: SnapshotRing, step: int = 1):
    snap = capture({"app": state}, step, 0, 0, 1, ring=ring)
    ring.add(snap)
    return snap


def _model_of(snap) -> dict:
    return snap.tree["app"]["model"]


def test_the_same_tensors_reuse_the_last_skeleton_and_copy_their_current_values():
    state, ring = _state(), SnapshotRing()
    first = _take(state, ring)
    state["model"]["w3"].add_(5.0)  # in place: the same tensor object, a new value
    second = _take(state, ring, 2)
    assert second.skeleton["app"]["model"] is first.skeleton["app"]["model"]
    assert second.skeleton["app"]["optim"]["state"] is first.skeleton["app"]["optim"]["state"]
    assert torch.equal(_model_of(second)["w3"], torch.full((3,), 8.0))


def test_a_replaced_tensor_or_a_new_key_is_walked_again():
    state, ring = _state(), SnapshotRing()
    first = _take(state, ring)
    state["model"]["w2"] = torch.full((3,), 42.0)  # a new object under the same key
    second = _take(state, ring, 2)
    assert second.skeleton["app"]["model"] is not first.skeleton["app"]["model"]
    assert torch.equal(_model_of(second)["w2"], torch.full((3,), 42.0))
    state["optim"]["state"]["w1"]["exp_avg_sq"] = torch.ones(3)  # an inner key added
    third = _take(state, ring, 3)
    assert torch.equal(third.tree["app"]["optim"]["state"]["w1"]["exp_avg_sq"], torch.ones(3))


def test_a_dict_that_moved_in_the_sources_is_not_taken_from_another_place():
    state, ring = _state(), SnapshotRing()
    _take(state, ring)
    moved = {"first": torch.zeros(2), **state}  # the model's tensors now start at index 1
    snap = capture({"app": moved}, 2, 0, 0, 1, ring=ring)
    assert torch.equal(snap.tree["app"]["model"]["w4"], torch.full((3,), 4.0))
    assert torch.equal(snap.tree["app"]["first"], torch.zeros(2))


def test_a_cleared_ring_forgets_its_skeletons():
    state, ring = _state(), SnapshotRing()
    first = _take(state, ring)
    ring.clear()
    assert _take(state, ring, 2).skeleton["app"]["model"] is not first.skeleton["app"]["model"]


def test_the_header_is_encoded_again_when_a_scalar_changes():
    state, ring, heads = _state(), SnapshotRing(), HeaderCache()
    one = to_bytes(_take(state, ring), heads)[0]
    assert to_bytes(_take(state, ring, 2), heads)[0] is one  # nothing in the header changed
    state["optim"]["param_groups"][0]["lr"] = 0.05
    snap = _take(state, ring, 3)
    chunks = to_bytes(snap, heads)
    assert chunks[0] is not one
    tree, _ = decode_state(bytearray(b"".join(bytes(c) for c in chunks)))
    assert tree["app"]["optim"]["param_groups"][0]["lr"] == 0.05


def test_the_memo_lets_go_of_the_tensors_it_compared_when_cleared():
    import gc
    import weakref

    state, ring = _state(), SnapshotRing()
    _take(state, ring)
    watched = weakref.ref(state["model"]["w0"])
    del state
    gc.collect()
    assert watched() is not None  # the memo still holds it (the snapshots hold copies only)
    ring.memo.clear()
    gc.collect()
    assert watched() is None
