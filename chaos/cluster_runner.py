"""Run one scenario the way it runs on a cluster: separate nodes, one etcd, faults through etcd.

:class:`ClusterRunner` starts (or uses) etcd, optionally a proxy in front of it and a namespace
per node, then one ``elastic-launch --etcd-endpoint ... --node-id ... --allow-chaos`` per node
(:mod:`chaos.nodes`).  Faults reach the nodes two ways:

* through etcd to the target node's agent (:mod:`chaos.delivery`): every fault a node can do
  to itself.  Step-triggered ones are posted at once with ``at_step`` and fire on the node's own
  step report; time-triggered ones are posted when their time comes; ``at_time_s: 0`` ones
  before the nodes start;
* by chaos itself on the infrastructure (:mod:`chaos.netfaults`): etcd outage and latency at the
  proxy or the etcd it started, a network partition of one node's namespace, one member of a
  3-member etcd stopped (chaos then starts three members, as ``launch.etcd_members: 3`` does);
* by chaos itself on a process it finds in the run's events, for the faults no agent executes
  (a node's warm spare: ``kill_spare``).

A fault with ``after`` and ``delay_s`` is timed by chaos: it fires that long after the fault it
follows ran, whoever carried that one out (a second kill while the run re-forms after the first).

Progress and the end of the run are read from the run's state in etcd (node heartbeats, the
``done`` / ``stop`` keys, the agents' fault results), not from files.  What happened is written
as ``chaos.*`` events into the run directory, where :mod:`chaos.analysis` checks the invariants.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.analysis import FILE_FAULTS
from chaos.delivery import AgentDelivery, Posted, params_dict
from chaos.etcd_proxy import EtcdProxy
from chaos.follow import RunFollower, parse_target
from chaos.injectors import InjectionContext, Injector, MemberStopParams, TargetNotFound
from chaos.netfaults import NET_FAULTS, Infra, InfraMissing, NetFault
from chaos.netns import NetLab
from chaos.nodes import NodeLaunch, NodeSet
from chaos.plan import FaultSpec
from elastic.agent.fault_actions import ACTIONS
from elastic.common.events import EventLog
from elastic.control.etcd_cluster import EtcdCluster
from elastic.control.etcd_server import EmbeddedEtcd
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreError

CHAOS_DIR = "chaos"
FINISH_MARGIN_S = 5.0
"""A fault posted less than this before the run finished counts as scheduled after its end."""
LOCAL_RETRY_S = 60.0
"""How long chaos retries a fault it carries out itself while its target is missing (a spare
being replaced), before recording it as not injected."""
AGENT_ALIASES = {"kill_during_recovery": "kill_worker"}
"""Faults an agent executes as another (they differ only in when chaos posts them)."""
INFRA_FAULTS = NET_FAULTS | {"etcd_member_stop"}


def route(fault: str) -> str:
    """Who carries a fault out in a cluster run: ``agent`` (through etcd), ``infra`` (chaos, on etcd
    or the network) or ``local`` (chaos, on a process named in the run's events)."""
    if fault in INFRA_FAULTS:
        return "infra"
    return "agent" if AGENT_ALIASES.get(fault, fault) in ACTIONS else "local"


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
    etcd_members: int | None = None
    """Members of the etcd chaos starts; None: 3 when the plan stops a member, else 1."""
    standby: list[str] = field(default_factory=list)
    """Warm standby nodes started beside ``nodes`` (``elastic-launch --standby``): each takes the slot
    of a node the run loses; never a fault's target."""


@dataclass
class ClusterOutcome:
    rc: int
    run_dir: Path
    wall_s: float
    node_rcs: dict[str, int | None]
    fired: list[dict] = field(default_factory=list)
    missed: list[dict] = field(default_factory=list)
    timed_out: bool = False
    """The run did not end within ``timeout_s``: a hang."""
    lingered: bool = False
    """The run finished but a launcher was still running a minute later (stopped by chaos)."""
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)
    requeues: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Nodes the run turned away (exit code): a requeue would be turned away again."""
    etcd_members: int = 1

    @property
    def hung(self) -> bool:
        """The run did not end on its own."""
        return self.timed_out or self.lingered


@dataclass
class _Planned:
    index: int
    spec: FaultSpec
    posted: Posted | None = None
    net: NetFault | _MemberStop | None = None
    ends_at: float | None = None
    injector: Injector | None = None
    """A fault chaos carries out itself on a process (route ``local``)."""
    ran_ts: float | None = None
    """When it was carried out (wall clock): faults with ``after`` and ``delay_s`` count from it."""
    due_ts: float | None = None
    last_error: str = ""
    reported: bool = False
    """Its outcome (injected or not) is in the events."""


class _WholeEtcd:
    """A 3-member etcd as ``etcd_outage`` sees it: one service, paused and resumed as a whole
    (a member that ``etcd_member_stop`` holds stays stopped until that fault ends)."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.held: set[int] = set()

    @property
    def pid(self) -> int | None:
        return self.cluster.pids[0]

    def pause(self) -> None:
        for member in self.cluster.members:
            member.pause()

    def resume(self) -> None:
        for i, member in enumerate(self.cluster.members):
            if i not in self.held:
                member.resume()

    def close(self) -> None:
        self.cluster.close()


