"""Snapshots handed from a worker to its node agent through shared memory, not a socket (no torch).

A worker's packed snapshot buffers (:class:`~elastic.checkpoint.snapshot.Packed`) are anonymous
shared memory (``memfd_create``).  A push sends the buffer's file descriptor to the agent over a
Unix socket (``SCM_RIGHTS``) with the small header and trailer; the agent maps the buffer and keeps
that mapping as the stored snapshot.  The node's copy thus costs no byte of copying beyond the
capture itself: over loopback TCP the worker's send and the agent's receive were two more copies of
every byte, and the receive's fresh buffer a page fault per 4 KiB.

Lifetime: the mapping outlives the worker (a killed worker's last two steps stay readable for the
spare that replaces it).  The worker reuses a buffer only for a capture after the agent stored a
newer step than the one it held (:class:`~elastic.checkpoint.snapshot.SnapshotRing` keeps two,
the agent two, and a push waits for the previous one), so a stored step is not overwritten; if a
push failed and the worker went on, an older stored step may be, and its checksum then refuses it
on read (the restore falls back).  Memory: the node's snapshots are the workers' buffers (three
per worker at most: two kept, one being filled), mapped, not copied, by the agent.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections import OrderedDict

_IDS = itertools.count()

MAPPINGS_PER_SLOT = 4
"""Mappings an agent keeps per worker slot for reuse (a worker's buffers rotate: three in use)."""


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_CLOEXEC")


def unix_address(port: int, token: str) -> str:
    """The agent's Unix socket for its workers' shared-memory pushes (Linux's abstract namespace:
    no file to clean up; every request still carries the token)."""
    return f"\0elastic-memstate-{port}-{token[:12]}"


class SharedBuffer:
    """``nbytes`` of anonymous shared memory (zeroed), its file descriptor kept to hand to the agent."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.id = f"{os.getpid()}-{next(_IDS)}"
        self.fd = os.memfd_create(f"snapshot-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            self.map = mmap.mmap(self.fd, max(nbytes, 1))
        except OSError:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class Parts:
    """A stored snapshot made of chunks (header, the mapped buffer's data, trailer): sent as they are."""

    def __init__(self, *chunks: bytes | bytearray | memoryview) -> None:
        self.chunks = chunks
        self.nbytes = sum(memoryview(c).nbytes for c in chunks)

    def __len__(self) -> int:
        return self.nbytes

    def joined(self) -> bytearray:
        out = bytearray(self.nbytes)
        offset = 0
        for chunk in self.chunks:
            n = memoryview(chunk).nbytes
            out[offset:offset + n] = chunk
            offset += n
        return out


class Mappings:
    """The agent's mappings of its workers' buffers, the newest few per slot (a buffer a worker
    reuses is not mapped again).  A mapping dropped here lives on while a stored snapshot views it."""

    def __init__(self) -> None:
        self._maps: dict[int, OrderedDict[str, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def view(self, slot: int, buffer_id: str, fd: int, size: int, length: int) -> memoryview:
        """The first ``length`` bytes of the worker's buffer ``buffer_id`` (``fd`` is closed here)."""
        try:
            with self._lock:
                maps = self._maps.setdefault(slot, OrderedDict())
                mapped = maps.get(buffer_id)
                if mapped is None or len(mapped) != size:
                    mapped = maps[buffer_id] = mmap.mmap(fd, size)
                maps.move_to_end(buffer_id)
                while len(maps) > MAPPINGS_PER_SLOT:
                    maps.popitem(last=False)
        finally:
            os.close(fd)
        return memoryview(mapped)[:length]
