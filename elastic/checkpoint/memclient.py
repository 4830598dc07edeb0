"""The client side of the agent's memory store (:mod:`elastic.checkpoint.memstate`).

A worker talks to its own node's agent over loopback; an agent talks to its buddy node's agent
(``peer=True``) to replicate snapshots.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any

from elastic.checkpoint import checksum, shm
from elastic.checkpoint.memstate import (
    Chunk,
    EntryMeta,
    GenerationFaulted,
    MemStateCorrupt,
    MemStateRejected,
    MemStateUnavailable,
    SnapMeta,
    _read_exact,
    _read_line,
    _send,
    sha256_bytes,
)
from elastic.common.env import MEMSTATE_ADDR_ENV, MEMSTATE_TOKEN_ENV


def _request(sock: socket.socket, header: dict, *chunks: Chunk) -> dict:
    """Send a request and read the reply header.  A server that refuses an upload answers before
    reading its body and closes: the rest of the send then fails, but the answer is there to read."""
    try:
        _send(sock, header, *chunks)
    except (BrokenPipeError, ConnectionResetError) as exc:
        try:
            return _read_line(sock)
        except (OSError, ValueError, ConnectionError):
            raise exc from None
    return _read_line(sock)


class MemStateClient:
    """The worker side: push and fetch one slot's entry."""

    def __init__(self, addr: str, token: str, timeout_s: float = 60.0, peer: bool = False,
                 keep_alive: bool = False) -> None:
        host, _, port = addr.rpartition(":")
        if not peer and host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"{MEMSTATE_ADDR_ENV}: a worker's cache is its own node's, got host {host!r}")
        self.addr = (host if peer else "127.0.0.1", int(port))
        self.token = token
        self.timeout_s = timeout_s
        # keep_alive: snapshot pushes (one per step) reuse one connection.  A connection per push
        # cost a connect here and an accept and a new thread in the store, at every hop (worker ->
        # agent -> buddy).  The lock serializes pushes that share it (an agent's forwarding threads).
        self.keep_alive = keep_alive
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        # A worker's pushes of shared-memory snapshots go over the agent's Unix socket (elastic.checkpoint.shm).
        self.shared = not peer and shm.supported()
        self._usock: socket.socket | None = None

    def close(self) -> None:
        """Close the kept connections (a later push opens new ones)."""
        for sock in (self._sock, self._usock):
            if sock is not None:
                sock.close()
        self._sock = self._usock = None

    @classmethod
    def from_env(cls, environ: dict[str, str], timeout_s: float = 60.0) -> MemStateClient | None:
        addr = environ.get(MEMSTATE_ADDR_ENV, "").strip()
        if not addr:
            return None
        return cls(addr, environ.get(MEMSTATE_TOKEN_ENV, ""), timeout_s)

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.addr, timeout=self.timeout_s)
            # Request/response: a write's tail must not wait for the peer's (delayed) ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            raise MemStateUnavailable(f"cannot reach the agent's cache at {self.addr[0]}:{self.addr[1]}: {exc}") from exc

    def put(self, meta: EntryMeta, *chunks: Chunk) -> None:
        """Store the concatenation of ``chunks`` (sent as they are: no joined copy) as the slot's entry."""
        with self._connect() as sock:
            try:
                reply = _request(sock, {"op": "put", "token": self.token, "meta": meta.to_json()}, *chunks)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"push failed: {exc}") from exc
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))

    def get(self, slot: int) -> tuple[EntryMeta, bytearray] | None:
        """The slot's entry (its sha256 verified), or None when the slot is empty."""
        with self._connect() as sock:
            try:
                _send(sock, {"op": "get", "token": self.token, "slot": slot})
                reply = _read_line(sock)
                if not reply.get("ok"):
                    if reply.get("miss"):
                        return None
                    raise MemStateRejected(str(reply.get("error")))
                meta = EntryMeta.from_json(reply["meta"])
                data = _read_exact(sock, meta.nbytes)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"fetch failed: {exc}") from exc
        if sha256_bytes(data) != meta.sha256:
            raise MemStateCorrupt(f"slot {slot}: cached bytes do not match their sha256")
        return meta, data

    def snap_put(self, meta: SnapMeta, *chunks: Chunk, replica: bool = False) -> None:
        header = {"op": "snap_put", "token": self.token, "meta": meta.to_json(), "replica": replica}
        if self.keep_alive:
            with self._lock:
                reply = self._on_kept(header, chunks)
        else:
            with self._connect() as sock:
                reply = self._on(sock, header, chunks)
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))

    @staticmethod
    def _on(sock: socket.socket, header: dict, chunks: tuple[Chunk, ...]) -> dict:
        try:
            return _request(sock, header, *chunks)
        except (OSError, ValueError, ConnectionError) as exc:
            raise MemStateUnavailable(f"snapshot push failed: {exc}") from exc

    def _on_kept(self, header: dict, chunks: tuple[Chunk, ...]) -> dict:
        reused = self._sock is not None
        if self._sock is None:
            self._sock = self._connect()
        try:
            reply = self._on(self._sock, header, chunks)
        except MemStateUnavailable:
            self.close()
            if not reused:
                raise
            # The store closes a connection left idle (or restarted): once more on a new one.  A
            # snapshot put twice is the same entry.
            return self._on_kept(header, chunks)
        if not reply.get("ok"):
            self.close()  # after a refusal the stream may hold an unread body
        return reply

    def snap_put_shared(self, meta: SnapMeta, buffer: shm.SharedBuffer, length: int, head: Chunk,
                        tail: Chunk) -> None:
        """Store a snapshot whose data region is the first ``length`` bytes of ``buffer``: the agent
        maps the buffer (its descriptor travels with the request) instead of receiving its bytes."""
        spec = {"id": buffer.id, "size": len(buffer.map), "len": length,
                "head": memoryview(head).nbytes, "tail": memoryview(tail).nbytes}
        header = {"op": "snap_put", "token": self.token, "meta": meta.to_json(), "shm": spec}
        with self._lock:
            reply = self._on_unix(header, buffer.fd, (head, tail), retry=self._usock is not None)
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))

    def _on_unix(self, header: dict, fd: int, chunks: tuple[Chunk, ...], retry: bool) -> dict:
        try:
            if self._usock is None:
                self._usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._usock.settimeout(self.timeout_s)
                self._usock.connect(shm.unix_address(self.addr[1], self.token))
            socket.send_fds(self._usock, [b"F"], [fd])
            return _request(self._usock, header, *chunks)
        except (OSError, ValueError, ConnectionError) as exc:
            if self._usock is not None:
                self._usock.close()
                self._usock = None
            if retry:  # the agent closed a connection left idle: once more on a new one
                return self._on_unix(header, fd, chunks, retry=False)
            raise MemStateUnavailable(f"snapshot push failed: {exc}") from exc

    def snap_put_torn(self, meta: SnapMeta, chunks: list[Chunk]) -> None:
        """Fault injection: send half of a snapshot, then die (SIGKILL) with the upload torn."""
        data = b"".join(bytes(c) for c in chunks)
        sock = self._connect()
        _send(sock, {"op": "snap_put", "token": self.token, "meta": meta.to_json()}, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    def snap_get(self, node: str, slot: int, step: int | None = None) -> tuple[SnapMeta, bytearray] | None:
        with self._connect() as sock:
            try:
                _send(sock, {"op": "snap_get", "token": self.token, "node": node, "slot": slot, "step": step})
                reply = _read_line(sock)
                if not reply.get("ok"):
                    if reply.get("miss"):
                        return None
                    raise MemStateRejected(str(reply.get("error")))
                meta = SnapMeta.from_json(reply["meta"])
                data = _read_exact(sock, meta.nbytes)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"snapshot fetch failed: {exc}") from exc
        if not checksum.verify(meta.checksum, data):
            raise MemStateCorrupt(f"snapshot {node}/{slot} step {meta.step}: bytes do not match their checksum "
                                  f"({meta.checksum.partition(':')[0]})")
        return meta, data

    def snap_fit(self, shard_bytes: int, local_shards: int) -> str | None:
        """Whether this rank's snapshots (``shard_bytes`` each, ``local_shards`` on the node) fit its
        agent's cap: None, or the one line that names the field, the size needed and the size allowed."""
        with self._connect() as sock:
            try:
                _send(sock, {"op": "snap_fit", "token": self.token, "nbytes": shard_bytes,
                             "local_shards": local_shards})
                reply = _read_line(sock)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"snapshot size check failed: {exc}") from exc
        return None if reply.get("ok") else str(reply.get("error"))

    def snap_list(self) -> list[SnapMeta]:
        with self._connect() as sock:
            try:
                _send(sock, {"op": "snap_list", "token": self.token})
                return [SnapMeta.from_json(m) for m in _read_line(sock).get("metas", [])]
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"snapshot list failed: {exc}") from exc

    def round_wait(self, epoch: int, gen: int, name: str, timeout_s: float) -> Any:
        """What the agent posted for generation ``gen`` under ``name`` (``plan``, ``store``), waiting up
        to ``timeout_s``; MemStateRejected when the round failed or nothing came (see RoundBoard)."""
        with self._connect() as sock:
            sock.settimeout(timeout_s + 10.0)  # the agent answers within timeout_s; then the link is gone
            try:
                _send(sock, {"op": "round_wait", "token": self.token, "epoch": epoch, "gen": gen, "name": name,
                             "timeout_s": timeout_s})
                reply = _read_line(sock)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"waiting for the {name} of generation {gen} failed: {exc}") from exc
        if not reply.get("ok"):
            raise (GenerationFaulted if reply.get("faulted") else MemStateRejected)(str(reply.get("error")))
        return reply.get("value")

    def fault_wait(self, epoch: int, since_gen: int, timeout_s: float) -> dict[str, Any] | None:
        """The newest fault the agent pushed for a generation >= ``since_gen``, or None when none
        came within ``timeout_s`` (a worker's fault monitor asks again)."""
        with self._connect() as sock:
            sock.settimeout(timeout_s + 10.0)
            try:
                _send(sock, {"op": "fault_wait", "token": self.token, "epoch": epoch, "since_gen": since_gen,
                             "timeout_s": timeout_s})
                reply = _read_line(sock)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"waiting for a fault failed: {exc}") from exc
        if reply.get("timeout"):
            return None
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))
        return dict(reply["value"])

    def drop(self, slot: int) -> bool:
        with self._connect() as sock:
            try:
                _send(sock, {"op": "drop", "token": self.token, "slot": slot})
                return bool(_read_line(sock).get("dropped"))
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"drop failed: {exc}") from exc


