"""Per-step memory snapshots: the first checkpoint tier, for in-process recovery.

After every optimizer step each rank copies the local view of its state (each DTensor's local
shard, with the global shape beside it; plain values as they are) into host memory:
:func:`capture`.  The copy is kept in-process (the last two steps, :class:`SnapshotRing`) and
pushed, serialized, to the node agent's store, which replicates it synchronously to a buddy
node's agent (:mod:`elastic.checkpoint.memstate`).  The push runs on a background thread and
must be done before one of the next step's collectives that every rank passes to finish that step
(:meth:`SnapshotPusher.wait`, called from the trainer's ``session.commit_point()`` before its last
collectives, else at the step's start): then any rank that completed step s has every peer's step
s-1 or later stored off-process, so a lost worker or a lost node costs at most one step.

Restoring into a freshly built model (:func:`restore`):

* same world, same ranks: each rank copies its own local shards back (bitwise);
* a different world (a node lost or added): the old ranks' shards of each tensor are joined along
  dim 0 into the full tensor (FSDP2 shards every parameter and optimizer state ``Shard(0)`` with
  ``torch.chunk`` semantics), and each new rank takes its ``torch.chunk`` of it.  In-process
  recovery does not join them: each new rank receives just its chunk's rows, point to point
  (:mod:`elastic.worker.reshard`), and loads them with :func:`load_tree`; bitwise the same state.

Values that are not sharded (step counters, the sampler position, RNG state, guard history) are
the same on every rank and come from the first old rank.
"""

from __future__ import annotations

import dataclasses
import io
import operator
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Shard

from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memory import (
    HeaderCache,
    as_state_dicts,
    data_table,
    decode_state,
    encode_packed,
    encode_state,
    resolve,
    tensor_ref,
)
from elastic.checkpoint import shm
from elastic.checkpoint.checksum import ALGORITHM, digest_chunks
from elastic.checkpoint.memstate import MemStateError, SnapMeta
from elastic.checkpoint.statedict import sizing
from elastic.common.events import EventLog

SHARD = "__shard__"
"""A sharded tensor in a snapshot: ``{SHARD: local tensor, "shape": global shape}``."""


class SnapshotError(RuntimeError):
    """A snapshot cannot be taken or restored (the caller falls back to a disk checkpoint)."""


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device for the worker's life (a stream per capture would leak handles)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _host_register(flat: torch.Tensor) -> bool:
    """Page-lock a shared buffer in place (cudaHostRegister), so a device copy into it is a DMA
    that overlaps compute; a pageable destination makes ``non_blocking`` copies synchronous."""
    if not flat.numel():
        return False
    err = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(err) != 0:
        raise SnapshotError(f"cudaHostRegister of a {flat.numel()}-byte snapshot buffer failed: {err}")
    return True


def copy_path(sources: list[torch.Tensor]) -> str:
    """``cuda``: the sources live on a GPU (pinned buffer, side stream, event); ``cpu``: a blocking
    copy, as before issue 28 (host tensors, or a CPU-only build)."""
    if not torch.cuda.is_available():  # first: the scan of every source was 20 us of a CPU capture
        return "cpu"
    return "cuda" if any(t.device.type == "cuda" for t in sources) else "cpu"


def wait_copied(snapshot: Snapshot | None) -> None:
    """Before the step changes state a GPU snapshot copies: the current stream waits for the copy
    (a wait queued on the device; the training thread does not block)."""
    if snapshot is not None and snapshot.ready is not None:
        torch.cuda.current_stream().wait_event(snapshot.ready)


