"""The node agent's in-memory checkpoint cache and its loopback protocol (no torch here).

After each save a worker pushes its rank's state (the serialized bytes of
exactly what the checkpoint wrote, see :mod:`elastic.checkpoint.memory`) to
its node agent; the agent keeps the newest entry per local slot (the worker's
``LOCAL_RANK``).  A worker restarted on the same node asks for its slot's
entry before reading the disk.  The cache is an accelerator, never a source of
truth: an entry is used only when it names the newest *committed* checkpoint
on disk (same step and same checkpoint id as that step's COMMIT marker), the
run's config fingerprint and the current world size; otherwise the loader
falls back to disk.

Why the agent: it survives its workers (a killed or crashed worker, a restart
caused by a peer), costs no extra process, and dies with the node, which is
when the entry would be useless anyway.

Transport: TCP on 127.0.0.1 only (the port and a random token reach the
workers in ``ELASTIC_MEMSTATE_ADDR`` / ``ELASTIC_MEMSTATE_TOKEN``).  One
request per connection: a JSON header line, then ``nbytes`` raw bytes for a
put; the reply is a JSON header line, then the entry's bytes for a get.
Integrity: every entry carries the sha256 of its bytes; the server checks it
when the bytes arrive (a torn or altered upload is refused) and the client
checks it again on every fetch (memory that changed at rest is refused).
Per-step snapshots carry a fast checksum instead (XXH3-128,
:mod:`elastic.checkpoint.checksum`), checked on every fetch only: their stores
(this node's agent and the buddy's) refuse a torn upload by its length, but do
not hash each step's bytes twice more; the checksum is what a restore verifies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastic.checkpoint import shm
from elastic.common.env import MEMSTATE_ADDR_ENV, MEMSTATE_TOKEN_ENV
from elastic.common.events import EventLog

log = logging.getLogger(__name__)

_MAX_HEADER = 64 * 1024
_CHUNK = 4 << 20
_PEEK = 4096
_IOV_MAX = 512  # below Linux's IOV_MAX (1024) per sendmsg


class MemStateError(RuntimeError):
    """Base class for in-memory cache failures (the caller then uses the disk)."""


class MemStateUnavailable(MemStateError):
    """The agent's cache could not be reached or stopped answering."""


class MemStateRejected(MemStateError):
    """The cache refused a request (stale push, too large, bad token, corrupt upload)."""


class GenerationFaulted(MemStateRejected):
    """A wait for a generation's plan or store ended because a pushed fault broke that generation."""


class MemStateCorrupt(MemStateError):
    """An entry's bytes do not match its sha256."""


@dataclass(frozen=True, kw_only=True)
class EntryMeta:
    """What an entry is: enough to decide, without its bytes, whether a load may use it."""

    slot: int
    """The worker's LOCAL_RANK on this node (the cache key)."""
    rank: int
    """The global rank that saved it (its shard of the state)."""
    world_size: int
    step: int
    checkpoint_id: str
    """The save's token, also written to the step's COMMIT marker: the same step number saved twice
    (after a rollback) is two different checkpoints."""
    fingerprint: str
    epoch: int
    """The run epoch of the saving worker: a late push from an older epoch never replaces a newer entry."""
    sha256: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryMeta:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"entry metadata lacks {sorted(missing)}")
        return cls(**{k: data[k] for k in names})


def reject_reason(
    meta: EntryMeta, *, step: int, checkpoint_id: str, fingerprint: str, world_size: int, slot: int
) -> str | None:
    """Why ``meta`` must not be loaded as committed checkpoint (step, checkpoint_id), or None if it may."""
    if meta.slot != slot:
        return f"entry is for slot {meta.slot}, not {slot}"
    if fingerprint and meta.fingerprint != fingerprint:
        return "fingerprint mismatch (saved by a different run config)"
    if meta.world_size != world_size:
        return f"saved by world size {meta.world_size}, now {world_size}"
    if meta.step != step:
        return f"entry is for step {meta.step}, newest committed is {step}"
    if not checkpoint_id or meta.checkpoint_id != checkpoint_id:
        return f"entry is checkpoint {meta.checkpoint_id!r}, step {step} on disk is {checkpoint_id or 'unnamed'!r}"
    return None


