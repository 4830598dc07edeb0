"""One node's part in one rendezvous round of the etcd3 barrier handler.

Keys (from :class:`~elastic.control.keys.RunKeys`, round ``r`` zero-padded)::

    rdzv/round/<r>/join/<node>   this node's join record, on its lease
    rdzv/round/<r>/ctl/coord     the round's coordinator, on the coordinator's lease
    rdzv/round/<r>/ctl/done      the round record: nodes in rank order, master address
    rdzv/round/<r>/ctl/closed    the rendezvous was closed while this round was open
    rdzv/latest                  newest round that formed (written with its done record)

A node joins with one transaction: if the rendezvous is not closed and round ``r`` not done,
put the join record, count the round's join records, and claim ``ctl/coord`` if nobody holds
it.  Nobody rewrites a shared key.  The round is closed by one compare-and-swap that creates
``ctl/done`` (and moves ``latest``): by the joiner whose count reached ``max_nodes``, or by
the coordinator -- the first joiner, which alone watches the join records -- once ``min_nodes``
have joined and either the last call has passed or every node of the previous round that is
still alive (its lease holds its records) has joined again.  Everyone else watches
``ctl/`` only, so a round costs each waiter O(1) events.  A node that is not in the round
record (it joined after the close snapshot) moves on to round ``r + 1``, where the nodes of
round ``r`` see it through ``num_nodes_waiting()``.  If the coordinator's lease expires, its
``ctl/coord`` vanishes and a waiter takes the role over by the same create-only write.
"""

from __future__ import annotations

import json
import random
import time
import zlib
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elastic.control.codec import WatchEvent, prefix_end
from elastic.control.keys import RunKeys
from elastic.control.store import EtcdStore, KeyValue
from elastic.control.txn import Compare, Count, Get, Put, Range, Txn

TAKEOVER_JITTER_S = 1.0
"""Waiters spread their bids for a dead coordinator's role over this long, so that one wins
and the others see its claim before they bid (each bid is a raft proposal)."""