class ClientPool:
    """Kept connections to one peer store, one per push in flight: an agent's forwarding threads (one
    per local worker's push) no longer queue behind one connection's lock, so a node's shards travel
    to the buddy side by side.  Connections are made as pushes overlap, at most one per local worker."""

    def __init__(self, addr: str, token: str, timeout_s: float) -> None:
        self.addr, self.token, self.timeout_s = addr, token, timeout_s
        self._idle: list[MemStateClient] = []
        self._lock = threading.Lock()
        self._closed = False

    def replicate(self, meta: SnapMeta, *chunks: Chunk) -> None:
        """Store a copy of a snapshot at the peer (``replica``: the peer does not forward it again)."""
        client = self._take()
        try:
            client.snap_put(meta, *chunks, replica=True)
        finally:
            self._give(client)

    def _take(self) -> MemStateClient:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return MemStateClient(self.addr, self.token, self.timeout_s, peer=True, keep_alive=True)

    def _give(self, client: MemStateClient) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(client)
                return
        client.close()

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for client in idle:
            client.close()


class PeerHold:
    """A watch on a peer agent's life: one silent connection to its memory store (op ``hold``).

    The peer's death closes the connection (its kernel sends a FIN or a reset at once), and
    ``on_lost`` runs on this watch's thread: an agent learns that its ring successor's node is gone
    in a round trip rather than a lease TTL, which matters under NCCL, where the survivors'
    collectives never raise.  A host that vanishes without a word (power, a dead link) is found by
    TCP keepalives: idle 2 s, then 3 probes 1 s apart, so ~5 s.  ``on_lost`` does not run after
    :meth:`close`."""

    def __init__(self, addr: str, token: str, on_lost: Any, connect_timeout_s: float = 2.0) -> None:
        host, _, port = addr.rpartition(":")
        self.addr = (host, int(port))
        self.on_lost = on_lost
        self.lost = False  # the connection ended (the watcher then holds the ring's next node)
        self._closed = threading.Event()
        self._sock = socket.create_connection(self.addr, timeout=connect_timeout_s)
        try:
            _keepalive(self._sock)
            _send(self._sock, {"op": "hold", "token": token})
            if not _read_line(self._sock).get("ok"):
                raise MemStateRejected(f"peer agent at {addr} refused the hold")
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        threading.Thread(target=self._watch, name=f"peer-hold-{port}", daemon=True).start()

    def _watch(self) -> None:
        reason = "its agent closed the connection"
        try:
            while self._sock.recv(64):
                pass
        except OSError as exc:
            reason = f"its agent's connection broke ({type(exc).__name__})"
        self.lost = True
        if not self._closed.is_set():
            self.on_lost(reason)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's (hours) stand
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
