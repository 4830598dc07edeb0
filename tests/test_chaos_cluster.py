"""Cluster mode for real: separately launched nodes, faults delivered through etcd.

(1) Three ``elastic-launch --etcd-endpoint ... --node-id ...`` processes form one run (a token-
protected one; node2 is started without ``--allow-chaos``).  ``chaos inject`` delivers a kill to
node1 through etcd and node1's agent executes it; the same kill unsigned, and a signed one to
node2, are refused with the reason, and nothing is killed by them.  The token never reaches etcd.

(2) A partition: three nodes, each in its own network namespace; node2's link goes down for 8 s.
Its lease expires, the leader re-forms the run with the other two, the link comes back and node2
trains again; every checkpoint verifies.  Needs root and ``ip`` (skipped otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.netns import available
from elastic.agent.remote_faults import DISABLED
from elastic.common.events import read_run_events
from elastic.control.store import EtcdStore
from tests.launch_helpers import kill_quietly, run_pids, write_run_config

pytestmark = pytest.mark.slow
TOKEN = "cluster-test-token-5f1c"


def _launch(config: Path, endpoint: str, node: str, env: dict, log: Path, allow: bool) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launch", str(config), "--etcd-endpoint", endpoint, "--node-id", node,
            "--run-id", "c1", "--nodes", "3", "--local-addr", "127.0.0.1", *(["--allow-chaos"] if allow else [])]
    with open(log, "wb") as fh:
        return subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _inject(endpoint: str, config: Path, env: dict, node: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chaos", "inject", "kill_worker", "--etcd-endpoint", endpoint,
                             "--run-id", "c1", "--node", node, "--config", str(config), "--wait-s", "240", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(400)
def test_kill_through_etcd_executed_and_refused_without_token_or_allow_chaos(tmp_path, etcd_endpoint, subprocess_env):
    env = {**subprocess_env, "RUN_TOKEN": TOKEN}
    config = write_run_config(tmp_path, nodes="3", steps=30, interval=5, step_sleep=0.1, run_id="c1",
                              security={"token_env": "RUN_TOKEN"})
    nodes = [_launch(config, etcd_endpoint, f"node{i}", env, tmp_path / f"node{i}.log", allow=i != 2)
             for i in range(3)]
    try:
        unsigned = _inject(etcd_endpoint, config, env, "node1", "--no-token")
        not_allowed = _inject(etcd_endpoint, config, env, "node2")
        signed = _inject(etcd_endpoint, config, env, "node1", "--at-step", "10")
        answers = {name: (p.wait(timeout=300), p.stdout.read(), p.stderr.read())
                   for name, p in (("unsigned", unsigned), ("not_allowed", not_allowed), ("signed", signed))}
        rcs = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    logs = {i: (tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(3)}
    assert rcs == [0, 0, 0], (rcs, logs, answers)
    rc, out, err = answers["unsigned"]
    assert rc == 1 and "carries no MAC" in json.loads(out)["refused"], (out, err)
    rc, out, err = answers["not_allowed"]
    assert rc == 1 and json.loads(out)["refused"] == DISABLED, (out, err)
    rc, out, err = answers["signed"]
    result = json.loads(out)
    assert rc == 0 and result["executed"] and result["step"] >= 10, (out, err)

    events = read_run_events(tmp_path / "run")
    victim = result["pids"][0]
    assert victim in run_pids(tmp_path / "run")["trainer"]
    node1 = [e for e in events if e.get("source") == "agent/node1"]
    assert [e for e in node1 if e["kind"] == "agent.chaos_executed"]
    assert len([e for e in node1 if e["kind"] == "agent.chaos_refused"]) == 1  # the unsigned one
    failed = [e for e in node1 if e["kind"] == "agent.state" and e.get("state") == "FAILED"]
    assert failed and failed[0]["ts"] > result["ts"]  # the kill made node1's worker fail ...
    starts = [e for e in events if e["kind"] == "trainer.start" and e["ts"] > result["ts"]]
    assert starts and [e for e in events if e["kind"] == "trainer.done"]  # ... and the run recovered and finished
    # The token signs requests but is never stored: nothing under the run's keys contains it.
    values = [kv.value for kv in EtcdStore(etcd_endpoint).get_prefix("/elastic/runs/c1/")]
    assert values and not any(TOKEN.encode() in (v if isinstance(v, bytes) else v.encode()) for v in values)
    kill_quietly(set().union(*run_pids(tmp_path / "run").values()))


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the partition's policy (who is declared lost, who stays) stays in the default suite as test_chaos_delivery.py's units.
@pytest.mark.soak
@pytest.mark.timeout(600)
@pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}")
def test_partition_of_one_node_in_a_namespace_is_detected_and_healed(tmp_path, subprocess_env):
    out = tmp_path / "suite"
    proc = subprocess.run([sys.executable, "-m", "chaos", "suite", "--nodes", "3", "--only", "partition", "--netns",
                           "--steps", "60", "--out", str(out), "--set", "agent.preflight.enabled=false",
                           "--set", "trainer.step_sleep=0.2"],
                          env=subprocess_env, capture_output=True, text=True, timeout=560)
    report = json.loads((out / "report.json").read_text())
    scenario = next(s for s in report["scenarios"] if s["name"] == "partition")
    invariants = {i["name"]: i for i in scenario["result"]["invariants"]}
    assert proc.returncode == 0 and report["ok"], (invariants, proc.stdout[-3000:], proc.stderr[-2000:])
    # A lost node changes the world size: nothing compares with a fault-free run, so none ran.
    assert [s["name"] for s in report["scenarios"]] == ["partition"] and report["baseline_checksum"] is None
    healed = invariants["partition_detected_and_healed"]
    assert healed["ok"] and "lost after" in healed["detail"], healed
    assert invariants["checkpoints_intact"]["ok"] and invariants["completed"]["ok"]
    events = read_run_events(Path(scenario["run_dir"]))
    lost = [e for e in events if e["kind"] == "leader.node_lost"]
    assert lost and "node2" in lost[0]["nodes"] and lost[0]["bumped"]
    assert [e for e in events if e["kind"] == "agent.lease_renewed" and e["source"] == "agent/node2"]
