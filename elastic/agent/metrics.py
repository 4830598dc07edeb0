"""Prometheus metrics of one node agent, fed from what the agent already sees.

Sources, all local to the agent (no extra traffic to etcd or the workers):

* the agent's own structured events (:class:`MeteredEventLog` forwards each
  emitted event): restarts by failure class, exclusions, state, epoch;
* the workers' step reports (UDP, :mod:`elastic.worker.channel`): steps, step time,
  loss, and the productive step time that goodput is made of;
* the checkpoint events of this node's lowest local rank, read incrementally
  from its ``events/trainer-rank<R>.jsonl`` on each :meth:`AgentMetrics.tick`
  (training blocked by a save, time to persist it);
* the heartbeat monitor at scrape time (seconds since the quietest local
  rank last reported).

Goodput here is the node's running view of :mod:`elastic.run.goodput`'s
definition: step time of steps whose result survived (a redone step replaces
the earlier execution) over wall time since the agent started.

Each agent has its own :class:`~prometheus_client.CollectorRegistry`: several
simulated nodes share one host in local mode, and a process-global registry
would mix their series.  The endpoint binds 127.0.0.1 unless configured
otherwise; port 0 picks a free port, published in the node's etcd record and
in the ``agent.metrics_started`` event.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server

from elastic.common.config import ConfigError
from elastic.common.events import EventLog

_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_CKPT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
_STATES = ("INIT", "SCREENING", "REGISTERED", "RUNNING", "FAILED", "SUCCEEDED", "STOPPED", "GAVE_UP", "EXCLUDED")


@dataclass(kw_only=True)
class MetricsConfig:
    """The agent's Prometheus endpoint (one registry per agent)."""

    enabled: bool = True
    """Serve the agent's Prometheus metrics over HTTP."""
    host: str = "127.0.0.1"
    """Bind address; loopback by default (a scraper on the node, or a port-forward)."""
    port: int = 0
    """0 = a free port, published in the node's etcd record (``metrics`` field)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be 0..65535, got {self.port}")
        if not self.host:
            raise ConfigError("host", "must not be empty")


def serve_metrics(metrics: AgentMetrics, config: MetricsConfig, events: EventLog, say: Callable[[str], None]) -> None:
    """Start the agent's metrics endpoint; a port already taken means running without it (an event, a line)."""
    try:
        address = metrics.serve(config)
    except OSError as exc:
        events.emit("agent.metrics_failed", error=str(exc), port=config.port)
        say(f": metrics endpoint not started: {exc}")
        return
    if address is not None:
        events.emit("agent.metrics_started", address=address)


