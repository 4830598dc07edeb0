"""Who may run as a lost node: the slot claim (elastic.agent.slots) and a standby's wait for one
(elastic.agent.standby), on the in-memory store."""

from __future__ import annotations

import threading

from elastic.agent.slots import Claimant, SlotClaims
from elastic.agent.standby import Standby
from elastic.common.events import EventLog
from elastic.control.generations import Plan
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState

KEYS = RunKeys.of("/t", "run")


def _state() -> RunState:
    return RunState(MemoryStore(), KEYS)


def _plan(state: RunState, gen: int, gone: tuple[str, ...], nodes: int, epoch: int = 0) -> Plan:
    plan = Plan(gen, 4, nodes=nodes, gone=gone)
    state.store.put(KEYS.gen_plan(epoch, gen), plan.to_json())
    return plan


def _me(name: str, pid: int) -> Claimant:
    return Claimant(name, "host-" + name, pid)


def test_of_two_claimants_of_a_lost_node_exactly_one_wins():
    state = _state()
    plan = _plan(state, 5, ("node0",), 3)
    standby, relaunch = SlotClaims(state, _me("standby0", 11)), SlotClaims(state, _me("node0", 12))
    assert standby.try_claim("node0", 0, plan)
    assert not relaunch.try_claim("node0", 0, plan)  # the same plan: the standby has not joined yet
    assert relaunch.held_by_other("node0", 0, lambda: plan)["by"] == "standby0"
    assert standby.try_claim("node0", 0, plan)  # the holder's own claim stands
    assert standby.held_by_other("node0", 0, lambda: plan) is None


def test_a_claim_is_free_again_once_its_holder_is_lost_after_joining():
    state = _state()
    standby, relaunch = SlotClaims(state, _me("standby0", 11)), SlotClaims(state, _me("node0", 12))
    assert standby.try_claim("node0", 0, _plan(state, 5, ("node0",), 3))  # joins generation 6
    back = _plan(state, 6, (), 4)
    assert relaunch.held_by_other("node0", 0, lambda: back) is not None
    lost_again = _plan(state, 9, ("node0",), 3)
    assert relaunch.held_by_other("node0", 0, lambda: lost_again) is None
    assert relaunch.try_claim("node0", 0, lost_again)


def test_an_earlier_epochs_claim_holds_while_its_holder_runs_as_the_node():
    state = _state()
    standby, relaunch = SlotClaims(state, _me("standby0", 11)), SlotClaims(state, _me("node0", 12))
    assert standby.try_claim("node0", 0, _plan(state, 5, ("node0",), 3))
    state.put_node("node0", {"node": "node0", "host": "host-standby0", "pid": 11})
    assert relaunch.held_by_other("node0", 1, lambda: None) is not None
    state.store.delete(KEYS.node("node0"))  # the holder's lease ran out: it is not the node any more
    assert relaunch.held_by_other("node0", 1, lambda: None) is None


def _standby(state: RunState, tmp_path, stop: threading.Event, needed: int = 4) -> Standby:
    events = EventLog(tmp_path / "standby.jsonl", "standby/sb")
    return Standby(state, SlotClaims(state, _me("sb", 21)), events, stop, needed, poll_s=0.01)


def test_a_standby_takes_the_slot_of_a_node_the_fixed_size_world_lost(tmp_path):
    state = _state()
    state.store.put(KEYS.epoch, "0")
    _plan(state, 1, (), 4)
    _plan(state, 2, ("node2", "node3"), 2)
    state.exclusions.add("node2", "bad GEMM", ttl_s=60)  # an excluded node's slot is a bad host's
    assert _standby(state, tmp_path, threading.Event()).wait([]) == "node3"
    assert state.store.get(KEYS.slot("node3")) is not None and state.store.get(KEYS.slot("node2")) is None


def test_a_standby_leaves_a_world_that_may_shrink_and_ends_with_the_run(tmp_path):
    state = _state()
    state.store.put(KEYS.epoch, "0")
    _plan(state, 1, ("node3",), 3)
    stop = threading.Event()
    threading.Timer(0.3, lambda: state.mark_done("node0")).start()
    assert _standby(state, tmp_path, stop, needed=3).wait([]) == 0  # 3 nodes are enough: nothing to take
    assert state.store.get(KEYS.slot("node3")) is None
    state.store.delete(KEYS.done)
    state.request_stop("saves failing", by="node0", code=88)
    assert _standby(state, tmp_path, stop, needed=3).wait([]) == 88


def test_a_standby_takes_a_slot_lost_while_it_waits(tmp_path):
    state = _state()
    state.store.put(KEYS.epoch, "0")
    _plan(state, 1, (), 4)
    threading.Timer(0.3, lambda: _plan(state, 2, ("node1",), 3)).start()  # a loss after the standby's first look
    assert _standby(state, tmp_path, threading.Event()).wait([]) == "node1"
