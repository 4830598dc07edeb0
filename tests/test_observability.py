"""Metrics endpoint, `elastic status`, the loss report and TensorBoard scalars (unit level, real parts)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from elastic.agent.metrics import serve_metrics
from elastic.agent.node import AgentState, NodeAgent, NodeSpec
from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.checkpoint.publish import EtcdCheckpointPublisher
from elastic.common.events import EventLog
from elastic.agent.metrics import AgentMetrics, MeteredEventLog, MetricsConfig
from elastic.control.lease import LeaseKeeper
from elastic.control.store import EtcdStore
from launch import ops_cli
from launch.report import plot_loss
from launch.status import format_plain, read_status, render_table


def _scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_fed_by_events_reports_and_checkpoint_log(tmp_path):
    now = [100.0]
    metrics = AgentMetrics("n0", tmp_path, clock=lambda: now[0])
    events = MeteredEventLog(tmp_path / "events" / "agent-n0.jsonl", "agent/n0", metrics)
    events.emit("agent.state", state="RUNNING", epoch=2)
    events.emit("agent.state", state="FAILED", failure_kind="hang", action="rescreen", epoch=2)
    events.emit("agent.restart", reason="hang", epoch=3, counted=True)
    events.emit("agent.restart", reason="peer", epoch=4, counted=False)
    events.emit("agent.excluded_self", reason="screen failed", by="rescreen", ttl_s=5)
    events.emit("leader.exclude", node="n3", reason="lemon", ttl_s=5)
    # The worker's step reports: steps 1-3, then step 3 again after a restart (lost work).
    for step, t in ((1, 0.5), (2, 0.5), (3, 0.5), (3, 0.25)):
        metrics.observe_report({"type": "step", "rank": 4, "local_rank": 0, "step": step, "loss": 1.0 / step,
                                "step_time": t})
    metrics.observe_report({"type": "step", "rank": 5, "local_rank": 1, "step": 3, "loss": 9.0, "step_time": 9.0})
    # rank 4's checkpoint events, written by the real event writer the trainer uses.
    trainer_log = EventLog(tmp_path / "events" / "trainer-rank4.jsonl", "trainer/rank4")
    trainer_log.emit("checkpoint.staged", step=3, blocking_s=0.125)
    trainer_log.emit("checkpoint.committed", step=3, persist_s=2.0, bytes=10)
    metrics.tick()
    now[0] += 10.0  # ten seconds of agent wall time, 1.25 s of it productive
    metrics.tick()  # a second tick must not count the same lines again
    address = metrics.serve(MetricsConfig(port=0))
    try:
        assert address.startswith("127.0.0.1:")
        got = _scrape(address)
    finally:
        metrics.close()
    assert got["elastic_steps_total"] == 4
    assert got["elastic_step"] == 3 and got["elastic_loss"] == pytest.approx(1 / 3)
    assert got["elastic_step_time_seconds_count"] == 4
    assert got['elastic_restarts_total{counted="true",failure_class="hang"}'] == 1
    assert got['elastic_restarts_total{counted="false",failure_class="peer"}'] == 1
    assert got['elastic_failures_total{action="rescreen",failure_class="hang"}'] == 1
    assert got['elastic_exclusions_total{by="rescreen"}'] == 1
    assert got['elastic_exclusions_total{by="leader"}'] == 1
    assert got["elastic_checkpoint_blocking_seconds_sum"] == pytest.approx(0.125)
    assert got["elastic_checkpoint_blocking_seconds_count"] == 1
    assert got["elastic_checkpoint_persist_seconds_sum"] == pytest.approx(2.0)
    assert got["elastic_productive_seconds"] == pytest.approx(1.25)  # the redone step 3 counts once
    assert got['elastic_agent_state{elastic_agent_state="FAILED"}'] == 1
    assert got["elastic_epoch"] == 2
    assert got["elastic_goodput_ratio"] == pytest.approx(0.125)
    assert got["elastic_uptime_seconds"] == pytest.approx(10.0)


def test_metrics_config_refuses_bad_port():
    from elastic.common.config import ConfigError

    with pytest.raises(ConfigError, match="port"):
        MetricsConfig(port=70000)


def _agent(tmp_path: Path, endpoint: str, node: str = "n0") -> NodeAgent:
    spec = NodeSpec(run_id="obs", node_id=node, endpoint=endpoint, run_dir=tmp_path, nnodes="1:2",
                    nproc_per_node=1, entrypoint=["-m", "trainer.train"], local_addr="10.1.2.3")
    return NodeAgent(spec, AgentConfig(), RendezvousConfig())


def test_agent_publishes_metrics_address_and_status_reads_it(tmp_path, etcd_endpoint, capsys):
    agent = _agent(tmp_path, etcd_endpoint)
    store = EtcdStore(etcd_endpoint)
    serve_metrics(agent.metrics, agent.config.metrics, agent.events, agent.leave.say)
    try:
        assert "--local-addr=10.1.2.3" in agent.new_attempt(0).argv()
        agent.records.lease = LeaseKeeper(store, 10)
        agent._set_state(AgentState.RUNNING)
        monitor = agent.supervisor.monitor
        monitor.observe({"type": "step", "rank": 0, "pid": 1, "step": 7, "loss": 0.5, "step_time": 0.25})
        agent.records.heartbeat(1, agent.status.value, monitor.summary())
        agent.state.exclusions.add("n9", "lemon node: 3 failures", ttl_s=60, by="leader/n0")
        EtcdCheckpointPublisher(store, agent.keys.prefix, world_size=2)(6, str(tmp_path / "checkpoints" / "step-6"))
        status = read_status(store, agent.keys.prefix)
        node = status["nodes"]["n0"]
        assert node["metrics"] == agent.metrics.address and node["state"] == "RUNNING"
        assert node["step"] == 7 and node["steps_per_s"] == pytest.approx(4.0)
        assert status["excluded"]["n9"]["by"] == "leader/n0"
        assert status["checkpoint"]["step"] == 6
        assert _scrape(agent.metrics.address)['elastic_agent_state{elastic_agent_state="RUNNING"}'] == 1
        plain = format_plain(status)
        assert "n9" in plain and "EXCLUDED" in plain and "step 6" in plain
        import io

        from rich.console import Console

        console = Console(file=io.StringIO(), record=True, width=120, force_terminal=True)
        console.print(render_table(status))
        text = console.export_text()
        assert "n0" in text and "RUNNING" in text and "n9" in text

        assert ops_cli.main(["status", "--etcd", etcd_endpoint, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["prefix"] == agent.keys.prefix and out["nodes"]["n0"]["step"] == 7
        assert ops_cli.main(["status", "--etcd", etcd_endpoint, "--run-id", "obs"]) == 0
        assert "newest checkpoint: step 6" in capsys.readouterr().out
        assert ops_cli.main(["status", "--etcd", etcd_endpoint, "--run-id", "nope"]) == 1
        assert capsys.readouterr().err.strip() == "elastic: status: no run at /elastic/runs/nope"
    finally:
        agent.records.lease.close(revoke=True)
        agent.metrics.close()


def test_status_unreachable_etcd_is_one_line(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert ops_cli.main(["status", "--etcd", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.match(r"elastic: status: etcd at 127\.0\.0\.1:\d+ unreachable", err)
    assert ops_cli.main(["status", "--etcd", "localhost:x"]) == 2
    assert capsys.readouterr().err.startswith("elastic: error: --etcd")
    assert ops_cli.main(["status"]) == 2
    assert "--etcd" in capsys.readouterr().err


def test_loss_report_from_a_real_event_log(tmp_path):
    launcher = EventLog(tmp_path / "events" / "launcher.jsonl", "launcher")
    agent = EventLog(tmp_path / "events" / "agent-n0.jsonl", "agent/n0")
    first = EventLog(tmp_path / "events" / "trainer-rank0.jsonl", "trainer/rank0")
    launcher.emit("launcher.start", run_id="r")
    for step in range(1, 6):
        first.emit("trainer.step", step=step, loss=2.0 / step, step_time=0.01)
    agent.emit("agent.state", state="FAILED", failure_kind="worker_signal", action="restart")
    agent.emit("agent.restart", reason="worker_signal", counted=True)
    launcher.emit("chaos.inject", fault="kill_worker")
    for log in (launcher, agent, first):
        log.close()
    path = plot_loss(tmp_path)
    assert path == tmp_path / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    # No loss reported -> no picture rather than an empty one.
    empty = tmp_path / "empty"
    EventLog(empty / "events" / "launcher.jsonl", "launcher").emit("launcher.start")
    assert plot_loss(empty) is None


def test_tensorboard_scalars_rank0_only(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastic.worker.scalars import ScalarLog, TensorBoardConfig

    cfg = TensorBoardConfig(enabled=True)
    assert ScalarLog(cfg, tmp_path, rank=1)._writer is None
    log = ScalarLog(cfg, tmp_path, rank=0)
    fp8 = {"layers": 4, "amax_input_max": 3.5, "amax_weight_min": 0.01, "sat_grad": 2}
    for step in (1, 2):
        log.step(step, loss=1.0 / step, step_time=0.5, grad_norm=0.25, tokens_per_s=128.0, lr=1e-3, fp8=fp8)
    log.close()
    acc = EventAccumulator(str(log.log_dir))
    acc.Reload()
    assert [s.value for s in acc.Scalars("train/loss")] == [1.0, 0.5]
    assert acc.Scalars("perf/steps_per_s")[0].value == 2.0
    assert acc.Scalars("fp8/amax_input_max")[1].value == 3.5
    assert "fp8/layers" not in acc.Tags()["scalars"]
    assert log.log_dir.parent == tmp_path / "tensorboard"
