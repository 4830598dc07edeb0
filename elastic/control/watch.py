"""A watch that survives the loss of an etcd member: every event from a revision on, in order.

etcd3gw's own watch dies silently when its server goes away (its reader thread swallows the
error and the iterator blocks forever; shared/reference/etcd-probe.md), so the store does not use
it.  :class:`WatchStream` holds one streaming ``/v3/watch`` request from a reader thread.  When
the stream breaks (member killed, connection idle for ``idle_s``), the thread opens a new one --
on the next endpoint if connecting fails -- from the revision after the last event it delivered,
so a failover loses and repeats nothing.  An idle stream costs one request per ``idle_s``.
"""

from __future__ import annotations

import json
import queue
import random
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import requests

from elastic.control.codec import WatchEvent, b64, event_from_json, prefix_end

if TYPE_CHECKING:
    from elastic.control.store import EtcdStore

_STREAM_ERRORS = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
                  requests.exceptions.Timeout, OSError, ValueError)


class WatchCompacted(RuntimeError):
    """The start revision was compacted away: the caller must re-read and watch again."""


class WatchStream:
    """Batches of :class:`WatchEvent` on ``key`` (or every key under it) from ``start_revision``."""

    def __init__(self, store: EtcdStore, key: str, start_revision: int, prefix: bool = False,
                 idle_s: float = 30.0, range_end: str | None = None) -> None:
        self._store = store
        self._body: dict[str, Any] = {"key": b64(key)}
        if prefix or range_end is not None:
            self._body["range_end"] = b64(range_end) if range_end is not None else prefix_end(key)
        self.next_revision = start_revision
        self._idle_s = idle_s
        self._queue: queue.Queue[list[WatchEvent] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._resp: requests.Response | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{key[-24:]}", daemon=True)
        self._thread.start()

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
                if not _idle(exc):
                    self._store.failover(index)
                    time.sleep(random.uniform(0.01, 0.1))
            except Exception as exc:  # noqa: BLE001 - an unusable watch is reported, never swallowed
                self._queue.put(exc)
                return

    def _stream(self, index: int) -> None:
        session, base = self._store.session_for(index)
        self._store.requests_sent += 1
        meter = self._store.meter
        if meter is not None:
            meter.watch()
        body = {"create_request": {**self._body, "start_revision": self.next_revision}}
        timeout = (self._store.request_timeout, self._idle_s)
        with session.post(base + "/watch", json=body, stream=True, timeout=timeout) as resp:
            self._resp = resp
            if resp.status_code != 200:
                raise requests.exceptions.ConnectionError(f"watch: HTTP {resp.status_code} {resp.text[:200]}")
            buffer = b""
            for chunk in resp.iter_content(chunk_size=None):
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

    def _handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise requests.exceptions.ConnectionError(f"watch: {message['error']}")
        result = message.get("result", {})
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise WatchCompacted(f"revision {self.next_revision} compacted (now {result['compact_revision']})")
        events = [event_from_json(e) for e in result.get("events") or []]
        if events:
            self.next_revision = max(e.mod_revision for e in events) + 1
            self._queue.put(events)


def _idle(exc: BaseException) -> bool:
    """A read timeout of an established stream: reconnect to the same member."""
    text = repr(exc)
    return "Read timed out" in text or "ReadTimeout" in text


def _abort(resp: requests.Response | None) -> None:
    """Wake a reader blocked on ``resp``: closing a socket from another thread does not."""
    if resp is None:
        return
    try:
        sock = resp.raw._fp.fp.raw._sock  # type: ignore[union-attr]
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass
    try:
        resp.close()
    except Exception:  # noqa: BLE001 - best effort on teardown
        pass
