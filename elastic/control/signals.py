"""The run-wide signals a running agent acts on, kept current by one watch stream.

A running agent must notice promptly a new epoch (a peer failed), its node's exclusion and the
run's stop.  It used to read the three in one transaction every ``epoch_poll_s`` (0.25 s): 4
requests/s per agent, ~4,100/s at 1,024 nodes, for records that change a few times in a run.
:class:`SignalWatch` reads them once, then watches the three keys over one stream
(:meth:`~elastic.control.store.EtcdStore.watch_keys`), and answers from memory.  An idle run then
costs etcd one reconnect per agent per ``idle_s``: the stream's read timeout, which is what tells a
silently dead connection (a member's host gone without a reset) from a quiet run; at 30 s that is
~34 requests/s at 1,024 nodes.

A stream that breaks (its member killed or restarted) reconnects by itself from the revision after
its last event (:mod:`elastic.control.watch`).  One that cannot resume (its revision compacted)
or fails otherwise is dropped: the next :meth:`SignalWatch.current` reads the records again and
opens a new stream, at most once per ``retry_s``, so an unreachable etcd is not hammered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic.control.runstate import RunSignals, RunState, decode
from elastic.control.store import KeyValue, WatchEvent


class _Stream(Protocol):
    def get(self, timeout: float) -> list[WatchEvent] | None: ...
    def close(self) -> None: ...


class SignalWatch:
    """``current()``: this node's :class:`RunSignals`, from one watch stream (see the module docstring)."""

    def __init__(self, state: RunState, node_id: str, idle_s: float = 30.0, retry_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 on_fault: Callable[[dict[str, Any]], None] | None = None, arbitration: bool = False,
                 on_note: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.state = state
        self.node_id = node_id
        self.arbitration = arbitration
        self.heard_ts = 0.0
        self.idle_s = idle_s
        self.retry_s = retry_s
        self.clock = clock
        self.keys = state.signal_keys(node_id, pushed_fault=on_fault is not None, arbitration=arbitration)
        self._records: dict[str, KeyValue | None] = dict.fromkeys(self.keys)
        self._stream: _Stream | None = None
        self._next_start = 0.0
        self.restarts = 0  # streams opened after the first (a compaction or a broken stream)
        # A pushed fault is acted on as its event arrives (a thread reads the stream), not at the
        # supervisor's next look: survivors blocked in a collective wait for it.
        self.on_fault = on_fault
        self._fault_revision = 0
        # A round note (a plan closed in place, a new c10d store's address) goes the same way: the
        # agent's round waits for it (elastic.agent.roundnotes).  Only with on_fault (its key is watched then).
        self.on_note = on_note
        self._note_revision = 0
        self._closed = False
        self._lock = threading.Lock()
        self._applied: dict[str, int] = {}  # key -> the revision its record is as of

    def current(self) -> RunSignals:
        """The signals now.  Reads etcd only to (re)start the stream; raises StoreError when that
        read fails (the caller keeps the attempt running, as through any etcd outage)."""
        if self._stream is None and self.clock() >= self._next_start:
            self._start()
        if self._stream is not None:
            self._drain()
        epoch, excluded, stop = (self._records[k] for k in self.keys[:3])
        return self.state.signals_of(epoch, excluded, stop)  # an exclusion's expiry is judged now

    def arbitration_request(self) -> tuple[int, dict[str, Any]] | None:
        """The newest arbitration asked of this node (replay verification): (its revision, the
        record), as of the last :meth:`current`; None when there is none or it is not watched."""
        record = self._records.get(self.state.keys.sdc_arbitrate(self.node_id)) if self.arbitration else None
        value = decode(record) if record is not None else None
        return (record.mod_revision, value) if record is not None and value else None

    def _start(self) -> None:
        self._next_start = self.clock() + self.retry_s
        records, revision = self.state.signal_records(self.node_id, pushed_fault=self.on_fault is not None,
                                                      arbitration=self.arbitration)
        for key, record in zip(self.keys, records):
            self._applied[key] = revision
            self._set(key, record)
        # With on_fault, the stream's reader thread applies each batch as it comes: a pushed fault is
        # acted on at once, not at the supervisor's next look (survivors blocked in a collective wait for it).
        on_events = self._apply_batch if self.on_fault is not None else None
        self._stream = self.state.store.watch_keys(self._by_urgency(), revision + 1, idle_s=self.idle_s,  # type: ignore[attr-defined]
                                                   on_events=on_events)

    def _by_urgency(self) -> list[str]:
        """The watched keys in the order their create requests go in the stream's body: the pushed
        fault and the round note first.  The gateway answers a body's first creates at once but may
        create the last ones late or never (:mod:`elastic.control.watch`), and a range not created is
        caught up only by a reconnect a second or more later.  Measured (benchmarks/control_plane.py,
        64 nodes, a loaded host): with the round note fifth of five, 20 of 64 agents' streams dropped a
        connect for a missing create, and the last agent heard the in-place plan 1.04 s after the
        fault while the median heard it in 0.14 s."""
        urgent = [k for k in (self.state.keys.pushed_fault, self.state.keys.round_note) if k in self.keys]
        return urgent + [k for k in self.keys if k not in urgent]

    def _apply_batch(self, batch: list[WatchEvent]) -> None:
        """A batch from the stream's reader thread (a failed stream is left to :meth:`current` to
        re-establish).  This replaced a thread of its own that polled the stream every 0.5 s."""
        if not self._closed:
            for event in batch:
                self._apply(event)

    def _drain(self) -> None:
        assert self._stream is not None
        try:
            while (batch := self._stream.get(0)) is not None:
                for event in batch:
                    self._apply(event)
        except Exception:  # noqa: BLE001 - compacted or broken for good: read again, watch anew
            self._drop_stream()  # not close(): that ends the fault pump for good (it did, until 2026-12)
            self.restarts += 1
            if self.clock() >= self._next_start:
                self._start()
                self._drain()

    def _apply(self, event: WatchEvent) -> None:
        """One event, unless the record it changes is already as new (the pump may apply a batch of
        the old stream after a restart read the records afresh)."""
        if event.key not in self._records or event.mod_revision <= self._applied.get(event.key, 0):
            return
        self._applied[event.key] = event.mod_revision
        self._set(event.key, KeyValue(event.key, event.value, event.mod_revision, 0, 0, 0)
                  if event.value is not None else None)

    def _set(self, key: str, record: KeyValue | None) -> None:
        self._records[key] = record
        if record is not None and self.arbitration and key == self.keys[-1]:
            self.heard_ts = time.time()  # when the watch delivered the newest arbitration (its event says)
        if key == self.state.keys.pushed_fault and record is not None and self.on_fault is not None:
            if self._newer(record, "_fault_revision"):
                fault = decode(record)
                if fault:
                    self.on_fault(fault)
        elif key == self.state.keys.round_note and record is not None and self.on_note is not None:
            if self._newer(record, "_note_revision"):
                note = decode(record)
                if note:
                    self.on_note(note)

    def _newer(self, record: KeyValue, seen: str) -> bool:
        """Whether ``record`` is newer than the revision held in attribute ``seen`` (then it is): the
        start's read and the stream, or two readers, see the same put."""
        with self._lock:
            if record.mod_revision <= getattr(self, seen):
                return False
            setattr(self, seen, record.mod_revision)
            return True

    def close(self) -> None:
        self._closed = True
        self._drop_stream()

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __enter__(self) -> SignalWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

