"""Generation rounds, one participant per node, on the in-memory store: the plan as a delta, one
coordinator closing each round, its deputy taking over, two faults in one round, late nodes."""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic.control.generations import (
    GenerationFailed,
    Generations,
    Plan,
    Slot,
    plan_in_place,
    plan_kept,
    plan_without,
    plan_next,
    ranks_at,
)
from elastic.agent.roundnotes import RoundNotes
from elastic.control.genround import NodeRound
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore

KEYS = RunKeys.of("/elastic", "rounds")
RPN = 2  # ranks per node in these tests


def _roster(nodes: int) -> dict[str, dict[int, int]]:
    return {f"n{i}": {local: i * RPN + local for local in range(RPN)} for i in range(nodes)}


def _registered(nodes: int) -> Generations:
    gens = Generations(MemoryStore(), KEYS, epoch=0)
    for node, ranks in _roster(nodes).items():
        gens.register_node(node, ranks)
    return gens


class Probes:
    """Each node's probe verdicts, and who probed whom (lost-node discovery is the coordinator's)."""

    def __init__(self, gone: set[str] = frozenset()) -> None:
        self.gone = set(gone)
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def of(self, by: str):
        def probe(nodes: list[str]) -> dict[str, str]:
            with self._lock:
                self.calls += [(by, node) for node in nodes]
            return {node: "refused" if node in self.gone else "" for node in nodes}
        return probe


def _rounds(gens: Generations, gen: int, nodes: list[str], probes: Probes, previous: Plan | None = None,
            delay: dict[str, float] | None = None, timeout_s: float = 5.0, takeover_s: float = 5.0,
            roster: dict | None = None, **hold) -> dict[str, Plan | Exception]:
    """Every node of ``nodes`` joins generation ``gen`` in a thread (after ``delay``); node -> plan or
    error.  A node the previous generation lost joins with its slots and no rank (it came back)."""
    roster = roster or gens.roster()
    ranks = ranks_at(roster, previous)
    out: dict[str, Plan | Exception] = {}

    def one(node: str) -> None:
        time.sleep((delay or {}).get(node, 0.0))
        mine = {local: ranks.get(Slot(node, local), -1) for local in roster[node]}
        notice = (KEYS.noticed(0, gen - 1), json.dumps({"by": node, "kind": "peer_lost"}))
        round_ = NodeRound(gens, node, gen, mine, previous, probes.of(node), timeout_s, poll_s=0.05,
                           takeover_s=takeover_s, notice=notice, **hold)
        try:
            out[node] = round_.run()
        except GenerationFailed as exc:
            out[node] = exc
        finally:
            round_.close()

    threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return out


def _one_plan(out: dict[str, Plan | Exception]) -> Plan:
    plans = {p for p in out.values() if isinstance(p, Plan)}
    assert len(plans) == 1, out
    return plans.pop()


def test_a_plan_is_a_delta_that_keeps_rank_order():
    roster = _roster(3)
    joined = {n: dict(s) for n, s in roster.items()}
    assert plan_next(1, roster, None, {"n0": roster["n0"]}, set()) is None  # still waiting for two nodes
    same = plan_next(1, roster, None, joined, set(), by="n0")
    assert same.keeps_ranks() and same.world == 6 and same.rank_of(3) == 3 and same.nodes == 3
    shrunk = plan_next(1, roster, None, {"n0": roster["n0"], "n2": roster["n2"]}, {"n1"})
    assert shrunk.dropped == (2, 3) and shrunk.world == 4 and shrunk.lost == ("n1",) and shrunk.gone == ("n1",)
    assert [shrunk.rank_of(r) for r in range(6)] == [0, 1, None, None, 2, 3]
    assert Plan.from_record(json.loads(shrunk.to_json())) == shrunk
    # The next round builds on it: generation-1 ranks, then n2 lost as well.
    assert ranks_at(roster, shrunk) == {Slot("n0", 0): 0, Slot("n0", 1): 1, Slot("n2", 0): 2, Slot("n2", 1): 3}
    second = plan_next(2, roster, shrunk, {"n0": {0: 0, 1: 1}}, {"n2"})
    assert second.old_world == 4 and second.dropped == (2, 3) and second.world == 2
    assert second.gone == ("n1", "n2") and second.dropped0 == (2, 3, 4, 5) and second.nodes == 1


