"""Where checkpoint bytes go: the ``CheckpointStorage`` seam.

Every byte of a checkpoint (tensor shards, manifest, commit marker) is written
through :meth:`CheckpointStorage.write_file`, so a test or the chaos suite can
make the write path fail for real.  :class:`LocalStorage` is the only
production implementation (local or network-mounted filesystem).

Fault injection for chaos runs is configured by one environment variable,
read at every save so a worker inherits it from its launcher::

    ELASTIC_CKPT_FAIL_WRITE=STEP[:RANK][,STEP[:RANK]...]

e.g. ``12`` (every rank fails the save of step 12) or ``12:1,20`` (rank 1
fails step 12, every rank fails step 20).  A matching save writes part of its
first file and then raises ``OSError(ENOSPC)`` from inside the write loop,
which is what a full disk looks like to the writer.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

FAIL_WRITE_ENV = "ELASTIC_CKPT_FAIL_WRITE"

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
    """Wraps a storage; saves of the chosen steps run out of disk space part-way.

    ``faults`` maps a step to the set of ranks that fail it (``None``: all ranks).
    """

    def __init__(self, inner: CheckpointStorage, faults: Mapping[int, set[int] | None], rank: int) -> None:
        self.inner = inner
        self.faults = dict(faults)
        self.rank = rank

    def _fails(self, step: int) -> bool:
        if step not in self.faults:
            return False
        ranks = self.faults[step]
        return ranks is None or self.rank in ranks

    def write_file(self, path: Path, chunks: Iterable[Chunk], step: int) -> int:
        if self._fails(step):
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
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by " + FAIL_WRITE_ENV + ")", str(path))


def parse_fail_write(spec: str) -> dict[int, set[int] | None]:
    """Parse the ``ELASTIC_CKPT_FAIL_WRITE`` syntax; raises ValueError on garbage."""
    faults: dict[int, set[int] | None] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        step_text, sep, rank_text = part.partition(":")
        step = int(step_text)
        if not sep:
            faults[step] = None
            continue
        current = faults.get(step, set())
        if current is None:  # already "all ranks"
            continue
        current.add(int(rank_text))
        faults[step] = current
    return faults


def storage_for_save(base: CheckpointStorage, rank: int, environ: Mapping[str, str] | None = None) -> CheckpointStorage:
    """``base``, wrapped with fault injection if ``ELASTIC_CKPT_FAIL_WRITE`` is set."""
    spec = (os.environ if environ is None else environ).get(FAIL_WRITE_ENV, "")
    if not spec.strip():
        return base
    return FaultInjectingStorage(base, parse_fail_write(spec), rank)
