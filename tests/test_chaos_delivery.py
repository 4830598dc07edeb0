"""Faults delivered through etcd, on the in-memory store: signing, refusal, and what the agent executes.

The agent side (:class:`RemoteFaults`) runs here against real processes where a fault signals
one (a sleeping child stands in for a worker) and real files where it writes one; only the
store is in memory.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from chaos.delivery import AgentDelivery
from elastic.agent.config import ChaosConfig
from elastic.agent.remote_faults import DISABLED, RemoteFaults
from elastic.common.events import EventLog
from elastic.control.faultauth import refusal, sign
from elastic.control.keys import RunKeys
from elastic.control.leader import ClusterPolicy, LeaderConfig, LeaderLoop
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import RunState

TOKEN = "s3cret-run-token"


@pytest.fixture
def state() -> RunState:
    return RunState(MemoryStore(), RunKeys.of("/elastic", "r1"))


def agent(state: RunState, tmp_path, enabled: bool = True, token: str | None = TOKEN, node: str = "node1"):
    events = EventLog(tmp_path / "events" / f"agent-{node}.jsonl", f"agent/{node}")
    return RemoteFaults(ChaosConfig(enabled=enabled, poll_s=0.01), node, "r1", tmp_path, tmp_path / "checkpoints",
                        state, events, token)


def result_of(state: RunState, node: str, posted) -> dict:
    return state.fault_results(node)[posted.request_id]


@pytest.fixture
def worker():
    """A live process standing in for a training worker."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_mac_covers_every_field_and_needs_the_token():
    request = {"id": "a-1", "fault": "kill_worker", "params": {}, "node": "n1", "run_id": "r1", "ts": time.time()}
    signed = sign(request, TOKEN)
    assert refusal(signed, TOKEN, "r1", "n1", 60) is None
    assert "MAC does not verify" in refusal(signed, "another-token", "r1", "n1", 60)
    assert "carries no MAC" in refusal(request, TOKEN, "r1", "n1", 60)
    tampered = {**signed, "fault": "kill_agent"}
    assert "MAC does not verify" in refusal(tampered, TOKEN, "r1", "n1", 60)
    assert "not this node" in refusal(signed, TOKEN, "r1", "n2", 60)
    assert "stale or replayed" in refusal(signed, TOKEN, "r1", "n1", 60, now=request["ts"] + 3600)
    assert TOKEN not in json.dumps(signed)  # the token itself never travels
    assert refusal(request, None, "r1", "n1", 60) is None  # a run without a token: unsigned is accepted


def test_executes_a_signed_kill_and_records_what_it_did(state, tmp_path, worker):
    remote = agent(state, tmp_path)
    remote.attach(torchrun_pid=None, epoch=0)
    remote.observe({"type": "step", "step": 3, "pid": worker.pid, "rank": 1, "local_rank": 0})
    remote.view.torchrun_pid = worker.pid  # an attempt is running
    posted = AgentDelivery(state, "r1", TOKEN).post("node1", "kill_worker", {"local_rank": 0})
    remote.poll()
    assert worker.wait(timeout=10) == -signal.SIGKILL
    result = result_of(state, "node1", posted)
    assert result["executed"] and result["pids"] == [worker.pid] and result["detail"]["rank"] == 1
    remote.poll()  # executed once: a second poll does not run it again
    assert len(state.fault_results("node1")) == 1


def test_a_request_armed_by_an_agent_that_died_is_carried_out_by_its_rejoined_successor(state, tmp_path, worker):
    """A kill armed for the node's next save, and the node's agent killed before that moment (soak
    seed 1: kill_during_checkpoint, then kill_agent 1.35 s later): its relaunched agent rejoins
    in-process, with no torchrun, and still carries the request out on its workers' reports."""
    delivery = AgentDelivery(state, "r1", TOKEN)
    posted = delivery.post("node1", "kill_worker", {"local_rank": 0}, at_step=10)
    first = agent(state, tmp_path)
    first.attach(torchrun_pid=4242, epoch=0)
    first.poll()
    assert first.armed and state.fault_results("node1") == {}  # armed; then the agent dies
    successor = agent(state, tmp_path)
    successor.attach(torchrun_pid=None, epoch=0)  # a rejoined node: no torchrun
    successor.poll()
    successor.observe({"type": "step", "step": 10, "pid": worker.pid, "rank": 0, "local_rank": 0})
    assert worker.wait(timeout=10) == -signal.SIGKILL
    assert result_of(state, "node1", posted)["executed"]