@dataclass(frozen=True, slots=True, order=True)
class NodeRecord:
    """A participant as its join record stores it; ordered by (addr, pid, local_id) = rank order."""

    addr: str
    pid: int
    local_id: int
    port: int = field(default=0, compare=False)
    """A free port picked at join: the master port if this node becomes rank 0."""

    @property
    def node_id(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"

    def encode(self) -> bytes:
        return json.dumps([self.addr, self.pid, self.local_id, self.port]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> NodeRecord:
        addr, pid, local_id, port = json.loads(raw)
        return cls(str(addr), int(pid), int(local_id), int(port))


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A formed round: node ids in rank order, and where rank 0 listens.

    Stored zlib-compressed: every waiter of the round receives it in its watch event, so etcd's
    gateway encodes it once per node.  At 2,048 participants the JSON is 48 KB (64 KB as the
    gateway's event): 128 MB to encode and send per formation, against 11 KB compressed (sorted
    ids share most of their characters).  A record written as plain JSON still decodes."""

    round: int
    nodes: list[str]
    master_addr: str
    master_port: int
    revision: int = 0  # etcd revision of the done record (not stored in it)

    def encode(self) -> bytes:
        return zlib.compress(json.dumps({"round": self.round, "nodes": self.nodes,
                                         "master": [self.master_addr, self.master_port]}).encode())

    @classmethod
    def decode(cls, raw: bytes, revision: int) -> RoundRecord:
        try:
            data = json.loads(raw if raw[:1] == b"{" else zlib.decompress(raw))
            addr, port = data["master"]
            return cls(int(data["round"]), [str(n) for n in data["nodes"]], str(addr), int(port), revision)
        except (ValueError, KeyError, TypeError, zlib.error) as exc:
            raise RendezvousStateError(f"corrupt round record: {raw[:200]!r}") from exc


class LateForRound(Exception):
    """The round formed without this node: join ``next_round`` (the one after the newest that formed)."""

    def __init__(self, next_round: int) -> None:
        super().__init__(next_round)
        self.next_round = next_round


class LeaseLost(Exception):
    """This node's lease expired while it waited: its join record is gone; join again."""


@dataclass(kw_only=True)
class RoundSpec:
    """What one attempt at a round needs to know."""

    keys: RunKeys
    round: int
    min_nodes: int
    max_nodes: int
    last_call_s: float
    deadline: float
    """time.monotonic() at which the join times out."""
    lease_ttl_s: float


class RoundAttempt:
    """Join round ``spec.round`` as ``node`` on ``lease_id``; :meth:`run` returns the round record."""

    def __init__(self, store: EtcdStore, spec: RoundSpec, node: NodeRecord, lease_id: int, lost) -> None:
        self._store, self._spec, self._node, self._lease = store, spec, node, lease_id
        self._lost = lost  # threading.Event set when the lease is gone
        k, r = spec.keys, spec.round
        self._join_key, self._joins, self._done = k.rdzv_join(r, node.node_id), k.rdzv_joins(r), k.rdzv_ctl(r, "done")
        self._coord, self._ctl = k.rdzv_ctl(r, "coord"), k.rdzv_ctl(r)
        self._latest = -1  # newest formed round, as the failure branch of the join reads it

    # -- joining ------------------------------------------------------------------
    def run(self) -> RoundRecord:
        record, revision, count, coordinator = self._join()
        if record is None and count >= self._spec.max_nodes:
            record = self.close()
        if record is None:
            record = self._coordinate() if coordinator else self._wait(revision)
        if self._node.node_id not in record.nodes:
            raise LateForRound(max(record.round, self._latest) + 1)
        return record

    def _join(self) -> tuple[RoundRecord | None, int, int, bool]:
        k = self._spec.keys
        result = self._store.txn(Txn(
            compare=[Compare.absent(k.rdzv_closed), Compare.absent(self._done)],
            success=[Put(self._join_key, self._node.encode(), self._lease), Count(self._joins), self._claim()],
            failure=[Get(k.rdzv_closed), Get(self._done), Get(k.rdzv_latest)]))
        if not result.succeeded:
            closed, done, latest = result.results
            if closed is not None:
                raise RendezvousClosedError()
            self._latest = int(latest.value) if latest is not None else -1
            return _round_of(done), result.revision, 0, False
        return None, result.revision, result.results[1], self._claimed(result.results[2])

    def _claim(self) -> Txn:
        """Create ``ctl/coord`` for this node unless someone holds it (else read who does)."""
        return Txn(compare=[Compare.absent(self._coord)], success=[Put(self._coord, self._node.node_id, self._lease)],
                   failure=[Get(self._coord)])

    def _claimed(self, result) -> bool:
        # A retried request whose first try was applied finds its own claim: that is a win too.
        holder = None if result.succeeded else result.results[0]
        return result.succeeded or (holder is not None and holder.value.decode() == self._node.node_id)

    def leave(self) -> None:
        """Withdraw the join record (timed out): a later close must not count this node."""
        self._store.delete(self._join_key)

    # -- closing ------------------------------------------------------------------
    def close(self) -> RoundRecord | None:
        """The one compare-and-swap that forms the round from the join records now present.

        None if fewer than ``min_nodes`` records are left (a lease expired meanwhile)."""
        joins = sorted(self._store.get_prefix(self._joins), key=lambda kv: kv.create_revision)
        nodes = sorted(NodeRecord.decode(kv.value) for kv in joins[: self._spec.max_nodes])
        if len(nodes) < self._spec.min_nodes:
            return None
        record = RoundRecord(self._spec.round, [n.node_id for n in nodes], nodes[0].addr, nodes[0].port)
        k = self._spec.keys
        result = self._store.txn(Txn(
            compare=[Compare.absent(self._done), Compare.absent(k.rdzv_closed)],
            success=[Put(self._done, record.encode()), Put(k.rdzv_latest, str(self._spec.round))],
            failure=[Get(self._done), Get(k.rdzv_closed)]))
        if result.succeeded:
            return RoundRecord(record.round, record.nodes, record.master_addr, record.master_port, result.revision)
        done, closed = result.results
        if done is None and closed is not None:
            raise RendezvousClosedError()
        return _round_of(done)

    # -- waiting --------------------------------------------------------------------
    def _wait(self, revision: int) -> RoundRecord:
        """Watch ``ctl/`` until the round record appears, or coordinate once the coordinator died."""
        with self._store.watch(self._ctl, revision + 1, prefix=True) as stream:
            record = self._wait_in(stream)
        return record if record is not None else self._coordinate()

    def _wait_in(self, stream) -> RoundRecord | None:
        """The round record, or None once this node has taken over the coordinator role.

        When ``ctl/coord`` vanishes (its holder's lease expired), each waiter bids after a random
        pause of up to TAKEOVER_JITTER_S unless it sees another's claim first, so few of the
        create-only bids (each one a raft proposal) are made."""
        bid_at: float | None = None
        while True:
            cap = None if bid_at is None else max(bid_at - time.monotonic(), 0.0)
            for event in self._next(stream, cap):
                record = self._on_ctl(event)
                if record is not None:
                    return record
                if event.key == self._coord:
                    bid_at = time.monotonic() + random.uniform(0, TAKEOVER_JITTER_S) if event.value is None else None
            if bid_at is not None and time.monotonic() >= bid_at:
                bid_at = None
                if self._bid():
                    return None

    def _on_ctl(self, event: WatchEvent) -> RoundRecord | None:
        if event.key == self._done and event.value is not None:
            return RoundRecord.decode(event.value, event.mod_revision)
        if event.key == self._ctl + "closed" and event.value is not None:
            raise RendezvousClosedError()
        return None

    def _bid(self) -> bool:
        return self._claimed(self._store.txn(self._claim()))

    def _next(self, stream, cap: float | None = None) -> list[WatchEvent]:
        """Next events; raises on the join deadline and when this node's lease is gone."""
        remaining = self._spec.deadline - time.monotonic()
        if remaining <= 0:
            self.leave()
            raise RendezvousTimeoutError()
        wait = min(remaining, self._spec.lease_ttl_s, cap if cap is not None else remaining)
        events = stream.get(wait) or []
        if self._lost.is_set():
            raise LeaseLost()
        return events

    # -- coordinating -----------------------------------------------------------------
    def _coordinate(self) -> RoundRecord:
        """Watch the join records of this round and the previous one; close when the rules allow."""
        view = _RoundView.read(self._store, self._spec)
        spec = self._spec
        start = spec.keys.rdzv_joins(spec.round - 1) if spec.round > 0 else spec.keys.rdzv_round(spec.round)
        end_key = _decode_range_end(spec.keys.rdzv_round(spec.round))
        with self._store.watch(start, view.revision + 1, range_end=end_key) as stream:
            while True:
                if view.done is not None:
                    return view.done
                if view.ready(spec, time.monotonic()):
                    record = self.close()
                    if record is not None:
                        return record
                    view.reset()
                for event in self._next(stream, max(view.until_last_call(spec, time.monotonic()), 0.0)):
                    view.apply(event, self)


@dataclass
class _RoundView:
    """What the coordinator knows: who joined this round, who of the previous round is alive."""

    joins: str
    prev_joins: str
    joined: set[str]
    prev_alive: set[str]
    prev_members: set[str] | None
    revision: int
    done: RoundRecord | None = None
    min_since: float | None = None

    @classmethod
    def read(cls, store: EtcdStore, spec: RoundSpec) -> _RoundView:
        k, r = spec.keys, spec.round
        prev_joins = k.rdzv_joins(r - 1) if r > 0 else ""
        ops = [Range(k.rdzv_joins(r)), Get(k.rdzv_ctl(r, "done"))]
        if r > 0:
            ops += [Range(prev_joins), Get(k.rdzv_ctl(r - 1, "done"))]
        res = store.txn(Txn(success=ops))
        prev = _round_of(res.results[3]) if r > 0 and res.results[3] is not None else None
        return cls(joins=k.rdzv_joins(r), prev_joins=prev_joins, joined={_tail(kv.key) for kv in res.results[0]},
                   prev_alive={_tail(kv.key) for kv in res.results[2]} if r > 0 else set(),
                   prev_members=set(prev.nodes) if prev is not None else None,
                   revision=res.revision, done=_round_of(res.results[1]) if res.results[1] else None)

    def apply(self, event: WatchEvent, attempt: RoundAttempt) -> None:
        name = _tail(event.key)
        if event.key.startswith(self.joins):
            (self.joined.add if event.value is not None else self.joined.discard)(name)
        elif self.prev_joins and event.key.startswith(self.prev_joins) and event.value is None:
            self.prev_alive.discard(name)
        else:
            self.done = attempt._on_ctl(event) or self.done

    def ready(self, spec: RoundSpec, now: float) -> bool:
        if len(self.joined) >= spec.max_nodes:
            return True
        if len(self.joined) < spec.min_nodes:
            self.min_since = None
            return False
        if self.min_since is None:
            self.min_since = now
        if self.prev_members is not None and (self.prev_members & self.prev_alive) <= self.joined:
            return True  # everyone still alive from the previous round is back
        return now >= self.min_since + spec.last_call_s

    def until_last_call(self, spec: RoundSpec, now: float) -> float:
        return float("inf") if self.min_since is None else self.min_since + spec.last_call_s - now

    def reset(self) -> None:
        self.min_since = None


def _round_of(kv: KeyValue | None) -> RoundRecord | None:
    return RoundRecord.decode(kv.value, kv.mod_revision) if kv is not None else None


def _tail(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _decode_range_end(prefix: str) -> str:
    import base64

    return base64.b64decode(prefix_end(prefix)).decode(errors="surrogateescape")
