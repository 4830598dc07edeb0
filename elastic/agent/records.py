"""This node's own records in etcd: the node record and the heartbeat, both on its lease.

Publishing must never take the agent down: etcd being briefly unreachable is an event
(``agent.store_error``), not an exception; the workers do not need etcd between rendezvous.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from elastic.common.events import EventLog
from elastic.control.runstate import RunState
from elastic.control.lease import LeaseKeeper
from elastic.control.store import LeaseExpired, StoreError

T = TypeVar("T")


class NodeRecords:
    def __init__(self, state: RunState, node_id: str, events: EventLog, metrics_address: Callable[[], Any],
                 extra: dict[str, Any] | None = None) -> None:
        self.state = state
        self.node_id = node_id
        self.events = events
        self.metrics_address = metrics_address
        self.extra = extra or {}  # e.g. where peers reach this node's snapshot store
        self.lease: LeaseKeeper | None = None
        self._published: tuple[str, int] | None = None

    @property
    def lease_id(self) -> int | None:
        return self.lease.lease_id if self.lease is not None else None

    def quietly(self, op: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None after an ``agent.store_error`` event when etcd fails."""
        try:
            return fn()
        except LeaseExpired as exc:
            self.events.emit("agent.store_error", op=op, error=str(exc))
            if self.lease is not None and op != "renew_lease":
                self.lease.mark_lost()  # etcd says so: renew now, not at the keeper's next refresh
            return None
        except StoreError as exc:
            self.events.emit("agent.store_error", op=op, error=str(exc))
            return None

    def publish_node(self, agent_state: str, failures: int) -> None:
        self._published = (agent_state, failures)
        if self.lease is None:
            return
        record = {"node": self.node_id, "host": socket.gethostname(), "pid": os.getpid(), "state": agent_state,
                  "failures": failures, "ts": time.time(), "metrics": self.metrics_address(), **self.extra}
        self.quietly("publish_node", lambda: self.state.put_node(self.node_id, record, lease=self.lease_id))

    def renew_lost_lease(self) -> None:
        """After an outage or partition longer than the TTL the lease is gone: register again on a new one."""
        old = self.lease
        if old is None or not old.lost.is_set():
            return
        fresh = self.quietly("renew_lease", old.renewed)
        if fresh is None:
            return
        self.lease = fresh
        self.events.emit("agent.lease_renewed", lease=fresh.lease_id)
        if self._published is not None:
            self.publish_node(*self._published)

    def heartbeat(self, epoch: int, agent_state: str, summary: dict[str, Any]) -> None:
        """This node's heartbeat, on its lease; a lease etcd says is gone is renewed at once and the
        heartbeat put again.  Why: after a 10 s stop of the etcd leader member, an agent whose lease
        had expired learned it from its heartbeat's put at once, but renewed only 4.8 s later (its
        keeper's next refresh, then the next heartbeat); the run's leader had called it lost by then
        and restarted every node from disk (chaos soak, seed 3: 25 s)."""
        self.renew_lost_lease()
        record = {"node": self.node_id, "epoch": epoch, "state": agent_state, "ts": time.time(), **summary}
        self.quietly("heartbeat", lambda: self.state.put_heartbeat(self.node_id, record, lease=self.lease_id))
        if self.lease is not None and self.lease.lost.is_set():
            self.renew_lost_lease()
            self.quietly("heartbeat", lambda: self.state.put_heartbeat(self.node_id, record, lease=self.lease_id))

    def joined(self) -> None:
        """On the run's roster: if this agent vanishes now, the leader reports the node lost."""
        self.quietly("member", lambda: self.state.set_member(self.node_id, "joined"))

    def left(self, agent_state: str) -> None:
        """Before the lease goes: this node leaves cleanly (the leader must not report it lost)."""
        self.quietly("member", lambda: self.state.set_member(self.node_id, agent_state))
