"""A cluster node whose agent is killed while the run goes on: its launcher leaves at once with the
agent's code and one line, and writes no summary (the run's is the finishing launchers').  A run
that is done is summarized as before.  Real launcher, agent and etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from elastic.common.events import read_run_events
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore
from elastic.run.schema import load_run_file
from launch.local import AgentProc, Launcher
from tests.launch_helpers import wait_for_event, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_node_lost_mid_run_leaves_without_summarizing_the_run(tmp_path, etcd_endpoint, subprocess_env):
    # Two nodes, only node1 started: its agent waits in the rendezvous, the run goes on without an end.
    config = write_run_config(tmp_path, nodes="2", run_id="lost")
    proc = subprocess.Popen([sys.executable, "-m", "launch", str(config), "--etcd-endpoint", etcd_endpoint,
                             "--node-id", "node1"], env=subprocess_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "run"
    started = wait_for_event(run, lambda e: e["kind"] == "launcher.agent_started", timeout=60, proc=proc)
    wait_for_event(run, lambda e: e["kind"] == "agent.state" and e.get("state") == "REGISTERED", timeout=60, proc=proc)
    os.kill(started["agent_pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 256 - signal.SIGKILL, out  # the agent's code, as before
    assert "this node was lost while the run goes on: agent node1 (signal 9)" in out
    assert not (run / "summary.json").exists() and not (run / "loss.png").exists()
    (lost,) = [e for e in read_run_events(run) if e["kind"] == "launcher.node_lost"]
    assert lost["nodes"] == {"node1": -signal.SIGKILL}


def test_a_node_killed_after_the_run_is_done_is_summarized(tmp_path, etcd_endpoint):
    cfg = load_run_file(write_run_config(tmp_path, nodes="2", run_id="done"))
    cfg.launch.etcd_endpoint = etcd_endpoint
    launcher = Launcher(cfg, tmp_path / "run")
    launcher.agents = [AgentProc("node1", subprocess.Popen(["true"]), tmp_path / "log", rc=-9)]
    assert launcher._node_lost()
    RunState(EtcdStore(etcd_endpoint), RunKeys.of(cfg.rendezvous.key_prefix, cfg.run.id)).mark_done("node0")
    assert not launcher._node_lost()
    launcher.agents[0].rc = 0
    assert not launcher._node_lost()
    launcher.agents[0].proc.wait()
