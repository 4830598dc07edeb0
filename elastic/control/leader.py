"""Leader election and cluster policy (stragglers, lemon nodes), run by one agent.

Election: the leader key ``<run>/leader`` is created with compare-and-swap
(create-only) under a short lease.  The holder keeps the lease alive; if its
agent dies, the lease expires after ``ttl_s`` and the next agent to try wins.
No extra service is needed beyond etcd.

Policy (each ``interval_s``, leader only), from the node heartbeats that
every agent publishes under ``<run>/heartbeat/<node>``:

* straggler: a node whose *busy* step time (step time minus the time spent
  waiting for peers at the step's sync point) exceeds ``straggler_factor``
  times the median of the other nodes, ``straggler_evaluations`` times in a
  row.  Total step time cannot tell: in synchronous training every rank's
  step takes as long as the slowest one's.
* lemon node: ``lemon_failures`` counted failures of one node within
  ``lemon_window_s`` (failure records under ``<run>/failures/<node>/``).
* lost node: a node whose agent vanished (:mod:`elastic.control.membership`) gets one
  ``run.fault`` record and a counted failure, so a node that keeps vanishing is a lemon too.

Both can exclude the node (exclusion record with reason and expiry); the
excluded node's agent sees it, stops and leaves, and the rest re-form
without it when the launch is elastic (``--nodes MIN:MAX``).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal

from elastic.common.config import ConfigError
from elastic.common.events import EventLog
from elastic.control.generations import Generations
from elastic.control.membership import Absences, LostNodes
from elastic.control.runstate import RunState
from elastic.control.store import KVStore, LeaseExpired, StoreError


@dataclass(kw_only=True)
class LeaderConfig:
    """The leader agent's cluster policy: stragglers, lemon nodes (``agent.leader``)."""

    ttl_s: int = 3
    """Lease TTL of the leader key: a dead leader is replaced within about this long."""
    interval_s: float = 1.0
    """How often the leader evaluates cluster policy."""
    straggler_factor: float = 2.0
    """A node is slow when its busy step time exceeds this multiple of the other nodes' median."""
    straggler_min_excess_s: float = 0.05
    """... and exceeds it by at least this many seconds (noise floor for tiny steps)."""
    straggler_evaluations: int = 3
    """Consecutive slow evaluations before a node counts as a straggler."""
    straggler_action: Literal["flag", "exclude"] = "flag"
    """flag: a ``leader.straggler`` event only; exclude: also exclude the node (``exclusion_ttl_s``), so an
    elastic run re-forms without it."""
    lemon_failures: int = 3
    """Counted failures of one node within lemon_window_s that exclude it; 0 disables."""
    lemon_window_s: float = 600.0
    """Window over which a node's counted failures are added up for ``lemon_failures``."""
    exclusion_ttl_s: float = 3600.0
    """Expiry of an exclusion by the leader (straggler or lemon node); the node may then come back."""
    lost_grace_s: float = 2.0
    """A node whose heartbeat vanished is declared lost (the run re-forms without it) only once it has
    stayed away this long; 0: at the first look.  An etcd fault can revoke live agents' leases (a
    paused leader member resumed: every heartbeat but one vanished at once and the run restarted,
    chaos soak; etcd before 3.5.11 lets a deposed leader revoke leases, etcd-io/etcd#15247), and
    their agents re-register within a second or so."""

    def __post_init__(self) -> None:
        if self.ttl_s < 2:
            raise ConfigError("ttl_s", "must be >= 2")
        if self.interval_s <= 0:
            raise ConfigError("interval_s", "must be > 0")
        if self.straggler_factor <= 1:
            raise ConfigError("straggler_factor", "must be > 1")
        if self.straggler_min_excess_s < 0:
            raise ConfigError("straggler_min_excess_s", "must be >= 0")
        if self.straggler_evaluations < 1:
            raise ConfigError("straggler_evaluations", "must be >= 1")
        if self.lemon_failures < 0:
            raise ConfigError("lemon_failures", "must be >= 0")
        if self.lost_grace_s < 0:
            raise ConfigError("lost_grace_s", "must be >= 0")
        for name in ("lemon_window_s", "exclusion_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")