def test_a_lost_node_that_joins_again_is_readmitted_with_its_generation_0_ranks():
    """n1 lost in generation 1 (the world shrank 6 -> 4); it comes back and joins generation 2: the
    plan puts its slots back at their generation-0 ranks, every other rank shifts back with them."""
    roster = _roster(3)
    shrunk = plan_next(1, roster, None, {"n0": roster["n0"], "n2": roster["n2"]}, {"n1"})
    assert [shrunk.rank_of0(r) for r in range(6)] == [0, 1, None, None, 2, 3]
    back = plan_next(2, roster, shrunk, {"n0": {0: 0, 1: 1}, "n2": {0: 2, 1: 3}, "n1": {0: -1, 1: -1}}, set())
    assert back.returned == ("n1",) and back.added == (2, 3) and back.world == 6 and back.nodes == 3
    assert back.gone == () and back.dropped0 == () and back.dropped == () and back.lost == ()
    assert [back.rank_of0(r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    assert Plan.from_record(json.loads(back.to_json())) == back
    assert ranks_at(roster, back) == {Slot(n, local): r for n, slots in roster.items() for local, r in slots.items()}
    # Without its join the round closes as before: n1 stays gone.
    still = plan_next(2, roster, shrunk, {"n0": {0: 0, 1: 1}, "n2": {0: 2, 1: 3}}, set())
    assert still.returned == () and still.world == 4 and still.gone == ("n1",)
    # Back while another node is lost in the same round: one in, one out.
    swap = plan_next(2, roster, shrunk, {"n0": {0: 0, 1: 1}, "n1": {0: -1, 1: -1}}, {"n2"})
    assert swap.returned == ("n1",) and swap.lost == ("n2",) and swap.gone == ("n2",)
    assert swap.dropped0 == (4, 5) and swap.world == 4 and [swap.rank_of0(r) for r in range(6)] == [0, 1, 2, 3, None, None]


def test_a_round_short_of_a_fixed_size_run_holds_until_the_lost_node_returns():
    """Generation 1 lost n0 (4 nodes -> 3).  The round of generation 2 would close short again: its
    coordinator holds it until n0's agent, restarted, joins it; every node gets the plan with n0 back."""
    gens = _registered(4)
    shrunk = gens.close(plan_next(1, gens.roster(), None, {f"n{i}": _roster(4)[f"n{i}"] for i in (1, 2, 3)}, {"n0"}))
    out = _rounds(gens, 2, ["n0", "n1", "n2", "n3"], Probes(), previous=shrunk, delay={"n0": 0.6},
                  min_nodes=4, rejoin_wait_s=5.0)
    plan = _one_plan(out)
    assert plan.returned == ("n0",) and plan.nodes == 4 and plan.world == 8 and plan.gone == ()
    assert plan.by == "n1"


def test_a_held_round_closes_short_once_the_wait_is_over_and_a_loss_in_the_round_holds_nothing():
    gens = _registered(4)
    # The round that loses n0 closes at once, short: n0 cannot rejoin a round that declared it lost.
    t0 = time.monotonic()
    first = _one_plan(_rounds(gens, 1, ["n1", "n2", "n3"], Probes({"n0"}), min_nodes=4, rejoin_wait_s=5.0))
    assert first.nodes == 3 and first.lost == ("n0",) and time.monotonic() - t0 < 2.0
    # The next one holds for n0, who does not come: it closes short after rejoin_wait_s.
    t0 = time.monotonic()
    second = _one_plan(_rounds(gens, 2, ["n1", "n2", "n3"], Probes(), previous=first, min_nodes=4,
                               rejoin_wait_s=0.5))
    held = time.monotonic() - t0
    assert second.nodes == 3 and second.gone == ("n0",) and second.returned == () and 0.5 <= held < 3.0
    # n0 back too late: the round it joins formed without it, and it is told so (the run restarts).
    late = _rounds(gens, 2, ["n0"], Probes(), previous=first, timeout_s=2.0)
    assert isinstance(late["n0"], GenerationFailed) and "formed without this node" in str(late["n0"])
    assert gens.member("n0") == _roster(4)["n0"] and gens.member("n9") is None
    # An elastic run above its minimum never holds.
    t0 = time.monotonic()
    third = _one_plan(_rounds(gens, 3, ["n1", "n2", "n3"], Probes(), previous=second, min_nodes=3,
                              rejoin_wait_s=5.0))
    assert third.nodes == 3 and time.monotonic() - t0 < 2.0


def test_a_slot_replaced_in_place_keeps_every_rank_and_what_was_lost_before():
    roster = _roster(3)
    first = plan_in_place(1, roster, None, by="n2")
    assert first.keeps_ranks() and first.world == 6 and first.nodes == 3 and first.by == "n2"
    shrunk = plan_next(1, roster, None, {"n0": roster["n0"], "n2": roster["n2"]}, {"n1"})
    again = plan_in_place(2, roster, shrunk, by="n0")
    assert again.keeps_ranks() and again.old_world == 4 and again.world == 4 and again.nodes == 2
    assert again.gone == ("n1",) and again.lost == () and again.dropped0 == shrunk.dropped0
    assert [again.rank_of(r) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(GenerationFailed):
        plan_in_place(2, {"n1": roster["n1"]}, shrunk, by="n0")  # nothing of generation 1 left
    # A node lost: the full round's plan, from the plan held and the lost node's record alone.
    lost1 = plan_next(1, roster, None, {"n0": roster["n0"], "n2": roster["n2"]}, {"n1"}, by="n2")
    assert plan_without(1, Plan(0, 6, nodes=3), "n1", roster["n1"], by="n2") == lost1
    four = _roster(4)
    kept = plan_next(1, four, None, {n: four[n] for n in ("n0", "n2", "n3")}, {"n1"}, by="n0")
    then = plan_next(2, four, kept, {"n0": four["n0"], "n3": four["n3"]}, {"n2"}, by="n0")
    assert plan_without(2, kept, "n2", four["n2"], by="n0") == then and then.rank_of(2) is None
    with pytest.raises(GenerationFailed):
        plan_without(2, kept, "n1", four["n1"], by="n0")  # lost before
    # The same plans without the roster: from the plan held, or generation 0's world and node count.
    assert plan_kept(1, Plan(0, 6, nodes=3), by="n2") == first
    assert plan_kept(2, shrunk, by="n0") == again
    assert plan_kept(3, again, by="n2") == plan_in_place(3, roster, again, by="n2")


class WatchCounting(MemoryStore):
    """Records the first key of every watch a round opens."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[str] = []

    def watch(self, key, start_revision, prefix=False, range_end=None, idle_s=30.0):
        self.watched.append(key)
        return super().watch(key, start_revision, prefix=prefix, range_end=range_end, idle_s=idle_s)


def _noted_gens(nodes: int, feed: bool = True) -> tuple[Generations, RoundNotes, WatchCounting]:
    """``nodes`` registered, and the round notes every agent's signal watch would hand on (one
    feed for all: every agent hears the same notes), unless ``feed`` is False."""
    store = WatchCounting()
    gens = Generations(store, KEYS, epoch=0)
    for node, ranks in _roster(nodes).items():
        gens.register_node(node, ranks)
    notes = RoundNotes(epoch=0)
    if feed:
        store.watch_keys([KEYS.round_note], store.revision() + 1,
                         on_events=lambda batch: [notes.heard(json.loads(e.value)) for e in batch if e.value])
    return gens, notes, store


def test_the_members_of_a_full_round_take_its_plan_and_store_from_the_round_note():
    """A node lost: every node joins, but only the four leaders watch the round; the others (here
    n4..n6) take the coordinator's plan and the new rank 0's store address from the round note."""
    gens, notes, store = _noted_gens(8)
    out = _rounds(gens, 1, [f"n{i}" for i in range(7)], Probes(gone={"n7"}), notes=notes)
    plan = _one_plan(out)
    assert plan.lost == ("n7",) and plan.world == 14 and plan.by == "n0"
    control = KEYS.gen_control(0, 1)[0]
    watchers = [key for key in store.watched if key.startswith(control) or key == KEYS.generation(0, 1)]
    # n0, n1, n2, n3 (the leaders) watched the round's control keys, and n0, coordinating, all of it;
    # n4, n5 and n6 watched nothing.
    assert watchers.count(control) == 4 and watchers.count(KEYS.generation(0, 1)) == 1 and len(watchers) == 5
    gens.put_store(1, "127.0.0.1:4242")
    member = NodeRound(gens, "n5", 1, {0: 10, 1: 11}, None, Probes().of("n5"), 5.0, notes=notes)
    member.state.plan = plan  # as after its run(): the store comes from the note too
    member._by_note = True
    assert member.wait_store(2.0) == "127.0.0.1:4242"


def test_a_member_whose_note_never_comes_watches_the_round_itself():
    gens, notes, store = _noted_gens(6, feed=False)
    events: list[tuple[str, dict]] = []
    t0 = time.monotonic()
    out = _rounds(gens, 1, [f"n{i}" for i in range(5)], Probes(gone={"n5"}), notes=notes, note_watch_after_s=0.5,
                  emit=lambda kind, **fields: events.append((kind, fields)))
    assert _one_plan(out).lost == ("n5",) and time.monotonic() - t0 < 5.0
    fallbacks = [f for kind, f in events if kind == "round.note_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["after_s"] >= 0.5  # n4, the one member past the leaders


def test_a_round_closed_in_place_ends_at_each_join_without_the_coordinators_wait():
    """The node whose spare took a slot writes the plan first: every node's join reads it back,
    so nobody waits for the last join (here n5 never joins: the usual round would time out)."""
    gens = _registered(6)
    gens.close(plan_in_place(1, gens.roster(), None, by="n3"))
    probes = Probes()
    out = _rounds(gens, 1, [f"n{i}" for i in range(5)], probes, timeout_s=2.0)
    plan = _one_plan(out)
    assert plan.by == "n3" and plan.keeps_ranks() and plan.world == 12 and probes.calls == []


def test_every_node_gets_one_plan_closed_by_the_first_node_alone():
    gens = _registered(6)
    probes = Probes()
    out = _rounds(gens, 1, [f"n{i}" for i in range(6)], probes)
    plan = _one_plan(out)
    assert plan.by == "n0" and plan.keeps_ranks() and plan.world == 12 and plan.nodes == 6
    # Every probe of the round came from the coordinator or its deputy, never from the other nodes.
    assert {by for by, _ in probes.calls} <= {"n0", "n1"}
    # The run's note of the fault: written once, inside the first join's transaction.
    assert json.loads(gens.store.get(KEYS.noticed(0, 0)).value)["kind"] == "peer_lost"


def test_a_lost_node_is_found_and_named_once_by_the_coordinator():
    gens = _registered(5)
    probes = Probes(gone={"n3"})
    out = _rounds(gens, 1, ["n0", "n1", "n2", "n4"], probes)
    plan = _one_plan(out)
    assert plan.lost == ("n3",) and plan.world == 8 and plan.rank_of(8) == 6  # n4's first slot moves down
    assert [node for by, node in probes.calls if node == "n3"] and {by for by, n in probes.calls if n == "n3"} == {"n0"}
    record = json.loads(gens.store.get(KEYS.gen_lost(0, 1, "n3")).value)
    assert record["by"] == "n0" and record["reason"] == "refused"


def test_the_coordinator_lost_mid_round_is_replaced_by_its_deputy():
    """n0 joined, then its node died before it closed the round: n1 (its deputy) finds it gone,
    declares it lost -- the hand-over everyone sees -- and closes the round without it."""
    gens = _registered(4)
    gens.join_node(1, "n0", {0: 0, 1: 1}, head_limit=3)  # its join is in, its agent is gone
    probes = Probes(gone={"n0"})
    out = _rounds(gens, 1, ["n1", "n2", "n3"], probes)
    plan = _one_plan(out)
    assert plan.by == "n1" and plan.lost == ("n0",) and plan.world == 6 and plan.rank_of(2) == 0
    # The next round starts from it: n0 is gone, so n1 coordinates generation 2 from the start.
    out2 = _rounds(gens, 2, ["n1", "n2", "n3"], Probes(), previous=plan)
    assert _one_plan(out2).by == "n1" and _one_plan(out2).world == 6


def test_two_faults_in_one_round_coordinator_and_deputy_both_gone():
    """n0 and n1 are lost together: nobody is left to probe them for their role, so the reserves (n2,
    n3) take over after ``takeover_s``; one plan drops both nodes; n4 and n5 never probe the lost
    pair.  (Once it is declared lost, n4 and n5 are the reserves of n2 and n3: on a loaded host the
    round can outlast another ``takeover_s`` and they then probe those two, as they should.)"""
    gens = _registered(6)
    probes = Probes(gone={"n0", "n1"})
    out = _rounds(gens, 1, ["n2", "n3", "n4", "n5"], probes, takeover_s=0.3)
    plan = _one_plan(out)
    assert plan.lost == ("n0", "n1") and plan.world == 8 and plan.by == "n2"
    assert {by for by, node in probes.calls if node in ("n0", "n1")} <= {"n2", "n3"}
    assert {node for by, node in probes.calls if by in ("n4", "n5")} <= {"n2", "n3"}


def test_two_faults_in_one_round_a_lost_node_and_a_replaced_worker():
    """n2's worker died (its spare holds the slot) while n3 was lost: n2 joins with both slots, the
    plan drops n3 only."""
    gens = _registered(4)
    out = _rounds(gens, 1, ["n0", "n1", "n2"], Probes(gone={"n3"}), delay={"n2": 0.3})
    plan = _one_plan(out)
    assert plan.lost == ("n3",) and plan.world == 6 and plan.rank_of(4) == 4


def test_a_slow_node_is_waited_for_and_a_node_back_after_its_loss_is_left_out():
    gens = _registered(3)
    out = _rounds(gens, 1, ["n0", "n1", "n2"], Probes(), delay={"n2": 0.6})  # alive (probe ok), late
    assert _one_plan(out).world == 6 and _one_plan(out).lost == ()
    # Generation 2: n2 is declared lost, then its agent joins after all: the round does not take it
    # back, and that agent learns it is out (its workers fall back to a restart).
    plan1 = _one_plan(out)
    gens.mark_lost(2, "n2", by="n0", reason="refused")
    out2 = _rounds(gens, 2, ["n0", "n1", "n2"], Probes(), previous=plan1, delay={"n2": 0.3})
    assert isinstance(out2["n2"], GenerationFailed) and "declared lost" in str(out2["n2"])
    assert out2["n0"] == out2["n1"] and out2["n0"].lost == ("n2",) and out2["n0"].world == 4


def test_a_round_that_cannot_close_fails_naming_the_missing_node():
    gens = _registered(3)
    out = _rounds(gens, 1, ["n0", "n2"], Probes(), timeout_s=0.5)  # n1 neither joins nor is lost
    assert isinstance(out["n0"], GenerationFailed) and "['n1']" in str(out["n0"])
    assert isinstance(out["n2"], GenerationFailed)


def test_a_round_without_a_registered_generation_zero_fails_at_once():
    gens = Generations(MemoryStore(), KEYS, epoch=0)
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="no node registered"):
        NodeRound(gens, "n0", 1, {0: 0}, None, lambda nodes: {}, timeout_s=5).run()
    assert time.monotonic() - started < 1


def test_a_node_reads_small_records_only():
    """Only the coordinator reads every join (once); the others read the round's control keys."""
    gens = _registered(8)
    reads: dict[str, int] = {}
    real = gens.store.get_prefix

    def counting(prefix: str, limit: int = 0):
        reads[prefix] = reads.get(prefix, 0) + 1
        return real(prefix, limit)

    gens.store.get_prefix = counting  # type: ignore[method-assign]
    out = _rounds(gens, 1, [f"n{i}" for i in range(8)], Probes(), roster=_roster(8))
    assert _one_plan(out).world == 16
    assert reads == {KEYS.gen_members(0): 1, KEYS.generation(0, 1): 1}  # the coordinator's two reads


def test_a_worker_learns_its_generation_from_its_agent_only():
    """The worker side (GenerationClient): the plan and this slot's old rank from the agent's board,
    the spare included; a failed round or no channel is RecoveryUnavailable (a restart from disk)."""
    from elastic.checkpoint.memstate import MemStateRejected, RoundBoard
    from elastic.common.env import WorkerEnv
    from elastic.worker.generation import GenerationClient, RecoveryUnavailable

    board = RoundBoard()

    class Channel:
        def round_wait(self, epoch, gen, name, timeout_s):
            reply = board.wait(epoch, gen, name, timeout_s)
            if not reply["ok"]:
                raise MemStateRejected(reply["error"])
            return reply["value"]

    env = WorkerEnv(node_id="n1", run_prefix="/elastic/runs/w", epoch="0", inprocess="0.5",
                    etcd_endpoint="127.0.0.1:1")
    plan = plan_next(1, _roster(2), None, {"n1": {0: 2, 1: 3}}, {"n0"})
    board.post(0, 1, "plan", {"plan": json.loads(plan.to_json()), "slots": {"0": 2, "1": 3}})
    board.post(0, 1, "store", "10.0.0.1:5")
    survivor = GenerationClient(env, 1, Channel())
    got = survivor.next_plan()
    assert got == plan and survivor.old_rank == 3 and survivor.rank_in(got) == 1
    assert survivor.store_address(1) == "10.0.0.1:5"
    survivor.adopt(got)
    assert survivor.gen == 1 and survivor.lost_nodes() == {"n0"}
    spare = GenerationClient(WorkerEnv(**{**env.__dict__, "join_gen": "1"}), 0, Channel())
    assert spare.joining and spare.rank_in(spare.next_plan()) == 0  # the dead worker's rank, from the agent
    board.fail(0, 2, ("plan", "store"), "generation 2: no plan within 60s")
    with pytest.raises(RecoveryUnavailable, match="no plan within"):
        survivor.next_plan()
    with pytest.raises(RecoveryUnavailable, match="no agent channel"):
        GenerationClient(env, 0, None).next_plan()


@pytest.mark.parametrize("seed", range(5))
def test_a_slots_rank_from_its_generation_0_rank_is_the_deltas_while_nobody_returns(seed):
    """Workers and agents now take a slot's rank from its generation-0 rank (rank_of0): over random
    sequences of losses it agrees with the delta's rank_of(old rank) at every generation."""
    import random

    rng = random.Random(seed)
    roster = _roster(6)
    previous = None
    for gen in range(1, 5):
        alive = [n for n in roster if n not in (previous.gone if previous else ())]
        lost = set(rng.sample(alive, k=min(len(alive) - 1, rng.choice([0, 1]))))
        ranks = ranks_at(roster, previous)
        joined = {n: {local: ranks[Slot(n, local)] for local in roster[n]} for n in alive if n not in lost}
        plan = plan_next(gen, roster, previous, joined, lost)
        for slot, old in ranks.items():
            assert plan.rank_of(old) == plan.rank_of0(roster[slot.node][slot.local_rank]), (gen, slot)
        previous = plan
