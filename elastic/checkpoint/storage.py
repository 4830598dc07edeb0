"""Where checkpoint bytes go: the ``CheckpointStorage`` seam.

Every byte of a checkpoint (tensor shards, manifest, commit marker) is written
through :meth:`CheckpointStorage.write_file`, so a test or the chaos suite can
make the write path fail for real.  :class:`LocalStorage` is the only
production implementation (local or network-mounted filesystem).

Fault injection: :class:`FaultInjectingStorage` wraps a storage with a predicate
over the step being saved; the worker session builds it from the run's fault files
(``{"kind": "ckpt_write_error", "step": 12, "rank": 1}``, see
:mod:`elastic.worker.faults`).  A failing save writes part of its first file and
then raises ``OSError(ENOSPC)`` from inside the write loop, which is what a full
disk looks like to the writer.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

Chunk = bytes | bytearray | memoryview


@runtime_checkable
class CheckpointStorage(Protocol):
    """The filesystem operations a checkpoint save needs."""

    def write_file(self, path: Path, chunks: Iterable[Chunk], step: int) -> int:
        """Create ``path`` (truncating), write ``chunks``, fsync; return bytes written."""
        ...

    def remove_tree(self, path: Path) -> None:
        """Remove a directory and everything under it; a missing path is not an error."""
        ...


class LocalStorage:
    """Plain files, fsynced before ``write_file`` returns."""

    def write_file(self, path: Path, chunks: Iterable[Chunk], step: int) -> int:
        written = 0
        with open(path, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
                written += len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes
            fh.flush()
            os.fsync(fh.fileno())
        return written

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


class FaultInjectingStorage:
    """Wraps a storage; the saves that ``fails(step)`` picks run out of disk space part-way."""

    def __init__(self, inner: CheckpointStorage, fails: Callable[[int], bool]) -> None:
        self.inner = inner
        self.fails = fails

    def write_file(self, path: Path, chunks: Iterable[Chunk], step: int) -> int:
        if self.fails(step):
            return self.inner.write_file(path, _run_out_of_space(chunks, path), step)
        return self.inner.write_file(path, chunks, step)

    def remove_tree(self, path: Path) -> None:
        self.inner.remove_tree(path)


def _run_out_of_space(chunks: Iterable[Chunk], path: Path) -> Iterator[Chunk]:
    """Yield the first chunk (truncated to half), then fail like a full disk."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        yield view[: max(1, view.nbytes // 2)]
        break
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected fault)", str(path))
