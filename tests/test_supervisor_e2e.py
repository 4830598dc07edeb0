"""Supervisor end to end (real etcd, torchrun, gloo): hang, NaN rollback, straggler shrink and
grow, leader failover, below-MIN stop, no-progress guard."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from elastic.control.runstate import Exclusions
from elastic.common.events import read_run_events
from elastic.control.keys import run_prefix
from elastic.control.store import EtcdStore
from elastic.worker.faults import write_fault
from tests.launch_helpers import start_launcher, wait_for_event, write_run_config

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

FAST_AGENT = {"max_restarts": 3, "term_grace_s": 2, "pg_timeout_s": 30, "preflight": {"enabled": False},
              "heartbeat": {"step_timeout_s": 2.5, "publish_interval_s": 0.5}}


def finish(proc, timeout: float = 300) -> str:
    return proc.communicate(timeout=timeout)[0]


def summary_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def kinds(run_dir, kind: str) -> list[dict]:
    return [e for e in read_run_events(run_dir) if e["kind"] == kind]


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: a stopped worker's hang verdict stays in the default suite (test_peer_hang_e2e.py, in-process).
@pytest.mark.soak
def test_sigstop_hang_is_detected_on_its_node_and_recovered(tmp_path, subprocess_env_session, baseline_run):
    proc = start_launcher(write_run_config(tmp_path, agent=FAST_AGENT), subprocess_env_session)
    run_dir = tmp_path / "run"
    victim = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["source"] == "trainer/rank1"
                            and e["step"] >= 5, timeout=180, proc=proc)
    node = next(e["node"] for e in kinds(run_dir, "trainer.start") if e["pid"] == victim["pid"])
    stopped_at = time.time()
    os.kill(victim["pid"], signal.SIGSTOP)
    out = finish(proc)
    assert proc.returncode == 0, out
    detected = kinds(run_dir, "agent.hang_detected")
    assert detected and detected[0]["source"] == f"agent/{node}" and detected[0]["verdict"] == "culprit"
    assert detected[0]["ts"] - stopped_at < 15  # seconds, not a collective timeout
    s = summary_of(run_dir)
    # Only the hang counts; a peer's in-process re-formation that gave up (recovery_failed) is listed uncounted.
    assert [(f["node"], f["failure_kind"]) for f in s["failures"] if f["counted"]] == [(f"agent/{node}", "hang")]
    assert s["final_checksum"] == baseline_run["summary"]["final_checksum"]


def test_nan_loss_rolls_back_and_skips_the_batch(tmp_path, subprocess_env_session, baseline_run):
    config = write_run_config(tmp_path, agent=FAST_AGENT)
    write_fault(tmp_path / "run", "nan", {"kind": "nan_loss", "rank": 0, "step": 7})
    proc = start_launcher(config, subprocess_env_session)
    out = finish(proc)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "run"
    s = summary_of(run_dir)
    assert s["last_step"] == 16 and s["rollbacks"] == 1
    assert {f["failure_kind"] for f in s["failures"]} == {"numerics"}
    assert s["restarts_counted"] == 1  # every node saw the one NaN; it counts once
    rollback = kinds(run_dir, "agent.rollback")[0]
    assert rollback["bad_step"] == 7 and rollback["skip"] == [[7, 7]]
    assert {e["step"] for e in kinds(run_dir, "trainer.step_skipped")} == {7}
    # The NaN never reached the weights: every loss after the rollback is finite, and the
    # weights differ from the fault-free run only by the one skipped batch.
    losses = [e["loss"] for e in kinds(run_dir, "trainer.step")]
    assert all(loss == loss for loss in losses)
    assert s["final_checksum"] and s["final_checksum"] != baseline_run["summary"]["final_checksum"]


# Long tier (pytest -m soak): the stop after max_rollbacks is test_runstate.py's policy test; a NaN
# rolled back end to end is test_nan_loss_rolls_back_and_skips_the_batch above.
@pytest.mark.soak
def test_repeated_numerics_failures_stop_with_a_report(tmp_path, subprocess_env_session):
    agent = {**FAST_AGENT, "failure": {"max_rollbacks": 1}}
    config = write_run_config(tmp_path, agent=agent)
    write_fault(tmp_path / "run", "nan1", {"kind": "nan_loss", "step": 3})
    write_fault(tmp_path / "run", "nan2", {"kind": "nan_loss", "step": 6})
    proc = start_launcher(config, subprocess_env_session)
    out = finish(proc)
    assert proc.returncode == 1, out
    run_dir = tmp_path / "run"
    gave_up = [e for e in kinds(run_dir, "agent.state") if e["state"] == "GAVE_UP"]
    assert any("max_rollbacks=1" in (e.get("reason") or "") for e in gave_up), gave_up
    assert len(kinds(run_dir, "agent.rollback")) == 1


# Long tier (pytest -m soak): 40-70 s on 2 cores. The straggler policy has unit tests on the in-memory
# store (test_supervisor_units.py) and the run's growth has test_barrier.py's late-node test.
@pytest.mark.soak
def test_straggler_is_excluded_run_shrinks_then_grows_back(tmp_path, subprocess_env_session):
    agent = {**FAST_AGENT,
             "leader": {"interval_s": 0.5, "straggler_action": "exclude", "straggler_evaluations": 2,
                        "exclusion_ttl_s": 600}}
    config = write_run_config(tmp_path, nodes="2:3", steps=60, interval=5, agent=agent,
                              launch={"respawn_excluded": True})
    run_dir = tmp_path / "run"
    write_fault(run_dir, "slow", {"kind": "straggle", "node": "node2", "from_step": 1, "delay_s": 0.3})
    proc = start_launcher(config, subprocess_env_session)
    excluded = wait_for_event(run_dir, lambda e: e["kind"] == "leader.exclude", timeout=240, proc=proc)
    assert excluded["node"] == "node2" and "straggler" in excluded["reason"]
    (run_dir / "faults" / "slow.json").unlink()  # the node is "repaired" while it is out
    # Every node slow alike (no straggler): leaves time for the node to come back before the end.
    write_fault(run_dir, "pace", {"kind": "straggle", "from_step": 1, "delay_s": 0.15})
    shrunk = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.start" and e["world_size"] == 2,
                            timeout=240, proc=proc)
    wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["ts"] > shrunk["ts"], timeout=120, proc=proc)
    # An operator (or a passing re-screen) clears the exclusion: the launcher brings the node back.
    endpoint = kinds(run_dir, "launcher.etcd_started")[0]["endpoint"]
    Exclusions(EtcdStore(endpoint), run_prefix("/elastic", "t")).clear("node2")
    out = finish(proc)
    assert proc.returncode == 0, out
    sizes = [e["world_size"] for e in kinds(run_dir, "trainer.start") if e["source"] == "trainer/rank0"]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes  # shrank to N-1, then grew back
    # The respawned agent grows the run either by bumping the epoch (agent.join_running, when it
    # sees fresh heartbeats) or through torchrun's own waiting-node check, which re-forms the
    # rendezvous when a node is waiting; which one wins is a race, the growth itself is not.
    assert kinds(run_dir, "launcher.agent_respawn")
    s = summary_of(run_dir)
    assert s["last_step"] == 60
    assert list(s["excluded"]) == ["node2"]


def test_leader_failover_when_leader_agent_is_killed(tmp_path, subprocess_env_session):
    # The survivors re-form in-process within a second or two: the rest of the run (26 steps of at
    # least 0.2 s) must outlast the dead leader's lease (agent.leader.ttl_s, 3 s) for a successor to be elected.
    config = write_run_config(tmp_path, nodes="2:3", steps=30, interval=5, step_sleep=0.2, agent=FAST_AGENT)
    run_dir = tmp_path / "run"
    proc = start_launcher(config, subprocess_env_session)
    wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["step"] >= 4, timeout=240, proc=proc)
    leader = kinds(run_dir, "leader.elected")[0]
    killed_at = time.time()
    os.kill(leader["pid"], signal.SIGKILL)  # the whole node is lost: agent, torchrun, workers
    out = finish(proc)
    assert proc.returncode == 0, out
    successors = [e for e in kinds(run_dir, "leader.elected") if e["ts"] > killed_at]
    assert successors and successors[0]["node"] != leader["node"]
    # The survivors re-form either in-process (trainer.recovered) or through a restart (trainer.start).
    worlds = sorted(kinds(run_dir, "trainer.start") + kinds(run_dir, "trainer.recovered"), key=lambda e: e["ts"])
    sizes = [e["world_size"] for e in worlds]
    assert sizes[0] == 3 and sizes[-1] == 2, [(e["kind"], e["world_size"]) for e in worlds]
    assert summary_of(run_dir)["last_step"] == 30


# Long tier (pytest -m soak): a run that cannot re-form stops with a reason in
# test_lost_node_e2e.py's fixed-size run too.
@pytest.mark.soak
def test_below_min_nodes_waits_then_stops_with_clear_message(tmp_path, subprocess_env_session):
    config = write_run_config(tmp_path, nodes="2", steps=200, agent=FAST_AGENT,
                              rendezvous={"join_timeout_s": 5})
    run_dir = tmp_path / "run"
    proc = start_launcher(config, subprocess_env_session)
    wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["step"] >= 3, timeout=240, proc=proc)
    agent = next(e for e in kinds(run_dir, "launcher.agent_started") if e["node"] == "node1")
    os.kill(agent["agent_pid"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 1, out
    failed = [e for e in kinds(run_dir, "agent.state") if e["source"] == "agent/node0" and e["state"] == "FAILED"]
    assert failed[-1]["failure_kind"] == "rendezvous_timeout" and failed[-1]["action"] == "stop"
    log = (run_dir / "logs" / "agent-node0.log").read_text()
    assert "stops the run: rendezvous_timeout" in log


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the guard itself stays in the default suite as test_runstate.py's ProgressGuard units.
@pytest.mark.soak
def test_no_progress_guard_stops_crash_loop(tmp_path, subprocess_env_session):
    agent = {**FAST_AGENT, "max_restarts": 10, "failure": {"no_progress_restarts": 2}}
    config = write_run_config(tmp_path, nodes="1", agent=agent)
    write_fault(tmp_path / "run", "crash", {"kind": "exit", "step": 1, "code": 3, "once": False})
    proc = start_launcher(config, subprocess_env_session)
    out = finish(proc)
    assert proc.returncode == 1, out
    run_dir = tmp_path / "run"
    assert len([e for e in kinds(run_dir, "agent.state") if e["state"] == "FAILED"]) == 3
    gave_up = [e for e in kinds(run_dir, "agent.state") if e["state"] == "GAVE_UP"]
    assert "no progress" in gave_up[-1]["reason"]


# Long tier (pytest -m soak): a failed screen excludes its node in test_agent.py's screen tests and
# in test_slurm.py's second job (exit 93, the others finish).
@pytest.mark.soak
def test_bad_hardware_at_preflight_excludes_only_that_node(tmp_path, subprocess_env_session):
    agent = {**FAST_AGENT, "preflight": {"enabled": True, "checks": ["gpu", "gemm"]}}
    config = write_run_config(tmp_path, nodes="2:3", steps=12, agent=agent)
    run_dir = tmp_path / "run"
    (run_dir / "faults").mkdir(parents=True)
    # node2's GEMM runs at a tenth of this host's throughput: the screen must fail it.
    (run_dir / "faults" / "diag-node2.yaml").write_text("gemm: {tflops_scale: 0.1}\n")
    proc = start_launcher(config, subprocess_env_session)
    out = finish(proc)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert list(s["excluded"]) == ["node2"] and "gemm" in s["excluded"]["node2"]
    assert s["nodes"]["node2"] == 93 and s["last_step"] == 12
    screens = {e["source"]: e["passed"] for e in kinds(run_dir, "agent.screen")}
    assert screens == {"agent/node0": True, "agent/node1": True, "agent/node2": False}
    # The screen runs beside the workers' start and holds back only the first step: the bad node
    # may join the first rendezvous, but it never trains a step, and every step is taken by 2 nodes.
    starts = kinds(run_dir, "trainer.start")
    stepped = {e["pid"] for e in kinds(run_dir, "trainer.step")}
    assert not {e["pid"] for e in starts if e["node"] == "node2"} & stepped
    assert {e["world_size"] for e in starts if e["pid"] in stepped} == {2}
