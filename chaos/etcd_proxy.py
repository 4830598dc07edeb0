"""An interposed TCP proxy in front of etcd: added latency, dropped connections, a full outage.

This machine's kernel has no ``sch_netem``, so latency cannot come from ``tc``; the nodes instead
reach etcd through this proxy (``--etcd-endpoint`` names it) and the chaos tool turns its knobs
while the run goes on:

* ``latency_s``: every chunk in either direction is delivered that much later (a queue per
  direction keeps the order and does not cap throughput the way a per-chunk sleep would);
* ``drop_rate``: each new connection, and each forwarded chunk, is cut (both sides closed) with
  this probability; a TCP stream cannot lose bytes and stay a stream, so "drop" means a reset;
* ``blackhole``: new connections are accepted and never answered, existing ones stall (an etcd
  that is up but unreachable).

It uses asyncio on one thread of its own (no library: the standard library does all of it).  Its
listening socket can be made in another network namespace (:mod:`chaos.netns`), so nodes in
namespaces reach an etcd that listens on this host's loopback only.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_CHUNK = 65536


@dataclass
class ProxyKnobs:
    latency_s: float = 0.0
    drop_rate: float = 0.0
    blackhole: bool = False


class EtcdProxy:
    def __init__(self, upstream: str, listen: socket.socket | None = None, seed: int = 0) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.knobs = ProxyKnobs()
        self._rng = random.Random(seed)
        self._sock = listen or _loopback_listener()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.dropped = 0

    @property
    def endpoint(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> EtcdProxy:
        self._thread.start()
        self._call(self._serve)
        return self

    def set(self, latency_s: float | None = None, drop_rate: float | None = None,
            blackhole: bool | None = None) -> None:
        if latency_s is not None:
            self.knobs.latency_s = max(float(latency_s), 0.0)
        if drop_rate is not None:
            self.knobs.drop_rate = min(max(float(drop_rate), 0.0), 1.0)
        if blackhole is not None:
            self.knobs.blackhole = bool(blackhole)

    def reset(self) -> None:
        self.knobs = ProxyKnobs()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._sock.close()

    # -- on the proxy's thread --------------------------------------------------------
    def _call(self, factory: Callable[[], object], timeout: float = 10.0) -> None:
        asyncio.run_coroutine_threadsafe(factory(), self._loop).result(timeout)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self._sock)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._conns):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._conns.add(writer)
        try:
            if self._drop() or await self._held(writer):
                return
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            self._conns.discard(writer)
            return
        self._conns.add(up_writer)
        pair = (writer, up_writer)
        await asyncio.gather(self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair),
                             return_exceptions=True)
        for w in (writer, up_writer):
            w.close()
            self._conns.discard(w)

    async def _held(self, writer: asyncio.StreamWriter) -> bool:
        """While blackholed, a new connection waits unanswered; True if it was closed meanwhile."""
        while self.knobs.blackhole:
            if writer.is_closing():
                return True
            await asyncio.sleep(0.05)
        return False

    def _drop(self) -> bool:
        if self.knobs.drop_rate and self._rng.random() < self.knobs.drop_rate:
            self.dropped += 1
            return True
        return False

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, writer))
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if self._drop():  # a reset: both sides lose the connection at once
                    for w in pair:
                        w.close()
                    break
                await queue.put((time.monotonic() + self.knobs.latency_s, data))
        finally:
            await queue.put((0.0, b""))
            await sender

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            while self.knobs.blackhole:
                await asyncio.sleep(0.05)
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                break
        if writer.can_write_eof() and not writer.is_closing():
            try:
                writer.write_eof()
            except OSError:
                pass


def _loopback_listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    return sock