class _MemberStop:
    """``etcd_member_stop`` in a cluster run: one member of chaos's etcd stopped (SIGSTOP) or killed,
    then continued (or restarted on its data dir) when ``duration_s`` is over."""

    def __init__(self, params: MemberStopParams, etcd: _WholeEtcd | None) -> None:
        self.params = params
        self.etcd = etcd
        self.index: int | None = None
        self.active = False

    @property
    def duration_s(self) -> float:
        return float(self.params.duration_s)

    def begin(self) -> dict[str, Any]:
        if self.etcd is None or len(self.etcd.cluster.members) < 3:
            raise InfraMissing("etcd_member_stop needs the 3-member etcd chaos starts (not an operator's etcd)")
        cluster = self.etcd.cluster
        leader = cluster.leader_index(timeout=3.0)
        index = leader if self.params.member is None else self.params.member
        if index >= len(cluster.members):
            raise InfraMissing(f"etcd has {len(cluster.members)} members, no member {index}")
        member = cluster.members[index]
        pid = member.pid
        if self.params.mode == "stop":
            self.etcd.held.add(index)
            member.pause()
        else:
            member.kill()
        self.index, self.active = index, True
        return {"member": index, "leader": index == leader, "mode": self.params.mode, "etcd_pid": pid,
                "duration_s": self.duration_s}

    def end(self) -> None:
        if not self.active or self.etcd is None or self.index is None:
            return
        self.active = False
        member = self.etcd.cluster.members[self.index]
        if self.params.mode == "stop":
            self.etcd.held.discard(self.index)
            member.resume()
        else:
            member.spawn()  # rejoins on its data dir; the other two kept the quorum meanwhile


class _ProxyGroup:
    """One :class:`EtcdProxy` per etcd member, turned together (the nodes list them all)."""

    def __init__(self, proxies: list[EtcdProxy]) -> None:
        self.proxies = proxies

    @property
    def endpoint(self) -> str:
        return ",".join(p.endpoint for p in self.proxies)

    def set(self, **knobs: Any) -> None:
        for proxy in self.proxies:
            proxy.set(**knobs)

    def reset(self) -> None:
        for proxy in self.proxies:
            proxy.reset()

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()


