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

import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic.control.runstate import RunSignals, RunState
from elastic.control.store import KeyValue, WatchEvent


class _Stream(Protocol):
    def get(self, timeout: float) -> list[WatchEvent] | None: ...
    def close(self) -> None: ...


class SignalWatch:
    """``current()``: this node's :class:`RunSignals`, from one watch stream (see the module docstring)."""

    def __init__(self, state: RunState, node_id: str, idle_s: float = 30.0, retry_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.node_id = node_id
        self.idle_s = idle_s
        self.retry_s = retry_s
        self.clock = clock
        self.keys = state.signal_keys(node_id)
        self._records: dict[str, KeyValue | None] = dict.fromkeys(self.keys)
        self._stream: _Stream | None = None
        self._next_start = 0.0
        self.restarts = 0  # streams opened after the first (a compaction or a broken stream)

    def current(self) -> RunSignals:
        """The signals now.  Reads etcd only to (re)start the stream; raises StoreError when that
        read fails (the caller keeps the attempt running, as through any etcd outage)."""
        if self._stream is None and self.clock() >= self._next_start:
            self._start()
        if self._stream is not None:
            self._drain()
        epoch, excluded, stop = (self._records[k] for k in self.keys)
        return self.state.signals_of(epoch, excluded, stop)  # an exclusion's expiry is judged now

    def _start(self) -> None:
        self._next_start = self.clock() + self.retry_s
        records, revision = self.state.signal_records(self.node_id)
        self._records = dict(zip(self.keys, records))
        self._stream = self.state.store.watch_keys(self.keys, revision + 1, idle_s=self.idle_s)  # type: ignore[attr-defined]

    def _drain(self) -> None:
        assert self._stream is not None
        try:
            while (batch := self._stream.get(0)) is not None:
                for event in batch:
                    self._apply(event)
        except Exception:  # noqa: BLE001 - compacted or broken for good: read again, watch anew
            self.close()
            self.restarts += 1
            if self.clock() >= self._next_start:
                self._start()
                self._drain()

    def _apply(self, event: WatchEvent) -> None:
        if event.key in self._records:
            self._records[event.key] = (KeyValue(event.key, event.value, event.mod_revision, 0, 0, 0)
                                        if event.value is not None else None)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __enter__(self) -> SignalWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

