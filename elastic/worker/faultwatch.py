"""Faults pushed to a worker, never waited for: the monitor thread, the abort, the unwind.

Under gloo a dead peer makes the survivors' next collective raise at once ("Connection closed
by peer"), and in-process recovery used to start from that error.  Under NCCL nothing raises: the
collective's kernel spins on the GPU, the training thread blocks at its next CUDA sync
(``float(loss)``), and only the watchdog's timeout ends it, by killing the process
(``../shared/reference/nccl-faults.md``).  So a worker learns of a fault from its agent instead:

* the agent that sees it (a reaped worker, a lost ring neighbour, a hang verdict) pushes it for
  the generation it broke: to its own workers over the local channel, to every other agent with one
  etcd put they watch (:mod:`elastic.agent.inprocess`);
* every worker runs a :class:`FaultMonitor` thread blocked on its agent's memory store for a fault
  of its generation (op ``fault_wait``).  On one it tears the generation down through the
  :class:`FaultLatch` (every process group aborted together, ``_abort_process_group``, then every
  TCP stream but etcd's and the agent's shut: gloo's abort leaves its pairs open and the c10d store
  is a plain socket under both backends) and raises :class:`PeerAborted` asynchronously into the
  training thread, wherever it is blocked (a collective, a device sync, a data-loader wait): it
  unwinds at its next bytecode, and the recovery proceeds as after a raised collective error.

The asynchronous exception lands only inside :meth:`FaultLatch.armed` (a step, not the recovery,
not a save's teardown), and is cleared when the zone closes, so it never surfaces in code that
does not expect it.

``ELASTIC_TEST_PEER_FAILURE=hang`` (a test switch) makes a collective that fails because a peer
went away block instead of raising, as NCCL's would, until its generation is torn down; then it
raises :class:`PeerAborted`, as a collective on an aborted NCCL communicator does.  With it on, a
CPU run recovers only through the pushed fault.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from elastic.common.peers import is_peer_lost

PEER_FAILURE_ENV = "ELASTIC_TEST_PEER_FAILURE"
"""Test switch: ``hang`` makes peer-loss errors inside collectives block (NCCL's behaviour)."""


class PeerAborted(RuntimeError):
    """The generation this worker trained in was torn down because a peer failed (pushed fault)."""

    def __init__(self, reason: str = "the generation was aborted: a peer failed (pushed fault)") -> None:
        super().__init__(reason)


class FaultChannel(Protocol):
    """Where a worker hears pushed faults (its agent's memory store client)."""

    def fault_wait(self, epoch: int, since_gen: int, timeout_s: float) -> dict[str, Any] | None: ...


def _covered(fault: dict[str, Any], lost: frozenset[str]) -> bool:
    """A pushed node loss of a node the plan already formed without."""
    return fault.get("kind") == "node_lost" and fault.get("node") in lost


class FaultLatch:
    """The generation this worker's process groups belong to, and whether it was torn down.

    Shared by the training thread (which forms generations and tears the old one down before a
    re-formation) and the monitor thread (which tears it down on a pushed fault): each generation
    is torn down once, by whichever comes first, under one lock.  A late monitor thus never cuts a
    newer generation's connections, and a generation torn down while it was still forming is
    noticed by :meth:`check` before its groups start."""

    def __init__(self, teardown: Callable[[], dict[str, Any]]) -> None:
        self._teardown = teardown
        self._lock = threading.Lock()
        self.gen = 0  # the generation whose groups are live or forming
        self._torn: set[int] = set()
        self._ahead: dict[int, list[dict[str, Any]]] = {}  # gen -> the pushed faults that broke it before it formed
        self._lost: frozenset[str] = frozenset()  # the nodes the current generation's plan formed without
        self.torn_event = threading.Event()  # set while self.gen is torn down
        self.recovering = threading.Event()  # set once the training thread began leaving self.gen (leave())
        self.fault: dict[str, Any] | None = None  # the pushed fault that tore a generation down, if one did
        self._armed = False
        self._thread_id = threading.main_thread().ident
        self.unwound_at: float | None = None  # when the monitor raised into the training thread

    # -- the training thread ----------------------------------------------------------------
    def forming(self, gen: int, lost: frozenset[str] | set[str] = frozenset()) -> None:
        """The training thread now forms generation ``gen`` (after tearing the previous one down);
        ``lost``: the nodes its plan formed without.  A fault that broke ``gen`` ahead of time only
        by losing one of those nodes breaks nothing: the plan already left the node out.  Measured:
        a node's loss pushed for the generation being planned (it might have joined) reached the
        workers before the plan, which then declared it lost; they failed that generation anyway,
        formed the next one relative to it (a world that never trained, so no snapshot matched)
        and fell back to disk (``tests/test_recovery_memory_e2e.py``, once in a full run)."""
        with self._lock:
            self.gen, self._lost = gen, frozenset(lost)
            self.recovering.clear()
            if gen in self._torn and all(_covered(f, self._lost) for f in self._ahead.get(gen, [{}])):
                self._torn.discard(gen)
            if gen in self._torn:  # a pushed fault broke it before it formed (fault_through)
                self.torn_event.set()
            else:
                self.torn_event.clear()

    def note_recovering(self) -> None:
        """The training thread reached its recovery (it leaves the generation): it was not stuck."""
        self.recovering.set()

    def torn(self) -> bool:
        """The current generation was torn down: any error of its world is that abort's doing
        (a group gone, a socket cut), whatever its text."""
        return self.gen in self._torn

    def check(self, gen: int | None = None) -> None:
        """Raise PeerAborted when generation ``gen`` (the current one) was torn down meanwhile."""
        if (self.gen if gen is None else gen) in self._torn:
            raise PeerAborted(self.describe())

    def teardown(self, gen: int | None = None, fault: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Tear generation ``gen`` (default: the current one) down once; its figures, or None when it
        was torn down already (or is not the current one: its groups are gone)."""
        with self._lock:
            gen = self.gen if gen is None else gen
            if gen in self._torn or gen != self.gen:
                return None
            self._torn.add(gen)
            self.fault = fault or self.fault
            figures = self._teardown()
            self.torn_event.set()
            return figures

    def fault_through(self, gen: int, fault: dict[str, Any]) -> dict[str, Any] | None:
        """A pushed fault of generation ``gen``, which breaks every generation up to it: the current
        one is torn down (its figures; None when it was already, or is newer than ``gen``), and a
        newer one up to ``gen`` that this worker has yet to form is marked, so that :meth:`check`
        fails it as soon as it forms (its plan counted a rank that died: its store would wait for
        that rank until its timeout)."""
        with self._lock:
            if gen < self.gen or (gen == self.gen and _covered(fault, self._lost)):
                return None  # older, or a loss the current plan already left out
            ahead = set(range(self.gen + 1, gen + 1)) - self._torn
            for later in range(self.gen + 1, gen + 1):
                self._ahead.setdefault(later, []).append(fault)
            if ahead:
                self._torn |= ahead
                self.fault = fault
        return self.teardown(self.gen, fault)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The zone where the monitor may raise PeerAborted into this (the training) thread."""
        with self._lock:
            self._thread_id = threading.get_ident()
            self._armed = True
        try:
            yield
        finally:
            self.disarm()

    def disarm(self) -> None:
        """No asynchronous exception from here on, and none pending (idempotent)."""
        with self._lock:
            self._armed = False
            _set_async_exc(self._thread_id, None)

    # -- the monitor thread -----------------------------------------------------------------
    def unwind(self) -> bool:
        """Raise PeerAborted in the training thread if it is in its armed zone (True if raised)."""
        with self._lock:
            if not self._armed:
                return False
            self._armed = False  # once: the zone's exit clears what was not delivered
            self.unwound_at = time.time()
            return _set_async_exc(self._thread_id, PeerAborted)

    def describe(self) -> str:
        fault = self.fault or {}
        if not fault:
            return f"generation {self.gen} was torn down"
        return (f"generation {fault.get('gen')} aborted: {fault.get('kind', 'fault')} of "
                f"{fault.get('node', '?')} ({fault.get('reason', '')})")


def _set_async_exc(thread_id: int | None, exc: type[BaseException] | None) -> bool:
    """CPython's PyThreadState_SetAsyncExc: ``exc`` raised in the thread at its next bytecode
    (None clears a pending one).  The only way to unwind a thread blocked where no Python code of
    ours runs; it lands once the blocking C call returns (after the abort)."""
    if thread_id is None:
        return False
    # The class by address (CPython's id) or NULL, which clears: a py_object argument cannot be NULL.
    done = _SET_ASYNC_EXC(ctypes.c_ulong(thread_id), ctypes.c_void_p(id(exc)) if exc is not None else None)
    return done == 1


_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc
_SET_ASYNC_EXC.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
_SET_ASYNC_EXC.restype = ctypes.c_int


class FaultMonitor:
    """A worker's thread that waits for pushed faults of its generation and acts on them."""

    POLL_S = 30.0
    """One fault wait's length: the request is re-sent this often while nothing happens (loopback)."""

    STUCK_S = 10.0
    """How long the training thread may take, after this monitor tore its generation down and raised
    into its step, to reach its recovery.  It normally takes milliseconds: the abort fails what it
    waits on and the unwind lands at its next bytecode.  (Only a step is watched: a spare's build or
    a restore's fetch runs no collective and may rightly take longer before it notices.)  One
    thread stayed in a gloo ``work.wait()`` through the abort and the cut sockets (2 of ~20 node
    losses under a CPU hog; cause not found), until the hang detector's 60 s and a restart from
    disk.  Past this, the process ends itself (``on_stuck``): its agent sees a worker die and its
    warm spare takes the slot in-process."""

    def __init__(self, channel: FaultChannel, epoch: int, latch: FaultLatch,
                 emit: Callable[..., None], current_gen: Callable[[], int],
                 on_stuck: Callable[[], None] | None = None) -> None:
        self.channel = channel
        self.epoch = epoch
        self.latch = latch
        self.emit = emit
        self.current_gen = current_gen
        self.on_stuck = on_stuck or _kill_self
        self.handled = -1  # the newest generation whose fault this monitor acted on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-monitor", daemon=True)

    def start(self) -> FaultMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            since = max(self.handled + 1, self.current_gen())
            try:
                fault = self.channel.fault_wait(self.epoch, since, self.POLL_S)
            except Exception:  # noqa: BLE001 - the agent is restarting or gone: its death ends us too
                self._stop.wait(1.0)
                continue
            if fault is not None and not self._stop.is_set():
                self.act(fault)

    def act(self, fault: dict[str, Any]) -> None:
        """Tear the faulted generation down and unwind the training thread."""
        gen = int(fault.get("gen", -1))
        self.handled = max(self.handled, gen)
        t0 = time.monotonic()
        figures = self.latch.fault_through(gen, fault)
        unwound = self.latch.unwind() if figures is not None else False
        pushed_at = float(fault.get("ts", 0.0) or 0.0)
        self.emit("recovery.fault_pushed", gen=gen, node=fault.get("node"), fault_kind=fault.get("kind"),
                  by=fault.get("by"), reason=str(fault.get("reason", ""))[:300], acted=figures is not None,
                  unwound=unwound, abort_s=round(time.monotonic() - t0, 4),
                  since_push_s=round(time.time() - pushed_at, 4) if pushed_at else None, **(figures or {}))
        if unwound:  # raised into a step: one that has not left it by STUCK_S is blocked in C
            self._watch_recovery(self.latch.gen)

    def _watch_recovery(self, gen: int) -> None:
        """The training thread must reach its recovery within STUCK_S of the teardown (see there)."""
        def watch() -> None:
            if self.latch.recovering.wait(self.STUCK_S) or self._stop.is_set() or self.latch.gen != gen:
                return
            self.emit("recovery.stuck", gen=gen, waited_s=self.STUCK_S, where=_training_stack(self.latch))
            self.on_stuck()

        threading.Thread(target=watch, name=f"recovery-watch-g{gen}", daemon=True).start()


def _training_stack(latch: FaultLatch) -> list[str]:
    """Where the training thread is blocked: its innermost frames, ``file:line function``."""
    frame = sys._current_frames().get(latch._thread_id or 0)
    return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
            for f in traceback.extract_stack(frame)[-6:]] if frame is not None else []


def _kill_self() -> None:
    """SIGKILL: nothing of this process can be trusted to unwind (its agent reaps the death)."""
    os.kill(os.getpid(), signal.SIGKILL)


class _Work(Protocol):
    def wait(self, timeout: Any = ...) -> Any: ...
    def is_completed(self) -> bool: ...


WAIT_SLICE_S = 0.05
"""How long one slice of :func:`wait_unless_torn` waits in C before looking at the latch."""


def wait_unless_torn(latch: FaultLatch, work: _Work) -> None:
    """Wait for a host (gloo) collective's ``work``, in slices of :data:`WAIT_SLICE_S`, and leave
    with PeerAborted once its generation is torn down, whether or not the wait returned.

    Why: the unwind lands only when C returns to Python, and once (1 run of ~836 in a full suite)
    a rank stayed 10 s inside gloo's ``Work.wait`` under the sync point's all-reduce after its
    monitor had aborted the groups and shut every socket; the ``recovery.stuck`` watchdog then
    killed it and, since its node held a lost node's only snapshot copy, the run restarted from
    disk.  The sync point is where a rank waits for its slower peers, so it is where most ranks
    are when a peer dies.  A slice that ends without the work is "Operation timed out!" and
    leaves the work running (measured on torch 2.15: it completes correctly at a later slice),
    so nothing is lost in the common case; a slice costs nothing when the work completes (the
    wait returns at once).  NCCL is not waited here: its abort fails queued work, and a CUDA
    tensor's read back is where the host waits."""
    gen = latch.gen
    piece = datetime.timedelta(seconds=WAIT_SLICE_S)
    while True:
        try:
            work.wait(piece)
            return
        except PeerAborted:  # the test switch's hang ended by the teardown
            raise
        except RuntimeError:
            if work.is_completed():  # it failed, or finished as the slice ran out: say which
                work.wait()
                return
        latch.check(gen)


# -- the test switch ----------------------------------------------------------------------
def peer_failure_mode() -> str:
    return os.environ.get(PEER_FAILURE_ENV, "").strip().lower()


def hang_until_torn(latch: FaultLatch, exc: BaseException) -> None:
    """What NCCL does where gloo raises: block until this generation is torn down, then raise
    PeerAborted (a collective on an aborted communicator).  Polls so that an asynchronous
    exception raised into this thread also lands here (it waits on Python code, not a C call)."""
    gen = latch.gen
    while not (latch.torn_event.is_set() and latch.gen == gen):
        time.sleep(0.002)
    raise PeerAborted(f"{latch.describe()} (the collective had failed: {' '.join(str(exc).split())[:200]})")


def install_hang_switch(latch: FaultLatch) -> bool:
    """With ``ELASTIC_TEST_PEER_FAILURE=hang``: a collective's ``Work.wait`` that fails because a peer
    went away blocks until its generation is torn down (sync collectives wait through it too, and
    FSDP2 waits on its all-gathers and reduce-scatters there).  Returns whether it was installed."""
    if peer_failure_mode() != "hang":
        return False
    import torch.distributed as dist  # the worker has torch; this module's imports stay light

    work = dist.distributed_c10d.Work
    if getattr(work.wait, "_elastic_hang", False):
        return True
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, PeerAborted) or not is_peer_lost(str(exc)):
                raise
            hang_until_torn(latch, exc)

    wait._elastic_hang = True  # type: ignore[attr-defined]
    work.wait = wait
    return True