Chunk = bytes | bytearray | memoryview


def sha256_bytes(data: Chunk) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_chunks(chunks: list[Chunk]) -> tuple[str, int]:
    """(sha256, total bytes) of the concatenation of ``chunks``."""
    digest = hashlib.sha256()
    total = 0
    for chunk in chunks:
        digest.update(chunk)
        total += memoryview(chunk).nbytes
    return digest.hexdigest(), total


def _read_line(sock: socket.socket) -> dict[str, Any]:
    """The JSON header line.  Peeks for its end and then consumes exactly that much, so the body
    stays unread: two system calls instead of one per byte (a snapshot push reads two headers on
    each of two agents every step: byte-wise that was ~1 ms of an agent's CPU per push)."""
    buf = bytearray()
    while True:
        peek = sock.recv(_PEEK, socket.MSG_PEEK)
        if not peek:
            raise ConnectionError("connection closed before the header ended")
        end = peek.find(b"\n")
        buf += _read_exact(sock, len(peek) if end < 0 else end + 1)
        if end >= 0:
            return json.loads(buf)
        if len(buf) > _MAX_HEADER:
            raise ValueError("header too long")


def _read_exact(sock: socket.socket, nbytes: int, into: bytearray | None = None) -> bytearray:
    """``nbytes`` from ``sock``, into ``into`` when given (a reused buffer of that length)."""
    data = bytearray(nbytes) if into is None else into
    view = memoryview(data)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:], min(_CHUNK, nbytes - got))
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {nbytes} bytes")
        got += n
    return data


def _send(sock: socket.socket, header: dict[str, Any], *body: Chunk) -> None:
    """The header line and the body's chunks with vectored writes (a snapshot is ~200 chunks: one
    sendall each cost a system call and a trip through Python per chunk)."""
    views = [view for view in (memoryview(c).cast("B") for c in (json.dumps(header).encode() + b"\n", *body))
             if view.nbytes]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + _IOV_MAX])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


class MemStateCache:
    """The entries and their rules (thread-safe); the server is a thin shell around it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[int, tuple[EntryMeta, bytearray]] = {}
        self._lock = threading.Lock()

    def put(self, meta: EntryMeta, data: bytearray) -> None:
        """Store ``data`` as the slot's entry, replacing an older one; raises MemStateRejected."""
        if len(data) != meta.nbytes:
            raise MemStateRejected(f"got {len(data)} bytes, header says {meta.nbytes}")
        if sha256_bytes(data) != meta.sha256:
            raise MemStateRejected("sha256 of the uploaded bytes does not match the header (corrupt upload)")
        with self._lock:
            current = self._entries.get(meta.slot)
            if current is not None and (meta.epoch, meta.step) < (current[0].epoch, current[0].step):
                raise MemStateRejected(
                    f"stale push: step {meta.step} of epoch {meta.epoch} is older than the cached "
                    f"step {current[0].step} of epoch {current[0].epoch}"
                )
            others = sum(m.nbytes for s, (m, _) in self._entries.items() if s != meta.slot)
            if others + meta.nbytes > self.max_bytes:
                raise MemStateRejected(
                    f"entry of {meta.nbytes} bytes does not fit (cache limit {self.max_bytes}, {others} held by other slots)"
                )
            self._entries[meta.slot] = (meta, data)

    def get(self, slot: int) -> tuple[EntryMeta, bytearray] | None:
        with self._lock:
            return self._entries.get(slot)

    def snap_put(self, meta: SnapMeta, *chunks: Chunk, replica: bool = False) -> None:
        with self._connect() as sock:
            try:
                _send(sock, {"op": "snap_put", "token": self.token, "meta": meta.to_json(), "replica": replica},
                      *chunks)
                reply = _read_line(sock)
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"snapshot push failed: {exc}") from exc
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))

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
        if sha256_bytes(data) != meta.sha256:
            raise MemStateCorrupt(f"snapshot {node}/{slot}: bytes do not match their sha256")
        return meta, data

    def snap_list(self) -> list[SnapMeta]:
        with self._connect() as sock:
            try:
                _send(sock, {"op": "snap_list", "token": self.token})
                return [SnapMeta.from_json(m) for m in _read_line(sock).get("metas", [])]
            except (OSError, ValueError, ConnectionError) as exc:
                raise MemStateUnavailable(f"snapshot list failed: {exc}") from exc

    def drop(self, slot: int) -> bool:
        with self._lock:
            return self._entries.pop(slot, None) is not None

    def metas(self) -> list[EntryMeta]:
        with self._lock:
            return [meta for meta, _ in self._entries.values()]

    def held_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.metas())


