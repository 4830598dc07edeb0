"""Cluster mode against an etcd that is not there: the agent waits out an outage for
``agent.etcd_wait_s``, then stops with one line naming the endpoint, and the launcher prints it;
an etcd that comes up within the wait is joined as if nothing happened.  Real launcher and agent."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from elastic.common.events import read_run_events
from elastic.control.etcd_server import EmbeddedEtcd, free_port
from tests.launch_helpers import start_launcher, wait_for_event, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_unreachable_etcd_stops_the_node_with_one_line(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="1", agent={"etcd_wait_s": 3})
    proc = subprocess.run([sys.executable, "-m", "launch", str(config), "--etcd-endpoint", "127.0.0.1:1",
                           "--node-id", "n0"], env=subprocess_env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    reason = json.loads((tmp_path / "run" / "summary.json").read_text())["stop_reasons"]["n0"]
    assert reason.startswith("gave_up: etcd at 127.0.0.1:1 is unreachable: no answer to admission for ")
    assert "(agent.etcd_wait_s=3)" in reason and "\n" not in reason
    assert f"  n0 {reason}" in out  # the launcher prints every node's reason
    log = (tmp_path / "run" / "logs" / "agent-n0.log").read_text()
    assert "Traceback" not in log and "elastic-agent: node n0 gave up: etcd at 127.0.0.1:1 is unreachable" in log


def test_an_outage_shorter_than_the_wait_is_waited_out(tmp_path, subprocess_env):
    port = free_port()
    config = write_run_config(tmp_path, nodes="1", steps=4, interval=2, agent={"etcd_wait_s": 60})
    proc = start_launcher(config, subprocess_env, "--etcd-endpoint", f"127.0.0.1:{port}", "--node-id", "n0")
    etcd = EmbeddedEtcd(data_dir=tmp_path / "etcd", client_port=port, log_path=tmp_path / "etcd.log")
    try:
        wait_for_event(tmp_path / "run", lambda e: e["kind"] == "agent.etcd_waiting", timeout=60, proc=proc)
        time.sleep(2)  # etcd stays away a little longer
        etcd.start()
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        etcd.close()
    assert proc.returncode == 0, out
    assert "4/4 steps" in out
    waits = [e for e in read_run_events(tmp_path / "run") if e["kind"] == "agent.etcd_waiting"]
    assert [e["op"] for e in waits] == ["admission"]