class Packed:
    """One snapshot's tensors in a single host buffer, laid out as the wire format's data region
    (:func:`~elastic.checkpoint.memory.data_table`), with a typed view per tensor.

    Why one buffer: cloning each of the tiny DiT's 124 tensors and then handing the push ~160
    memoryviews cost 0.74 + 1.96 ms of CPU per rank and step (``/tmp`` profile of ``capture`` and
    ``to_bytes``); one ``_foreach_copy_`` into cached views and a three-chunk push cost a fraction.
    The views are made once per buffer; :class:`SnapshotRing` hands buffers back for reuse."""

    def __init__(self, layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...], shared: bool = False,
                 pinned: bool = False) -> None:
        self.layout = layout
        self.pinned = pinned
        specs = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in layout]
        self.table, nbytes = data_table(specs)
        # shared: in memory the node agent maps instead of receiving (elastic.checkpoint.shm).
        self.shared = shm.SharedBuffer(nbytes) if shared and nbytes and shm.supported() else None
        if self.shared is not None:  # zeroed as a new memfd is: the alignment gaps are sent too
            self.flat = torch.frombuffer(self.shared.map, dtype=torch.uint8, count=nbytes)
        else:
            self.flat = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._registered = pinned and self.shared is not None and _host_register(self.flat)
        self.views = self._views()

    def _views(self) -> list[torch.Tensor]:
        return [self.flat[off:off + n].view(dtype).view(shape)
                for (dtype, shape), (_, _, off, n) in zip(self.layout, self.table)]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a restore's exchange between ranks) as a plain host copy: the shared memory and
        its mapping, and the page-locking, belong to this process."""
        state = {**self.__dict__, "flat": self.flat.clone(), "shared": None, "_registered": False, "pinned": False}
        del state["views"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.views = self._views()

    def fill(self, sources: list[torch.Tensor]) -> None:
        if not sources:
            return
        with torch.no_grad():  # the sources may require grad (parameters); the copy must not
            try:
                torch._foreach_copy_(self.views, sources)
            except RuntimeError:  # e.g. sources on several devices: the plain path
                for view, src in zip(self.views, sources):
                    view.copy_(src)

    def fill_async(self, sources: list[torch.Tensor]) -> torch.cuda.Event:
        """GPU sources: copied into this (pinned) buffer on a side stream, ordered after the work
        already queued on the current stream (the optimizer step that made the state); returns the
        event recorded after the copy.  Nothing here waits: the training thread goes on queueing
        the next step, the step's stream waits for the event before it changes the copied state
        (:func:`wait_copied`), and the push thread waits for it before it reads the bytes."""
        on_gpu = [i for i, t in enumerate(sources) if t.device.type == "cuda"]
        device = sources[on_gpu[0]].device
        host = [i for i, t in enumerate(sources) if t.device.type != "cuda"]  # e.g. Adam's step counters
        with torch.no_grad():
            for i in host:
                self.views[i].copy_(sources[i])
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):
            torch._foreach_copy_([self.views[i] for i in on_gpu], [sources[i] for i in on_gpu], non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def __del__(self) -> None:
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())

    def data(self) -> memoryview:
        return memoryview(self.flat.numpy()).cast("B") if self.flat.numel() else memoryview(b"")


@dataclass
class Snapshot:
    step: int
    gen: int
    rank: int
    world: int
    _tree: dict[str, Any] | None
    extra: bytes = b""
    packed: Packed | None = None
    """The buffer the tensors are in (a captured snapshot; None for one read back)."""
    skeleton: Any = None
    """The state with tensor references in place of the tensors (with ``packed``: the wire header's)."""
    ready: Any = None
    """GPU copy path: the CUDA event recorded after the copy into ``packed`` (None: the copy is done)."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled after its copy is complete; the CUDA event stays behind."""
        if self.ready is not None:
            self.ready.synchronize()
        return {**self.__dict__, "ready": None}

    @property
    def tree(self) -> dict[str, Any]:
        """The state, its tensors views of ``packed``: built when first asked for (a restore), not
        at every capture (the walk over the optimizer's lists was a third of a capture's CPU)."""
        if self._tree is None and self.packed is not None:
            self._tree = resolve(self.skeleton, self.packed.views)
        assert self._tree is not None
        return self._tree


_LEAVES = frozenset({int, float, str, bool, bytes, type(None)})


def _skeleton(tree: Any, sources: list[torch.Tensor], memo: SkeletonMemo | None = None) -> Any:
    """``tree`` with each tensor (a DTensor: its local shard, with the global shape) replaced by a
    reference to its place in ``sources``; containers are new, other values are kept as they are.

    Exact types first: most nodes are plain dicts and scalars, and an ``isinstance`` against the
    ``Mapping`` ABC for each of them was a third of the walk (it runs on the training thread).
    With ``memo``, a large dict of tensors that holds the same tensors as at the last capture is
    not walked: its skeleton is the last one (:class:`SkeletonMemo`)."""
    kind = type(tree)
    if kind in _LEAVES:
        return tree
    if kind is dict:
        if memo is not None and len(tree) >= SkeletonMemo.MIN_KEYS:
            return memo.skeleton(tree, sources)
        return {key: _skeleton(value, sources, memo) for key, value in tree.items()}
    if kind is list:
        return [_skeleton(value, sources, memo) for value in tree]
    if isinstance(tree, DTensor):
        if any(not isinstance(p, Shard) or p.dim != 0 for p in tree.placements):
            raise SnapshotError(f"cannot snapshot a DTensor placed {tree.placements} (only Shard(0))")
        sources.append(tree._local_tensor)
        return {SHARD: tensor_ref(len(sources) - 1), "shape": list(tree.shape)}
    if isinstance(tree, torch.Tensor):
        sources.append(tree)
        return tensor_ref(len(sources) - 1)
    if isinstance(tree, Mapping):
        return {key: _skeleton(value, sources, memo) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(value, sources, memo) for value in tree)
    return tree


@dataclass
class _Walked:
    """One dict's last walk: what identifies it, and what the walk gave."""

    keys: list[Any]
    leaves: list[torch.Tensor]
    shards: list[torch.Tensor]
    skeleton: Any
    sources: list[torch.Tensor]


class SkeletonMemo:
    """The skeletons of a rank's large dicts of tensors (a model's parameters, an optimizer's
    per-parameter state), kept from one capture to the next.

    Why: the walk of the tiny DiT's 126 tensors into a skeleton was 0.25 ms of a capture's 0.54 ms
    (quiet core, cProfile), on every step.  A dict whose keys (and its inner dicts' keys) are the
    same, whose tensors are the same objects and whose DTensors hold the same local shards as at
    the last capture at the same place in ``sources`` has the same skeleton: that check is a few
    C-level list comparisons.  It holds the tensors it compares (an ``id`` is never reused under it).
    What it cannot see, and nothing here does: a tensor resized in place, a DTensor re-placed in place.
    The skeletons it returns are shared between snapshots: nobody may change one."""

    MIN_KEYS = 8
    """Smaller dicts (a param group, the sampler's state) are walked: the check would cost as much."""

    def __init__(self) -> None:
        self._walked: dict[int, _Walked] = {}  # by the index in ``sources`` where the dict's tensors start

    def clear(self) -> None:
        self._walked.clear()

    def skeleton(self, tree: dict[Any, Any], sources: list[torch.Tensor]) -> Any:
        flat = _tensor_leaves(tree)
        if flat is None:  # not only tensors: walked as any dict, nothing kept
            return {key: _skeleton(value, sources, self) for key, value in tree.items()}
        keys, leaves = flat
        base, last = len(sources), self._walked.get(len(sources))
        if last is not None and _same_walk(last, keys, leaves):
            sources.extend(last.sources)
            return last.skeleton
        skeleton = {key: _skeleton(value, sources, None) for key, value in tree.items()}
        self._walked[base] = _Walked(keys, leaves, _shards(leaves), skeleton, sources[base:])
        return skeleton


def _tensor_leaves(tree: dict[Any, Any]) -> tuple[list[Any], list[torch.Tensor]] | None:
    """(keys, tensors) of a dict whose values are tensors or plain dicts of tensors; else None."""
    keys: list[Any] = []
    leaves: list[torch.Tensor] = []
    for key, value in tree.items():
        if type(value) is dict:
            keys.append((key, *value))
            leaves.extend(value.values())
        else:
            keys.append(key)
            leaves.append(value)
    return (keys, leaves) if all(isinstance(t, torch.Tensor) for t in leaves) else None


def _shards(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t._local_tensor for t in leaves if isinstance(t, DTensor)]


def _same_walk(last: _Walked, keys: list[Any], leaves: list[torch.Tensor]) -> bool:
    return (last.keys == keys and len(last.leaves) == len(leaves) and all(map(operator.is_, last.leaves, leaves))
            and all(map(operator.is_, last.shards, _shards(leaves))))


def snapshot_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """Like :func:`as_state_dicts`, through a Stateful's cheap ``snapshot_state_dict()`` where it has
    one (the same tree, checked: :mod:`elastic.checkpoint.statedict`)."""
    return {key: _state_of(value) for key, value in state.items()}


def _state_of(value: Any) -> Any:
    if hasattr(value, "snapshot_state_dict"):
        return value.snapshot_state_dict()
    return value.state_dict() if isinstance(value, Stateful) else value


def capture(state: Mapping[str, Any], step: int, gen: int, rank: int, world: int,
            extra: dict[str, Any] | None = None, ring: SnapshotRing | None = None) -> Snapshot:
    """A copy of this rank's state after ``step`` (its local shards): one memcpy on the training
    thread, into a buffer of ``ring``'s that no snapshot it keeps still uses (else a new one)."""
    blob = b""
    if extra:
        buf = io.BytesIO()
        torch.save(extra, buf)
        blob = buf.getvalue()
    sources: list[torch.Tensor] = []
    skeleton = _skeleton(snapshot_state_dicts(state), sources, ring.memo if ring is not None else None)
    layout = tuple((t.dtype, tuple(t.shape)) for t in sources)
    cuda = copy_path(sources) == "cuda"
    packed = ring.buffer(layout, pinned=cuda) if ring is not None else Packed(layout, pinned=cuda)
    ready = packed.fill_async(sources) if cuda else packed.fill(sources)
    return Snapshot(step, gen, rank, world, None, blob, packed, skeleton, ready)


def snapshot_nbytes(state: Mapping[str, Any]) -> int:
    """The bytes of this rank's snapshot of ``state`` as it is now (its packed tensors), without a copy
    (a fresh optimizer's state, not created yet, counts nothing: :func:`~elastic.checkpoint.statedict.sizing`)."""
    sources: list[torch.Tensor] = []
    with sizing():
        _skeleton(snapshot_state_dicts(state), sources)
    return data_table([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in sources])[1]


def extra_of(snapshot: Snapshot) -> dict[str, Any]:
    return torch.load(io.BytesIO(snapshot.extra), weights_only=True) if snapshot.extra else {}


@dataclass
class SnapshotCosts:
    """What per-step snapshots cost: the copy (on whichever thread took it), the training thread's
    waits for a copy taken in the background and for the previous push, and its total time blocked."""

    capture_s: list[float] = dataclasses.field(default_factory=list)
    capture_cpu_s: list[float] = dataclasses.field(default_factory=list)
    """The copying thread's own CPU time per capture (on shared cores ``capture_s`` includes waiting)."""
    capture_wait_s: list[float] = dataclasses.field(default_factory=list)
    wait_s: list[float] = dataclasses.field(default_factory=list)
    deferred: int = 0
    """Captures taken on the push thread while the training thread went on."""
    blocked_s: float = 0.0

    def summary(self, push_s: list[float], push_cpu_s: list[float] | None = None) -> dict[str, Any]:
        def ms(values: list[float] | None) -> float | None:
            return round(statistics.median(values) * 1000, 3) if values else None
        return {"snapshots": len(self.capture_s), "deferred": self.deferred, "capture_ms_median": ms(self.capture_s),
                "capture_cpu_ms_median": ms(self.capture_cpu_s), "capture_wait_ms_median": ms(self.capture_wait_s),
                "push_cpu_ms_median": ms(push_cpu_s), "wait_ms_median": ms(self.wait_s),
                "push_ms_median": ms(push_s), "blocked_ms_total": round(self.blocked_s * 1000, 1)}


class SnapshotRing:
    """This rank's newest snapshots in-process (two: see the module docstring)."""

    def __init__(self, depth: int = 2, shared: bool = False) -> None:
        self.depth = depth
        self.shared = shared  # buffers in shared memory (a worker whose agent maps them)
        self._items: list[Snapshot] = []
        self._free: list[Packed] = []  # buffers of snapshots the ring let go (their pushes are done)
        self.memo = SkeletonMemo()  # the last captures' skeletons (capture)

    def add(self, snapshot: Snapshot) -> None:
        kept = [s for s in self._items if s.step != snapshot.step][-(self.depth - 1):] + [snapshot]
        kept_ids = {id(s.packed) for s in kept}
        self._free += [s.packed for s in self._items if s.packed is not None and id(s.packed) not in kept_ids]
        self._items = kept

    def buffer(self, layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...], pinned: bool = False) -> Packed:
        """A buffer for the next capture: one the ring let go, when its layout fits.

        A snapshot leaves the ring only when a newer one is added, after its own push finished
        (a push is waited for before the next step's last collectives), so nothing reads it."""
        self._free = [p for p in self._free if p.layout == layout and p.pinned == pinned]  # a new world: new shapes
        return self._free.pop() if self._free else Packed(layout, self.shared, pinned)

    def get(self, step: int) -> Snapshot | None:
        return next((s for s in self._items if s.step == step), None)

    def newest(self) -> Snapshot | None:
        return self._items[-1] if self._items else None

    def clear(self) -> None:
        self._items = []
        self._free = []
        self.memo.clear()


