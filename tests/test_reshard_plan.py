"""Point-to-point resharding (elastic.worker.reshard), the parts that need no process group: every
rank's plan, played out in one process, fills each new shard bitwise as joining the old shards and
taking the new rank's ``torch.chunk`` does; both ends of a pair list their pieces in one order."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic.checkpoint.snapshot import SHARD, Snapshot, SnapshotError
from elastic.worker.generation import RecoveryUnavailable
from elastic.worker.reshard import Layout, describe, plan, providers, rounds, shard_sources

ROWS = (0, 1, 2, 3, 5, 7, 12, 33)
"""Row counts of the tensors: fewer rows than ranks (some shards empty), uneven and even splits."""


def _full(rows: int, i: int) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 1000 * i


def _old_tree(old: int, old_world: int) -> dict:
    """An old rank's snapshot tree: sharded tensors (chunks as FSDP2 makes them), a plain tensor, scalars."""
    shards = {}
    for i, rows in enumerate(ROWS):
        chunks = torch.chunk(_full(rows, i), old_world)
        local = chunks[old] if old < len(chunks) else _full(rows, i)[0:0]
        shards[f"w{i}"] = {SHARD: local.clone(), "shape": [rows, 3]}
    return {"app": {"model": shards, "count": torch.tensor([7 + old]), "step": 5, "groups": [{"lr": 0.1}]}}


def _targets(rank: int, world: int, sharded_rows: set[int]) -> dict:
    """A fresh state of the new world: a shard-sized tensor per sharded leaf, a full one for the others."""
    model = {}
    for i, rows in enumerate(ROWS):
        chunks = torch.chunk(torch.empty(rows, 3), world)
        size = chunks[rank].shape[0] if rank < len(chunks) else 0
        model[f"w{i}"] = torch.full((size if i in sharded_rows else rows, 3), -1.0)
    return {"app": {"model": model, "count": torch.tensor([0]), "step": 0, "groups": [{"lr": 0.0}]}}


def _snapshots(old_world: int) -> dict[int, Snapshot]:
    return {old: Snapshot(5, 0, old, old_world, _old_tree(old, old_world)) for old in range(old_world)}


def _agree(snaps: dict[int, Snapshot], chosen: dict[int, int], world: int) -> Layout:
    gathered = [describe({o: s for o, s in snaps.items() if chosen[o] == new}, chosen[0] == new)
                for new in range(world)]
    return Layout.agree(gathered, sorted(snaps))


def _play(old_world: int, world: int, chosen: dict[int, int]) -> tuple[list[list], Layout, list[list]]:
    """Every new rank's plan, its rows moved by direct copies (the transfer without a process group)."""
    snaps = _snapshots(old_world)
    layout = _agree(snaps, chosen, world)
    expected = list(range(old_world))
    sources = shard_sources(snaps)
    all_dests, plans = [], []
    for rank in range(world):
        dests = [t.clone() for t in _targets(rank, world, set(range(len(ROWS))))["app"]["model"].values()]
        plans.append(plan(layout, [True] * len(ROWS), chosen, expected, world, rank))
        all_dests.append(dests)
    for rank, pieces in enumerate(plans):
        for p in pieces:
            if p.dst == rank:
                src = sources[p.old][p.leaf][p.lo - p.src_first:p.hi - p.src_first]
                all_dests[rank][p.leaf][p.lo - p.dst_first:p.hi - p.dst_first] = src
    return plans, layout, all_dests


@pytest.mark.parametrize("old_world,world", [(4, 3), (4, 2), (5, 3), (3, 1), (2, 2)])
def test_every_new_shard_is_the_chunk_of_the_joined_old_shards(old_world, world):
    chosen = {old: old % world for old in range(old_world)}
    _, _, dests = _play(old_world, world, chosen)
    for rank in range(world):
        for i, rows in enumerate(ROWS):
            chunks = torch.chunk(_full(rows, i), world)
            want = chunks[rank] if rank < len(chunks) else _full(rows, i)[0:0]
            assert torch.equal(dests[rank][i], want), (rank, i)


def test_both_ends_of_a_pair_list_the_same_pieces_in_the_same_order():
    plans, _, _ = _play(4, 3, {0: 0, 1: 1, 2: 2, 3: 1})
    for src, dst in itertools.permutations(range(3), 2):
        sent = [p for p in plans[src] if (p.src, p.dst) == (src, dst)]
        received = [p for p in plans[dst] if (p.src, p.dst) == (src, dst)]
        assert sent == received


