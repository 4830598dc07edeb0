"""Run one scenario the way it runs on a cluster: separate nodes, one etcd, faults through etcd.

:class:`ClusterRunner` starts (or uses) etcd, optionally a proxy in front of it and a namespace
per node, then one ``elastic-launch --etcd-endpoint ... --node-id ... --allow-chaos`` per node
(:mod:`chaos.nodes`).  Faults reach the nodes two ways:

* through etcd to the target node's agent (:mod:`chaos.delivery`): every fault a node can do
  to itself.  Step-triggered ones are posted at once with ``at_step`` and fire on the node's own
  step report; time-triggered ones are posted when their time comes; ``at_time_s: 0`` ones
  before the nodes start;
* by chaos itself (:mod:`chaos.netfaults`): etcd outage and latency at the proxy or the etcd
  it started, a network partition of one node's namespace.

Progress and the end of the run are read from the run's state in etcd (node heartbeats, the
``done`` / ``stop`` keys, the agents' fault results), not from files.  What happened is written
as ``chaos.*`` events into the run directory, where :mod:`chaos.analysis` checks the invariants.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.delivery import AgentDelivery, Posted, params_dict
from chaos.etcd_proxy import EtcdProxy
from chaos.follow import parse_target
from chaos.netfaults import NET_FAULTS, Infra, InfraMissing, NetFault
from chaos.netns import NetLab
from chaos.nodes import NodeLaunch, NodeSet
from chaos.plan import FaultSpec
from elastic.common.events import EventLog
from elastic.control.etcd_server import EmbeddedEtcd
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreError

CHAOS_DIR = "chaos"
FINISH_MARGIN_S = 5.0
"""A fault posted less than this before the run finished counts as scheduled after its end."""


@dataclass
class ClusterSpec:
    config: Path
    run_id: str
    run_dir: Path
    nodes: list[str]
    node_range: str
    env: dict[str, str]
    key_prefix: str = "/elastic"
    steps: int | None = None
    overrides: list[str] = field(default_factory=list)
    etcd_endpoint: str | None = None
    """An operator's etcd; None: chaos starts one of its own on loopback."""
    proxy: bool = False
    netns: bool = False
    token: str | None = field(default=None, repr=False)
    allow_chaos: set[str] | None = None
    interval: int = 0
    """The job's checkpoint interval (kill_during_checkpoint needs it)."""
    nproc_per_node: int = 1
    requeue: bool = False
    """Relaunch a node whose launcher died while the run goes on (a scheduler's requeue)."""
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    """Batches to skip from the start (a fault-free replay of a run that skipped them)."""
    timeout_s: float = 600.0


@dataclass
class ClusterOutcome:
    rc: int
    run_dir: Path
    wall_s: float
    node_rcs: dict[str, int | None]
    fired: list[dict] = field(default_factory=list)
    missed: list[dict] = field(default_factory=list)
    timed_out: bool = False
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    requeues: int = 0


@dataclass
class _Planned:
    index: int
    spec: FaultSpec
    posted: Posted | None = None
    net: NetFault | None = None
    ends_at: float | None = None


