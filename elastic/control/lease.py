"""Keeping a lease alive from a background thread (node records, leadership, rendezvous joins)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic.control.store import KVStore, LeaseExpired, StoreError

log = logging.getLogger(__name__)


RETRY_S = 0.25
"""The first retry after a failed refresh; each further one waits twice as long, up to the interval."""


def next_wait(interval: float, failures: int) -> float:
    """Seconds to the next refresh: the interval while refreshes succeed; after a failure, soon.

    A refresh that failed (its member stalled, an election under way) was retried only a whole
    interval later: a 10 s lease refreshed at 3.3 s, failed over after a 2 s attempt, and tried again
    at 8.6 s, when an election under CPU load had not always finished; the lease expired during an
    11 s stop of the leader member (``tests/test_etcd_cluster.py``, the full suite beside a CPU hog).
    Backing off from 0.25 s keeps a failing cluster from a flood of keepalives (1,024 agents: at
    most 4,096 in the first second, then half as many each time)."""
    if failures <= 0:
        return interval
    return min(interval, RETRY_S * 2 ** (failures - 1))


class LeaseKeeper:
    """Keeps a lease alive from a daemon thread; records loss instead of raising.

    The keeper refreshes at a third of the TTL so that one missed refresh
    (etcd briefly unreachable) does not lose the lease.  If the lease does
    expire, ``lost`` is set and ``on_lost`` is called once; the owner decides
    what that means (the agent re-registers).
    """

    def __init__(self, store: KVStore, ttl: int, on_lost: Callable[[], None] | None = None) -> None:
        self.store = store
        self.ttl = ttl
        self.lease_id = store.grant_lease(ttl)
        self.lost = threading.Event()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.lease_id:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        # Each keepalive attempt gives up after a fifth of the TTL, so a stalled member (SIGSTOPped,
        # a full disk, a GC pause) costs one short attempt before the store fails over to the next
        # member.  With the store's 5 s request timeout, a refresh sent 3.3 s into a 10 s lease
        # reached another member only 8-9 s in: three agents of a 4-node run lost their leases
        # during a 10 s stop of one member of three, and the leader declared them lost.
        per_try = max(self.ttl / 5.0, 0.5)
        failures = 0
        while not self._stop.wait(next_wait(interval, failures)):
            try:
                self.store.refresh_lease(self.lease_id, timeout=per_try)
                failures = 0
            except LeaseExpired:
                self.mark_lost()
                return
            except StoreError as exc:
                failures += 1
                log.warning("lease %x refresh failed (will retry): %s", self.lease_id, exc)

    def mark_lost(self) -> None:
        """etcd said the lease is gone (a put on it failed with "lease not found"): lost now, without
        waiting for the next refresh (up to a third of the TTL later); ``on_lost`` runs once."""
        with self._lock:
            if self.lost.is_set():
                return
            self.lost.set()
        self._stop.set()
        if self._on_lost:
            self._on_lost()

    def renewed(self) -> LeaseKeeper:
        """A keeper of a new lease with the same TTL and callback (this one was lost)."""
        return LeaseKeeper(self.store, self.ttl, self._on_lost)

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if revoke and not self.lost.is_set():
            try:
                self.store.revoke_lease(self.lease_id)
            except StoreError:
                pass
