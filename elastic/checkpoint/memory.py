"""Worker side of the in-memory fast path: push each saved state to the agent, load it back.

What is pushed is this rank's *local view* of exactly the state the
checkpoint saved: the same nested state dicts DCP was given (Stateful objects
turned into their ``state_dict()``), with every DTensor replaced by its local
shard, serialized with ``torch.save``.  With async saves it is DCP's own
staged copy (:class:`~elastic.checkpoint.staging.FlatStager`'s buffer), so the push
costs no second snapshot on the training thread and holds the very bytes the
shard files were written from.

Loading mirrors what ``dcp.load`` does with a same-layout checkpoint: ask
each Stateful for its ``state_dict()``, copy every saved tensor into the
corresponding (local) tensor in place, replace every non-tensor value, then
hand the dicts back with ``load_state_dict()``.  The values are bitwise the
saved ones, so a resume from memory continues exactly like one from disk.

The decision is collective and all-or-nothing: every rank fetches its slot's
entry and checks it against the newest committed checkpoint (step and id
from its COMMIT marker, fingerprint, world size); only when every rank holds
a usable entry and the entries cover every saved rank exactly once does
anyone load from memory.  Rank placement may change across a restart (torch
orders a round's nodes by agent pid), so an entry may sit on the node that
is now another rank: the ranks then swap entries over the checkpoint's gloo
group (point-to-point, RAM to RAM) before loading.  Any failure after the
decision (layout mismatch, a swap that does not verify) is also agreed on
collectively and sends every rank to the disk path, which overwrites
whatever the memory path had already written.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elastic.checkpoint.config import MemoryCacheConfig
from elastic.common import collectives
from elastic.common.env import EPOCH_ENV
from elastic.common.events import EventLog
from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memstate import EntryMeta, MemStateError, reject_reason, sha256_bytes, sha256_chunks

_FORMAT = "elastic-memstate-v1"
_TENSOR_REF = "__memstate_tensor__"
_ALIGN = 64


class MemoryLayoutMismatch(ValueError):
    """A cached state does not fit the state it should be loaded into (names, shapes, dtypes)."""


def as_state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP saves for ``state``: each Stateful replaced by its state_dict()."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def _skeleton(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` with each tensor (DTensor: its local shard) replaced by its index in ``tensors``."""
    if isinstance(tree, torch.Tensor):
        # The entry is host bytes: a GPU tensor (the live state, when saves are synchronous) is
        # copied to host memory here; numpy() cannot read device memory.  CPU tensors: no copy.
        tensors.append(_local(tree).detach().cpu())
        return {_TENSOR_REF: len(tensors) - 1}
    if isinstance(tree, Mapping):
        return {key: _skeleton(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(value, tensors) for value in tree)
    return tree


def encode_state(tree: Mapping[str, Any], extra: bytes) -> list[memoryview | bytes]:
    """The entry as chunks: a small header, then every tensor's raw bytes (views, no copy), then ``extra``.

    Layout: 8-byte little-endian header length, the header (the tree with tensor references, each
    tensor's dtype/shape/offset: see :func:`_dump_header`), padding to 64 bytes, the tensor data
    (each tensor 64-byte aligned), the extra blob.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(tree, tensors)
    views = [_raw(t) for t in tensors]
    table, offset = data_table(tensors)
    chunks: list[memoryview | bytes] = [_head(skeleton, table, offset, len(extra))]
    pos = 0
    for (_, _, off, _), view in zip(table, views):
        if off > pos:
            chunks.append(b"\0" * (off - pos))
        chunks.append(view)
        pos = off + view.nbytes
    chunks.append(bytes(extra))
    return chunks


def data_table(tensors: list[torch.Tensor]) -> tuple[list[tuple[str, list[int], int, int]], int]:
    """Each tensor's (dtype name, shape, offset, bytes) in the data region, 64-byte aligned; its size."""
    table, offset = [], 0
    for tensor in tensors:
        offset += -offset % _ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        table.append((str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset += nbytes
    return table, offset


def _head(skeleton: Any, table: list[tuple[str, list[int], int, int]], data_bytes: int, extra_bytes: int) -> bytes:
    header = _dump_header({"format": _FORMAT, "state": skeleton, "tensors": table, "data_bytes": data_bytes,
                           "extra_bytes": extra_bytes})
    head = struct.pack("<Q", len(header)) + header
    return head + b"\0" * (-len(head) % _ALIGN)


def encode_packed(skeleton: Any, table: list[tuple[str, list[int], int, int]], data: memoryview,
                  extra: bytes, heads: HeaderCache | None = None) -> list[memoryview | bytes]:
    """:func:`encode_state`'s chunks when the tensors already sit in one buffer laid out by
    :func:`data_table` (a per-step snapshot's): header, that buffer, ``extra`` -- three chunks."""
    head = heads.head(skeleton, table, data.nbytes, len(extra)) if heads is not None \
        else _head(skeleton, table, data.nbytes, len(extra))
    return [head, data, bytes(extra)]


class HeaderCache:
    """The last header a pusher encoded, reused while what it encodes is equal.

    Why: a per-step snapshot's header is the same from step to step but for a few scalars (the
    step, a learning rate), and pickling it (checked by loading it back) was 0.1 ms of each push's
    CPU for the tiny DiT (quiet core).  The comparison is C-level and short-circuits on the
    sub-skeletons a capture shares with the last one (:class:`~elastic.checkpoint.snapshot.SkeletonMemo`)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._head = b""

    def head(self, skeleton: Any, table: list[tuple[str, list[int], int, int]], data_bytes: int,
             extra_bytes: int) -> bytes:
        key = (skeleton, table, data_bytes, extra_bytes)
        if self._key is None or not _equal(self._key, key):
            self._key, self._head = key, _head(skeleton, table, data_bytes, extra_bytes)
        return self._head


def _equal(a: Any, b: Any) -> bool:
    """``a == b``, False where a comparison raises (a value whose ``==`` is not a bool)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- then simply not equal: the header is encoded anew
        return False


def tensor_ref(index: int) -> dict[str, int]:
    """How a skeleton names the ``index``-th tensor of the data region."""
    return {_TENSOR_REF: index}


def resolve(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """``skeleton`` with each tensor reference replaced by its tensor."""
    return _resolve(skeleton, tensors)


def _resolve(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and _TENSOR_REF in skeleton:
            return tensors[skeleton[_TENSOR_REF]]
        return {key: _resolve(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_resolve(value, tensors) for value in skeleton)
    return skeleton


class _PlainUnpickler(pickle.Unpickler):
    """Builtin containers and scalars only: pickle writes those as opcodes, so any class lookup
    means the bytes are not a header this module wrote, and nothing in them may run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a memory-state header may not name {module}.{name}")


def _dump_header(header: dict[str, Any]) -> bytes:
    """Plain pickle where the tree holds only builtins (checked by loading it back the safe way),
    else ``torch.save``.  ``torch.save`` calls a Python hook per pickled object: ~0.6 ms of every
    per-step snapshot push of the tiny DiT, a tenth of the push's CPU (``benchmarks/recovery.py``)."""
    data = pickle.dumps(header, protocol=5)
    try:
        _PlainUnpickler(io.BytesIO(data)).load()
        return data
    except pickle.UnpicklingError:
        buf = io.BytesIO()
        torch.save(header, buf)
        return buf.getvalue()


def _load_header(data: memoryview) -> Any:
    if bytes(data[:1]) == b"\x80":  # a pickle stream (torch.save writes a zip: b"PK")
        return _PlainUnpickler(io.BytesIO(data)).load()
    return torch.load(io.BytesIO(data), weights_only=True)


def decode_state(data: bytearray | bytes) -> tuple[dict[str, Any], bytes]:
    """(state tree, extra blob).  Tensors are views into ``data`` (no copy); the header is loaded
    with ``weights_only``: the bytes came over a socket, so nothing in them may run code."""
    try:
        (head_len,) = struct.unpack_from("<Q", data, 0)
        header = _load_header(memoryview(data)[8:8 + head_len])
    except (struct.error, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise MemoryLayoutMismatch(f"cached state has no readable header ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise MemoryLayoutMismatch(f"cached state is not {_FORMAT}")
    base = 8 + head_len + (-(8 + head_len) % _ALIGN)
    if base + header["data_bytes"] + header["extra_bytes"] != len(data):
        raise MemoryLayoutMismatch("cached state is truncated")
    tensors = []
    for dtype_name, shape, offset, nbytes in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        flat = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=base + offset)
        tensors.append(flat.view(dtype).view(shape))
    extra_at = base + header["data_bytes"]
    return _resolve(header["state"], tensors), bytes(memoryview(data)[extra_at:])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def check_layout(target: Any, saved: Any, path: str = "") -> None:
    """Raise MemoryLayoutMismatch unless ``saved`` can be restored into ``target`` as is."""
    if isinstance(target, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise MemoryLayoutMismatch(f"{path}: tensor now, {type(saved).__name__} cached")
        local = _local(target)
        if local.shape != saved.shape or local.dtype != saved.dtype:
            raise MemoryLayoutMismatch(
                f"{path}: {tuple(saved.shape)} {saved.dtype} cached, {tuple(local.shape)} {local.dtype} now"
            )
    elif isinstance(target, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != set(target):
            raise MemoryLayoutMismatch(f"{path or '/'}: keys differ from the cached state")
        for key, value in target.items():
            check_layout(value, saved[key], f"{path}/{key}")
    elif isinstance(target, (list, tuple)):
        if type(saved) is not type(target) or len(saved) != len(target):
            raise MemoryLayoutMismatch(f"{path}: {type(target).__name__} of {len(target)} now, different cached")
        for i, value in enumerate(target):
            check_layout(value, saved[i], f"{path}[{i}]")
    elif isinstance(saved, torch.Tensor):
        raise MemoryLayoutMismatch(f"{path}: {type(target).__name__} now, tensor cached")


def _restore(target: Any, saved: Any) -> Any:
    """Write ``saved`` into ``target`` (tensors in place); return the value the parent should hold."""
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            _local(target).copy_(saved)
        return target
    if isinstance(target, dict):
        for key in list(target):
            target[key] = _restore(target[key], saved[key])
        return target
    if isinstance(target, list):
        for i in range(len(target)):
            target[i] = _restore(target[i], saved[i])
        return target
    if isinstance(target, tuple):
        return type(target)(_restore(t, s) for t, s in zip(target, saved))
    return saved


@dataclass(frozen=True)
class _RankInfo:
    usable: bool
    saved_rank: int
    sha256: str
    nbytes: int
    reason: str


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


class MemoryFastPath:
    """Push after each save, try before each load; every failure is an event, never an exception."""

    def __init__(
        self,
        client: MemStateClient,
        fingerprint: str,
        events: EventLog,
        group: dist.ProcessGroup | None,
        slot: int,
        epoch: int,
    ) -> None:
        self.client = client
        self.fingerprint = fingerprint
        self.events = events
        self.group = group
        self.slot = slot
        self.epoch = epoch

    @classmethod
    def from_env(
        cls, config: MemoryCacheConfig, fingerprint: str, events: EventLog, group: dist.ProcessGroup | None,
        client: MemStateClient | None = None, environ: Mapping[str, str] | None = None,
    ) -> MemoryFastPath | None:
        """The fast path for a worker under an agent with the cache on, else None (with an event saying why)."""
        if not config.enabled:
            return None
        env = dict(os.environ if environ is None else environ)
        if client is None:
            client = MemStateClient.from_env(env, config.timeout_s)
        if client is None:
            events.emit("checkpoint.memory_unavailable", reason="no agent cache (ELASTIC_MEMSTATE_ADDR unset)")
            return None
        return cls(client, fingerprint, events, group, slot=int(env.get("LOCAL_RANK", 0)),
                   epoch=int(env.get(EPOCH_ENV) or 0))

    # -- save side -------------------------------------------------------------------
    def push(self, step: int, checkpoint_id: str, tree: Mapping[str, Any], extra: bytes) -> None:
        t0 = time.monotonic()
        try:
            chunks = encode_state(tree, extra)
            sha, nbytes = sha256_chunks(chunks)
            meta = EntryMeta(slot=self.slot, rank=collectives.rank(self.group),
                             world_size=collectives.world_size(self.group), step=step,
                             checkpoint_id=checkpoint_id, fingerprint=self.fingerprint, epoch=self.epoch,
                             sha256=sha, nbytes=nbytes)
            self.client.put(meta, *chunks)
        except (MemStateError, OSError, RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            # TypeError / NotImplementedError: a tensor whose bytes cannot be read on the host
            # (e.g. a meta tensor); the push is an optimisation and must never stop training.
            self.events.emit("checkpoint.memory_push_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500])
            return
        self.events.emit("checkpoint.memory_pushed", step=step, slot=self.slot, bytes=meta.nbytes,
                         push_s=round(time.monotonic() - t0, 6))

    # -- load side -------------------------------------------------------------------
    def try_load(
        self, state: dict[str, Any], step: int, checkpoint_id: str
    ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """Collective: load committed checkpoint (step, checkpoint_id) from the agents' caches.

        Returns (step, extra, event fields) or None (every rank then goes to disk).
        """
        rank, world = collectives.rank(self.group), collectives.world_size(self.group)
        t0 = time.monotonic()
        data, info = self._fetch(step, checkpoint_id, world)
        t_fetch = time.monotonic()
        infos = self._gather(info)
        if not all(i.usable for i in infos) or sorted(i.saved_rank for i in infos) != list(range(world)):
            self._miss(step, info.reason or "another rank has no usable entry")
            return None
        holder = next(r for r, i in enumerate(infos) if i.saved_rank == rank)
        error = ""
        try:
            if holder != rank:
                data = self._swap(data, infos, rank, holder)
            if sha256_bytes(data) != infos[holder].sha256:
                raise MemoryLayoutMismatch("entry received from a peer does not match its sha256")
            t_swap = time.monotonic()
            tree, extra_blob = decode_state(data)
            t_decode = time.monotonic()
            targets = as_state_dicts(state)
            check_layout(targets, tree)
        except (MemoryLayoutMismatch, RuntimeError, OSError, KeyError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        if not collectives.all_true(not error, self.group):
            self._miss(step, error or "another rank's entry does not fit")
            return None
        t_apply = time.monotonic()
        try:
            for key in sorted(state):
                value = _restore(targets[key], tree[key])
                if isinstance(state[key], Stateful):
                    state[key].load_state_dict(value)
                else:
                    state[key] = value
            extra = torch.load(io.BytesIO(extra_blob), weights_only=False) if extra_blob else {}
        except (RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        if not collectives.all_true(not error, self.group):
            # Some ranks may have written part of the state: the disk load that follows rewrites all of it.
            self._miss(step, error or "restore failed on another rank")
            return None
        timings = {"fetch_s": t_fetch - t0, "swap_s": t_swap - t_fetch, "decode_s": t_decode - t_swap,
                   "target_s": t_apply - t_decode, "restore_s": time.monotonic() - t_apply}
        return step, extra, {"exchanged": holder != rank, "bytes": len(data),
                             **{k: round(v, 6) for k, v in timings.items()}}

    def _fetch(self, step: int, checkpoint_id: str, world: int) -> tuple[bytearray | None, _RankInfo]:
        try:
            got = self.client.get(self.slot)
        except MemStateError as exc:
            return None, _RankInfo(False, -1, "", 0, f"{type(exc).__name__}: {exc}")
        if got is None:
            return None, _RankInfo(False, -1, "", 0, f"slot {self.slot} is empty")
        meta, data = got
        reason = reject_reason(meta, step=step, checkpoint_id=checkpoint_id, fingerprint=self.fingerprint,
                               world_size=world, slot=self.slot)
        if reason is not None:
            return None, _RankInfo(False, -1, "", 0, reason)
        return data, _RankInfo(True, meta.rank, meta.sha256, meta.nbytes, "")

    def _gather(self, info: _RankInfo) -> list[_RankInfo]:
        if not dist.is_initialized():
            return [info]
        out: list[Any] = [None] * collectives.world_size(self.group)
        dist.all_gather_object(out, info, group=self.group)
        return out

    def _swap(self, data: bytearray | None, infos: list[_RankInfo], rank: int, holder: int) -> bytearray:
        """Send this rank's entry to the rank that saved it; receive ours from whoever holds it."""
        assert data is not None
        # Saved ranks form a permutation, so a rank not holding its own entry holds another's.
        send = torch.frombuffer(data, dtype=torch.uint8)
        recv = torch.empty(infos[holder].nbytes, dtype=torch.uint8)
        requests = [
            dist.isend(send, _global(self.group, infos[rank].saved_rank), group=self.group),
            dist.irecv(recv, _global(self.group, holder), group=self.group),
        ]
        for request in requests:
            request.wait()
        return bytearray(recv.numpy().tobytes())

    def _miss(self, step: int, reason: str) -> None:
        self.events.emit("checkpoint.memory_miss", step=step, slot=self.slot, reason=reason[:500])
