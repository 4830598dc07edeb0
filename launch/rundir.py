"""The run directory must be usable before anything starts: one line naming the path and the cause.

A run directory that cannot be created (``/proc/nope``, a path below a file), is not writable,
or (local mode) has too little room for the embedded etcd's write-ahead log, which etcd
preallocates in 64 MiB segments, stops the launch with exit 2 instead of a traceback or an etcd
that dies with the cause only in its own log.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ETCD_WAL_BYTES = 64 << 20
"""etcd 3.5 preallocates each write-ahead-log segment (wal.SegmentSizeBytes) at start."""
_HEADROOM_BYTES = 16 << 20  # etcd's snapshot db, the run's events and logs


class RunDirError(Exception):
    """The run directory cannot be used; ``str()`` is one line naming the path and the cause."""


def _cause(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def prepare_run_dir(run_dir: Path, embedded_etcd: bool) -> None:
    """Create ``run_dir`` and prove it writable (and, for a local launch, roomy enough for etcd)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"{exc.filename or run_dir}: cannot create the run directory: {_cause(exc)}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-probe-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise RunDirError(f"{run_dir}: the run directory is not writable: {_cause(exc)}") from None
    if embedded_etcd:
        free = shutil.disk_usage(run_dir).free
        if free < ETCD_WAL_BYTES + _HEADROOM_BYTES:
            raise RunDirError(f"{run_dir}: only {free / (1 << 20):.1f} MiB free; the embedded etcd needs "
                              f"{(ETCD_WAL_BYTES + _HEADROOM_BYTES) >> 20} MiB (it preallocates a 64 MiB "
                              f"write-ahead log in {run_dir / 'etcd'})")


def os_error_line(exc: OSError) -> str:
    """One line for an OSError met while the run was going (a disk filling up under the launcher)."""
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{_cause(exc)}"