def leader_excluder(state: RunState, node_id: str, events: EventLog) -> Callable[[str, str, float], None]:
    """The leader policy's way to exclude another node (it notices and leaves); never raises."""

    def exclude(node: str, reason: str, ttl_s: float) -> None:
        try:
            state.exclusions.add(node, reason, ttl_s=ttl_s, by=f"leader/{node_id}")
            events.emit("leader.exclude", node=node, reason=reason, ttl_s=ttl_s)
        except StoreError as exc:
            events.emit("leader.store_error", error=str(exc))

    return exclude


class LeaderElection:
    def __init__(self, store: KVStore, key: str, node_id: str, ttl_s: int) -> None:
        self.store = store
        self.key = key
        self.node_id = node_id
        self.ttl_s = ttl_s
        self.lease_id: int | None = None

    def try_acquire(self) -> bool:
        """One attempt; True if this node holds (or already held) the leadership."""
        if self.lease_id is not None:
            try:
                self.store.refresh_lease(self.lease_id)
                return True
            except LeaseExpired:
                self.lease_id = None  # lost it (e.g. etcd outage longer than the TTL): re-run
        if self.store.get(self.key) is not None:
            # Held by another node: a read, not a lease grant + lost CAS + revoke (three raft
            # writes per follower per interval, measured: 3.6 grants/s on 4 local nodes).
            return False
        lease = self.store.grant_lease(self.ttl_s)
        ok, _ = self.store.compare_and_swap(self.key, json.dumps({"node": self.node_id, "ts": time.time()}), 0,
                                            lease=lease)
        if ok:
            self.lease_id = lease
            return True
        self.store.revoke_lease(lease)
        return False

    def current(self) -> str | None:
        kv = self.store.get(self.key)
        if kv is None:
            return None
        try:
            return json.loads(kv.value).get("node")
        except json.JSONDecodeError:
            return None

    def resign(self) -> None:
        if self.lease_id is not None:
            try:
                self.store.revoke_lease(self.lease_id)
            except StoreError:
                pass
            self.lease_id = None


class ClusterPolicy:
    """Straggler and lemon-node rules over heartbeats and failure records."""

    def __init__(self, config: LeaderConfig, exclude: Callable[[str, str, float], None], events: EventLog) -> None:
        self.config = config
        self.exclude = exclude
        self.events = events
        self._slow_streak: dict[str, int] = {}
        self._flagged: set[str] = set()
        self.excluded_by_policy: set[str] = set()
        self._judged_since: dict[str, float] = {}  # a returning node's old failures are forgiven

    def evaluate_stragglers(self, heartbeats: dict[str, dict]) -> list[str]:
        """Nodes that are stragglers now (after enough consecutive slow evaluations)."""
        busy = {n: hb["busy_time"] for n, hb in heartbeats.items()
                if hb.get("busy_time") is not None and hb.get("samples", 0) >= 3}
        stragglers = []
        for node, value in busy.items():
            others = [v for n, v in busy.items() if n != node]
            if not others:
                continue
            reference = statistics.median(others)
            slow = (value > self.config.straggler_factor * reference
                    and value - reference > self.config.straggler_min_excess_s)
            self._slow_streak[node] = self._slow_streak.get(node, 0) + 1 if slow else 0
            if self._slow_streak[node] >= self.config.straggler_evaluations:
                stragglers.append(node)
                if node not in self._flagged:
                    self._flagged.add(node)
                    reason = (f"straggler: busy step time {value:.3f}s vs median {reference:.3f}s of the others "
                              f"(> {self.config.straggler_factor:g}x, {self._slow_streak[node]} evaluations)")
                    self.events.emit("leader.straggler", node=node, busy_time=value, reference=reference,
                                     action=self.config.straggler_action)
                    if self.config.straggler_action == "exclude":
                        self.excluded_by_policy.add(node)
                        self.exclude(node, reason, self.config.exclusion_ttl_s)
        return stragglers

    def evaluate_lemons(self, failures: dict[str, list[float]], now: float | None = None) -> list[str]:
        if self.config.lemon_failures <= 0:
            return []
        now = time.time() if now is None else now
        lemons = []
        for node, stamps in failures.items():
            since = self._judged_since.get(node, 0.0)
            recent = [t for t in stamps if now - t <= self.config.lemon_window_s and t > since]
            if len(recent) >= self.config.lemon_failures:
                lemons.append(node)
                if node not in self._flagged:
                    self._flagged.add(node)
                    reason = (f"lemon node: {len(recent)} failures within {self.config.lemon_window_s:g}s")
                    self.events.emit("leader.lemon", node=node, failures=len(recent))
                    self.excluded_by_policy.add(node)
                    self.exclude(node, reason, self.config.exclusion_ttl_s)
        return lemons

    def forget(self, node: str) -> None:
        """A node came back (exclusion expired or cleared): judge it afresh."""
        self._flagged.discard(node)
        self._slow_streak.pop(node, None)
        self.excluded_by_policy.discard(node)
        self._judged_since[node] = time.time()


