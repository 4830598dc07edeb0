"""In-process recovery that never waits for a collective to raise (NCCL's behaviour), end to end.

``ELASTIC_TEST_PEER_FAILURE=hang`` makes a peer-loss error inside the survivors' collectives block
instead of raising, as NCCL's would: the run recovers only because the agent that saw the fault
pushes it and every worker's fault monitor aborts its world and unwinds its training thread
(:mod:`elastic.worker.faultwatch`).  A SIGSTOPped worker is a real hang on gloo too (no error
anywhere): its agent's hang verdict kills it and the spare takes its slot in-process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic.common.procs import descendants
from tests.launch_helpers import kill_node, worker_pid, write_run_config
from tests.test_inprocess_e2e import _after_retire, _assert_in_process, _dit_config, _kill_worker, _run, _steps_lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANG = {"ELASTIC_TEST_PEER_FAILURE": "hang"}


def _pushed(events: list[dict], kill_ts: float) -> list[dict]:
    """The survivors' recoveries, each unwound by the pushed fault (never by a collective's error)."""
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts
                 and e.get("unwound_by") is not None]
    assert recovered and {e["unwound_by"] for e in recovered} == {"pushed fault"}, recovered
    return recovered


def test_dit_worker_kill_recovers_in_process_bitwise_when_collectives_hang(tmp_path, subprocess_env):
    baseline, _, _ = _run(_dit_config(tmp_path, "base", "2", 1, cp=1), subprocess_env)
    summary, events, kill_ts = _run(_dit_config(tmp_path, "kill", "2", 1, cp=1), {**subprocess_env, **HANG},
                                    _kill_worker("node0", min_step=8))
    _assert_in_process(events, kill_ts)
    assert _steps_lost(events, kill_ts) <= 1
    recovered = _pushed(events, kill_ts)
    assert all(e["fault_kind"] == "worker_died" and e["bitwise"] for e in recovered)
    pushed = [e for e in events if e["kind"] == "agent.fault_pushed"]
    assert [e["source"] for e in pushed] == ["agent/node0"]  # one push, by the agent that reaped it
    assert summary["final_checksum"] == baseline["final_checksum"]


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: hanging collectives stay in the default suite through the worker-kill test above.
@pytest.mark.soak
def test_node_loss_recovers_in_process_when_collectives_hang(tmp_path, subprocess_env):
    """Nobody's collective raises: node1 (node2's ring predecessor) sees its hold on node2 break and
    pushes the loss; the round's coordinator declares it lost and the others re-form without it."""
    config = write_run_config(tmp_path, nodes="3:4", steps=120, run_id="nodeloss-hang")

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node2", min_step=10)
        return kill_node(run_dir, "node2")

    summary, events, kill_ts = _run(config, {**subprocess_env, **HANG}, act)
    _assert_in_process(events, kill_ts)
    recovered = _pushed(events, kill_ts)
    assert {e["world_size"] for e in recovered} == {3} and {e["fault_kind"] for e in recovered} == {"node_lost"}
    # A shrunk world is resharded: the run says its trajectory changed rather than claim bitwise.
    assert all(not e["bitwise"] and "resharded" in e["trajectory_changed"] for e in recovered)
    assert _steps_lost(events, kill_ts) <= 1
    pushed = [e for e in events if e["kind"] == "agent.fault_pushed" and e["ts"] > kill_ts]
    assert pushed and pushed[0]["node"] == "node2" and pushed[0]["fault_kind"] == "node_lost"
    assert summary["last_step"] == 120 and summary["nodes"]["node2"] == -9


def test_a_stopped_worker_is_killed_on_the_hang_verdict_and_replaced_in_process(baseline_run, tmp_path,
                                                                               subprocess_env):
    config = write_run_config(tmp_path, steps=16, agent={"max_restarts": 3, "term_grace_s": 2,
                                                         "preflight": {"enabled": False},
                                                         "heartbeat": {"step_timeout_s": 2.0}})
    frozen: list[int] = []

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node1", min_step=4)
        pid = worker_pid(run_dir, "node1")
        frozen.append(pid)
        stop_ts = time.time()
        os.kill(pid, signal.SIGSTOP)
        return stop_ts

    summary, events, stop_ts = _run(config, subprocess_env, act)
    killed = [e for e in events if e["kind"] == "agent.hang_kill"]
    assert [(e["source"], e["worker_pid"]) for e in killed] == [("agent/node1", frozen[0])]
    assert any(e["kind"] == "agent.inprocess_replace" and e["source"] == "agent/node1" for e in events)
    _assert_in_process(events, stop_ts)
    assert _steps_lost(events, stop_ts) <= 1
    faults = [e for e in events if e["kind"] == "run.fault" and e["ts"] > stop_ts]
    assert [e["failure_kind"] for e in faults] == ["hang"]
    assert summary["final_checksum"] == baseline_run["summary"]["final_checksum"]
    with pytest.raises(ProcessLookupError):
        os.kill(frozen[0], 0)  # the frozen process is gone, not orphaned
    assert not any(os.path.exists(f"/proc/{pid}") for pid in descendants(os.getpid()) if pid == frozen[0])
