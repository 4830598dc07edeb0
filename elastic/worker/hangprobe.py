"""Where a worker is when the run stalls: its Python stacks on demand, and its last collective.

Silence alone cannot say who hangs: in synchronous training every healthy rank soon waits in a
collective behind the one that does not arrive.  So every worker installs a :class:`HangProbe`:

* ``faulthandler.register(SIGUSR1)`` dumps every thread's Python stack into
  ``<run_dir>/stacks/e<epoch>-<name>-pid<pid>.txt`` when the node agent asks (``kill -USR1``;
  the pid in the name lets the agent find a worker's files after an in-process re-formation
  gave it another rank).  The dump
  is written by faulthandler's C signal handler, so it works while the main thread is blocked
  in C code (a gloo wait, ``time.sleep``, a lock) and holds no GIL;
* :meth:`HangProbe.collective` records ``in <name> <step>`` / ``out <name> <step>`` with one
  ``pwrite`` into ``<run_dir>/stacks/e<epoch>-<name>-pid<pid>.where`` around the collectives the worker
  session issues itself (its step sync point): a syscall of a few microseconds, no flush.

The agents read both (:mod:`elastic.agent.hangs`): ranks waiting in the collective the others
wait in are victims, the ranks that are not in it are the culprits.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STACKS_DIR = "stacks"
PROBE_SIGNAL = signal.SIGUSR1
_MARK_BYTES = 64


def stack_file(run_dir: Path, epoch: int, name: str, pid: int) -> Path:
    """Where worker ``name`` (``rank3``, process ``pid``) of ``epoch`` dumps its stacks."""
    return Path(run_dir) / STACKS_DIR / f"e{epoch}-{name}-pid{pid}.txt"


def find_stack_file(run_dir: Path, epoch: int, pid: int) -> Path | None:
    """The stack file of worker process ``pid`` in ``epoch`` (whatever its rank is by now)."""
    return next(iter(sorted((Path(run_dir) / STACKS_DIR).glob(f"e{epoch}-*-pid{pid}.txt"))), None)


def where_file(stacks: Path) -> Path:
    """The collective mark (``in sync 12``) beside a worker's stack file."""
    return stacks.with_suffix(".where")


class HangProbe:
    """Installed once per worker process; every method is a no-op if the files could not be made."""

    def __init__(self, run_dir: Path, epoch: int, name: str) -> None:
        self._stacks = None
        self._fd: int | None = None
        try:
            path = stack_file(run_dir, epoch, name, os.getpid())
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stacks = open(path, "w")
            self._fd = os.open(where_file(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            self.close()
            return
        faulthandler.register(PROBE_SIGNAL, file=self._stacks, all_threads=True, chain=False)

    def mark(self, text: str) -> None:
        if self._fd is not None:
            try:
                os.pwrite(self._fd, text[:_MARK_BYTES - 1].ljust(_MARK_BYTES - 1).encode() + b"\n", 0)
            except OSError:
                pass  # a full disk must not fail a training step

    @contextmanager
    def collective(self, name: str, step: int) -> Iterator[None]:
        """Mark the time spent in a collective (``in``) and after it (``out``)."""
        self.mark(f"in {name} {step}")
        try:
            yield
        finally:
            self.mark(f"out {name} {step}")

    def close(self) -> None:
        if self._stacks is not None:
            faulthandler.unregister(PROBE_SIGNAL)
            self._stacks.close()
            self._stacks = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
