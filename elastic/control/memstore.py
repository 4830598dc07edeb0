"""An in-memory :class:`~elastic.control.store.KVStore` for policy tests.

It keeps etcd's semantics that the runtime's policies rely on: one global revision that every
write moves; compare-and-swap on a key's ``mod_revision`` (0 = create-only); leases whose keys
vanish when the lease expires or is revoked; prefix ranges in key order; and watches from a
revision (history is kept, so a watch from an old revision sees what happened since).  Time for
leases comes from ``clock`` (a :class:`FakeClock` in tests, so expiry needs no sleeping).

It is not a substitute for etcd in end-to-end tests: no raft, no network, no outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic.control.store import KeyValue, LeaseExpired, StoreTimeout, WatchEvent
from elastic.control.txn import Compare, Count, Delete, Get, Put, Range, Txn, TxnResult


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Lease:
    ttl: float
    expires: float
    keys: set[str] = field(default_factory=set)


class MemoryStore:
    """Thread-safe in-memory KVStore (see the module docstring for what it models)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._kvs: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._history: list[WatchEvent] = []
        self._revision = 1
        self._next_lease = 0x1000
        self._cond = threading.Condition()

    # -- internals (call with the lock held) ---------------------------------
    def _expire(self) -> None:
        now = self.clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires <= now]:
            self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        for key in sorted(self._leases.pop(lease_id).keys):
            self._delete(key)

    def _write(self, key: str, value: bytes | str, lease: int | None) -> int:
        if lease and lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} not found")
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._revision += 1
        old = self._kvs.get(key)
        self._detach(old)
        self._kvs[key] = KeyValue(key, data, self._revision, old.create_revision if old else self._revision,
                                  (old.version if old else 0) + 1, lease or 0)
        if lease:
            self._leases[lease].keys.add(key)
        self._history.append(WatchEvent(key, data, self._revision))
        self._cond.notify_all()
        return self._revision

    def _detach(self, kv: KeyValue | None) -> None:
        if kv is not None and kv.lease in self._leases:
            self._leases[kv.lease].keys.discard(kv.key)

    def _delete(self, key: str) -> bool:
        old = self._kvs.pop(key, None)
        if old is None:
            return False
        self._detach(old)
        self._revision += 1
        self._history.append(WatchEvent(key, None, self._revision))
        self._cond.notify_all()
        return True

    # -- KVStore ----------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        with self._cond:
            self._expire()
            return self._kvs.get(key)

    def read(self, key: str) -> tuple[KeyValue | None, int]:
        """``key`` and the revision it was read at (transactions, ``txn``, are not modelled here)."""
        with self._cond:
            self._expire()
            return self._kvs.get(key), self._revision

    def txn(self, txn: Txn) -> TxnResult:
        """One transaction, atomically: its compares, then Put, Get, Range, Count and nested
        transactions in order (what :meth:`RunState.signals` and a node's generation join send)."""
        with self._cond:
            self._expire()
            return self._txn(txn)

    def _txn(self, txn: Txn) -> TxnResult:
        ok = all(self._holds(c) for c in txn.compare)
        return TxnResult(ok, self._revision, [self._op(op) for op in (txn.success if ok else txn.failure)])

    def _holds(self, compare: Compare) -> bool:
        kv = self._kvs.get(compare.key)
        actual: int | bytes = {"version": kv.version if kv else 0, "create": kv.create_revision if kv else 0,
                               "mod": kv.mod_revision if kv else 0, "value": kv.value if kv else b""}[compare.target]
        expected = compare.value.encode() if isinstance(compare.value, str) else compare.value
        return {"=": actual == expected, "!=": actual != expected, "<": actual < expected,  # type: ignore[operator]
                ">": actual > expected}[compare.op]  # type: ignore[operator]

    def _op(self, op: Put | Get | Range | Count | Delete | Txn) -> object:
        if isinstance(op, Put):
            return self._write(op.key, op.value, op.lease)
        if isinstance(op, Get):
            return self._kvs.get(op.key)
        if isinstance(op, Range):
            return self._in(op.prefix, op.limit)
        if isinstance(op, Count):
            return len(self._in(op.prefix))
        if isinstance(op, Delete):
            keys = [k for k in self._kvs if k.startswith(op.key)] if op.prefix else [op.key]
            return sum(self._delete(k) for k in keys)
        return self._txn(op)

    def _in(self, prefix: str, limit: int = 0) -> list[KeyValue]:
        found = [self._kvs[k] for k in sorted(self._kvs) if k.startswith(prefix)]
        return found[:limit] if limit else found

    def get_prefix(self, prefix: str, limit: int = 0) -> list[KeyValue]:
        with self._cond:
            self._expire()
            return self._in(prefix, limit)

    def count_prefix(self, prefix: str) -> int:
        with self._cond:
            self._expire()
            return len(self._in(prefix, 0))

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        with self._cond:
            self._expire()
            return self._write(key, value, lease)

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._delete(key)

    def delete_prefix(self, prefix: str) -> int:
        with self._cond:
            return sum(self._delete(k) for k in [k for k in self._kvs if k.startswith(prefix)])

    def compare_and_swap(self, key: str, value: bytes | str, expected_mod_revision: int,
                         lease: int | None = None) -> tuple[bool, KeyValue | None]:
        with self._cond:
            self._expire()
            current = self._kvs.get(key)
            if (current.mod_revision if current else 0) != expected_mod_revision:
                return False, current
            self._write(key, value, lease)
            return True, self._kvs[key]

    def add(self, key: str, amount: int) -> int:
        """Atomic counter (what :meth:`EtcdStore.add` does with a CAS loop)."""
        with self._cond:
            current = self._kvs.get(key)
            value = (int(current.value) if current else 0) + amount
            self._write(key, str(value), None)
            return value

    def grant_lease(self, ttl: int) -> int:
        with self._cond:
            self._next_lease += 1
            self._leases[self._next_lease] = _Lease(ttl, self.clock() + ttl)
            return self._next_lease

    def refresh_lease(self, lease_id: int, timeout: float | None = None) -> int:
        with self._cond:
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseExpired(f"lease {lease_id:x} expired or revoked")
            lease.expires = self.clock() + lease.ttl
            return int(lease.ttl)

    def revoke_lease(self, lease_id: int) -> None:
        with self._cond:
            if lease_id in self._leases:
                self._drop_lease(lease_id)

    def revision(self) -> int:
        with self._cond:
            return self._revision

    def watch_once(self, key: str, start_revision: int, timeout: float, prefix: bool = False) -> WatchEvent | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire()
                for event in self._history:
                    if event.mod_revision >= start_revision and (event.key.startswith(key) if prefix
                                                                 else event.key == key):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, 0.05))

    def watch_keys(self, keys: list[str], start_revision: int, idle_s: float = 30.0,
                   on_events: Callable[[list[WatchEvent]], None] | None = None) -> MemoryWatch:
        """Every change to any of ``keys`` from ``start_revision`` on (what :class:`WatchStream` gives)."""
        return MemoryWatch(self, lambda key: key in keys, start_revision, on_events)

    def watch(self, key: str, start_revision: int, prefix: bool = False, range_end: str | None = None,
              idle_s: float = 30.0) -> MemoryWatch:
        """Every change to ``key`` (its prefix, or [key, range_end)) from ``start_revision`` on."""
        if range_end is not None:
            return MemoryWatch(self, lambda k: key <= k < range_end, start_revision)
        return MemoryWatch(self, (lambda k: k.startswith(key)) if prefix else (lambda k: k == key), start_revision)

    def events_since(self, start_revision: int, match: Callable[[str], bool], timeout: float) -> list[WatchEvent]:
        """The events at or after ``start_revision`` on keys ``match`` accepts; waits up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire()
                found = [e for e in self._history if e.mod_revision >= start_revision and match(e.key)]
                remaining = deadline - time.monotonic()
                if found or remaining <= 0:
                    return found
                self._cond.wait(min(remaining, 0.05))

    def wait_for_key(self, key: str, timeout: float, poll: float = 1.0) -> KeyValue:
        deadline = time.monotonic() + timeout
        while (kv := self.get(key)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(f"key {key} did not appear within {timeout:.1f}s")
            self.watch_once(key, self.revision() + 1, min(poll, remaining))
        return kv

    def stop_retrying(self) -> None:
        """Nothing is retried in memory (the agent calls this on shutdown)."""


class MemoryWatch:
    """A watch on a :class:`MemoryStore`: batches of events in revision order, like a WatchStream."""

    def __init__(self, store: MemoryStore, match: Callable[[str], bool], start_revision: int,
                 on_events: Callable[[list[WatchEvent]], None] | None = None) -> None:
        self._store = store
        self._match = match
        self.next_revision = start_revision
        self.closed = False
        self._pushing = on_events is not None
        if on_events is not None:  # as WatchStream's reader thread hands its batches on
            threading.Thread(target=self._push, args=(on_events,), name="memory-watch", daemon=True).start()

    def _push(self, on_events: Callable[[list[WatchEvent]], None]) -> None:
        while not self.closed:
            batch = self._take(0.2)
            if batch and not self.closed:
                on_events(batch)

    def get(self, timeout: float) -> list[WatchEvent] | None:
        """The next batch (None when none came, or when batches go to ``on_events``)."""
        if self._pushing:
            time.sleep(max(timeout, 0.0))
            return None
        return self._take(timeout)

    def _take(self, timeout: float) -> list[WatchEvent] | None:
        events = self._store.events_since(self.next_revision, self._match, timeout)
        if not events:
            return None
        self.next_revision = events[-1].mod_revision + 1
        return events

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> MemoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