def to_bytes(snapshot: Snapshot, heads: HeaderCache | None = None) -> list[memoryview | bytes]:
    if snapshot.packed is not None:
        return encode_packed(snapshot.skeleton, snapshot.packed.table, snapshot.packed.data(), snapshot.extra, heads)
    return encode_state(snapshot.tree, snapshot.extra)


def from_bytes(meta: SnapMeta, data: bytearray) -> Snapshot:
    tree, extra = decode_state(data)
    return Snapshot(meta.step, meta.gen, meta.rank, meta.world_size, tree, extra)


class SnapshotPusher:
    """Takes (optionally) and pushes each snapshot to the node agent on a background thread, one
    at a time.

    One thread for the worker's life, handed each job through a condition: starting a thread per
    push made the training thread wait for the new thread to be scheduled (``Thread.start`` blocks
    until it runs), 0.7-1.4 ms of every snapshotted step of the tiny DiT on 2 shared cores.

    A job is a snapshot already taken (:meth:`push`) or a function that takes it (:meth:`submit`):
    then the copy itself runs on this thread too, while the training thread goes on to the next
    step's device work, and :meth:`wait_captured` holds the training thread before that step
    changes any state the copy reads (see :meth:`InProcess.snapshot`)."""

    def __init__(self, client: MemStateClient, node: str, slot: int, epoch: int, events: EventLog,
                 kill_during: Callable[[int], bool] = lambda step: False, checksum: str = ALGORITHM) -> None:
        self.client = client
        self.checksum = checksum  # the algorithm (elastic.checkpoint.checksum); sha256 for a baseline
        self.kill_during = kill_during  # fault injection: die with a torn upload (elastic.worker.faults)
        self.corrupt_during: Callable[[int], bool] = lambda step: False  # fault injection: a byte changed at rest
        self.node, self.slot, self.epoch = node, slot, epoch
        self.events = events
        self._cond = threading.Condition()
        self._job: Callable[[], Snapshot] | None = None  # the job in flight (None: nothing to wait for)
        self._captured = True  # the job in flight has taken its snapshot (or failed to)
        self._capture_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.last_pushed: int | None = None
        self.failures = 0
        self.push_s: list[float] = []  # each push's duration on the background thread (stats())
        self.push_cpu_s: list[float] = []  # and that thread's CPU time for it
        self.capture_s: list[float] = []  # each deferred capture's duration on this thread
        self.done_at: list[float] = []  # when each job was done (stored or failed), monotonic: the moment a wait() ends
        self._heads = HeaderCache()  # this thread's last header (to_bytes)

    def push(self, snapshot: Snapshot) -> None:
        self.submit(lambda: snapshot)

    def submit(self, take: Callable[[], Snapshot]) -> None:
        """Run ``take`` and push what it returns, on the background thread."""
        self.wait()
        with self._cond:
            self._job, self._captured = take, False
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="snapshot-push", daemon=True)
            self._thread.start()

    def wait_captured(self) -> None:
        """Block until the job in flight has taken its snapshot; re-raises what the taking raised
        (a state that cannot be snapshotted fails the training thread, as a capture there would)."""
        with self._cond:
            self._cond.wait_for(lambda: self._captured)
            error, self._capture_error = self._capture_error, None
        if error is not None:
            raise error

    def take_error(self) -> BaseException | None:
        """What the last deferred capture raised (and forget it)."""
        with self._cond:
            error, self._capture_error = self._capture_error, None
        return error

    def wait(self) -> None:
        """Block until the snapshot in flight is stored by the agent (and its buddy), or failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._job is None)

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None)
                job = self._job
            assert job is not None
            try:
                snapshot = self._take(job)
                if snapshot is not None:
                    self._guarded_push(snapshot)
            finally:
                with self._cond:
                    self._job, self._captured = None, True
                    self.done_at.append(time.monotonic())
                    self._cond.notify_all()

    def _take(self, job: Callable[[], Snapshot]) -> Snapshot | None:
        t0 = time.monotonic()
        try:
            snapshot = job()
            self.capture_s.append(time.monotonic() - t0)
            return snapshot
        except Exception as exc:  # noqa: BLE001 -- handed to the training thread (wait_captured)
            with self._cond:
                self._capture_error = exc
            return None
        finally:
            with self._cond:
                self._captured = True
                self._cond.notify_all()

    def _guarded_push(self, snapshot: Snapshot) -> None:
        try:
            self._push(snapshot)
        except Exception as exc:  # noqa: BLE001 -- a waiting training thread must never hang on it
            self._failed(snapshot, exc)

    def _push(self, snapshot: Snapshot) -> None:
        t0, cpu0 = time.monotonic(), time.thread_time()
        try:
            if snapshot.ready is not None:
                snapshot.ready.synchronize()  # the GPU copy: waited for here, never on the training thread
            chunks = to_bytes(snapshot, self._heads)
            digest, nbytes = digest_chunks(chunks, self.checksum)  # here, off the training thread (it releases the GIL)
            meta = SnapMeta(node=self.node, slot=self.slot, rank=snapshot.rank, world_size=snapshot.world,
                            epoch=self.epoch, gen=snapshot.gen, step=snapshot.step, checksum=digest, nbytes=nbytes)
            if self.kill_during(snapshot.step):
                self.client.snap_put_torn(meta, chunks)  # never returns
            if self.corrupt_during(snapshot.step):
                chunks = _corrupted(chunks)
            self._send(snapshot, meta, chunks)
        except (MemStateError, OSError, RuntimeError, ValueError) as exc:
            self._failed(snapshot, exc)
            return
        self.last_pushed = snapshot.step
        self.push_s.append(time.monotonic() - t0)
        self.push_cpu_s.append(time.thread_time() - cpu0)
        if snapshot.step % 50 == 0 or self.failures:
            self.events.emit("snapshot.pushed", step=snapshot.step, bytes=nbytes, push_s=round(self.push_s[-1], 6))

    def _send(self, snapshot: Snapshot, meta: SnapMeta, chunks: list[memoryview | bytes]) -> None:
        """To the agent: the shared buffer's descriptor where it has one (no bytes copied), else the bytes."""
        shared = snapshot.packed.shared if snapshot.packed is not None else None
        if shared is not None and self.client.shared and len(chunks) == 3:
            self.client.snap_put_shared(meta, shared, memoryview(chunks[1]).nbytes, chunks[0], chunks[2])
        else:
            self.client.snap_put(meta, *chunks)

    def _failed(self, snapshot: Snapshot, exc: BaseException) -> None:
        self.failures += 1
        self.events.emit("snapshot.push_failed", step=snapshot.step, error=f"{type(exc).__name__}: {exc}"[:300])


