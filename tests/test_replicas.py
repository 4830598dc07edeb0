"""Replica-group mode (torchft): config checks, the leader's Lighthouse, and one end-to-end kill.

The e2e test runs the real stack: launcher, embedded etcd, two agents (= two replica
groups), the real torchft Lighthouse, real torchrun and gloo.  One group's worker is
SIGKILLed mid-run; the other must keep committing steps without restarting, and the
restarted group must heal from it (not from disk) and end with the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# torchft ships x86_64 wheels only (pyproject installs it there); elsewhere this mode is not available.
pytest.importorskip("torchft")

from elastic.agent.node import NodeAgent, NodeSpec
from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.common.config import ConfigError, from_dict, override
from elastic.common.events import EventLog, read_run_events
from elastic.replicas.config import ReplicaConfig
from elastic.replicas.runtime import LighthouseUnavailable, ReplicaRuntime
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore
from elastic.run.schema import RunConfig
from trainer.minimal_config import MLPTrainerConfig
from tests.launch_helpers import start_launcher, wait_for_event, write_run_config


def _replica_run(**fields) -> RunConfig:
    cfg = override(RunConfig(), "launch.nodes", "2")
    for key, value in fields.items():
        cfg = override(cfg, key, value)
    return cfg


def test_replica_config_errors_name_the_field(monkeypatch):
    from elastic.run import workloads

    assert _replica_run(**{"replicas.enabled": True}).replicas.enabled
    plain = workloads.Workload(name="plain", entry="trainer.train", config_class=MLPTrainerConfig)
    registered = {**workloads.available(), "plain": plain}  # a workload without a torchft entry point
    monkeypatch.setattr(workloads, "available", lambda: registered)
    with pytest.raises(ConfigError, match=r"^launch\.workload: 'plain' has no torchft support"):
        from_dict(RunConfig, {"launch": {"workload": "plain"}, "replicas": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"^replicas\.min_replicas: 3 exceeds the 2 replica groups"):
        _replica_run(**{"replicas.enabled": True, "replicas.min_replicas": 3})
    with pytest.raises(ConfigError, match=r"^replicas\.heartbeat_timeout_ms: must be >= 1$"):
        _replica_run(**{"replicas.heartbeat_timeout_ms": 0})
    with pytest.raises(ConfigError, match=r"^replicas\.transport: must be one of \['pg', 'http'\]"):
        _replica_run(**{"replicas.transport": "tcp"})
    with pytest.raises(ConfigError, match=r"^replicas\.heartbeat_ms: unknown key"):
        _replica_run(**{"replicas.heartbeat_ms": 5})


def test_leader_hosts_lighthouse_and_publishes_address(etcd_endpoint, tmp_path):
    store = EtcdStore(etcd_endpoint)
    events = EventLog(tmp_path / "events.jsonl", "test")
    cfg = ReplicaConfig(enabled=True, lighthouse_wait_s=0.5)
    state = RunState(store, RunKeys("/t/runs/r"))
    first = ReplicaRuntime(cfg, state, "node0", "r", tmp_path, events)
    other = ReplicaRuntime(cfg, state, "node1", "r", tmp_path, events)
    key = "/t/runs/r/torchft/lighthouse"  # written out: the layout is a contract with elastic status
    with pytest.raises(LighthouseUnavailable, match="lighthouse_wait_s=0.5s"):
        other.lighthouse_address()  # nobody leads yet
    other.tick(False, store.grant_lease(5))
    assert not other.host.running()  # only a leader starts one
    lease0, lease1 = store.grant_lease(5), store.grant_lease(5)
    first.tick(True, lease0)
    try:
        address = other.lighthouse_address()
        assert address.startswith("http://127.0.0.1:")
        host, port = address[len("http://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2):
            pass  # a real Lighthouse is listening on loopback
        assert other.worker_env(address)["TORCHFT_LIGHTHOUSE"] == address
        assert other.worker_env(address)["REPLICA_GROUP_ID"] == "node1"
        assert other.rdzv_id(3) == "r-rg-node1-a3"
        pid = json.loads(store.get(key).value)["pid"]
        # Leadership moving (load, etcd hiccup) must not take the groups' Lighthouse away.
        first.tick(False, lease0)
        other.tick(True, lease1)
        assert first.host.running() and not other.host.running() and other.lighthouse_address() == address
        # The host agent gone (its node lease expired): the leader starts a new Lighthouse.
        store.revoke_lease(lease0)
        other.tick(True, lease1)
        assert other.host.running() and other.lighthouse_address() != address
        first.tick(False, lease0)  # the old host sees it was superseded and stops its own
        assert not first.host.running()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        first.close(drain=False)
        other.close(drain=False)
    assert store.get(key) is None and not other.host.running()


def test_agent_in_replica_mode_never_bumps_the_epoch(etcd_endpoint, tmp_path):
    spec = NodeSpec(run_id="r", node_id="node1", endpoint=etcd_endpoint, run_dir=tmp_path, nnodes="2",
                    nproc_per_node=2, entrypoint=["-m", "trainer.ft_train"])
    agent = NodeAgent(spec, AgentConfig(), RendezvousConfig(), replicas=ReplicaConfig(enabled=True))
    assert agent.scope.bump(0) == 0 and agent.state.epoch() == 0
    agent.attempt = 2
    cmd = agent.new_attempt(0).argv()
    assert "--nnodes=1" in cmd and "--nproc-per-node=2" in cmd and "--rdzv-id=r-rg-node1-a2" in cmd
    plain = NodeAgent(spec, AgentConfig(), RendezvousConfig())
    assert plain.scope.bump(0) == 1 and "--nnodes=2" in plain.new_attempt(1).argv()
    # A group restarting after its peers finished the run must not train alone from step 0.
    agent.store.put(agent.keys.done, json.dumps({"by": "node0"}))
    result = agent._run_once(0)
    assert result.outcome == "succeeded" and agent.current is None


def test_late_group_stops_when_the_run_is_finished(etcd_endpoint, monkeypatch):
    from trainer.replica import RunFinished

    monkeypatch.setenv("ELASTIC_ETCD_ENDPOINT", etcd_endpoint)
    monkeypatch.setenv("ELASTIC_RUN_PREFIX", "/t/runs/r")
    mark = RunFinished(every=10)
    cpu = torch.device("cpu")
    assert not mark.seen(20, participants=1, rank=0, world=1, device=cpu)
    mark.publish(300, "node0")
    assert mark.seen(20, participants=1, rank=0, world=1, device=cpu)
    assert not mark.seen(21, participants=1, rank=0, world=1, device=cpu)  # only every 10th step
    assert not mark.seen(20, participants=2, rank=0, world=1, device=cpu)  # it has peers: it is not late


def _steps(events: list[dict], source: str) -> list[dict]:
    return [e for e in events if e["kind"] == "trainer.step" and e["source"] == source]


# Long tier (pytest -m soak): the replica machinery it exercises (trainer/replica.py, Lighthouse, heal)
# is the DiT replica trainer's too, killed the same way in test_dit_replicas.py.
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sigkill_one_group_survivor_keeps_training_and_restarted_group_heals(tmp_path, subprocess_env):
    config = write_run_config(
        tmp_path, nodes="2", steps=450, step_sleep=0.05, run_id="ft",
        replicas={"enabled": True, "heartbeat_timeout_ms": 1000, "join_timeout_ms": 500},
    )
    proc = start_launcher(config, subprocess_env)
    run_dir = tmp_path / "run"
    victim = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["source"] == "trainer/node1/rank0"
                            and e["committed"] and e["step"] >= 5, timeout=100, proc=proc)
    kill_ts = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    events = read_run_events(run_dir)

    survivor = _steps(events, "trainer/node0/rank0")
    after = [e for e in survivor if e["ts"] > kill_ts]
    first_commit = next(e for e in after if e["committed"])
    # Bounded by the Lighthouse heartbeat timeout (1 s) plus a quorum tick, not by a restart.
    assert first_commit["ts"] - kill_ts < 5.0, first_commit["ts"] - kill_ts
    assert sum(1 for e in after if not e["committed"]) <= 1  # at most the step the kill landed in
    assert len({e["pid"] for e in survivor}) == 1  # the survivor never restarted
    assert [e["kind"] for e in events if e["source"] == "agent/node0" and e["kind"] == "agent.restart"] == []
    assert any(e["participants"] == 1 for e in after)  # it trained alone while the peer was down

    healed = [e for e in events if e["kind"] == "trainer.healed" and e["source"] == "trainer/node1/rank0"
              and e["ts"] > kill_ts]
    assert healed and healed[0]["from_step"] == 0 and healed[0]["to_step"] > victim["step"], healed
    rejoined = [e for e in _steps(events, "trainer/node1/rank0") if e["ts"] > kill_ts]
    assert rejoined and rejoined[0]["step"] == healed[0]["to_step"] + 1  # resumed at the peer's step
    assert any(e["participants"] == 2 for e in rejoined)
    assert not (run_dir / "checkpoints").exists()  # live recovery, nothing from disk
    checksums = {node: (run_dir / f"final_checksum-{node}.txt").read_text().strip() for node in ("node0", "node1")}
    assert checksums["node0"] == checksums["node1"], checksums
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nodes"] == {"node0": 0, "node1": 0} and summary["restarts"] == 1


def test_lighthouse_main_runs_without_importing_torch():
    # The leader starts it while holding a 3 s lease: a torch import (1-4 s loaded) must not be in the way.
    script = Path(__file__).parents[1] / "elastic" / "replicas" / "lighthouse_main.py"
    # (No -X flag: the Lighthouse parses the process argv from argv[1], which must be the script.)
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run([sys.executable, str(script), "--help"], check=False, capture_output=True, text=True,
                         timeout=30, env=env)
    assert out.returncode == 0 and "--heartbeat_timeout_ms" in out.stdout, out
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert imported and "torch" not in imported and "torchft" not in imported
