"""Structured events: one JSON object per line, one file per writer.

Every state change in the runtime (agent start, rendezvous, worker start/exit,
restart, checkpoint commit, exclusion, fault injection...) is recorded as an
event so that recovery times, goodput and chaos invariants can be computed
afterwards from the log alone.  Writers never share a file, so no locking is
needed; readers merge files by timestamp.

Event fields: ``ts`` (wall clock, seconds since the epoch), ``mono`` (monotonic
clock of the writing host), ``kind`` (dotted name, e.g. ``agent.worker_exit``),
``source`` (who wrote it, e.g. ``agent/node1``), ``pid`` and free-form fields.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


_RESERVED = frozenset({"ts", "mono", "kind", "source", "pid"})


class EventLog:
    """Append-only JSONL event writer.

    Writes are flushed line by line: an event must survive the writer being
    SIGKILLed right after ``emit`` returns, because the chaos suite reads the
    log of processes it killed.
    """

    def __init__(self, path: str | os.PathLike[str] | None, source: str) -> None:
        self.source = source
        self._path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._file = None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "a", buffering=1, encoding="utf-8")

    @property
    def path(self) -> Path | None:
        return self._path

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        if fields.keys() & _RESERVED:
            raise ValueError(f"event fields {sorted(fields.keys() & _RESERVED)} are reserved")
        event = {
            "ts": time.time(),
            "mono": time.monotonic(),
            "kind": kind,
            "source": self.source,
            "pid": os.getpid(),
            **fields,
        }
        if self._file is not None:
            line = json.dumps(event, default=str, sort_keys=False)
            with self._lock:
                self._file.write(line + "\n")
                self._file.flush()
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Read and merge event files, sorted by wall-clock timestamp.

    A torn last line (writer killed mid-write) is skipped rather than fatal.
    """
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(_read_one(Path(path)))
    events.sort(key=lambda e: e.get("ts", 0.0))
    return events


def read_run_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run directory (``<run_dir>/events/*.jsonl``)."""
    return read_events(sorted(Path(run_dir, "events").glob("*.jsonl")))


def _read_one(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