@dataclass(frozen=True, kw_only=True)
class SnapMeta:
    """One per-step snapshot of one worker's shard (:mod:`elastic.checkpoint.snapshot`)."""

    node: str
    slot: int
    """The worker's LOCAL_RANK on ``node``."""
    rank: int
    world_size: int
    epoch: int
    gen: int
    step: int
    checksum: str
    """``algorithm:hex`` of the snapshot's bytes (:mod:`elastic.checkpoint.checksum`), verified on every read."""
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SnapMeta:
        names = {f.name for f in dataclasses.fields(cls)}
        if names - set(data):
            raise ValueError(f"snapshot metadata lacks {sorted(names - set(data))}")
        return cls(**{k: data[k] for k in names})


SNAPSHOT_CAP_FIELD = "agent.inprocess.snapshot_mib"


def snapshot_need(shard_bytes: int, local_shards: int, depth: int = 2) -> int:
    """Bytes one agent holds at most: ``depth`` steps of each local shard and of the buddy's (the
    buddy node runs as many shards as this one: a run's nodes have the same slots)."""
    return depth * 2 * local_shards * shard_bytes


def snapshot_fit_error(shard_bytes: int, local_shards: int, limit_bytes: int, depth: int = 2) -> str | None:
    """The one line that stops a run whose snapshots cannot fit the agent's cap, or None when they
    fit.  Checked once at the start, never per step: a snapshot dropped for lack of room would turn
    the next fault into a disk restart without a word."""
    need = snapshot_need(shard_bytes, local_shards, depth)
    if need <= limit_bytes:
        return None
    return (f"{SNAPSHOT_CAP_FIELD}: per-step snapshots need {_mib(need)} MiB ({depth} steps x ({local_shards} local "
            f"shards + {local_shards} of the buddy's) x {shard_bytes / 2**20:.1f} MiB), {_mib(limit_bytes)} MiB "
            "allowed; raise it, or set agent.inprocess.snapshots: false to run without them")


