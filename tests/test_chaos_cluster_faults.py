"""How a cluster run (``chaos suite`` / ``chaos soak``) carries out the faults added for issue 26, without
nodes: a kill timed from the fault before it, a kill posted to the agent under its action's name, a file
fault held until the agent knows the run's step, a spare kill that chaos does itself from the run's events."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import chaos.cluster_runner as cr
from chaos.cluster_runner import ClusterOutcome, ClusterRunner, ClusterSpec, _Planned
from chaos.delivery import Posted
from chaos.follow import RunFollower
from chaos.plan import FaultSpec
from elastic.common.events import EventLog, read_run_events

pytestmark = pytest.mark.timeout(60)
NODES = ["node0", "node1", "node2", "node3"]


class FakeDelivery:
    def __init__(self) -> None:
        self.posts: list[dict] = []

    def post(self, node, fault, params=None, at_step=None, after="", wait_s=300.0):
        self.posts.append({"node": node, "fault": fault, "params": params, "at_step": at_step, "after": after})
        return Posted(node, f"id-{len(self.posts)}", fault, time.time())


def _wait_exec(pid: int) -> None:
    """Until the child runs its own command line (right after fork it still shows the parent's)."""
    deadline = time.monotonic() + 10
    while b"elastic.worker.spare" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _runner(tmp_path: Path, faults: list[FaultSpec]) -> tuple[ClusterRunner, list[_Planned], EventLog]:
    spec = ClusterSpec(Path("job.yaml"), "r", tmp_path / "run", NODES, "4", {}, interval=10)
    runner = ClusterRunner(spec, faults)
    events = EventLog(tmp_path / "run" / "events" / "chaos.jsonl", "chaos")
    return runner, [_Planned(i, f) for i, f in enumerate(faults)], events


def test_a_follower_fires_its_delay_after_the_fault_before_it_ran_and_goes_as_the_agents_action(tmp_path):
    faults = [FaultSpec("kill_worker", "node1", at_time_s=5.0),
              FaultSpec("kill_during_recovery", "node3", at_time_s=5.0, after=0, delay_s=0.5)]
    runner, planned, events = _runner(tmp_path, faults)
    delivery, outcome = FakeDelivery(), ClusterOutcome(0, tmp_path, 0.0, {})
    runner._fire_due(planned, 4.0, 10, delivery, events, outcome)
    assert delivery.posts == []  # not yet time
    runner._fire_due(planned, 5.0, 10, delivery, events, outcome)
    assert [p["fault"] for p in delivery.posts] == ["kill_worker"]  # the follower waits for the first to run
    planned[0].ran_ts = time.time()  # the agent's result says the first kill ran now
    runner._fire_due(planned, 5.1, 10, delivery, events, outcome)
    assert len(delivery.posts) == 1
    planned[0].ran_ts -= 0.6
    runner._fire_due(planned, 5.2, 10, delivery, events, outcome)
    second = delivery.posts[1]
    # Posted to node3's agent as the kill it is, with no agent-side "after" (that one ran on node1).
    assert (second["node"], second["fault"], second["after"]) == ("node3", "kill_worker", "")
    events.close()
    posted = [e for e in read_run_events(tmp_path / "run") if e["kind"] == "chaos.posted"]
    assert [e["fault"] for e in posted] == ["kill_worker", "kill_during_recovery"]


def test_a_file_fault_waits_until_the_agent_has_seen_the_runs_step(tmp_path):
    runner, planned, events = _runner(tmp_path, [FaultSpec("nan", "node0", at_time_s=3.0),
                                                 FaultSpec("nan", "node1", at_time_s=3.0, params={"step": 7})])
    runner._max_step = 58  # from the heartbeats; an agent just restarted from step 50 reports none yet
    delivery = FakeDelivery()
    runner._fire_due(planned, 3.0, 58, delivery, events, ClusterOutcome(0, tmp_path, 0.0, {}))
    assert [p["at_step"] for p in delivery.posts] == [58, None]  # an explicit step needs no wait


def test_chaos_kills_a_spare_itself_and_gives_up_with_the_reason(tmp_path, monkeypatch):
    faults = [FaultSpec("kill_spare", "node2", at_time_s=1.0),
              FaultSpec("kill_worker", "node2", at_time_s=1.0, after=0, delay_s=2.0),
              FaultSpec("kill_spare", "node1", at_time_s=1.0)]
    runner, planned, events = _runner(tmp_path, faults)
    assert cr.route("kill_spare") == "local", "the agents execute kill_spare now: move this test to delivery"
    for p in planned:
        if cr.route(p.spec.fault) == "local":
            p.injector = p.spec.build()
    spare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "elastic.worker.spare"])
    try:
        _wait_exec(spare.pid)
        event = {"ts": time.time(), "kind": "agent.spare_started", "source": "agent/node2", "pid": 1,
                 "spare_pid": spare.pid}
        (tmp_path / "run" / "events" / "agent-node2.jsonl").write_text(json.dumps(event) + "\n")
        runner._follower = RunFollower(tmp_path / "run")
        runner._follower.poll()
        delivery, outcome = FakeDelivery(), ClusterOutcome(0, tmp_path, 0.0, {})
        runner._fire_due(planned, 1.0, 20, delivery, events, outcome)
        assert spare.wait(timeout=5) == -9
        assert planned[0].reported and planned[0].ran_ts is not None and not planned[2].reported
        assert delivery.posts == []  # node2's worker kill comes 2 s after the spare's
        monkeypatch.setattr(cr, "LOCAL_RETRY_S", 0.0)
        planned[0].ran_ts -= 2.5
        runner._fire_due(planned, 1.2, 20, delivery, events, outcome)
        assert [(p["node"], p["fault"]) for p in delivery.posts] == [("node2", "kill_worker")]
        assert planned[2].reported  # node1 has no spare: given up, with the reason
    finally:
        if spare.poll() is None:
            spare.kill()
        spare.wait()
    events.close()
    got = [e for e in read_run_events(tmp_path / "run") if e.get("source") == "chaos"]
    inject = [e for e in got if e["kind"] == "chaos.inject"]
    assert inject[0]["fault"] == "kill_spare" and inject[0]["pids"] == [spare.pid] and inject[0]["by"] == "chaos"
    missed = [e for e in got if e["kind"] == "chaos.not_injected"]
    assert missed[0]["fault"] == "kill_spare" and "no live warm spare for 'node1'" in missed[0]["reason"]
    assert missed[0]["trigger_reached"]
