"""Run-state policies on the in-memory store (no etcd binary): epoch, exclusions, rollback,
leader policy, restart decisions, the progress guard, and the store's own etcd semantics."""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic.agent.attempt import AttemptResult, NodeSpec, Outcome
from elastic.agent.classify import FailureKind
from elastic.agent.config import FailurePolicy
from elastic.agent.failures import FailureHandler, ProgressGuard
from elastic.agent.scopes import RunScope
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys
from elastic.control.leader import ClusterPolicy, LeaderConfig, LeaderLoop
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import RunSignals, RunState
from elastic.control.store import EtcdStore, LeaseExpired


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock) -> RunState:
    return RunState(MemoryStore(clock), RunKeys.of("/elastic", "r"), clock=clock)


def test_keys_are_built_under_the_run_prefix():
    keys = RunKeys.of("/elastic/", "dit64")
    assert keys.prefix == "/elastic/runs/dit64"
    assert keys.epoch == "/elastic/runs/dit64/epoch" and keys.node("n1") == "/elastic/runs/dit64/nodes/n1"
    assert keys.exclusions == "/elastic/runs/dit64/excluded/" and keys.failure("n1", 5) == "/elastic/runs/dit64/failures/n1/5"
    assert keys.checkpoint_latest == "/elastic/runs/dit64/checkpoint/latest"
    assert RunKeys.tail(keys.heartbeat("n2"), keys.heartbeats) == "n2"


