"""A watch that survives the loss of an etcd member: every event from a revision on, in order.

etcd3gw's own watch dies silently when its server goes away (its reader thread swallows the
error and the iterator blocks forever; shared/reference/etcd-probe.md), so the store does not use
it.  :class:`WatchStream` holds one streaming ``/v3/watch`` request from a reader thread.  When
the stream breaks (member killed, connection idle for ``idle_s``), the thread opens a new one --
on the next endpoint if connecting fails -- from the revision after the last event it delivered,
so a failover loses and repeats nothing.  An idle stream costs one request per ``idle_s``.

One stream may watch several ranges (:meth:`WatchStream.of_keys`): the gateway's ``/v3/watch``
reads every create request in the body, so the records an agent watches in steady state (epoch,
its exclusion, stop, ...) cost one stream, not one each.  Each range resumes from the revision
after its own last event: etcd orders events within one watcher, not across the watchers of a stream.

The gateway does not always read every create request, though: it answers the first ones while it
still reads the body, and Go's HTTP/1 server may close a request body once the response is flushed
(measured, 4-node DiT runs on a loaded host: 30 of 130 connects of an agent's 5-key stream created
4 watchers, the last key, an arbitration request, then never delivered; on an idle host 0 of 152).
So a connect whose ``created`` answers do not all come within ``create_timeout_s`` is dropped and
made again, the ranges it missed first in the body (:attr:`WatchStream.incomplete_creates` counts
them).  Nothing is lost meanwhile: every range resumes from its own revision.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import requests
import urllib3

from elastic.control.codec import WatchEvent, b64, event_from_json, prefix_end

if TYPE_CHECKING:
    from elastic.control.store import EtcdStore

_STREAM_ERRORS = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
                  requests.exceptions.Timeout, urllib3.exceptions.HTTPError, OSError, ValueError)


class WatchCompacted(RuntimeError):
    """The start revision was compacted away: the caller must re-read and watch again."""


class WatchStream:
    """Batches of :class:`WatchEvent` on ``key`` (or every key under it) from ``start_revision``."""

    def __init__(self, store: EtcdStore, key: str, start_revision: int, prefix: bool = False,
                 idle_s: float = 30.0, range_end: str | None = None,
                 ranges: list[tuple[str, str | None]] | None = None,
                 on_events: Callable[[list[WatchEvent]], None] | None = None) -> None:
        self._store = store
        # on_events: each batch goes to it on the reader thread, not to get() (a failure still does).
        # A second thread to hand batches on was a second wake-up per event for every agent: with
        # 1,024 simulated agents on 2 cores, the pushed fault's median agent heard it 0.6 s late.
        self._on_events = on_events
        if ranges is None:
            ranges = [(key, range_end)]
        # Each range as etcd takes it (base64; no end: the key alone) and as bytes, to place events.
        self._ranges: list[tuple[str, str | None]] = []
        self._bounds: list[tuple[bytes, bytes | None]] = []
        for low, high in ranges:
            end = b64(high) if high is not None else (prefix_end(low) if prefix else None)
            self._ranges.append((b64(low), end))
            self._bounds.append((low.encode(), base64.b64decode(end) if end is not None else None))
        self._next = [start_revision] * len(ranges)  # per range: the revision to resume from
        self._order = list(range(len(ranges)))  # the ranges' create requests, in body order
        self._created = 0  # created answers on the current connect (watch ids follow body order)
        self._short = False  # the current connect was dropped for a missing created answer
        self.create_timeout_s = 1.0
        """How long a connect waits for every range's ``created`` answer (doubled after each short
        connect, up to ``idle_s``: a loaded etcd answering slowly is not reconnected without end)."""
        self._create_wait = 0.0  # the current wait (0: not yet set from create_timeout_s)
        self.incomplete_creates = 0
        self._idle_s = idle_s
        self._queue: queue.Queue[list[WatchEvent] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._resp: urllib3.BaseHTTPResponse | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{key[-24:]}", daemon=True)
        self._thread.start()

    @classmethod
    def of_keys(cls, store: EtcdStore, keys: list[str], start_revision: int, idle_s: float = 30.0,
                on_events: Callable[[list[WatchEvent]], None] | None = None) -> WatchStream:
        """One stream over several single keys."""
        return cls(store, keys[0], start_revision, idle_s=idle_s, ranges=[(k, None) for k in keys],
                   on_events=on_events)

    @property
    def next_revision(self) -> int:
        return min(self._next)

    def get(self, timeout: float) -> list[WatchEvent] | None:
        """The next batch of events, or None if none came within ``timeout`` seconds."""
        try:
            item = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._queue.put(item)  # the stream stays failed for every later call
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        _abort(self._resp)

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reader thread ------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            index = self._store.endpoint_index()
            try:
                self._stream(index)
            except WatchCompacted as exc:
                self._queue.put(exc)
                return
            except _STREAM_ERRORS as exc:
                if self._stop.is_set():
                    return
                short, self._short = self._short, False
                if not (short or _idle(exc)):
                    self._store.failover(index)
                    time.sleep(random.uniform(0.01, 0.1))
            except Exception as exc:  # noqa: BLE001 - an unusable watch is reported, never swallowed
                self._queue.put(exc)
                return

    def _stream(self, index: int) -> None:
        client = self._store.stream_client(index)
        self._store.requests_sent += 1
        meter = self._store.meter
        if meter is not None:
            meter.watch()
        body = "".join(json.dumps({"create_request": self._create(i)}) for i in self._order).encode()
        self._created = 0
        resp = client.stream("/watch", body, self._store.request_timeout, self._idle_s)
        self._resp = resp
        watchdog = None
        try:
            if resp.status != 200:
                raise requests.exceptions.ConnectionError(f"watch: HTTP {resp.status} {resp.read()[:200]!r}")
            watchdog = _ALARMS.after(self._create_wait or self.create_timeout_s, self._check_created, resp)
            self._read(resp, meter)
        finally:
            if watchdog is not None:
                _ALARMS.cancel(watchdog)
            _close(resp)

    def _check_created(self, resp: urllib3.BaseHTTPResponse) -> None:
        """Drop a connect that did not create every range's watcher (see the module docstring)."""
        created = self._created
        if created >= len(self._ranges) or self._stop.is_set():
            self._create_wait = self.create_timeout_s
            return
        self.incomplete_creates += 1
        self._create_wait = min(2 * (self._create_wait or self.create_timeout_s), self._idle_s)
        self._order = self._order[created:] + self._order[:created]  # the missed ones first
        self._short = True
        _shutdown(resp)  # the reader's next read fails: it connects again

    def _read(self, resp: urllib3.BaseHTTPResponse, meter: Any) -> None:
        buffer = b""
        for chunk in resp.read_chunked(decode_content=False):
            if self._stop.is_set():
                return
            if meter is not None:
                meter.read(len(chunk))
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    self._handle(json.loads(line))
        raise requests.exceptions.ChunkedEncodingError("watch stream ended")

    def _create(self, i: int) -> dict[str, Any]:
        key, end = self._ranges[i]
        body: dict[str, Any] = {"key": key, "start_revision": self._next[i]}
        if end is not None:
            body["range_end"] = end
        return body

    def _handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise requests.exceptions.ConnectionError(f"watch: {message['error']}")
        result = message.get("result", {})
        if result.get("created"):
            self._created += 1
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise WatchCompacted(f"revision {self.next_revision} compacted (now {result['compact_revision']})")
        events = [event_from_json(e) for e in result.get("events") or []]
        if events:
            for event in events:
                self._advance(event)
            self._deliver(events)

    def _deliver(self, events: list[WatchEvent]) -> None:
        if self._on_events is None:
            self._queue.put(events)
            return
        try:
            self._on_events(events)
        except Exception as exc:  # noqa: BLE001 - the consumer's failure is reported by get(), never swallowed
            self._queue.put(exc)

    def _advance(self, event: WatchEvent) -> None:
        key = event.key.encode()
        for i, (low, end) in enumerate(self._bounds):
            if key == low or (end is not None and low <= key and (key < end or end == b"\0")):
                self._next[i] = max(self._next[i], event.mod_revision + 1)


