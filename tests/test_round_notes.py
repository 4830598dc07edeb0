"""A round closed in place reaches the other nodes on the run's round note: no join, no watch.

The note's arithmetic (:class:`~elastic.agent.roundnotes.RoundNotes`), two agents' rounds on the
in-memory store (the note handed over as the signal watch would hand it), and the real signal watch
delivering the note from a real etcd.  (Issue 29: at 1,024 nodes a worker loss cost every node a
join transaction and a new watch stream for a plan already written.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from elastic.agent.attempt import NodeSpec
from elastic.agent.config import InProcessConfig
from elastic.agent.inprocess import InProcessWorkers
from elastic.agent.roundnotes import RoundNotes
from elastic.common.events import EventLog, read_events
from elastic.common.config import ConfigError
from elastic.control.generations import GenerationFailed, Generations, Plan, plan_in_place, plan_kept
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState, decode
from elastic.control.signals import SignalWatch
from elastic.control.store import EtcdStore

pytestmark = pytest.mark.timeout(60)

KEYS = RunKeys.of("/t", "notes")
NEVER = lambda: False  # noqa: E731 - a round whose attempt never ends


def _plan_note(epoch: int, gen: int, by: str = "n1") -> dict:
    return {"kind": "plan", "epoch": epoch, "gen": gen, "plan": {"gen": gen, "old_world": 8, "by": by}}


# -- the notes ---------------------------------------------------------------------------------
def test_an_in_place_fault_makes_the_next_generation_wait_for_its_note():
    notes = RoundNotes(epoch=2)
    notes.heard_fault({"epoch": 2, "gen": 3, "in_place": False})
    notes.heard_fault({"epoch": 1, "gen": 4, "in_place": True})  # another epoch's
    assert not notes.expects(4) and not notes.expects(5)
    notes.heard_fault({"epoch": 2, "gen": 4, "in_place": True})
    assert notes.expects(5)
    threading.Timer(0.1, notes.heard, args=(_plan_note(2, 5),)).start()
    plan = notes.plan(5, wait_s=5.0, stopped=NEVER)
    assert plan is not None and plan.gen == 5 and plan.by == "n1" and plan.keeps_ranks()


def test_a_note_of_another_epoch_or_generation_is_not_taken():
    notes = RoundNotes(epoch=2)
    notes.heard(_plan_note(1, 5))
    notes.heard(_plan_note(2, 4))
    notes.heard({"kind": "plan", "epoch": "x", "gen": 5})  # malformed: ignored, not raised
    t0 = time.monotonic()
    assert notes.plan(5, wait_s=0.2, stopped=NEVER) is None
    assert time.monotonic() - t0 >= 0.19
    assert notes.plan(4, wait_s=0, stopped=NEVER).gen == 4  # type: ignore[union-attr]


def test_a_wait_for_a_note_ends_with_the_attempt():
    notes = RoundNotes(epoch=0)
    ended = threading.Event()
    threading.Timer(0.1, ended.set).start()
    t0 = time.monotonic()
    assert notes.plan(1, wait_s=30.0, stopped=ended.is_set) is None
    assert time.monotonic() - t0 < 5
    with pytest.raises(GenerationFailed, match="attempt ended"):
        notes.store(1, 30.0, ended.is_set, lambda: None)


def test_a_store_address_comes_from_its_note_or_else_from_a_read_once_a_second():
    notes = RoundNotes(epoch=0)
    notes.heard({"kind": "store", "epoch": 0, "gen": 1, "addr": "10.0.0.1:29500"})
    assert notes.store(1, 5.0, NEVER, lambda: pytest.fail("noted: no read")) == "10.0.0.1:29500"
    reads: list[float] = []
    addr = notes.store(2, 5.0, NEVER, lambda: (reads.append(time.monotonic()), "10.0.0.2:1" if len(reads) > 1 else None)[1])
    assert addr == "10.0.0.2:1" and len(reads) == 2 and reads[1] - reads[0] >= 0.9
    with pytest.raises(GenerationFailed, match="published no store within 0.3s"):
        notes.store(3, 0.3, NEVER, lambda: None)


def test_old_generations_are_dropped_as_newer_notes_arrive():
    notes = RoundNotes(epoch=0)
    for gen in range(1, 30):
        notes.heard(_plan_note(0, gen))
        notes.heard_fault({"epoch": 0, "gen": gen, "in_place": True})
    assert notes.plan(1, 0, NEVER) is None and notes.plan(29, 0, NEVER) is not None
    assert not notes.expects(2) and notes.expects(30)


def test_in_place_wait_s_must_stay_below_the_join_timeout():
    assert InProcessConfig(in_place_wait_s=0).in_place_wait_s == 0
    with pytest.raises(ConfigError, match="in_place_wait_s"):
        InProcessConfig(in_place_wait_s=60.0)


# -- two agents' rounds on the in-memory store ---------------------------------------------------
@pytest.fixture
def agents(tmp_path: Path):
    """node0 and node1 of one run, 2 slots each, generation 0 registered; node1's worker died and
    its spare took the slot (node1 closes generation 1 in place)."""
    store = MemoryStore()
    made: list[tuple[InProcessWorkers, EventLog]] = []

    def agent(node: str, ranks: dict[int, int], wait_s: float) -> InProcessWorkers:
        spec = NodeSpec("run", node, "127.0.0.1:1", tmp_path, "2", 2, ["-m", "json.tool"])
        events = EventLog(tmp_path / f"{node}.jsonl", f"agent/{node}")
        workers = InProcessWorkers(spec, InProcessConfig(in_place_wait_s=wait_s), RunState(store, KEYS), events,
                                   None, epoch=0)  # type: ignore[arg-type]
        workers.detached = True
        workers.ranks = dict(ranks)
        workers.pids = {local: 100 + rank for local, rank in ranks.items()}
        workers.register()
        made.append((workers, events))
        return workers

    yield agent, store, lambda node: read_events([tmp_path / f"{node}.jsonl"])
    for workers, events in made:
        workers._closed.set()
        events.close()


def _joined(store: MemoryStore, gen: int) -> list[str]:
    base = KEYS.gen_joins(0, gen)
    return sorted(RunKeys.tail(kv.key, base) for kv in store.get_prefix(base))


def test_a_node_told_the_fault_is_in_place_takes_the_noted_plan_without_joining(agents):
    agent, store, events = agents
    node0, node1 = agent("node0", {0: 0, 1: 1}, 5.0), agent("node1", {0: 2, 1: 3}, 5.0)
    node1.push_fault("node1", "worker_died", "local rank 1 died", gen=0, in_place=True)
    node0.heard_fault(decode(store.get(KEYS.pushed_fault)))  # what node0's signal watch hands it
    node0.join_wanted()  # its workers asked for generation 1 (they heard the push)
    node1.replaced_in_place(1)
    node1.join_wanted()
    deadline = time.monotonic() + 10
    while store.get(KEYS.round_note) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    unheard = node0.board.wait(0, 1, "plan", timeout_s=0.1)  # the note is not heard yet: node0 waits, joins nothing
    assert not unheard["ok"] and "had no plan" in unheard["error"]
    node0.heard_note(decode(store.get(KEYS.round_note)))  # node1's close put the note
    answer = node0.board.wait(0, 1, "plan", timeout_s=5)
    plan = Plan.from_record(answer["value"]["plan"])
    assert plan.by == "node1" and plan.world == 4 and node0.ranks == {0: 0, 1: 1}
    node1.gens.put_store(1, "127.0.0.1:29999")  # the new rank 0 (node0's slot 0) publishes its store
    node0.heard_note(decode(store.get(KEYS.round_note)))
    assert node0.board.wait(0, 1, "store", timeout_s=5)["value"] == "127.0.0.1:29999"
    assert node1.board.wait(0, 1, "store", timeout_s=5)["value"] == "127.0.0.1:29999"
    assert _joined(store, 1) == []  # nobody joined: node1 wrote the plan with its fault, in one transaction
    assert next(e for e in events("node1") if e["kind"] == "round.in_place")["with_fault"]
    closer = next(e for e in events("node1") if e["kind"] == "agent.round_plan")
    assert closer["role"] == "closed_with_fault" and closer["by"] == "node1"
    noted = next(e for e in events("node0") if e["kind"] == "round.noted")
    assert noted["gen"] == 1 and noted["by"] == "node1"
    assert next(e for e in events("node0") if e["kind"] == "agent.round_plan")["role"] == "noted"


def test_the_node_closing_in_place_counts_the_roster_and_reads_none_of_its_records(agents, monkeypatch):
    """Its workers' generation-0 reports said the world (4): the plan needs the roster's node count
    only, not its N records (~290 KB at 1,024 nodes, read while the whole run hears the fault)."""
    agent, store, _ = agents
    agent("node0", {0: 0, 1: 1}, 5.0)
    node1 = agent("node1", {0: 2, 1: 3}, 5.0)
    node1.detached = False
    for local, rank in ((0, 2), (1, 3)):  # what its workers' channel sends with every step report
        node1.observe({"type": "step", "local_rank": local, "pid": 100 + rank, "rank": rank, "gen": 0, "step": 3,
                       "world": 4})
    node1.detached = True
    read: list[str] = []
    get_prefix = store.get_prefix
    monkeypatch.setattr(store, "get_prefix", lambda prefix, limit=0: read.append(prefix) or get_prefix(prefix, limit))
    node1.push_fault("node1", "worker_died", "local rank 1 died", gen=0, in_place=True)
    node1.replaced_in_place(1)
    node1.join_wanted()
    plan = Plan.from_record(node1.board.wait(0, 1, "plan", timeout_s=5)["value"]["plan"])
    assert KEYS.gen_members(0) not in read
    assert plan == plan_in_place(1, node1.gens.roster(), None, "node1")  # the roster's plan, field for field
    assert plan.world == 4 and plan.nodes == 2 and plan.keeps_ranks()
    assert decode(store.get(KEYS.round_note))["plan"] == json.loads(plan.to_json())


def test_a_node_loss_pushed_with_its_plan_reaches_the_others_without_a_join(agents):
    """node0 found node2 gone (its ring successor): its push also closes generation 1 without
    node2 (the plan held, node2's roster record) and declares node2 lost; node1 hears the fault
    and the note and takes the plan; nobody joins."""
    agent, store, events = agents
    node0, node1 = agent("node0", {0: 0, 1: 1}, 5.0), agent("node1", {0: 2, 1: 3}, 5.0)
    agent("node2", {0: 4, 1: 5}, 5.0)._closed.set()
    node0._gone["node2"] = "its store refused"
    node0.push_fault("node2", "node_lost", "node node2: hold broke; its store refused", gen=0)
    pushed = decode(store.get(KEYS.pushed_fault))
    assert pushed["closed"] and not pushed["in_place"]
    node1.heard_fault(pushed)
    node1.join_wanted()
    node1.heard_note(decode(store.get(KEYS.round_note)))
    plan = Plan.from_record(node1.board.wait(0, 1, "plan", timeout_s=5)["value"]["plan"])
    assert plan.lost == ("node2",) and plan.world == 4 and plan.nodes == 2 and plan.by == "node0"
    assert node1.ranks == {0: 2, 1: 3}
    node0.join_wanted()
    assert Plan.from_record(node0.board.wait(0, 1, "plan", timeout_s=5)["value"]["plan"]) == plan
    assert _joined(store, 1) == [] and store.get(KEYS.gen_lost(0, 1, "node2")) is not None
    assert [f["node"] for f in node0.state.faults()] == ["node2"]
    closed = next(e for e in events("node0") if e["kind"] == "round.closed_without")
    assert closed["lost"] == ["node2"] and closed["with_fault"]


def test_a_note_that_does_not_come_costs_the_wait_then_the_round_as_before(agents):
    """The in-place closer died between its push and its plan: the others wait ``in_place_wait_s``,
    then join; the full round forms without it (its node is found lost by the coordinator's probe)."""
    agent, store, events = agents
    node0 = agent("node0", {0: 0, 1: 1}, 0.3)
    agent("node1", {0: 2, 1: 3}, 0.3)._closed.set()
    node0.heard_fault({"epoch": 0, "gen": 0, "node": "node1", "in_place": True})
    node0.gens.close(plan_in_place(1, node0.gens.roster(), None, "node1"))  # written without its note
    node0.join_wanted()
    answer = node0.board.wait(0, 1, "plan", timeout_s=10)
    assert Plan.from_record(answer["value"]["plan"]).by == "node1"  # read back by node0's own join
    missed = next(e for e in events("node0") if e["kind"] == "round.note_missed")
    assert missed["gen"] == 1 and missed["waited_s"] >= 0.29
    assert _joined(store, 1) == ["node0"]


def test_a_node_that_heard_no_in_place_fault_joins_at_once(agents):
    agent, store, events = agents
    node0 = agent("node0", {0: 0, 1: 1}, 30.0)
    agent("node1", {0: 2, 1: 3}, 30.0)
    node0.want(1)  # its workers' collectives raised (gloo) before any push arrived
    node0.join_wanted()
    deadline = time.monotonic() + 5
    while not _joined(store, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _joined(store, 1) == ["node0"]
    assert not any(e["kind"] in ("round.noted", "round.note_missed") for e in events("node0"))


def test_a_noted_plan_that_left_this_node_out_fails_its_round(agents):
    agent, store, _ = agents
    node0 = agent("node0", {0: 0, 1: 1}, 5.0)
    node0.heard_fault({"epoch": 0, "gen": 0, "in_place": True})
    node0.heard_note({"kind": "plan", "epoch": 0, "gen": 1,
                      "plan": {"gen": 1, "old_world": 4, "dropped": [0, 1], "lost": ["node0"], "by": "node1"}})
    node0.join_wanted()
    answer = node0.board.wait(0, 1, "plan", timeout_s=5)
    assert not answer["ok"] and "formed without this node (node0)" in answer["error"]


# -- the real signal watch -------------------------------------------------------------------------
def test_the_signal_watch_delivers_the_in_place_plan_and_the_store_address_from_etcd(etcd_endpoint):
    state = RunState(EtcdStore(etcd_endpoint), KEYS)
    gens = Generations(state.store, KEYS, epoch=0)
    gens.register_node("n0", {0: 0})
    gens.register_node("n1", {0: 1})
    notes: list[dict] = []
    got = threading.Event()
    with SignalWatch(state, "n0", on_fault=lambda record: None,
                     on_note=lambda note: (notes.append(note), got.set())) as watch:
        watch.current()
        closed = gens.close(plan_in_place(1, gens.roster(), None, "n1"), note=True)
        assert got.wait(5.0)
        assert notes[0]["kind"] == "plan" and Plan.from_record(notes[0]["plan"]) == closed
        got.clear()
        assert gens.close(plan_in_place(1, gens.roster(), None, "n0"), note=True).by == "n1"  # lost: no note
        gens.put_store(1, "127.0.0.1:4242")
        assert got.wait(5.0)
        assert [n["kind"] for n in notes] == ["plan", "store"] and notes[1]["addr"] == "127.0.0.1:4242"
        assert gens.store_at(1) == "127.0.0.1:4242"


def test_a_fault_pushed_with_its_in_place_plan_reaches_a_watch_as_one_write(etcd_endpoint):
    """``push_fault(in_place=True)``'s transaction: the fault, the plan and its note at one revision
    (one raft write), heard together; a second close of the generation still pushes its fault."""
    state = RunState(EtcdStore(etcd_endpoint), KEYS)
    gens = Generations(state.store, KEYS, epoch=0)
    faults: list[dict] = []
    notes: list[dict] = []
    with SignalWatch(state, "n0", on_fault=faults.append, on_note=notes.append) as watch:
        watch.current()
        record = {"epoch": 0, "gen": 0, "node": "n1", "kind": "worker_died", "in_place": True}
        closed = gens.close(plan_kept(1, Plan(0, 2, nodes=2), "n1"), note=True, also=[state.fault_put(record)])
        deadline = time.monotonic() + 5.0  # one batch, applied event by event: the note may come first
        while not (faults and notes) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert faults and faults[0]["node"] == "n1" and notes[0]["plan"]["by"] == "n1"
        revisions = {state.store.get(key).mod_revision  # type: ignore[union-attr]
                     for key in (KEYS.pushed_fault, KEYS.round_note, KEYS.gen_plan(0, 1))}
        assert len(revisions) == 1
        again = gens.close(plan_kept(1, Plan(0, 2, nodes=2), "n0"), note=True,
                           also=[state.fault_put({**record, "node": "n0", "by": "n0"})])
        assert again == closed and again.by == "n1"  # lost: the plan stays n1's, no note
        assert decode(state.store.get(KEYS.pushed_fault))["node"] == "n0"  # but the fault is pushed