def test_concurrent_epoch_bumps_move_the_epoch_once(state):
    results: list[tuple[int, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(state.bump_epoch(0))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state.epoch() == 1
    assert sorted(moved for _, moved in results) == [False] * 7 + [True]
    assert {epoch for epoch, _ in results} == {1}
    assert state.bump_epoch(0) == (1, False)  # a stale bump sees the current epoch


def test_exclusions_expire_on_the_clock_and_carry_extra_fields(state, clock):
    state.exclusions.add("n1", "diag: ecc", ttl_s=60, by="diag", report={"failed": ["gpu"]})
    state.exclusions.add("n2", "operator", by="ops")  # no ttl: until cleared
    assert state.exclusions.get("n1")["report"] == {"failed": ["gpu"]}
    clock.advance(61)
    assert set(state.exclusions.all()) == {"n2"}
    state.exclusions.clear("n2")
    assert state.exclusions.all() == {}


def _signals_follow_the_records(state, clock) -> None:
    assert state.signals("n1") == RunSignals(0, None, None)
    state.bump_epoch(0)
    state.exclusions.add("n1", "diag: ecc", ttl_s=60, by="diag")
    state.request_stop("operator", by="ops")
    got = state.signals("n1")
    assert (got.epoch, got.excluded["reason"], got.stop["by"]) == (1, "diag: ecc", "ops")
    assert state.signals("n2").excluded is None
    clock.advance(61)
    assert state.signals("n1").excluded is None  # expired, as exclusions.get() says


def test_signals_read_epoch_exclusion_and_stop_at_once(state, clock):
    _signals_follow_the_records(state, clock)


def test_signals_against_a_real_etcd(etcd_endpoint):
    clock = FakeClock()
    _signals_follow_the_records(RunState(EtcdStore(etcd_endpoint), RunKeys.of("/elastic", "sig"), clock=clock), clock)


def test_rollback_is_recorded_once_per_failure_and_a_repeat_stops(state):
    first = state.record_rollback(12, epoch=3, by="n0", skip_before=1, max_rollbacks=3)
    assert first.action == "rollback" and first.skip == ((11, 12),) and state.skip_spec() == "11-12"
    assert state.record_rollback(12, epoch=3, by="n1", skip_before=1, max_rollbacks=3).action == "duplicate"
    repeat = state.record_rollback(12, epoch=4, by="n0", skip_before=1, max_rollbacks=3)
    assert repeat.action == "stop" and "repeats at step 12" in repeat.reason
    state.record_rollback(20, epoch=4, by="n0", skip_before=0, max_rollbacks=2)
    spent = state.record_rollback(30, epoch=5, by="n0", skip_before=0, max_rollbacks=2)
    assert spent.action == "stop" and "max_rollbacks=2" in spent.reason


def test_leased_records_vanish_with_the_lease(state, clock):
    lease = state.store.grant_lease(5)
    state.put_node("n0", {"state": "RUNNING"}, lease=lease)
    state.put_heartbeat("n0", {"epoch": 0, "step": 3}, lease=lease)
    clock.advance(3)
    state.store.refresh_lease(lease)
    clock.advance(3)
    assert state.nodes() == {"n0": {"state": "RUNNING"}}  # refreshed at 3 s: alive at 6 s
    clock.advance(6)
    assert state.nodes() == {} and state.heartbeats() == {}
    with pytest.raises(LeaseExpired):
        state.store.refresh_lease(lease)


def test_leader_policy_excludes_a_straggler_of_the_current_epoch_only(state, clock):
    events = EventLog(None, "test")
    cfg = LeaderConfig(straggler_evaluations=2, straggler_action="exclude", straggler_min_excess_s=0.01)
    excluded: list[str] = []
    policy = ClusterPolicy(cfg, lambda node, reason, ttl: excluded.append(node), events)
    loop = LeaderLoop(state, "n0", cfg, policy, events)
    state.bump_epoch(0)
    for node, busy in (("n0", 0.1), ("n1", 0.1), ("n2", 0.5)):
        state.put_heartbeat(node, {"epoch": 1, "busy_time": busy, "samples": 5})
    state.put_heartbeat("old", {"epoch": 0, "busy_time": 9.0, "samples": 5})  # another membership
    loop.evaluate()
    assert excluded == []  # one slow evaluation is not enough
    loop.evaluate()
    assert excluded == ["n2"]


def test_failure_handler_counts_own_failures_and_not_a_peers(state):
    handler = FailureHandler(FailurePolicy(), "n0", state, EventLog(None, "test"))
    peer = handler.decide(AttemptResult(Outcome.FAILED, kind=FailureKind.STALL, detail="blocked"), epoch=0)
    assert not peer.counted and peer.action == "restart" and handler.failures == 0
    own = handler.decide(AttemptResult(Outcome.FAILED, kind=FailureKind.HANG, detail="stopped"), epoch=0)
    assert own.counted and own.action == "rescreen" and handler.failures == 1
    assert list(state.failures()) == ["n0"]


def test_a_nan_reported_by_every_node_is_one_rollback(state):
    events = EventLog(None, "test")
    nan = AttemptResult(Outcome.FAILED, kind=FailureKind.NUMERICS, detail="nan", numerics_step=7)
    a = FailureHandler(FailurePolicy(), "n0", state, events).decide(nan, epoch=2)
    b = FailureHandler(FailurePolicy(), "n1", state, events).decide(nan, epoch=2)
    assert (a.action, a.counted) == ("restart", True) and (b.action, b.counted) == ("restart", False)
    no_step = AttemptResult(Outcome.FAILED, kind=FailureKind.NUMERICS, detail="nan")
    stop = FailureHandler(FailurePolicy(), "n2", state, events).decide(no_step, epoch=2)
    assert stop.action == "stop" and "without a step" in stop.reason


def test_progress_guard_stops_a_crash_loop_and_forgives_progress():
    guard = ProgressGuard(limit=2)
    for _ in range(2):
        guard.restarted()
        assert guard.check(None) is None
    guard.restarted()
    reason = guard.check(None)
    assert reason is not None and "2 restarts without a new committed checkpoint" in reason
    guard.restarted()
    assert guard.check({"step": 10}) is None  # a new commit since: only this restart counts


def test_a_joining_node_bumps_the_epoch_only_when_the_run_trains_without_it(state, clock, tmp_path):
    spec = NodeSpec(run_id="r", node_id="n3", endpoint="-", run_dir=tmp_path, nnodes="2:4", nproc_per_node=1,
                    entrypoint=["-m", "x"])
    scope = RunScope(spec, state, EventLog(None, "test"))
    scope.join_running(fresh_after_s=6)
    assert state.epoch() == 0  # nobody trains: the first rendezvous will include it
    state.put_heartbeat("n0", {"node": "n0", "epoch": 0, "step": 5, "ts": time.time()})
    scope.join_running(fresh_after_s=6)
    assert state.epoch() == 1
    state.mark_done("n0")
    scope.join_running(fresh_after_s=6)
    assert state.epoch() == 1  # a finished run does not re-form


def test_memory_store_watch_sees_writes_from_a_revision():
    store = MemoryStore()
    rev = store.revision()
    store.put("/a/x", "1")
    store.delete("/a/x")
    event = store.watch_once("/a/", rev + 1, timeout=0.1, prefix=True)
    assert event is not None and event.key == "/a/x" and event.value == b"1"
    deleted = store.watch_once("/a/x", rev + 2, timeout=0.1)
    assert deleted is not None and deleted.value is None
    assert store.watch_once("/a/", store.revision() + 1, timeout=0.05, prefix=True) is None
    ok, _ = store.compare_and_swap("/k", "v", 0)
    again, current = store.compare_and_swap("/k", "w", 0)
    assert ok and not again and json.loads(b'"' + current.value + b'"') == "v"
