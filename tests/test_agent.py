"""Node agent: exclusion refused before anything starts; exclusion records expire."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic.agent.node import EXIT_EXCLUDED
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import Exclusions
from elastic.common.events import read_run_events
from elastic.control.keys import RunKeys, run_prefix
from elastic.control.store import EtcdStore
from tests.launch_helpers import write_run_config


@pytest.mark.slow
def test_excluded_node_refuses_to_start(etcd_endpoint, tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="1", run_id="excl")
    run_dir = tmp_path / "run"
    store = EtcdStore(etcd_endpoint)
    Exclusions(store, run_prefix("/elastic", "excl")).add("node7", "ECC uncorrected errors", ttl_s=600, by="test")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic.agent", "--run-id", "excl", "--node-id", "node7",
         "--etcd-endpoint", etcd_endpoint, "--run-dir", str(run_dir), "--config", str(config)],
        env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_EXCLUDED, proc.stderr
    assert "excluded" in proc.stderr and "ECC uncorrected errors" in proc.stderr
    states = [e["state"] for e in read_run_events(run_dir) if e["kind"] == "agent.state"]
    assert states == ["EXCLUDED"]
    assert not (run_dir / "torchrun").exists()  # torchrun was never started
    assert store.get(RunKeys.of('/elastic', 'excl').node("node7")) is None  # never registered


def test_exclusions_expire_and_clear():
    clock = FakeClock()
    ex = Exclusions(MemoryStore(clock), "/elastic/runs/r", clock=clock)
    ex.add("a", "straggler", ttl_s=0.5)
    ex.add("b", "lemon")
    assert set(ex.all()) == {"a", "b"}
    assert ex.get("a")["reason"] == "straggler"
    clock.advance(0.7)
    assert ex.get("a") is None and set(ex.all()) == {"b"}
    ex.clear("b")
    assert ex.all() == {}


def test_unreadable_exclusion_record_still_excludes(etcd_endpoint):
    store = EtcdStore(etcd_endpoint)
    store.put("/elastic/runs/r/excluded/x", b"{not json")
    assert Exclusions(store, "/elastic/runs/r").get("x") == {"reason": "unreadable exclusion record", "until": None}
    assert json.loads(json.dumps(Exclusions(store, "/elastic/runs/r").all()))


@pytest.mark.slow
def test_node_excluded_by_a_failed_screen_returns_after_passing_one(etcd_endpoint, tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="1", steps=4, run_id="back",
                              agent={"preflight": {"enabled": True, "checks": ["gpu", "membw"]}})
    run_dir = tmp_path / "run"
    ex = Exclusions(EtcdStore(etcd_endpoint), run_prefix("/elastic", "back"))
    ex.add("node0", "pre-flight screen failed: membw: low", ttl_s=600, by="preflight")
    ex.add("node9", "straggler", ttl_s=600, by="leader/node1")
    proc = subprocess.run(
        [sys.executable, "-m", "elastic.agent", "--run-id", "back", "--node-id", "node0",
         "--etcd-endpoint", etcd_endpoint, "--run-dir", str(run_dir), "--config", str(config)],
        env=subprocess_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = [e["kind"] for e in read_run_events(run_dir)]
    assert "agent.exclusion_cleared" in kinds and "trainer.done" in kinds
    assert ex.get("node0") is None and ex.get("node9") is not None  # only the screened node came back
