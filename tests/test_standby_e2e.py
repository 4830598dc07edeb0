"""A warm standby takes the slot of a node lost from a fixed-size run, in-process, and the run ends
bitwise equal to a fault-free one; the lost node, relaunched, never runs as the node again.

Real launchers (the run's, local with two nodes; the standby's, ``elastic-launch --standby`` in
cluster mode against the run's etcd), agents, etcd and trainers.  The standby's warm spare takes
the lost node's slot: no cold start after the fault (elastic.agent.standby)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.common.events import read_run_events
from elastic.worker.faults import write_fault
from tests.launch_helpers import kill_node, wait_for_event, write_run_config
from tests.test_inprocess_e2e import _steps_lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cluster_node(config: Path, endpoint: str, node: str, env: dict, *flags: str) -> subprocess.Popen[str]:
    """``elastic-launch`` for one node against the run's etcd, as a job step on its host runs it."""
    return subprocess.Popen([sys.executable, "-m", "launch", str(config), "--etcd-endpoint", endpoint,
                             "--node-id", node, "--run-id", "t", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _spare_warm(run_dir: Path) -> bool:
    logs = list((run_dir / "torchrun" / "standby0" / "standby").glob("spare-*.log"))
    return bool(logs) and b'"spare": "warm"' in logs[0].read_bytes()


def test_a_standby_takes_a_lost_nodes_slot_in_process_and_the_run_ends_bitwise(baseline_run, tmp_path, etcd_endpoint,
                                                                                 subprocess_env):
    config = write_run_config(tmp_path)  # the baseline's: 2 nodes, fixed size
    run = tmp_path / "run"
    write_fault(run, "stop", {"kind": "hang", "node": "node1", "step": 10})  # the loss lands at step 10
    nodes = [_cluster_node(config, etcd_endpoint, n, subprocess_env) for n in ("node0", "node1")]
    standby = _cluster_node(config, etcd_endpoint, "standby0", subprocess_env, "--standby")
    wait_for_event(run, lambda e: e["kind"] == "fault.fired" and e["fault"] == "hang", timeout=150, proc=nodes[0])
    deadline = time.monotonic() + 60
    while not _spare_warm(run) and time.monotonic() < deadline:
        assert standby.poll() is None, standby.communicate()[0]
        time.sleep(0.1)
    kill_ts = kill_node(run, "node1")
    claimed = wait_for_event(run, lambda e: e["kind"] == "standby.claimed", timeout=60, proc=nodes[0])
    back = _cluster_node(config, etcd_endpoint, "node1", subprocess_env)  # the lost node's relaunch, after the claim
    outs = [p.communicate(timeout=200)[0] for p in (*nodes, standby, back)]
    assert [p.returncode for p in (*nodes, standby, back)] == [0, 256 - 9, 0, 0], outs
    assert "this node was lost while the run goes on" in outs[1]
    events = read_run_events(run)
    assert claimed["node"] == "node1" and claimed["source"] == "standby/standby0"
    standby_pid = next(e["agent_pid"] for e in events if e["kind"] == "launcher.agent_started"
                       and e["node"] == "standby0")
    rejoined = [e for e in events if e["kind"] == "agent.rejoin"]
    assert [e["pid"] for e in rejoined] == [standby_pid] and rejoined[0]["source"] == "agent/node1"
    adopted = next(e for e in events if e["kind"] == "agent.spare_adopted")
    assert list(rejoined[0]["workers"].values()) == [adopted["spare_pid"]]  # the warm spare, no cold start
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert sorted((e["rank"], e["world_size"], e["bitwise"]) for e in recovered) == [(0, 2, True), (1, 2, True)]
    assert _steps_lost(events, kill_ts) <= 1
    assert (run / "final_checksum.txt").read_text().strip() == baseline_run["summary"]["final_checksum"]
    # The relaunched node1 found its slot taken (the standby runs as node1 now) and waited as a standby.
    back_pid = next(e["agent_pid"] for e in events if e["kind"] == "launcher.agent_started" and e["node"] == "node1"
                    and e["ts"] > kill_ts)
    assert [e["kind"] for e in events if e["pid"] == back_pid and e["kind"] in
            ("agent.slot_taken", "agent.rejoin", "standby.waiting", "standby.released")] == [
        "agent.slot_taken", "standby.waiting", "standby.released"]


def test_a_standby_that_fails_its_screen_is_excluded_before_it_can_take_a_slot(tmp_path, etcd_endpoint,
                                                                               subprocess_env):
    config = write_run_config(tmp_path, agent={"preflight": {"enabled": True, "checks": ["gemm"]}})
    run = tmp_path / "run"
    (run / "faults").mkdir(parents=True)
    (run / "faults" / "diag-standby0.yaml").write_text("gemm: {tflops_scale: 0.1}\n")  # a tenth of this host's
    standby = _cluster_node(config, etcd_endpoint, "standby0", subprocess_env, "--standby")
    out, _ = standby.communicate(timeout=120)
    assert standby.returncode == 93, out  # excluded: do not requeue
    events = read_run_events(run)
    (excluded,) = [e for e in events if e["kind"] == "standby.excluded"]
    assert "gemm" in excluded["reason"]
    assert not [e for e in events if e["kind"] == "standby.waiting"]
    assert len(list((run / "torchrun" / "standby0" / "standby").glob("spare-*.log"))) == 1  # started beside the screen
    assert not _spares_of(run)  # and gone with the standby


def _spares_of(run: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"elastic.worker.spare" in cmd and str(run).encode() in cmd:
            found.append(int(proc.name))
    return found