def test_a_plain_target_gets_every_row_and_the_rest_comes_from_old_rank_0():
    snaps = _snapshots(4)
    chosen = {0: 0, 1: 1, 2: 1, 3: 2}
    layout = _agree(snaps, chosen, 3)
    targets = _targets(1, 3, sharded_rows={0, 1, 2, 3, 4, 5, 6})  # the last leaf plain: every row
    dests = [t for t in targets["app"]["model"].values()]
    sharded = [True] * (len(ROWS) - 1) + [False]
    pieces = plan(layout, sharded, chosen, list(range(4)), 3, rank=1)
    assert {p.old for p in pieces if p.leaf == len(ROWS) - 1} == {0, 1, 2, 3}
    tree = layout.tree(dests, sharded)
    assert tree["app"]["count"].item() == 7 and tree["app"]["step"] == 5 and tree["app"]["groups"] == [{"lr": 0.1}]
    assert tree["app"]["model"]["w0"] == {SHARD: dests[0], "shape": [0, 3]}
    assert tree["app"]["model"][f"w{len(ROWS) - 1}"] is dests[-1]


def test_the_rest_is_cloned_out_of_a_packed_buffer():
    big = torch.zeros(1000)
    snap = Snapshot(5, 0, 0, 1, {"app": {"count": big[:1], "w": {SHARD: big[1:3].reshape(2, 1), "shape": [2, 1]}}})
    rest = describe({0: snap}, True)["rest"]
    assert rest["app"]["count"].untyped_storage().nbytes() == 4  # not the 4000 bytes it is a view of
    assert rest["app"]["w"] == {SHARD: None, "shape": [2, 1], "dtype": "float32"}


def test_rounds_cut_whole_leaves_alike_on_every_rank():
    snaps = _snapshots(4)
    layout = _agree(snaps, {o: 0 for o in range(4)}, 1)
    pieces = plan(layout, [True] * len(ROWS), {o: 0 for o in range(4)}, list(range(4)), 1, 0)
    batches = rounds(pieces, layout.leaves, budget=200)
    assert sum(batches, []) == pieces and len(batches) > 2
    for batch in batches:
        leaves = {p.leaf for p in batch}
        assert len(leaves) == 1 or sum(layout.leaves[i].nbytes for i in leaves) <= 200
    empty_rank = rounds([], layout.leaves, budget=200)
    assert len(empty_rank) == len(batches)  # a rank without pieces still has every round


def test_agreement_fails_alike_when_a_snapshot_is_missing_or_laid_out_otherwise():
    snaps = _snapshots(4)
    chosen = {0: 0, 1: 1, 2: 2, 3: 0}
    gathered = [describe({o: s for o, s in snaps.items() if chosen[o] == n and o != 2}, n == 0) for n in range(3)]
    with pytest.raises(RecoveryUnavailable, match=r"old ranks \[2\]"):
        Layout.agree(gathered, list(range(4)))
    snaps[3].tree["app"]["model"]["w7"][SHARD] = snaps[3].tree["app"]["model"]["w7"][SHARD].double()
    gathered = [describe({o: s for o, s in snaps.items() if chosen[o] == n}, n == 0) for n in range(3)]
    with pytest.raises(SnapshotError, match=r"old ranks \[3\]"):
        Layout.agree(gathered, list(range(4)))


def test_a_destination_that_does_not_fit_is_refused_before_any_transfer():
    layout = _agree(_snapshots(4), {o: 0 for o in range(4)}, 3)
    targets = _targets(0, 3, sharded_rows=set())  # plain tensors (no DTensor without a mesh): every row
    assert layout.dests(targets, 0, 3)[1] == [False] * len(ROWS)
    targets["app"]["model"]["w7"] = torch.zeros(5, 3)
    with pytest.raises(SnapshotError, match="w7"):
        layout.dests(targets, 0, 3)


def test_providers_spread_a_lost_nodes_snapshots_over_the_ranks_that_hold_them():
    offers = [{0: [4, 5]}, {1: [4, 5], 2: [5], 3: [5]}, {2: [5], 3: [4, 5]}]  # ranks 1, 2: the buddy node
    chosen = providers(offers, 5, [0, 1, 2, 3])
    assert chosen == {0: 0, 1: 1, 2: 1, 3: 2}
