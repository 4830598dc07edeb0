"""Saying why, as policy on the in-memory store (no etcd binary, fake clock): one record per fault,
lost nodes named once and judged as lemons, restarts counted per fault, the reason a fixed-size run
stops, an etcd outage waited out for a bounded time, goodput of a run that never recovered, and the
failure classes that stop a run instead of restarting it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from elastic.agent.attempt import AttemptResult, Outcome
from elastic.agent.classify import FailureKind, classify
from elastic.agent.config import FailurePolicy
from elastic.agent.failures import FailureHandler
from elastic.agent.outage import EtcdUnreachable, EtcdWait
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys
from elastic.control.leader import ClusterPolicy, LeaderConfig
from elastic.control.membership import LostNodes
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import RunState
from elastic.control.store import StoreUnavailable
from elastic.run.goodput import compute_goodput
from launch.summary import restart_counts


class Recorder(EventLog):
    def __init__(self, source: str = "test") -> None:
        super().__init__(None, source)
        self.seen: list[dict] = []

    def emit(self, kind: str, **fields):
        event = super().emit(kind, **fields)
        self.seen.append(event)
        return event

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.seen if e["kind"] == kind]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock) -> RunState:
    return RunState(MemoryStore(clock), RunKeys.of("/elastic", "r"), clock=clock)


def _register(state: RunState, node: str, agent_state: str = "RUNNING", epoch: int = 0, step: int = 7,
              ttl: int = 10) -> int:
    lease = state.store.grant_lease(ttl)
    state.put_node(node, {"node": node, "state": agent_state, "ts": state.clock()}, lease=lease)
    state.put_heartbeat(node, {"node": node, "epoch": epoch, "step": step, "ts": state.clock()}, lease=lease)
    state.set_member(node, "joined" if agent_state not in ("SUCCEEDED", "STOPPED") else agent_state)
    return lease


def _look(lost: LostNodes, state: RunState) -> list[str]:
    return lost.evaluate(state.nodes(), state.heartbeats())


def test_a_vanished_node_is_one_fault_whoever_looks(state, clock):
    for node in ("n0", "n1"):
        _register(state, node, ttl=100)
    _register(state, "n2", step=7)
    events = Recorder()
    first, second = LostNodes(state, "n0", events), LostNodes(state, "n1", events)  # a leader, then its successor
    assert _look(first, state) == [] and _look(second, state) == []
    clock.advance(11)  # n2's agent was SIGKILLed: its lease expires
    assert state.store.get(state.keys.node("n2")) is None
    assert _look(first, state) == ["n2"]
    assert _look(second, state) == []  # reported already: the next leader writes nothing
    faults = events.kinds("run.fault")
    assert len(faults) == 1 and faults[0]["node"] == "n2" and faults[0]["failure_kind"] == "node_lost"
    assert faults[0]["step"] == 7 and faults[0]["epoch"] == 0 and faults[0]["by"] == "leader/n0"
    assert [f["node"] for f in state.faults()] == ["n2"] and list(state.failures()) == ["n2"]


def test_a_leader_elected_after_the_loss_still_names_the_node(state, clock):
    _register(state, "n0", ttl=100)
    _register(state, "n1", epoch=2)  # n1 was the leader; it dies before anyone else looked
    clock.advance(11)
    events = Recorder()
    assert _look(LostNodes(state, "n0", events), state) == ["n1"]
    (fault,) = events.kinds("run.fault")
    assert fault["node"] == "n1" and fault["step"] is None and state.members()["n1"]["state"] == "lost"


def test_the_step_of_a_loss_is_where_the_first_survivor_noticed_it(state, clock):
    _register(state, "n0", ttl=100)
    _register(state, "n1", step=3)  # its last heartbeat lags behind the run
    lost = LostNodes(state, "n0", Recorder())
    _look(lost, state)
    handler = FailureHandler(FailurePolicy(), "n0", state, Recorder())
    peer = AttemptResult(Outcome.FAILED, kind=FailureKind.PEER_LOST, detail="connection reset", step=9)
    assert not handler.decide(peer, epoch=0).counted
    assert not state.notice_fault(0, 9, "n2", "stall")  # a second survivor noticing the same fault
    state.bump_epoch(0)
    clock.advance(11)
    assert _look(lost, state) == ["n1"] and state.faults()[0]["step"] == 9
    _register(state, "n2", epoch=1)
    clock.advance(11)  # a leader that never saw n2's heartbeat: the noticed epoch still dates the loss
    state.notice_fault(1, 4, "n0", "peer_lost")
    assert _look(LostNodes(state, "n0", Recorder()), state) == ["n2"]
    assert [(f["node"], f["epoch"], f["step"]) for f in state.faults()] == [("n1", 0, 9), ("n2", 1, 4)]


def test_a_node_that_leaves_cleanly_is_not_lost(state, clock):
    lease = _register(state, "n1")
    lost = LostNodes(state, "n0", Recorder())
    _look(lost, state)
    clock.advance(1)
    state.set_member("n1", "STOPPED")  # the agent's last act before it revokes its lease
    state.store.revoke_lease(lease)
    finished = _register(state, "n2", agent_state="SUCCEEDED")
    _look(lost, state)
    state.store.revoke_lease(finished)
    assert _look(lost, state) == [] and state.faults() == []


def test_a_node_that_keeps_vanishing_is_excluded_as_a_lemon(state, clock):
    excluded: list[tuple[str, str]] = []
    policy = ClusterPolicy(LeaderConfig(lemon_failures=3), lambda n, r, ttl: excluded.append((n, r)), Recorder())
    lost = LostNodes(state, "n0", Recorder())
    for epoch in range(3):
        _register(state, "n1", epoch=epoch)
        _look(lost, state)
        clock.advance(11)
        assert _look(lost, state) == ["n1"]
    policy.evaluate_lemons(state.failures(), now=clock())
    assert [n for n, _ in excluded] == ["n1"] and "3 failures" in excluded[0][1]


def test_a_counted_failure_is_the_epochs_fault_record(state):
    events = Recorder()
    handler = FailureHandler(FailurePolicy(), "n1", state, events)
    crash = AttemptResult(Outcome.FAILED, kind=FailureKind.HANG, detail="rank 1 is stopped", step=12)
    assert handler.decide(crash, epoch=3).counted
    peer = FailureHandler(FailurePolicy(), "n0", state, events)
    assert not peer.decide(AttemptResult(Outcome.FAILED, kind=FailureKind.STALL, detail="blocked"), epoch=3).counted
    faults = events.kinds("run.fault")
    assert [(f["node"], f["failure_kind"], f["step"], f["epoch"]) for f in faults] == [("n1", "hang", 12, 3)]


def test_a_rendezvous_timeout_says_which_node_is_missing(state, clock):
    state.record_fault(0, "node2", {"kind": "node_lost", "step": 7, "detail": "vanished", "by": "leader/node0"})
    handler = FailureHandler(FailurePolicy(), "node0", state, Recorder(), needs=("3", 30))
    decision = handler.decide(AttemptResult(Outcome.FAILED, kind=FailureKind.RENDEZVOUS_TIMEOUT,
                                            detail="rendezvous timed out"), epoch=1)
    assert decision.action == "stop"
    assert decision.reason == ("rendezvous_timeout: node node2 lost at step 7; the run needs 3 nodes "
                               "(launch.nodes=3), none joined within 30s (rendezvous.join_timeout_s)")
    unknown = FailureHandler(FailurePolicy(), "n0", RunState(MemoryStore(clock), RunKeys("/x")), Recorder(),
                             needs=("2:4", 60)).decide(AttemptResult(Outcome.FAILED, kind=FailureKind.RENDEZVOUS_TIMEOUT,
                                                                     detail="x"), epoch=0)
    assert "the run needs 2 nodes (launch.nodes=2:4); not enough joined within 60s" in unknown.reason


def test_restarts_are_counted_per_fault_not_per_agent():
    restarts = [{"kind": "agent.restart", "source": f"agent/n{i}", "ts": float(i), "fault": "e0",
                 "counted": i == 2} for i in range(3)]
    restarts += [{"kind": "agent.restart", "source": f"agent/n{i}", "ts": 10.0 + i, "fault": "e1", "counted": False}
                 for i in range(2)]
    assert restart_counts(restarts) == {"restarts": 2, "restarts_counted": 1}


def test_etcd_outage_is_waited_out_then_named(clock):
    events, stop = Recorder(), threading.Event()
    wait = EtcdWait("10.0.0.5:2379", 5.0, events, stop, clock=clock)
    calls = []

    def flaky():
        calls.append(clock())
        clock.advance(1.0)  # each try takes a second of (fake) time
        if len(calls) < 3:
            raise StoreUnavailable("etcd at 10.0.0.5:2379 unreachable during get: refused")
        return "ok"

    stop.wait = lambda timeout: False  # no real sleeping: the fake clock moves in flaky()
    assert wait.call("admission", flaky) == "ok" and len(calls) == 3
    assert [e["op"] for e in events.kinds("agent.etcd_waiting")] == ["admission"]

    def down():
        clock.advance(2.0)
        raise StoreUnavailable("etcd at 10.0.0.5:2379 unreachable during get: connection refused")

    with pytest.raises(EtcdUnreachable) as info:
        wait.call("admission", down)
    line = str(info.value)
    assert line.startswith("etcd at 10.0.0.5:2379 is unreachable: no answer to admission for 6s")
    assert "agent.etcd_wait_s=5" in line and "\n" not in line


def _ev(kind: str, ts: float, **fields) -> dict:
    return {"kind": kind, "ts": ts, "source": fields.pop("source", "trainer/rank0"), **fields}


def test_goodput_counts_the_wait_for_a_lost_node_as_recovery():
    events = [_ev("launcher.start", 0.0, source="launcher"), _ev("trainer.start", 1.0, step=0)]
    events += [_ev("trainer.step", 1.0 + s, step=s, step_time=1.0) for s in range(1, 6)]
    events += [_ev("agent.torchrun_exit", 6.5, source="agent/n0", rc=1),
               _ev("agent.restart", 6.6, source="agent/n0", fault="e0"),
               _ev("agent.state", 26.0, source="agent/n0", state="GAVE_UP", reason="node n1 lost"),
               _ev("launcher.etcd_stopped", 27.0, source="launcher")]
    g = compute_goodput(events)
    assert g["recovery_s"] == pytest.approx(20.0) and g["other_s"] == pytest.approx(1.0)
    clean = [e for e in events if e["kind"] not in ("agent.torchrun_exit", "agent.restart")]
    assert compute_goodput(clean)["recovery_s"] == 0.0  # no failure after the last step: nothing to recover


def test_worker_exit_codes_that_stop_the_run_carry_the_workers_line(tmp_path: Path):
    log = ("trainer: checkpoint mismatch: checkpoint step-00000008 in /r/checkpoints was written by a different "
           "run config: trainer.dim: 16 -> 32; relaunch with --fresh ...\n"
           "[ERROR] failures:\n  exitcode  : 2 (pid: 11)\n")
    kind, detail = classify(tmp_path, 1, log)
    assert kind == FailureKind.CONFIG and detail.startswith("checkpoint mismatch: checkpoint step-00000008")
    assert FailurePolicy().action(kind.value) == "stop"
    kind, detail = classify(tmp_path, 1, "trainer: checkpoint.on_save_failure=stop: 3 checkpoint saves failed "
                                         "in a row\n  exitcode  : 88\n")
    assert kind == FailureKind.CHECKPOINT and detail == "checkpoint.on_save_failure=stop: 3 checkpoint saves failed in a row"
    assert FailurePolicy().action(kind.value) == "stop"


def test_two_in_process_worker_deaths_of_one_node_in_one_epoch_are_two_faults(state):
    """In-process recoveries stay in their epoch: each dead worker is its own fault, named by the
    generation that replaced it, so the summary's faults match the counted failures one for one."""
    events = Recorder("agent/node1")
    handler = FailureHandler(FailurePolicy(), "node1", state, events)
    for gen in (1, 2):
        result = AttemptResult(Outcome.FAILED, -9, kind=FailureKind.WORKER_SIGNAL, detail="killed", gen=gen, step=5)
        assert handler.decide(result, epoch=0).counted
    faults = events.kinds("run.fault")
    assert [f["gen"] for f in faults] == [1, 2] and handler.failures == 2
    assert len(state.faults()) == 2


def test_a_node_lost_in_process_is_named_once_whoever_sees_it(state):
    """The agent that declared the loss wrote the run's record: the leader's later look writes none."""
    _register(state, "node0")
    state.set_member("node2", "joined")
    assert state.record_fault(0, "node2", {"kind": "node_lost", "step": 14, "detail": "refused", "by": "node0"})
    leader_events = Recorder("agent/node0")
    reported = LostNodes(state, "node0", leader_events).evaluate(state.nodes(), state.heartbeats())
    assert reported == [] and leader_events.kinds("run.fault") == []
    assert state.members()["node2"]["state"] == "lost"