def _corrupted(chunks: list[memoryview | bytes]) -> list[memoryview | bytes]:
    """Fault injection: the chunks with the data region's first byte changed (in place when it is
    the shared buffer: the agent's stored copy changes as memory at rest would)."""
    data = memoryview(chunks[1]).cast("B") if len(chunks) == 3 else None
    if data is None or not data.nbytes or data.readonly:
        return [bytes(b ^ 0xFF for b in bytes(chunks[0])[:1]) + bytes(chunks[0])[1:], *chunks[1:]]
    data[0] ^= 0xFF
    return chunks


# -- restore ---------------------------------------------------------------------------------------
def _is_shard(value: Any) -> bool:
    return isinstance(value, dict) and SHARD in value


def _full(values: list[Any]) -> Any:
    """The full value from the old ranks' values (shards joined along dim 0; others: the first)."""
    first = values[0]
    if _is_shard(first):
        full = torch.cat([v[SHARD] for v in values], dim=0)
        if list(full.shape) != list(first["shape"]):
            raise SnapshotError(f"shards join to {list(full.shape)}, expected {first['shape']}")
        return full
    if isinstance(first, Mapping):
        return {key: _full([v[key] for v in values]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_full([v[i] for v in values]) for i in range(len(first)))
    return first


def _local_value(saved: Any, target: Any, rank: int, world: int) -> Any:
    """What ``target`` (a leaf of the new state) gets from ``saved`` (a leaf of the old state)."""
    if isinstance(target, DTensor):
        full = saved[SHARD] if _is_shard(saved) else saved
        if _is_shard(saved) and list(full.shape) != list(target.shape):  # own shard, same layout
            return full
        chunks = torch.chunk(full, world, dim=0)
        return chunks[rank] if rank < len(chunks) else full[0:0]
    return saved[SHARD] if _is_shard(saved) else saved


def _write(target: Any, saved: Any, rank: int, world: int, path: str = "") -> Any:
    if isinstance(target, torch.Tensor):
        value = _local_value(saved, target, rank, world)
        local = target._local_tensor if isinstance(target, DTensor) else target
        if not isinstance(value, torch.Tensor) or value.shape != local.shape or value.dtype != local.dtype:
            raise SnapshotError(f"{path}: snapshot holds {getattr(value, 'shape', type(value).__name__)}, "
                                f"the model needs {tuple(local.shape)} {local.dtype}")
        with torch.no_grad():
            local.copy_(value)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, Mapping) or set(saved) != set(target):
            raise SnapshotError(f"{path or '/'}: keys differ from the snapshot")
        for key in list(target):
            target[key] = _write(target[key], saved[key], rank, world, f"{path}/{key}")
        return target
    if isinstance(target, (list, tuple)):
        values = [_write(t, s, rank, world, f"{path}[{i}]") for i, (t, s) in enumerate(zip(target, saved))]
        return values if isinstance(target, list) else type(target)(values)
    return saved[SHARD] if _is_shard(saved) else saved


def restore(state: dict[str, Any], snapshots: list[Snapshot], rank: int, world: int) -> None:
    """Load ``snapshots`` into a freshly built ``state``.

    ``snapshots``: this rank's own snapshot when the world kept its ranks (one item), else every old
    rank's snapshot of the same step in old-rank order (the full tensors are rebuilt from them).
    """
    tree = snapshots[0].tree if len(snapshots) == 1 else _full([s.tree for s in snapshots])
    load_tree(state, tree, rank, world)


def load_tree(state: dict[str, Any], tree: dict[str, Any], rank: int, world: int,
              targets: dict[str, Any] | None = None) -> None:
    """Load a snapshot's ``tree`` into ``state``: each sharded entry is either this rank's shard as
    it is, or a tensor this rank takes its ``torch.chunk`` of (see :func:`_local_value`).
    ``targets``: ``as_state_dicts(state)`` when the caller already has it (a fresh optimizer's state
    is created by that call; the caller may have filled it in place already)."""
    targets = as_state_dicts(state) if targets is None else targets
    for key in sorted(state):
        value = _write(targets[key], tree[key], rank, world, key)
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value