def test_refuses_without_allow_chaos_without_the_token_and_with_the_wrong_one(state, tmp_path, worker):
    disabled = agent(state, tmp_path, enabled=False, node="node2")
    posted = AgentDelivery(state, "r1", TOKEN).post("node2", "kill_worker")
    disabled.poll()
    assert result_of(state, "node2", posted)["refused"] == DISABLED

    remote = agent(state, tmp_path)
    remote.observe({"type": "step", "step": 3, "pid": worker.pid, "local_rank": 0})
    unsigned = AgentDelivery(state, "r1", None).post("node1", "kill_worker")
    forged = AgentDelivery(state, "r1", "guessed").post("node1", "kill_worker")
    remote.poll()
    assert "carries no MAC" in result_of(state, "node1", unsigned)["refused"]
    assert "does not verify" in result_of(state, "node1", forged)["refused"]
    assert worker.poll() is None  # nothing was killed


def test_step_trigger_and_ordering(state, tmp_path):
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    shard = tmp_path / "checkpoints" / "step-00000004" / "shard-00001.safetensors"
    shard.write_bytes(bytes(range(256)) * 4)
    (shard.parent / "COMMIT").write_text(json.dumps({"files": {shard.name: {"sha256": "x", "bytes": 1024}}}))
    remote = agent(state, tmp_path)
    delivery = AgentDelivery(state, "r1", TOKEN)
    corrupt = delivery.post("node1", "corrupt_checkpoint", {"min_step": 4}, at_step=5)
    straggle = delivery.post("node1", "straggler", {"delay_s": 0.1, "num_steps": 2}, at_step=5,
                             after=corrupt.request_id)
    remote.attach(torchrun_pid=None, epoch=0)
    remote.poll()
    remote.observe({"type": "step", "step": 4, "pid": 1, "rank": 1, "local_rank": 0})
    assert state.fault_results("node1") == {}  # step 4 < 5: both still armed
    before = shard.read_bytes()
    remote.observe({"type": "step", "step": 5, "pid": 1, "rank": 1, "local_rank": 0})
    results = state.fault_results("node1")
    assert results[corrupt.request_id]["detail"]["checkpoint_step"] == 4 and shard.read_bytes() != before
    spec = results[straggle.request_id]["detail"]["spec"]
    assert spec == {"kind": "straggle", "from_step": 7, "to_step": 8, "delay_s": 0.1, "node": "node1"}
    assert results[corrupt.request_id]["ts"] <= results[straggle.request_id]["ts"]
    written = json.loads((tmp_path / "faults" / "chaos-node1-straggle-7.json").read_text())
    assert written["node"] == "node1"  # only this node's workers fire it


def test_a_fault_whose_moment_never_comes_is_refused_after_its_wait(state, tmp_path):
    remote = agent(state, tmp_path)
    posted = AgentDelivery(state, "r1", TOKEN).post("node1", "kill_worker", wait_s=0.05)
    remote.poll()
    time.sleep(0.1)
    remote.poll()
    assert "moment never came" in result_of(state, "node1", posted)["refused"]


def test_unknown_fault_and_bad_params_are_refused_with_the_reason(state, tmp_path):
    remote = agent(state, tmp_path)
    delivery = AgentDelivery(state, "r1", TOKEN)
    unknown = delivery.post("node1", "format_disk")
    bad = delivery.post("node1", "kill_during_checkpoint", {"every": 0})
    remote.attach(torchrun_pid=123, epoch=0)
    remote.poll()
    assert "unknown fault 'format_disk'" in result_of(state, "node1", unknown)["refused"]
    assert "params.every" in result_of(state, "node1", bad)["refused"]


def test_a_new_leader_declares_lost_the_old_leader_that_was_cut_off():
    """The partitioned node was the leader: its heartbeat expires before the next leader's first
    look.  The new leader compares with the view its predecessor left in etcd."""
    clock = FakeClock()
    store = MemoryStore(clock)
    state = RunState(store, RunKeys.of("/elastic", "r1"), clock=clock)
    leases = {n: store.grant_lease(4) for n in ("n0", "n1", "n2")}
    for node, lease in leases.items():
        state.put_heartbeat(node, {"epoch": 0, "step": 5}, lease=lease)
    events = []

    class Log:
        def emit(self, kind, **fields):
            events.append((kind, fields))

    def loop(node: str) -> LeaderLoop:
        return LeaderLoop(state, node, LeaderConfig(), ClusterPolicy(LeaderConfig(), lambda *a: None, Log()), Log())

    loop("n2").evaluate()  # n2 leads and sees all three; then it is cut off from etcd
    clock.advance(3)
    for node in ("n0", "n1"):
        store.refresh_lease(leases[node])
    clock.advance(2)
    successor = loop("n1")
    successor.evaluate()  # its first look: n2's heartbeat is already gone (judged after lost_grace_s)
    assert state.epoch() == 0
    for node in ("n0", "n1"):
        store.refresh_lease(leases[node])
    clock.advance(LeaderConfig().lost_grace_s)
    successor.evaluate()
    assert state.epoch() == 1
    assert ("leader.node_lost", {"nodes": ["n2"], "epoch": 0, "new_epoch": 1, "bumped": True}) in events
    successor.evaluate()  # a new epoch: a new baseline, nothing more is lost
    assert state.epoch() == 1