class _EventTail:
    """New complete lines of a JSONL file since the last read (a torn last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class AgentMetrics:
    """The metric families of one agent and the code that feeds them."""

    def __init__(self, node_id: str, run_dir: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self.run_dir = run_dir
        self.clock = clock
        self.started = clock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.address: str | None = None
        self._server = None
        self._lock = threading.Lock()
        self._kept: dict[int, float] = {}   # step -> step time of its last execution
        self._ckpt_blocking_s = 0.0
        self._tail: _EventTail | None = None
        self._tail_rank: int | None = None
        self._silence: Callable[[], float] | None = None
        r = self.registry
        self.steps = Counter("elastic_steps", "Training steps reported by this node's first local rank", registry=r)
        self.step = Gauge("elastic_step", "Newest step reported on this node", registry=r)
        self.loss = Gauge("elastic_loss", "Loss of the newest step reported on this node", registry=r)
        self.step_time = Histogram("elastic_step_time_seconds", "Step time reported by the first local rank",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.restarts = Counter("elastic_restarts", "torchrun restarts of this node by failure class",
                                ["failure_class", "counted"], registry=r)
        self.failures = Counter("elastic_failures", "Failed torchrun attempts of this node by failure class",
                                ["failure_class", "action"], registry=r)
        self.exclusions = Counter("elastic_exclusions", "Exclusions decided by this agent (self or, as leader, others)",
                                  ["by"], registry=r)
        self.hangs = Counter("elastic_hangs_detected", "Hangs or stalls detected by this agent", ["verdict"], registry=r)
        self.ckpt_blocking = Histogram("elastic_checkpoint_blocking_seconds",
                                       "Training time blocked by a checkpoint save (first local rank)",
                                       buckets=_CKPT_BUCKETS, registry=r)
        self.ckpt_persist = Histogram("elastic_checkpoint_persist_seconds",
                                      "Save start to checkpoint persisted/committed (first local rank)",
                                      buckets=_CKPT_BUCKETS, registry=r)
        self.ckpt_failed = Counter("elastic_checkpoint_failures", "Checkpoint saves that failed", registry=r)
        self.epoch = Gauge("elastic_epoch", "Run-wide restart epoch this node last ran in", registry=r)
        self.state = Enum("elastic_agent_state", "Agent state", states=list(_STATES), registry=r)
        Gauge("elastic_goodput_ratio", "Productive step time / wall time since the agent started",
              registry=r).set_function(self.goodput)
        Gauge("elastic_productive_seconds", "Step time of steps whose result survived",
              registry=r).set_function(self.productive_s)
        Gauge("elastic_heartbeat_age_seconds", "Seconds since the quietest local rank last reported",
              registry=r).set_function(self.heartbeat_age)
        Gauge("elastic_uptime_seconds", "Seconds since the agent started", registry=r).set_function(self.uptime)

    # -- feeding ------------------------------------------------------------------
    def observe_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "agent.state":
            state = event.get("state")
            if state in _STATES:
                self.state.state(state)
            if state == "FAILED":
                self.failures.labels(str(event.get("failure_kind")), str(event.get("action"))).inc()
            if event.get("epoch") is not None:
                self.epoch.set(event["epoch"])
        elif kind == "agent.restart":
            self.restarts.labels(str(event.get("reason")), str(bool(event.get("counted"))).lower()).inc()
        elif kind == "agent.excluded_self":
            self.exclusions.labels(str(event.get("by") or "self")).inc()
        elif kind == "leader.exclude":
            self.exclusions.labels("leader").inc()
        elif kind == "agent.hang_detected":
            self.hangs.labels(str(event.get("verdict"))).inc()

    def observe_report(self, report: dict[str, Any]) -> None:
        """A worker's step report; only the lowest local rank counts (all ranks step together)."""
        if report.get("type") != "step" or int(report.get("local_rank", 0)) != 0:
            return
        step = int(report.get("step", 0))
        step_time = report.get("step_time")
        self.steps.inc()
        self.step.set(step)
        if report.get("loss") is not None:
            self.loss.set(float(report["loss"]))
        if step_time is not None:
            self.step_time.observe(float(step_time))
            with self._lock:
                self._kept[step] = float(step_time)
        rank = report.get("rank")
        if rank is not None and rank != self._tail_rank:
            # The first local rank's global rank can change across re-forms: follow its new file.
            self._tail_rank = int(rank)
            path = self.run_dir / "events" / f"trainer-rank{self._tail_rank}.jsonl"
            self._tail = _EventTail(path)
            self._tail.offset = path.stat().st_size if path.exists() else 0

    def observe_checkpoint(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "checkpoint.staged" and "blocking_s" in event:
            self.ckpt_blocking.observe(float(event["blocking_s"]))
            with self._lock:
                self._ckpt_blocking_s += float(event["blocking_s"])
        elif kind in ("checkpoint.persisted", "checkpoint.committed") and "persist_s" in event:
            self.ckpt_persist.observe(float(event["persist_s"]))
        elif kind == "checkpoint.save_failed":
            self.ckpt_failed.inc()

    def tick(self) -> None:
        """Pick up the checkpoint events the first local rank wrote since the last tick."""
        if self._tail is None:
            return
        for event in self._tail.read():
            if str(event.get("kind", "")).startswith("checkpoint."):
                self.observe_checkpoint(event)

    def watch_silence(self, silent_for: Callable[[], float]) -> None:
        self._silence = silent_for

    # -- derived values (read at scrape time) ---------------------------------------
    def uptime(self) -> float:
        return max(self.clock() - self.started, 0.0)

    def productive_s(self) -> float:
        with self._lock:
            return sum(self._kept.values())

    def goodput(self) -> float:
        wall = self.uptime()
        return self.productive_s() / wall if wall > 0 else 0.0

    def heartbeat_age(self) -> float:
        return float(self._silence()) if self._silence is not None else 0.0

    # -- serving ------------------------------------------------------------------------
    def serve(self, config: MetricsConfig) -> str | None:
        """Start the HTTP endpoint; returns "host:port" (or None when disabled)."""
        if not config.enabled:
            return None
        self._server, _thread = start_http_server(config.port, addr=config.host, registry=self.registry)
        host, port = self._server.server_address[:2]
        self.address = f"{host}:{port}"
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MeteredEventLog(EventLog):
    """An :class:`EventLog` whose events also feed the agent's metrics."""

    def __init__(self, path: Path | None, source: str, metrics: AgentMetrics) -> None:
        super().__init__(path, source)
        self.metrics = metrics

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = super().emit(kind, **fields)
        self.metrics.observe_event(event)
        return event