def _mib(nbytes: int) -> int:
    return -(-nbytes // 2**20)


class SnapshotCache:
    """The newest ``depth`` snapshots of each (node, slot): this node's workers' and, as a buddy, a peer's.

    Two steps are kept because the ranks of a failed step may differ by one step in what they
    last pushed; the restore then agrees on the older one.
    """

    def __init__(self, max_bytes: int, depth: int = 2) -> None:
        self.max_bytes = max_bytes
        self.depth = depth
        self._entries: dict[tuple[str, int], list[tuple[SnapMeta, bytearray]]] = {}
        self._lock = threading.Lock()
        self._free: list[bytearray] = []  # receive buffers that evicted snapshots left (buffer())
        self._reading: dict[int, int] = {}  # id(buffer) -> fetches sending it (never reused meanwhile)

    def buffer(self, nbytes: int) -> bytearray:
        """A buffer to receive a snapshot of ``nbytes`` into: one an evicted snapshot of the same size
        left, else a new one.  Why: a fresh 47 MiB bytearray's first touch (page faults) cost ten
        times the copy into it (1.3 vs 13.8 GB/s on this host).  Memory: the free list holds at
        most half the cap, so a store holds at most 1.5 x ``max_bytes`` (a slot's third buffer is
        the one the next step arrives in while the two it keeps stay whole)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) == nbytes:
                    return self._free.pop(i)
        return bytearray(nbytes)

    def release(self, data: bytearray) -> None:
        """Hand back a buffer that holds nothing kept (a refused upload, an evicted snapshot)."""
        with self._lock:
            self._recycle(data)

    def _recycle(self, data: bytearray | shm.Parts) -> None:
        if not isinstance(data, bytearray) or self._reading.get(id(data)):
            return  # a fetch is sending it: left to the garbage collector
        if sum(len(b) for b in self._free) + len(data) <= self.max_bytes // 2:
            self._free.append(data)

    def put(self, meta: SnapMeta, data: bytearray) -> None:
        # Length only: the checksum is checked when the snapshot is read (MemStateClient.snap_get),
        # the one time its bytes matter.  Hashing them here too, at this node's store and again at
        # the buddy's, was ~0.35 ms of CPU per store per step on the DiT benchmark (2 shared cores),
        # a third of what the stores cost a step; a corrupt copy still never reaches a model.
        if len(data) != meta.nbytes:
            raise MemStateRejected(f"snapshot of {len(data)} bytes, its header says {meta.nbytes} (torn upload)")
        with self._lock:
            kept = [e for e in self._entries.get((meta.node, meta.slot), [])
                    if (e[0].epoch, e[0].gen, e[0].step) != (meta.epoch, meta.gen, meta.step)]
            kept = sorted(kept + [(meta, data)], key=lambda e: (e[0].epoch, e[0].step, e[0].gen))[-self.depth:]
            others = sum(m.nbytes for key, es in self._entries.items() if key != (meta.node, meta.slot)
                         for m, _ in es)
            if others + sum(m.nbytes for m, _ in kept) > self.max_bytes:
                raise MemStateRejected(f"snapshot of {meta.nbytes} bytes does not fit (limit {self.max_bytes})")
            kept_ids = {id(d) for _, d in kept}
            for _, old in self._entries.get((meta.node, meta.slot), []):
                if id(old) not in kept_ids:
                    self._recycle(old)
            self._entries[(meta.node, meta.slot)] = kept

    def get(self, node: str, slot: int, step: int | None = None) -> tuple[SnapMeta, bytearray] | None:
        with self._lock:
            return self._find(node, slot, step)

    def _find(self, node: str, slot: int, step: int | None) -> tuple[SnapMeta, bytearray] | None:
        matching = [e for e in self._entries.get((node, slot), []) if step is None or e[0].step == step]
        return matching[-1] if matching else None

    @contextlib.contextmanager
    def reading(self, node: str, slot: int, step: int | None = None) -> Iterator[tuple[SnapMeta, bytearray] | None]:
        """:meth:`get`, its buffer kept from reuse until the caller has sent it."""
        with self._lock:
            entry = self._find(node, slot, step)
            if entry is not None:
                self._reading[id(entry[1])] = self._reading.get(id(entry[1]), 0) + 1
        try:
            yield entry
        finally:
            if entry is not None:
                with self._lock:
                    self._reading[id(entry[1])] -= 1
                    if not self._reading[id(entry[1])]:
                        del self._reading[id(entry[1])]

    def metas(self) -> list[SnapMeta]:
        with self._lock:
            return [meta for entries in self._entries.values() for meta, _ in entries]


class RoundBoard:
    """What the agent tells its workers about a generation round, over the local channel: values
    posted under (epoch, generation, name) -- ``plan``, ``store`` -- that a worker waits for with
    one blocking request (op ``round_wait``).  The workers of a node thus learn a plan from their
    agent's one watch instead of one etcd watch each (elastic.control.generations).

    ``on_wait`` (set by the agent) hears every wait: a worker asking for a round is a reason to join
    it, should its fault report (a UDP datagram) have been lost.
    """

    KEEP = 4
    """Generations kept per epoch: a spare or a slow worker may still ask for the previous one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._values: dict[tuple[int, int, str], dict[str, Any]] = {}
        self._faults: dict[int, dict[str, Any]] = {}  # epoch -> the fault of its newest faulted generation
        self.on_wait: Callable[[int, int, str], None] = lambda epoch, gen, name: None

    def post(self, epoch: int, gen: int, name: str, value: Any) -> None:
        self._set((epoch, gen, name), {"ok": True, "value": value})

    def fail(self, epoch: int, gen: int, names: tuple[str, ...], reason: str) -> None:
        """Every waiter of these names hears that the round failed (it then leaves: a restart from disk)."""
        for name in names:
            self._set((epoch, gen, name), {"ok": False, "error": reason})

    def _set(self, key: tuple[int, int, str], answer: dict[str, Any]) -> None:
        with self._cond:
            self._values.setdefault(key, answer)  # the first answer stands
            newest = max(g for e, g, _ in self._values if e == key[0])
            self._values = {k: v for k, v in self._values.items() if k[0] == key[0] and k[1] > newest - self.KEEP}
            self._cond.notify_all()

    def _left_out(self, epoch: int, gen: int, fault: dict[str, Any]) -> bool:
        """The fault is the loss of a node that generation ``gen``'s plan already formed without (it
        was pushed for ``gen`` while the node might still have joined it): it breaks nothing there."""
        answer = self._values.get((epoch, gen, "plan")) or {}
        plan = (answer.get("value") or {}).get("plan") or {} if answer.get("ok") else {}
        return fault.get("kind") == "node_lost" and fault.get("node") in {*plan.get("lost", []), *plan.get("gone", [])}

    def _plan_may_leave_out(self, epoch: int, gen: int, fault: dict[str, Any]) -> bool:
        """The fault is a node's loss pushed for generation ``gen`` before its plan is known: the plan
        may form without the node (then nothing broke), so a wait for that plan goes on until the
        plan or the round's failure is posted (a wait for the store comes after the plan).  Why: one worker told "faulted" at once skipped to ``gen + 1``
        while its peers, whose agents posted the plan first, formed ``gen`` and waited 60 s for it
        at its process group's start (``test_two_adjacent_nodes_lost_fall_back_to_the_disk_checkpoint``:
        node2's loss pushed for generation 1 0.3 s before generation 1's plan, which left node2 out)."""
        return (fault.get("kind") == "node_lost" and int(fault["gen"]) == gen
                and (epoch, gen, "plan") not in self._values)

    def post_fault(self, epoch: int, record: dict[str, Any]) -> bool:
        """A fault in generation ``record["gen"]`` (pushed: a worker died, a node was lost, a rank
        hung); False when a fault of that generation or a newer one is already posted."""
        with self._cond:
            known = self._faults.get(epoch)
            if known is not None and int(known["gen"]) >= int(record["gen"]):
                return False
            self._faults = {epoch: dict(record)}  # an older epoch's workers are gone
            self._cond.notify_all()
            return True

    def wait_fault(self, epoch: int, since_gen: int, timeout_s: float) -> dict[str, Any]:
        """The newest fault of a generation >= ``since_gen`` (a worker's fault monitor waits here
        for its own generation's), or a timeout answer (``{"ok": False, "timeout": True}``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while int(self._faults.get(epoch, {}).get("gen", -1)) < since_gen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"ok": False, "timeout": True, "error": f"no fault of generation >= {since_gen}"}
                self._cond.wait(remaining)
            return {"ok": True, "value": self._faults[epoch]}

    def wait(self, epoch: int, gen: int, name: str, timeout_s: float) -> dict[str, Any]:
        """``{"ok": True, "value": ...}``, ``{"ok": False, "error": ...}``, or a timeout answer.  A
        wait for a generation that a pushed fault broke ends at once (``faulted``): its store may
        never be published (its rank 0 left), and the worker asks for the next one instead."""
        self.on_wait(epoch, gen, name)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (epoch, gen, name) not in self._values:
                fault = self._faults.get(epoch)
                if fault is not None and int(fault["gen"]) >= gen and not self._left_out(epoch, gen, fault) \
                        and not (name == "plan" and self._plan_may_leave_out(epoch, gen, fault)):
                    return {"ok": False, "faulted": True,
                            "error": f"generation {gen} was faulted: {fault.get('kind', 'fault')} of {fault.get('node')}"}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {"ok": False, "error": f"the agent had no {name} of generation {gen} within {timeout_s:g}s"}
                self._cond.wait(remaining)
            return self._values[(epoch, gen, name)]


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # replies are small: never held back
        owner = self.server.owner
        try:
            if not sock.recv(1, socket.MSG_PEEK):
                return  # connected and closed without a word: a peer agent probing that this one lives
            while True:
                header = _read_line(sock)
                if not secrets.compare_digest(str(header.get("token", "")), owner.token):
                    _send(sock, {"ok": False, "error": "bad token"})
                    return
                owner.dispatch(sock, header)
                # Snapshot pushes come once a step on a kept connection (MemStateClient keep_alive);
                # a push always reads its whole body, so the stream is at the next request.
                if header.get("op") != "snap_put" or not _next_request(sock):
                    return
        except (OSError, ValueError, KeyError, TypeError, ConnectionError) as exc:
            owner.events.emit("memstate.request_failed", error=f"{type(exc).__name__}: {exc}"[:500])


def _chunks(data: bytearray | shm.Parts) -> tuple[Chunk, ...]:
    return data.chunks if isinstance(data, shm.Parts) else (data,)


def _hold(sock: socket.socket) -> None:
    """A peer agent's liveness watch (:class:`~elastic.checkpoint.memclient.PeerHold`): the
    connection stays open, silent, for as long as both agents live.  This agent's death closes it
    (the kernel sends the FIN or RST at once): the watcher knows in a round trip, not a lease TTL."""
    sock.settimeout(None)
    _send(sock, {"ok": True})
    with contextlib.suppress(OSError):
        while sock.recv(64):
            pass


def _next_request(sock: socket.socket) -> bool:
    """Wait for another request on a kept connection: False when the peer closed it or left it idle
    for the I/O timeout (the client then opens a new one)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except (TimeoutError, socket.timeout, ConnectionError):
        return False


class _UnixHandler(_Handler):
    """A worker's shared-memory pushes (:mod:`elastic.checkpoint.shm`): each request starts with one
    byte that carries the buffer's file descriptor (``SCM_RIGHTS``), read alone so that no later
    read can drop it, then the usual header and the small inline body."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout_s)
        owner = self.server.owner
        try:
            while self._one(sock, owner):
                pass
        except (TimeoutError, socket.timeout):
            return  # a kept connection left idle: the worker opens a new one
        except (OSError, ValueError, KeyError, TypeError, ConnectionError) as exc:
            owner.events.emit("memstate.request_failed", error=f"{type(exc).__name__}: {exc}"[:500])

    @staticmethod
    def _one(sock: socket.socket, owner: MemStateServer) -> bool:
        marker, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not marker:
            return False
        header = _read_line(sock)
        if not secrets.compare_digest(str(header.get("token", "")), owner.token):
            for fd in fds:
                os.close(fd)
            _send(sock, {"ok": False, "error": "bad token"})
            return False
        owner.dispatch(sock, header, fds[0] if fds else None)
        return header.get("op") == "snap_put"


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    owner: MemStateServer
    io_timeout_s: float


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: MemStateServer
    io_timeout_s: float


class MemStateServer:
    """The agent side: a loopback TCP server in front of one :class:`MemStateCache`."""

    def __init__(self, max_bytes: int, events: EventLog | None = None, io_timeout_s: float = 60.0,
                 host: str = "127.0.0.1") -> None:
        self.cache = MemStateCache(max_bytes)
        self.snapshots = SnapshotCache(max_bytes)
        # Set by the agent: a copy of every snapshot of this node's workers goes to the buddy node.
        self.replicate: Callable[..., None] | None = None  # (meta, *chunks)
        self.buddy_link: Any = None  # in-process mode: the agent's link to its ring successor (replicas, liveness)
        self.board = RoundBoard()
        self.events = events or EventLog(None, "memstate")
        self.token = secrets.token_hex(16)
        self._server = _TCPServer((host, 0), _Handler)
        self._server.owner = self
        self._server.io_timeout_s = io_timeout_s
        self.mappings = shm.Mappings()
        self._unix = self._unix_server(io_timeout_s) if shm.supported() else None
        # A short poll interval only bounds how long close() waits for the serving threads.
        self._threads = [threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1},
                                          name="memstate", daemon=True) for srv in (self._server, self._unix) if srv]
        for thread in self._threads:
            thread.start()
        self.events.emit("memstate.started", addr=self.addr, max_bytes=max_bytes)

    def _unix_server(self, io_timeout_s: float) -> _UnixServer | None:
        try:
            server = _UnixServer(shm.unix_address(self.port, self.token), _UnixHandler)
        except OSError as exc:  # e.g. no abstract namespace: the workers push over TCP
            self.events.emit("memstate.no_shared_memory", error=str(exc)[:300])
            return None
        server.owner, server.io_timeout_s = self, io_timeout_s
        return server

    @property
    def addr(self) -> str:
        """Where this node's workers reach the store (loopback, also when it listens on every interface)."""
        host, port = self._server.server_address[:2]
        return f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def worker_env(self) -> dict[str, str]:
        return {MEMSTATE_ADDR_ENV: self.addr, MEMSTATE_TOKEN_ENV: self.token}

    def dispatch(self, sock: socket.socket, header: dict[str, Any], fd: int | None = None) -> None:
        op = header.get("op")
        if fd is not None and op != "snap_put":
            os.close(fd)
        if op == "put":
            self._put(sock, header)
        elif op == "get":
            entry = self.cache.get(int(header["slot"]))
            if entry is None:
                _send(sock, {"ok": False, "error": "empty", "miss": True})
                return
            meta, data = entry
            _send(sock, {"ok": True, "meta": meta.to_json()}, *_chunks(data))
        elif op == "drop":
            _send(sock, {"ok": True, "dropped": self.cache.drop(int(header["slot"]))})
        elif op == "snap_put" and fd is not None:
            self._snap_put_shared(sock, header, fd)
        elif op == "snap_put":
            self._snap_put(sock, header)
        elif op == "snap_get":
            self._snap_get(sock, header)
        elif op == "snap_fit":
            error = snapshot_fit_error(int(header["nbytes"]), int(header["local_shards"]), self.snapshots.max_bytes)
            _send(sock, {"ok": error is None, "error": error})
        elif op == "snap_list":
            _send(sock, {"ok": True, "metas": [m.to_json() for m in self.snapshots.metas()]})
        elif op == "round_wait":
            _send(sock, self.board.wait(int(header["epoch"]), int(header["gen"]), str(header["name"]),
                                        float(header["timeout_s"])))
        elif op == "fault_wait":
            _send(sock, self.board.wait_fault(int(header["epoch"]), int(header["since_gen"]),
                                              float(header["timeout_s"])))
        elif op == "hold":
            _hold(sock)
        else:
            _send(sock, {"ok": False, "error": f"unknown op {op!r}"})

    def _put(self, sock: socket.socket, header: dict[str, Any]) -> None:
        meta = EntryMeta.from_json(header["meta"])
        if meta.nbytes > self.cache.max_bytes:  # refuse before reading what cannot be kept
            _send(sock, {"ok": False, "error": f"entry of {meta.nbytes} bytes exceeds the cache limit "
                                              f"{self.cache.max_bytes}"})
            return
        t0 = time.monotonic()
        data = _read_exact(sock, meta.nbytes)
        try:
            self.cache.put(meta, data)
        except MemStateRejected as exc:
            self.events.emit("memstate.put_rejected", slot=meta.slot, step=meta.step, error=str(exc))
            _send(sock, {"ok": False, "error": str(exc)})
            return
        self.events.emit("memstate.put", slot=meta.slot, rank=meta.rank, step=meta.step, bytes=meta.nbytes,
                         recv_s=round(time.monotonic() - t0, 6), held_bytes=self.cache.held_bytes())
        _send(sock, {"ok": True})

    def _snap_put(self, sock: socket.socket, header: dict[str, Any]) -> None:
        meta = SnapMeta.from_json(header["meta"])
        buf = self.snapshots.buffer(meta.nbytes)
        try:
            data = _read_exact(sock, meta.nbytes, into=buf)
            self.snapshots.put(meta, data)
        except (MemStateRejected, OSError, ConnectionError) as exc:
            self.snapshots.release(buf)
            if not isinstance(exc, MemStateRejected):
                raise
            self._refused(sock, meta, exc)
            return
        self._stored(sock, header, meta, data)

    def _snap_put_shared(self, sock: socket.socket, header: dict[str, Any], fd: int) -> None:
        """A push from this node's worker whose data region is its shared buffer ``fd`` (mapped here)."""
        meta, spec = SnapMeta.from_json(header["meta"]), header["shm"]
        try:
            head = _read_exact(sock, int(spec["head"]))
            tail = _read_exact(sock, int(spec["tail"]))
        except BaseException:
            os.close(fd)
            raise
        view = self.mappings.view(meta.slot, str(spec["id"]), fd, int(spec["size"]), int(spec["len"]))
        data = shm.Parts(head, view, tail)
        try:
            self.snapshots.put(meta, data)
        except MemStateRejected as exc:
            self._refused(sock, meta, exc)
            return
        self._stored(sock, header, meta, data)

    def _refused(self, sock: socket.socket, meta: SnapMeta, exc: MemStateRejected) -> None:
        self.events.emit("memstate.snapshot_rejected", node=meta.node, slot=meta.slot, step=meta.step,
                         error=str(exc))
        _send(sock, {"ok": False, "error": str(exc)})

    def _stored(self, sock: socket.socket, header: dict[str, Any], meta: SnapMeta,
                data: bytearray | shm.Parts) -> None:
        # Replication is synchronous: the worker's push completes once the buddy holds the copy too,
        # so a whole node's loss never costs more than the step in flight.
        if self.replicate is not None and not header.get("replica"):
            self.replicate(meta, *_chunks(data))
        _send(sock, {"ok": True})

    def _snap_get(self, sock: socket.socket, header: dict[str, Any]) -> None:
        step = header.get("step")
        with self.snapshots.reading(str(header["node"]), int(header["slot"]),
                                    None if step is None else int(step)) as entry:
            if entry is None:
                _send(sock, {"ok": False, "error": "empty", "miss": True})
                return
            meta, data = entry
            _send(sock, {"ok": True, "meta": meta.to_json()}, *_chunks(data))

    def close(self) -> None:
        for server in (self._server, self._unix):
            if server is not None:
                server.shutdown()
                server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