def test_leader_reforms_when_a_member_loses_its_lease():
    clock = FakeClock()
    store = MemoryStore(clock)
    state = RunState(store, RunKeys.of("/elastic", "r1"), clock=clock)
    leases = {n: store.grant_lease(4) for n in ("n0", "n1", "n2")}
    for node, lease in leases.items():
        state.put_heartbeat(node, {"epoch": 0, "step": 5}, lease=lease)
    events = []

    class Log:
        def emit(self, kind, **fields):
            events.append((kind, fields))

    loop = LeaderLoop(state, "n0", LeaderConfig(), ClusterPolicy(LeaderConfig(), lambda *a: None, Log()), Log())
    loop.evaluate()
    assert state.epoch() == 0
    clock.advance(3)
    for node in ("n0", "n1"):
        store.refresh_lease(leases[node])
    clock.advance(2)  # n2 (partitioned) stopped refreshing: its lease has expired, the others' not
    loop.evaluate()
    assert state.epoch() == 0  # away, not yet lost
    for node in ("n0", "n1"):
        store.refresh_lease(leases[node])
    clock.advance(LeaderConfig().lost_grace_s)
    loop.evaluate()
    assert state.epoch() == 1
    assert ("leader.node_lost", {"nodes": ["n2"], "epoch": 0, "new_epoch": 1, "bumped": True}) in events
    state.mark_done("n0")
    loop.evaluate()  # the next membership's baseline; a node leaving a finished run is no loss
    store.revoke_lease(leases["n1"])
    loop.evaluate()
    assert state.epoch() == 1


def _wave_setup():
    clock = FakeClock()
    store = MemoryStore(clock)
    state = RunState(store, RunKeys.of("/elastic", "r1"), clock=clock)
    leases = {n: store.grant_lease(4) for n in ("n0", "n1", "n2")}
    for node, lease in leases.items():
        state.put_heartbeat(node, {"epoch": 0, "step": 5}, lease=lease)
        state.put_node(node, {"state": "RUNNING"}, lease=lease)
        state.set_member(node, "joined")
    events = []

    class Log:
        def emit(self, kind, **fields):
            events.append((kind, fields))

    loop = LeaderLoop(state, "n0", LeaderConfig(), ClusterPolicy(LeaderConfig(), lambda *a: None, Log()), Log())
    return clock, store, state, leases, events, loop


def _register_again(store, state, node):
    lease = store.grant_lease(4)
    state.put_heartbeat(node, {"epoch": 0, "step": 6}, lease=lease)
    state.put_node(node, {"state": "RUNNING"}, lease=lease)
    return lease


def test_leases_dropped_by_etcd_with_the_leaders_own_are_no_node_loss():
    """A paused etcd leader that resumed revoked every agent's lease at once (chaos soak): the leader,
    whose own record vanished too, knows its agent is alive, so it declares nobody lost; the agents
    register again on new leases and the run goes on in its epoch."""
    clock, store, state, leases, events, loop = _wave_setup()
    loop.evaluate()
    for lease in leases.values():
        store.revoke_lease(lease)
    for _ in range(3):
        clock.advance(LeaderConfig().lost_grace_s)
        loop.evaluate()
    assert state.epoch() == 0 and not [e for e in events if e[0] in ("leader.node_lost", "run.fault")]
    for node in leases:
        _register_again(store, state, node)
    loop.evaluate()
    assert state.epoch() == 0 and state.members()["n2"]["state"] == "joined"


def test_a_node_back_within_the_grace_is_not_lost_and_one_that_stays_away_is():
    clock, store, state, leases, events, loop = _wave_setup()
    loop.evaluate()
    store.revoke_lease(leases["n1"])
    loop.evaluate()
    clock.advance(LeaderConfig().lost_grace_s / 2)
    _register_again(store, state, "n1")  # its agent noticed and registered again
    loop.evaluate()
    assert state.epoch() == 0 and not [e for e in events if e[0] == "run.fault"]
    store.revoke_lease(leases["n2"])
    loop.evaluate()
    clock.advance(LeaderConfig().lost_grace_s)
    loop.evaluate()
    faults = [f for kind, f in events if kind == "run.fault"]
    assert state.epoch() == 1 and [f["node"] for f in faults] == ["n2"]
