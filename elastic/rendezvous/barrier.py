"""The ``etcd3`` torchrun rendezvous handler: a barrier on etcd v3 with no key every node rewrites.

torch's ``DynamicRendezvousHandler`` keeps a rendezvous in one state blob that every
participant rewrites by compare-and-swap, keep-alives included; at a few hundred nodes the
conflicts (each attempt a raft proposal) keep it from forming.  This handler follows the
barrier design of NVIDIA's ft_launcher instead (per-node records, one closer, everyone waits
on a round-done key); the protocol of one round is in :mod:`elastic.rendezvous.round`:

* each node's join record is its own key on its own lease: liveness is the lease keep-alive
  (every ``keep_alive_interval``; the lease lasts ``keep_alive_interval * keep_alive_max_attempt``),
  never a rewrite of shared state, and a node whose lease expires drops out of every round;
* one compare-and-swap closes a round; ranks follow the sorted (addr, pid, local id) of the
  nodes, as in torch;
* waiting is a watch; after a round forms, one more watch on the next round's join records
  lets ``num_nodes_waiting()`` answer without a request while nobody waits;
* ``set_closed()`` / ``shutdown()`` close the whole rendezvous, as torch's do: later joins raise
  ``RendezvousClosedError``, and nodes waiting in the open round are woken with it;
* the store handed to torchrun is :class:`~elastic.rendezvous.c10d_store.EtcdC10dStore`, one
  prefix per round, whose counters have no hot key either;
* each round's workers get a store of their own (``use_agent_store`` is False: worker rank 0
  hosts it on the port its node picked when joining).  torch's default, one agent TCPStore
  shared by every round, breaks torchrun's own ``--max-restarts`` for gloo workers (restarted
  workers read the previous attempt's addresses; see :mod:`elastic.rendezvous.backend`), and
  torch offers the fix only as ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: this handler needs none.

``--rdzv-conf`` keys: torch's ``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``keep_alive_interval``, ``keep_alive_max_attempt`` (``heartbeat_timeout`` is accepted and
bounds one keep-alive request), plus this project's etcd keys (see
:func:`elastic.rendezvous.backend.store_from_params`).
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from elastic.control.keys import BACKEND_NAME, DEFAULT_KEY_PREFIX, RunKeys
from elastic.control.lease import LeaseKeeper
from elastic.control.store import EtcdStore, StoreError
from elastic.rendezvous.c10d_store import EtcdC10dStore
from elastic.rendezvous.round import LateForRound, LeaseLost, NodeRecord, RoundAttempt, RoundRecord, RoundSpec

_LOCAL_IDS = itertools.count()


@dataclass(frozen=True, kw_only=True)
class BarrierSettings:
    """Timings and bounds of one rendezvous (torch's defaults and names)."""

    run_id: str
    """torchrun's ``--rdzv-id``: all keys live under this run's prefix."""
    min_nodes: int
    max_nodes: int
    key_prefix: str = DEFAULT_KEY_PREFIX
    """Root of every key (``<key_prefix>/runs/<run_id>/rdzv/...``)."""
    join_timeout_s: float = 600.0
    """A join that has not formed a round by then raises RendezvousTimeoutError."""
    last_call_timeout_s: float = 30.0
    """After ``min_nodes`` have joined, how long the round waits for more (see round.py)."""
    close_timeout_s: float = 30.0
    """Accepted for torch's contract; closing is one write here."""
    keep_alive_interval_s: float = 5.0
    """How often this node's lease is refreshed."""
    keep_alive_max_attempt: int = 3
    """Refreshes that may fail before the lease -- and the node -- is gone."""

    @property
    def lease_ttl_s(self) -> int:
        return max(2, math.ceil(self.keep_alive_interval_s * self.keep_alive_max_attempt))

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> BarrierSettings:
        def seconds(name: str, default: float) -> float:
            value = params.get_as_int(name)
            if value is not None and value <= 0:
                raise ValueError(f"--rdzv-conf {name}: must be a positive number of seconds")
            return float(value) if value is not None else default

        return cls(run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                   key_prefix=params.get("key_prefix", DEFAULT_KEY_PREFIX) or DEFAULT_KEY_PREFIX,
                   join_timeout_s=seconds("join_timeout", 600), last_call_timeout_s=seconds("last_call_timeout", 30),
                   close_timeout_s=seconds("close_timeout", 30),
                   keep_alive_interval_s=seconds("keep_alive_interval", 5),
                   keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3)


class BarrierRendezvousHandler(RendezvousHandler):
    """torchrun's ``RendezvousHandler`` over the per-node-record barrier (see the module docstring)."""

    def __init__(self, store: EtcdStore, settings: BarrierSettings, local_addr: str | None = None) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store, self._settings = store, settings
        self._keys = RunKeys.of(settings.key_prefix, settings.run_id)
        self._addr = local_addr or socket.getfqdn()
        self._local_id = next(_LOCAL_IDS)
        self._port = 0  # picked afresh at every join (see NodeRecord.port)
        self._lease: LeaseKeeper | None = None
        self._lock = threading.Lock()
        self._round: RoundRecord | None = None
        self._waiting: _NextRoundWatch | None = None
        atexit.register(_release_at_exit, weakref.ref(self))

    # -- torch API -----------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # workers' own store each round (module docstring)

    @property
    def round(self) -> int | None:
        """The round this node last formed (None before the first)."""
        return self._round.round if self._round else None

    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_waiting()
        deadline = time.monotonic() + self._settings.join_timeout_s
        try:
            record = self._form(deadline)
        except StoreError as exc:
            raise RendezvousConnectionError(f"etcd failed during the rendezvous: {exc}") from exc
        self._round = record
        rank = record.nodes.index(self._node().node_id)
        store = EtcdC10dStore(self._store, self._keys.c10d_round(record.round))
        return RendezvousInfo(store, rank, len(record.nodes),
                              RendezvousStoreInfo(record.master_addr, record.master_port))

    def is_closed(self) -> bool:
        return self._guard(lambda: self._store.get(self._keys.rdzv_closed) is not None)

    def set_closed(self) -> None:
        """Close the rendezvous for every node; wake the nodes waiting in the open round."""
        def close() -> None:
            self._store.put(self._keys.rdzv_closed, str(time.time()))
            latest = self._store.get(self._keys.rdzv_latest)
            open_round = int(latest.value) + 1 if latest is not None else 0
            self._store.put(self._keys.rdzv_ctl(open_round, "closed"), "1")

        self._guard(close)

    def num_nodes_waiting(self) -> int:
        """Nodes joined to the next round; no request is sent until the watch has seen one.

        The watch starts at the first call (torchrun's monitor loop calls this every interval),
        from the revision of the round record, so no join since the round formed is missed; that
        first call also counts once, so its answer does not wait for the watch."""
        if self._round is None:
            return 0
        joins = self._keys.rdzv_joins(self._round.round + 1)
        first = self._waiting is None
        if first:
            self._waiting = _NextRoundWatch(self._store, joins, self._round.revision + 1)
        if not (first or self._waiting.fired.is_set()):
            return 0
        return self._guard(lambda: self._store.count_prefix(joins))

    def shutdown(self) -> bool:
        self._stop_waiting()
        try:
            self.set_closed()
        except RendezvousError:
            return False
        finally:
            self._release()
        return True

    # -- forming ---------------------------------------------------------------------
    def _node(self) -> NodeRecord:
        return NodeRecord(self._addr, os.getpid(), self._local_id, self._port)

    def _form(self, deadline: float) -> RoundRecord:
        target = self._first_round()
        self._port = get_free_port()
        while True:
            lease = self._ensure_lease()
            spec = RoundSpec(keys=self._keys, round=target, min_nodes=self._settings.min_nodes,
                             max_nodes=self._settings.max_nodes, last_call_s=self._settings.last_call_timeout_s,
                             deadline=deadline, lease_ttl_s=float(self._settings.lease_ttl_s))
            try:
                return RoundAttempt(self._store, spec, self._node(), lease.lease_id, lease.lost).run()
            except LateForRound as late:
                target = late.next_round
            except LeaseLost:
                continue  # a fresh lease, the same round

    def _first_round(self) -> int:
        """The round after this node's last one (0 at first): optimistic, with no read.  If it has
        formed already, the failed join reads the newest round and the node moves past it."""
        return self._round.round + 1 if self._round is not None else 0

    def _ensure_lease(self) -> LeaseKeeper:
        with self._lock:
            if self._lease is None or self._lease.lost.is_set():
                self._lease = LeaseKeeper(self._store, self._settings.lease_ttl_s)
            return self._lease

    # -- teardown ----------------------------------------------------------------------
    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.close()
            self._waiting = None

    def _release(self) -> None:
        """Give up the lease: this node's join records vanish at once instead of at its expiry."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self._store.stop_retrying()
            lease.close(revoke=True)

    @staticmethod
    def _guard(fn):
        try:
            return fn()
        except StoreError as exc:
            raise RendezvousConnectionError(f"etcd failed: {exc}") from exc


class _NextRoundWatch:
    """Sets ``fired`` at the first join record of the next round (one watch, no polling)."""

    def __init__(self, store: EtcdStore, joins: str, start_revision: int) -> None:
        self.fired = threading.Event()
        self._stream = store.watch(joins, start_revision, prefix=True, idle_s=60.0)
        self._thread = threading.Thread(target=self._run, name="rdzv-next-round", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.fired.is_set():
            try:
                if self._stream.get(60.0):
                    self.fired.set()
            except Exception:  # noqa: BLE001 - a broken watch must not hide a waiting node
                self.fired.set()
        self._stream.close()

    def close(self) -> None:
        self.fired.set()
        self._stream.close()


def _release_at_exit(ref: weakref.ref) -> None:
    """An agent that exits without shutdown() (a signal) leaves at once rather than at lease expiry."""
    handler = ref()
    if handler is not None:
        handler._release()


def create_barrier_handler(params: RendezvousParameters) -> BarrierRendezvousHandler:
    """Creator registered with torchrun as ``etcd3`` (via :mod:`elastic.rendezvous.plugin`)."""
    from elastic.rendezvous.backend import store_from_params

    return BarrierRendezvousHandler(store_from_params(params), BarrierSettings.from_params(params), params.local_addr)