class ClusterRunner:
    def __init__(self, spec: ClusterSpec, faults: list[FaultSpec], poll_s: float = 0.25) -> None:
        self.spec = spec
        self.faults = faults
        self.poll_s = poll_s
        self.infra: Infra | None = None
        self._nets: list[NetFault] = []
        self._max_step = 0
        self._finished_ts: float | None = None

    # -- set-up -----------------------------------------------------------------------
    def _start_infra(self) -> Infra:
        base = self.spec.run_dir.parent
        etcd = None
        endpoint = self.spec.etcd_endpoint
        if endpoint is None:
            etcd = EmbeddedEtcd(data_dir=base / "etcd", log_path=base / "etcd.log")
            endpoint = etcd.start()
        infra = Infra(endpoint, etcd, nodes=tuple(self.spec.nodes))
        self.infra = infra
        if self.spec.netns:
            infra.lab = NetLab(len(self.spec.nodes)).create()
        if self.spec.proxy or self.spec.netns:
            listen = infra.lab.listener() if infra.lab else None
            infra.proxy = EtcdProxy(endpoint, listen=listen).start()
        return infra

    def _stop_infra(self) -> None:
        infra = self.infra
        if infra is None:
            return
        if infra.proxy is not None:
            infra.proxy.close()
        if infra.lab is not None:
            infra.lab.close()
        if infra.etcd is not None:
            infra.etcd.resume()  # never leave it stopped, or it cannot be stopped
            infra.etcd.close()

    def _node_of(self, target: str) -> tuple[str, int | None]:
        node, rank = parse_target(target)
        if node is None and rank is not None:
            node, rank = self.spec.nodes[rank // self.spec.nproc_per_node], rank % self.spec.nproc_per_node
        return node or self.spec.nodes[-1], rank

    # -- run ---------------------------------------------------------------------------
    def run(self) -> ClusterOutcome:
        spec = self.spec
        (spec.run_dir / CHAOS_DIR).mkdir(parents=True, exist_ok=True)
        events = EventLog(spec.run_dir / "events" / "chaos.jsonl", "chaos")
        started = time.monotonic()
        nodes: NodeSet | None = None
        outcome = ClusterOutcome(rc=-1, run_dir=spec.run_dir, wall_s=0.0, node_rcs={})
        try:
            infra = self._start_infra()
            state = RunState(EtcdStore(infra.endpoint, request_timeout=2.0, retry_deadline=2.0),
                             RunKeys.of(spec.key_prefix, spec.run_id))
            if spec.skip_ranges:
                state.seed_skip_ranges(spec.skip_ranges, by="chaos replay")
            delivery = AgentDelivery(state, spec.run_id, spec.token)
            planned = [_Planned(i, f) for i, f in enumerate(self.faults)]
            events.emit("chaos.start", plan=[f.describe() for f in self.faults], endpoint=infra.endpoint,
                        proxy=infra.proxy.endpoint if infra.proxy else None, netns=bool(infra.lab),
                        nodes=spec.nodes, skip_ranges=spec.skip_ranges)
            for p in planned:
                if p.spec.fault not in NET_FAULTS and (p.spec.at_step is not None or p.spec.before_launch):
                    self._post(p, planned, delivery, events)
            nodes = NodeSet(self._node_launch(infra))
            nodes.start()
            outcome.timed_out = self._follow(nodes, state, delivery, planned, events, outcome)
            outcome.skip_ranges = self._quietly(state.skip_ranges, [])
            self._final_results(state, delivery, planned, events, outcome)
        finally:
            if nodes is not None:
                nodes.stop()
                outcome.node_rcs = nodes.poll()
                outcome.rc = nodes.exit_code()
            for net in self._nets:
                net.end()
            self._stop_infra()
            outcome.wall_s = time.monotonic() - started
            events.emit("chaos.end", rc=outcome.rc, wall_s=outcome.wall_s, timed_out=outcome.timed_out,
                        node_rcs=outcome.node_rcs, requeues=outcome.requeues)
            events.close()
        return outcome

    def _node_launch(self, infra: Infra) -> NodeLaunch:
        spec = self.spec
        endpoint = infra.proxy.endpoint if infra.proxy else infra.endpoint
        return NodeLaunch(spec.config, spec.run_id, spec.run_dir, spec.nodes, spec.node_range, endpoint,
                          spec.run_dir.parent / "logs", spec.env, spec.overrides, spec.steps, spec.allow_chaos,
                          infra.lab)

    def _follow(self, nodes: NodeSet, state: RunState, delivery: AgentDelivery, planned: list[_Planned],
                events: EventLog, outcome: ClusterOutcome) -> bool:
        t0 = time.monotonic()
        finished_at: float | None = None
        while nodes.running():
            now = time.monotonic()
            if now - t0 > self.spec.timeout_s:
                events.emit("chaos.timeout", timeout_s=self.spec.timeout_s)
                return True
            step = self._step(state)
            self._fire_due(planned, now - t0, step, delivery, events)
            self._collect(planned, delivery, events, outcome)
            finished = self._quietly(state.finished, False)
            if self.spec.requeue and not finished:
                self._requeue(nodes, events, outcome)
            if finished and finished_at is None:
                finished_at, self._finished_ts = now, time.time()
            if finished_at is not None and now - finished_at > 60:
                events.emit("chaos.launchers_linger", running=nodes.running())
                return False
            time.sleep(self.poll_s)
        return False

    @staticmethod
    def _quietly(fn, default):
        try:
            return fn()
        except StoreError:
            return default

    def _step(self, state: RunState) -> int:
        beats = self._quietly(state.heartbeats, {})
        self._max_step = max([self._max_step, *(int(hb.get("step") or 0) for hb in beats.values())])
        return self._max_step

    def _fire_due(self, planned: list[_Planned], elapsed: float, step: int, delivery: AgentDelivery,
                  events: EventLog) -> None:
        for p in planned:
            if p.net is not None and p.ends_at is not None and time.monotonic() >= p.ends_at:
                p.net.end()
                p.ends_at = None
                events.emit("chaos.healed", index=p.index, fault=p.spec.fault, target=p.spec.target, step=step)
            if p.posted is not None or p.net is not None or p.spec.before_launch:
                continue
            due = step >= p.spec.at_step if p.spec.at_step is not None else elapsed >= (p.spec.at_time_s or 0)
            if not due:
                continue
            if p.spec.fault in NET_FAULTS:
                self._begin_net(p, step, events)
            else:
                self._post(p, planned, delivery, events)

    def _begin_net(self, p: _Planned, step: int, events: EventLog) -> None:
        assert self.infra is not None
        fault = NetFault(p.spec.fault, p.spec.target, p.spec.params, self.infra)
        p.net = fault
        try:
            detail = fault.begin()
        except (InfraMissing, OSError, RuntimeError) as exc:
            events.emit("chaos.not_injected", index=p.index, fault=p.spec.fault, target=p.spec.target,
                        trigger_reached=True, reason=str(exc))
            return
        self._nets.append(fault)
        p.ends_at = time.monotonic() + fault.duration_s
        events.emit("chaos.inject", index=p.index, fault=p.spec.fault, target=p.spec.target, pids=[], step=step,
                    detail=detail, injected_ts=time.time(), by="chaos")

    def _post(self, p: _Planned, planned: list[_Planned], delivery: AgentDelivery, events: EventLog) -> None:
        node, local_rank = self._node_of(p.spec.target)
        params = params_dict(p.spec.params)
        if local_rank is not None:
            params["local_rank"] = local_rank
        if p.spec.fault == "kill_during_checkpoint":
            params.setdefault("every", self.spec.interval)
        after = ""
        if p.spec.after is not None and planned[p.spec.after].posted is not None:
            after = planned[p.spec.after].posted.request_id
        try:
            p.posted = delivery.post(node, p.spec.fault, params, at_step=p.spec.at_step, after=after,
                                     wait_s=self.spec.timeout_s)
        except StoreError as exc:
            events.emit("chaos.post_failed", index=p.index, fault=p.spec.fault, error=str(exc))
            return
        events.emit("chaos.posted", index=p.index, fault=p.spec.fault, node=node, id=p.posted.request_id,
                    at_step=p.spec.at_step, after=after or None)

    def _collect(self, planned: list[_Planned], delivery: AgentDelivery, events: EventLog,
                 outcome: ClusterOutcome) -> None:
        for p in planned:
            if p.posted is None or getattr(p, "reported", False):
                continue
            result = delivery.result(p.posted)
            if result is None:
                continue
            p.reported = True  # type: ignore[attr-defined]
            self._report(p, result, events, outcome)

    def _report(self, p: _Planned, result: dict[str, Any], events: EventLog, outcome: ClusterOutcome) -> None:
        if result.get("executed"):
            outcome.fired.append(events.emit(
                "chaos.inject", index=p.index, fault=p.spec.fault, target=p.spec.target, pids=result.get("pids", []),
                step=result.get("step"), detail=result.get("detail", {}), injected_ts=result.get("ts"),
                by=f"agent/{p.posted.node}", request_id=p.posted.request_id))
        else:
            outcome.missed.append(events.emit(
                "chaos.not_injected", index=p.index, fault=p.spec.fault, target=p.spec.target, trigger_reached=True,
                reason=f"refused by agent/{p.posted.node}: {result.get('refused')}", request_id=p.posted.request_id))

    def _reached(self, p: _Planned) -> bool:
        """Whether the run got to the fault's trigger (a fault planned past the end is not a failure)."""
        if p.posted is None:
            return False
        if self._finished_ts is not None and self._finished_ts - p.posted.posted_ts < FINISH_MARGIN_S:
            return False  # posted as the run was ending: its agent had no poll left to see it
        return p.spec.at_step is None or self._max_step >= p.spec.at_step

    def _requeue(self, nodes: NodeSet, events: EventLog, outcome: ClusterOutcome) -> None:
        for name in nodes.lost():
            node = nodes.nodes[name]
            events.emit("chaos.requeue", node=name, rc=node.rc, launches=node.launches + 1)
            nodes.start_node(node.index)
            outcome.requeues += 1

    def _final_results(self, state: RunState, delivery: AgentDelivery, planned: list[_Planned], events: EventLog,
                       outcome: ClusterOutcome) -> None:
        self._collect(planned, delivery, events, outcome)
        for p in planned:
            if p.net is not None or getattr(p, "reported", False):
                continue
            reason = ("the run ended before its trigger" if p.posted is None else
                      f"no result from agent/{p.posted.node} (its moment never came, or the node was gone)")
            outcome.missed.append(events.emit("chaos.not_injected", index=p.index, fault=p.spec.fault,
                                              target=p.spec.target, trigger_reached=self._reached(p), reason=reason))
        records = self._quietly(state.exclusions.all, {})
        events.emit("chaos.exclusions", nodes=sorted(records), records=records)