class _Alarms:
    """Runs each due callback on one daemon thread per process (a connect's created-check).

    A ``threading.Timer`` per connect was one more thread started and woken per watch: in the
    2,048-participant rendezvous (128 participant threads per process on 2 cores) that is 2,048
    threads for a check that almost never fires.  Callbacks must be short: they run in turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[list[Any]] = []  # [due, seq, fn, args]; fn None once cancelled
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> list[Any]:
        entry = [time.monotonic() + delay, next(self._seq), fn, args]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="watch-alarms", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:
                self._cond.notify()
        return entry

    @staticmethod
    def cancel(entry: list[Any]) -> None:
        entry[2] = None  # dropped when due (the heap is not searched)

    def _run(self) -> None:
        while True:
            fn, args = self._next_due()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one failed check must not stop the others
                pass

    def _next_due(self) -> tuple[Callable[..., None], tuple[Any, ...]]:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2] is None:
                    heapq.heappop(self._heap)  # cancelled: almost every check is (a wake-up each was most of this thread's CPU)
                wait = self._heap[0][0] - time.monotonic() if self._heap else None
                if wait is not None and wait <= 0:
                    _, _, fn, args = heapq.heappop(self._heap)
                    return fn, args
                self._cond.wait(wait)

    def _after_fork(self) -> None:
        self._cond, self._heap, self._thread = threading.Condition(), [], None  # the thread did not fork


_ALARMS = _Alarms()
os.register_at_fork(after_in_child=_ALARMS._after_fork)


def _idle(exc: BaseException) -> bool:
    """A read timeout of an established stream: reconnect to the same member."""
    text = repr(exc)
    return "Read timed out" in text or "ReadTimeout" in text


def _shutdown(resp: urllib3.BaseHTTPResponse) -> None:
    """Wake a reader blocked on ``resp``: closing a socket from another thread does not."""
    try:
        sock = resp._fp.fp.raw._sock  # type: ignore[attr-defined]
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


def _close(resp: urllib3.BaseHTTPResponse) -> None:
    """Close a finished stream and hand its (closed) connection back: the client's pool then
    connects afresh for the next stream."""
    try:
        resp.close()
    finally:
        resp.release_conn()


def _abort(resp: urllib3.BaseHTTPResponse | None) -> None:
    """Wake a reader blocked on ``resp`` and close it."""
    if resp is None:
        return
    _shutdown(resp)
    try:
        resp.close()
    except Exception:  # noqa: BLE001 - best effort on teardown
        pass