class LeaderLoop:
    """Background thread of every agent: campaign, and run the policy while leader."""

    def __init__(self, state: RunState, node_id: str, config: LeaderConfig,
                 policy: ClusterPolicy, events: EventLog,
                 on_tick: Callable[[bool], None] | None = None) -> None:
        # Called with is_leader after every election attempt, from the leader thread.
        self.on_tick = on_tick
        self.state = state
        self.config = config
        self.policy = policy
        self.events = events
        self.election = LeaderElection(state.store, state.keys.leader, node_id, config.ttl_s)
        self.lost = LostNodes(state, node_id, events, config.lost_grace_s)
        self.is_leader = False
        self._members: tuple[int, set[str]] | None = None
        self._absent = Absences(node_id, config.lost_grace_s, state.clock)  # members whose heartbeat vanished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        self.election.resign()

    def _run(self) -> None:
        # Campaign at a third of the TTL so that a holder refreshes well before expiry.
        while not self._stop.wait(min(self.config.interval_s, self.config.ttl_s / 3)):
            try:
                leader = self.election.try_acquire()
            except StoreError as exc:
                self.events.emit("leader.store_error", error=str(exc))
                continue
            if leader and not self.is_leader:
                self.events.emit("leader.elected", node=self.election.node_id)
            elif not leader and self.is_leader:
                self.events.emit("leader.lost", node=self.election.node_id)
            self.is_leader = leader
            if self.on_tick is not None:
                self.on_tick(leader)
            if leader:
                try:
                    self.evaluate()
                except StoreError as exc:
                    self.events.emit("leader.store_error", error=str(exc))

    def evaluate(self) -> None:
        """One round of the cluster policy (the leader's job), from the run's records."""
        for node in list(self.policy.excluded_by_policy):
            if self.state.exclusions.get(node) is None:  # expired or cleared: the node may return
                self.policy.forget(node)
        # Compare nodes of the same membership only.
        epoch = self.state.epoch()
        beats = self.state.heartbeats(epoch=epoch)
        self.check_lost(epoch, set(beats))
        self.policy.evaluate_stragglers(beats)
        self.lost.evaluate(self.state.nodes(), self.state.heartbeats())
        self.policy.evaluate_lemons(self.state.failures())

    def check_lost(self, epoch: int, members: set[str]) -> None:
        """A node of this membership whose heartbeat vanished (its lease expired: crashed, partitioned
        from etcd) makes the others re-form now, instead of each waiting out its collective timeout.

        The view is kept in etcd too: a leader that just took over compares with its predecessor's
        (the partitioned node may have been the leader; its heartbeat can vanish before the new
        leader's first look, and without the stored view nobody declared it lost).  A vanished node
        stays in the view until it is judged: lost after ``lost_grace_s`` away, or back."""
        seen = self._members if self._members is not None else self.state.leader_view()
        if seen is None or seen[0] != epoch:
            self._remember(seen, epoch, members)
            return
        lost = self._absent.judge(seen[1] - members)
        self._remember(seen, epoch, members | (seen[1] - members - lost))
        if not lost or self.state.finished():
            return
        handled = lost & Generations(self.state.store, self.state.keys, epoch).ever_lost()
        if handled == lost:  # the survivors already re-formed in-process without them: no restart
            self.events.emit("leader.node_lost", nodes=sorted(lost), epoch=epoch, new_epoch=epoch, bumped=False,
                             handled_in_process=True)
            return
        current, moved = self.state.bump_epoch(epoch)
        self.events.emit("leader.node_lost", nodes=sorted(lost), epoch=epoch, new_epoch=current, bumped=moved)

    def _remember(self, seen: tuple[int, set[str]] | None, epoch: int, members: set[str]) -> None:
        self._members = (epoch, members)
        if seen != self._members:
            self.state.set_leader_view(epoch, members)
