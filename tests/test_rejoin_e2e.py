"""A node lost from a fixed-size run comes back and rejoins the running world in-process.

A run of ``launch.nodes: 2`` cannot shrink.  Before, a whole node's loss ended every worker and the
run restarted from the disk checkpoint once the node was back (the soak's ``kill_agent``: 13.8 s, 10
steps redone).  Now the survivor keeps its process and holds the next generation open
(``agent.inprocess.rejoin_wait_s``); the node's agent, started again with the same node id (here
by hand, as a scheduler's requeue or a rescheduled pod would), copies its snapshots back from its
buddy, and its fresh worker joins that generation with its old rank.  Nothing is read from disk,
at most one step is redone, and the final weights equal a fault-free run's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.common.events import read_run_events
from elastic.worker.faults import write_fault
from tests.launch_helpers import kill_node, start_launcher, wait_for_event, write_run_config
from tests.test_inprocess_e2e import _assert_in_process, _steps_lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _relaunch(config: Path, run_dir: Path, node: str, env: dict) -> subprocess.Popen[str]:
    """``elastic-launch`` for one node against the run's etcd, as a requeued job step runs it."""
    start = next(e for e in read_run_events(run_dir) if e["kind"] == "launcher.start")
    return subprocess.Popen([sys.executable, "-m", "launch", str(config), "--etcd-endpoint", start["endpoint"],
                             "--node-id", node, "--run-id", start["run_id"]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_lost_node_that_comes_back_rejoins_the_fixed_size_world_in_process(baseline_run, tmp_path, subprocess_env):
    config = write_run_config(tmp_path)  # the baseline's: 2 nodes, fixed size
    run = tmp_path / "run"
    # node1's worker stops itself at step 10 so that the node's loss lands there, whatever the host's speed.
    write_fault(run, "stop", {"kind": "hang", "node": "node1", "step": 10})
    proc = start_launcher(config, subprocess_env)
    wait_for_event(run, lambda e: e["kind"] == "fault.fired" and e["fault"] == "hang", timeout=150, proc=proc)
    wait_for_event(run, lambda e: e["kind"] == "agent.spare_started" and e["source"] == "agent/node1",
                   timeout=60, proc=proc)
    kill_ts = kill_node(run, "node1")
    wait_for_event(run, lambda e: e["kind"] == "recovery.rejoin_wait" and e["ts"] > kill_ts, timeout=60, proc=proc)
    back = _relaunch(config, run, "node1", subprocess_env)
    out, _ = proc.communicate(timeout=200)
    back_out, _ = back.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert back.returncode == 0, back_out
    events = read_run_events(run)
    _assert_in_process(events, kill_ts)
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert sorted((e["rank"], e["world_size"], e["bitwise"]) for e in recovered) == [(0, 2, True), (1, 2, True)]
    assert {e["loaded_from"] for e in recovered} == {"own memory", "agent memory"}
    (rejoined,) = [e for e in events if e["kind"] == "agent.rejoin"]
    copied = next(e for e in events if e["kind"] == "agent.rejoin_snapshots")
    assert copied["holder"] == "node0" and copied["copied"] >= 1
    plan = next(e for e in events if e["kind"] == "agent.round_plan" and e["gen"] == rejoined["gen"])
    assert plan["world"] == 2 and plan["nodes"] == 2
    assert _steps_lost(events, kill_ts) <= 1
    summary_checksum = (run / "final_checksum.txt").read_text().strip()
    assert summary_checksum == baseline_run["summary"]["final_checksum"]
    assert time.time() - kill_ts < 200
