"""Waiting out an etcd outage where the agent cannot go on without etcd, for a bounded time.

Registration, the exclusion check and the start of each attempt need etcd (training itself
does not: a running attempt keeps training through an outage).  :class:`EtcdWait` retries such
a step while etcd is unreachable, for at most ``agent.etcd_wait_s`` in all, and then raises
:class:`EtcdUnreachable` with the one line the agent leaves with: ``etcd at HOST:PORT is
unreachable ...``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elastic.common.events import EventLog
from elastic.control.store import StoreUnavailable

T = TypeVar("T")


class EtcdUnreachable(RuntimeError):
    """etcd stayed unreachable for longer than the agent may wait; ``str()`` is one line."""


class EtcdWait:
    def __init__(self, endpoint: str, limit_s: float, events: EventLog, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.limit_s = limit_s
        self.events = events
        self.stop = stop
        self.clock = clock

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while etcd is unreachable; EtcdUnreachable once ``limit_s`` has passed."""
        started = self.clock()
        announced = False
        while True:
            try:
                return fn()
            except StoreUnavailable as exc:
                waited = self.clock() - started
                if waited >= self.limit_s or self.stop.is_set():
                    raise EtcdUnreachable(
                        f"etcd at {self.endpoint} is unreachable: no answer to {what} for {waited:.0f}s "
                        f"(agent.etcd_wait_s={self.limit_s:g}); last error: {_short(exc)}") from None
                if not announced:
                    self.events.emit("agent.etcd_waiting", op=what, endpoint=self.endpoint,
                                     limit_s=self.limit_s, error=str(exc))
                    announced = True
                self.stop.wait(min(1.0, max(self.limit_s - waited, 0.0)))


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