class ClusterRunner:
    def __init__(self, spec: ClusterSpec, faults: list[FaultSpec], poll_s: float = 0.25) -> None:
        self.spec = spec
        self.faults = faults
        self.poll_s = poll_s
        self.infra: Infra | None = None
        self._nets: list[NetFault | _MemberStop] = []
        self._max_step = 0
        self._finished_ts: float | None = None
        self._follower: RunFollower | None = None
        members = spec.etcd_members
        if members is None:
            members = 3 if any(f.fault == "etcd_member_stop" for f in faults) else 1
        self.etcd_members = members if spec.etcd_endpoint is None else 1

    # -- set-up -----------------------------------------------------------------------
    def _start_infra(self) -> Infra:
        base = self.spec.run_dir.parent
        etcd: EmbeddedEtcd | _WholeEtcd | None = None
        endpoint = self.spec.etcd_endpoint
        if endpoint is None and self.etcd_members > 1:
            cluster = EtcdCluster(base / "etcd", members=self.etcd_members, log_dir=base)
            try:
                endpoint = cluster.start()
            except BaseException:
                cluster.close()  # the members that did start
                raise
            etcd = _WholeEtcd(cluster)
        elif endpoint is None:
            etcd = EmbeddedEtcd(data_dir=base / "etcd", log_path=base / "etcd.log")
            endpoint = etcd.start()
        infra = Infra(endpoint, etcd, nodes=tuple(self.spec.nodes))  # type: ignore[arg-type]
        self.infra = infra
        if self.spec.netns:
            infra.lab = NetLab(len(self.spec.nodes)).create()
        if self.spec.proxy or self.spec.netns:
            # One proxy per member: the nodes list them all and move on from a stopped one.
            proxies = [EtcdProxy(member, listen=infra.lab.listener() if infra.lab else None).start()
                       for member in endpoint.split(",")]
            infra.proxy = proxies[0] if len(proxies) == 1 else _ProxyGroup(proxies)  # type: ignore[assignment]
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
        planned: list[_Planned] = []
        try:
            infra = self._start_infra()
            state = RunState(EtcdStore(infra.endpoint, request_timeout=2.0, retry_deadline=2.0),
                             RunKeys.of(spec.key_prefix, spec.run_id))
            if spec.skip_ranges:
                state.seed_skip_ranges(spec.skip_ranges, by="chaos replay")
            delivery = AgentDelivery(state, spec.run_id, spec.token)
            planned = [_Planned(i, f) for i, f in enumerate(self.faults)]
            for p in planned:
                if route(p.spec.fault) == "local":
                    p.injector = p.spec.build()
            if any(p.injector for p in planned):
                self._follower = RunFollower(spec.run_dir)
            outcome.etcd_members = self.etcd_members
            events.emit("chaos.start", plan=[f.describe() for f in self.faults], endpoint=infra.endpoint,
                        proxy=infra.proxy.endpoint if infra.proxy else None, netns=bool(infra.lab),
                        nodes=spec.nodes, skip_ranges=spec.skip_ranges, etcd_members=self.etcd_members)
            for p in planned:
                early = p.spec.at_step is not None or p.spec.before_launch
                if route(p.spec.fault) == "agent" and p.spec.delay_s is None and early:
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
            for p in planned:
                if p.injector is not None:
                    p.injector.cleanup()
            self._stop_infra()
            outcome.wall_s = time.monotonic() - started
            events.emit("chaos.end", rc=outcome.rc, wall_s=outcome.wall_s, timed_out=outcome.timed_out,
                        lingered=outcome.lingered, node_rcs=outcome.node_rcs, requeues=outcome.requeues)
            events.close()
        return outcome

    def _node_launch(self, infra: Infra) -> NodeLaunch:
        spec = self.spec
        endpoint = infra.proxy.endpoint if infra.proxy else infra.endpoint
        return NodeLaunch(spec.config, spec.run_id, spec.run_dir, [*spec.nodes, *spec.standby], spec.node_range,
                          endpoint, spec.run_dir.parent / "logs", spec.env, spec.overrides, spec.steps,
                          spec.allow_chaos, infra.lab, standby=set(spec.standby))

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
            if self._follower is not None:
                self._follower.poll()
            self._fire_due(planned, now - t0, step, delivery, events, outcome)
            self._collect(planned, delivery, events, outcome)
            finished = self._quietly(state.finished, False)
            if self.spec.requeue and not finished:
                self._requeue(nodes, events, outcome)
            if finished and finished_at is None:
                finished_at, self._finished_ts = now, time.time()
            if finished_at is not None and now - finished_at > 60:
                events.emit("chaos.launchers_linger", running=nodes.running())
                outcome.lingered = True
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
                  events: EventLog, outcome: ClusterOutcome) -> None:
        for p in planned:
            if p.net is not None and p.ends_at is not None and time.monotonic() >= p.ends_at:
                p.net.end()
                p.ends_at = None
                events.emit("chaos.healed", index=p.index, fault=p.spec.fault, target=p.spec.target, step=step)
            if p.posted is not None or p.net is not None or p.reported or p.spec.before_launch:
                continue
            if not self._due(p, planned, elapsed, step):
                continue
            p.due_ts = p.due_ts or time.time()
            how = route(p.spec.fault)
            if how == "infra":
                self._begin_net(p, step, events)
            elif how == "local":
                self._inject_local(p, events, outcome)
            else:
                self._post(p, planned, delivery, events)

    def _due(self, p: _Planned, planned: list[_Planned], elapsed: float, step: int) -> bool:
        spec = p.spec
        due = step >= spec.at_step if spec.at_step is not None else elapsed >= (spec.at_time_s or 0)
        if due and spec.after is not None and spec.delay_s is not None:
            ran = planned[spec.after].ran_ts
            due = ran is not None and time.time() >= ran + spec.delay_s
        return due

    def _inject_local(self, p: _Planned, events: EventLog, outcome: ClusterOutcome) -> None:
        """A fault chaos carries out itself, on a process it finds in the run's events."""
        assert p.injector is not None and self._follower is not None
        ctx = InjectionContext(self.spec.run_dir, self._follower, None, list(self.spec.nodes))
        try:
            if not p.injector.ready(ctx):
                raise TargetNotFound("its moment (see the fault's description) never came")
            record = p.injector.inject(ctx)
        except TargetNotFound as exc:
            p.last_error = str(exc)
            if p.due_ts is not None and time.time() - p.due_ts > LOCAL_RETRY_S:
                p.reported = True
                outcome.missed.append(events.emit("chaos.not_injected", index=p.index, fault=p.spec.fault,
                                                  target=p.spec.target, trigger_reached=True,
                                                  reason=f"{p.last_error} (for {LOCAL_RETRY_S:g}s)"))
            return
        p.reported, p.ran_ts = True, record.ts
        outcome.fired.append(events.emit("chaos.inject", index=p.index, by="chaos", **record.event_fields()))

    def _begin_net(self, p: _Planned, step: int, events: EventLog) -> None:
        assert self.infra is not None
        if p.spec.fault == "etcd_member_stop":
            fault: NetFault | _MemberStop = _MemberStop(p.spec.params, self.infra.etcd
                                                        if isinstance(self.infra.etcd, _WholeEtcd) else None)
        else:
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
        p.ran_ts = time.time()
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
        if p.spec.after is not None and p.spec.delay_s is None and planned[p.spec.after].posted is not None:
            after = planned[p.spec.after].posted.request_id  # the agent keeps the order (same node)
        at_step = p.spec.at_step
        if at_step is None and p.spec.fault in FILE_FAULTS and "step" not in params and self._max_step:
            # The agent names the step from its own attempt's reports: right after a restart it has
            # none (step 0), and a fault file for step 2 never fires in a run resuming at step 50.
            at_step = self._max_step
        try:
            p.posted = delivery.post(node, AGENT_ALIASES.get(p.spec.fault, p.spec.fault), params,
                                     at_step=at_step, after=after, wait_s=self.spec.timeout_s)
        except StoreError as exc:
            events.emit("chaos.post_failed", index=p.index, fault=p.spec.fault, error=str(exc))
            return
        events.emit("chaos.posted", index=p.index, fault=p.spec.fault, node=node, id=p.posted.request_id,
                    at_step=at_step, after=after or None)

    def _collect(self, planned: list[_Planned], delivery: AgentDelivery, events: EventLog,
                 outcome: ClusterOutcome) -> None:
        for p in planned:
            if p.posted is None or p.reported:
                continue
            result = delivery.result(p.posted)
            if result is None:
                continue
            p.reported = True
            if result.get("executed"):
                p.ran_ts = float(result.get("ts") or time.time())
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
        if p.injector is not None and p.due_ts is not None:
            return self._finished_ts is None or self._finished_ts - p.due_ts >= FINISH_MARGIN_S
        if p.posted is None:
            return False
        if self._finished_ts is not None and self._finished_ts - p.posted.posted_ts < FINISH_MARGIN_S:
            return False  # posted as the run was ending: its agent had no poll left to see it
        return p.spec.at_step is None or self._max_step >= p.spec.at_step

    def _requeue(self, nodes: NodeSet, events: EventLog, outcome: ClusterOutcome) -> None:
        for name, rc in nodes.refused().items():
            if name not in outcome.refused:
                outcome.refused[name] = rc
                events.emit("chaos.requeue_refused", node=name, rc=rc,
                            reason="the run refused this node (its code, config or token differs): not relaunched")
        for name in nodes.lost():
            node = nodes.nodes[name]
            events.emit("chaos.requeue", node=name, rc=node.rc, launches=node.launches + 1)
            nodes.start_node(node.index)
            outcome.requeues += 1

    def _final_results(self, state: RunState, delivery: AgentDelivery, planned: list[_Planned], events: EventLog,
                       outcome: ClusterOutcome) -> None:
        self._collect(planned, delivery, events, outcome)
        for p in planned:
            if p.net is not None or p.reported:
                continue
            if p.injector is not None and p.due_ts is not None:
                reason = f"not carried out by chaos before the run ended: {p.last_error}"
            elif p.posted is None:
                reason = "the run ended before its trigger"
                if p.spec.after is not None and p.spec.delay_s is not None and planned[p.spec.after].ran_ts is None:
                    reason = f"fault #{p.spec.after}, which it follows, never ran"
            else:
                reason = f"no result from agent/{p.posted.node} (its moment never came, or the node was gone)"
            outcome.missed.append(events.emit("chaos.not_injected", index=p.index, fault=p.spec.fault,
                                              target=p.spec.target, trigger_reached=self._reached(p), reason=reason))
        records = self._quietly(state.exclusions.all, {})
        events.emit("chaos.exclusions", nodes=sorted(records), records=records)
