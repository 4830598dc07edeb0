"""In-worker fault hooks: the seam through which chaos reaches inside a training step.

A fault is a small JSON file under ``<run_dir>/faults/`` (the run directory is
shared by all simulated nodes in local mode; in cluster mode the chaos tool
writes the same files on the target node)::

    {"kind": "nan_loss",  "rank": 1, "step": 12}
    {"kind": "straggle",  "rank": 0, "from_step": 5, "to_step": 30, "delay_s": 0.5}
    {"kind": "hang",      "rank": 2, "step": 8}            # SIGSTOP itself at that step
    {"kind": "block",     "rank": 2, "step": 8, "duration_s": 600}  # asleep outside any collective
    {"kind": "block", "node": "node1", "at": "join", "duration_s": 2}  # a joining spare, before its checkpoint group
    {"kind": "exit",      "rank": 1, "step": 9, "code": 1}  # die with an exit code (crash)
    {"kind": "ckpt_write_error", "step": 10}               # the checkpoint writer raises ENOSPC
    {"kind": "snapshot_kill", "rank": 1, "step": 12}       # SIGKILL itself halfway through the step's snapshot push
    {"kind": "snapshot_corrupt", "rank": 1, "from_step": 5}  # change a byte of each stored snapshot after its checksum
    {"kind": "sdc", "node": "node1", "rank": 0, "step": 6, "bit": 22}  # flip one gradient bit, silently
    {"kind": "sdc", "node": "node1", "step": 6, "at": "local"}  # ... of the rank's own gradient (a wrong GEMM)

``rank`` may be omitted (every rank) or be a list; ``node`` (a node id, or a
list) restricts a fault to the workers of that node, whatever ranks they get. A fault with ``"once": true``
(the default for nan_loss, hang and exit) fires once per run: the firing rank
renames the file to ``*.fired`` so that the replay after a restart or rollback
runs clean, which is what a transient fault looks like.

Trainers call :meth:`FaultHooks.before_step` and :meth:`FaultHooks.loss` each
step; without a faults directory every call is a cheap no-op (one stat per
``poll_s``).

An ``sdc`` fault is silent: it emits no ``fault.fired`` event (the runtime must find the flip by
itself).  What it did is written into its ``*.fired`` file instead (:meth:`FaultHooks.sdc_fired`),
where chaos reads it back as ground truth (:func:`fired_records`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.common.env import NODE_ID_ENV

FAULTS_DIR = "faults"
ONCE_BY_DEFAULT = {"nan_loss": True, "hang": True, "exit": True, "ckpt_write_error": True, "straggle": False,
                   "snapshot_kill": True, "block": True, "snapshot_corrupt": False, "sdc": True}
KINDS = frozenset(ONCE_BY_DEFAULT)
JOIN = "join"
"""A fault's ``at`` for a warm spare joining a generation (:meth:`FaultHooks.joining`), not a step."""


class FaultSpecError(ValueError):
    """A fault file is malformed; names the file and the field."""


@dataclass
class Fault:
    path: Path
    kind: str
    spec: dict[str, Any]

    def targets(self, rank: int, node: str | None = None) -> bool:
        want_node = self.spec.get("node")
        if want_node is not None:
            nodes = want_node if isinstance(want_node, list) else [want_node]
            if node not in nodes:
                return False
        want = self.spec.get("rank")
        if want is None:
            return True
        return rank in want if isinstance(want, list) else rank == int(want)

    def active_at(self, step: int) -> bool:
        if self.spec.get("at") == JOIN:
            return False  # fired only by FaultHooks.joining
        if "step" in self.spec:
            return step == int(self.spec["step"])
        lo = int(self.spec.get("from_step", 0))
        hi = int(self.spec.get("to_step", 1 << 62))
        return lo <= step <= hi

    @property
    def once(self) -> bool:
        return bool(self.spec.get("once", ONCE_BY_DEFAULT[self.kind]))


def write_fault(run_dir: str | os.PathLike[str], name: str, spec: dict[str, Any]) -> Path:
    """Install a fault (atomically, so a worker never reads half a file)."""
    if spec.get("kind") not in KINDS:
        raise FaultSpecError(f"{name}: kind must be one of {sorted(KINDS)}, got {spec.get('kind')!r}")
    directory = Path(run_dir) / FAULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps(spec))
    final = directory / f"{name}.json"
    tmp.rename(final)
    return final


def load_faults(run_dir: str | os.PathLike[str]) -> list[Fault]:
    directory = Path(run_dir) / FAULTS_DIR
    faults = []
    if not directory.is_dir():
        return faults
    for path in sorted(directory.glob("*.json")):
        try:
            spec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced or already consumed by another rank
        kind = spec.get("kind")
        if kind not in KINDS:
            raise FaultSpecError(f"{path.name}: kind must be one of {sorted(KINDS)}, got {kind!r}")
        faults.append(Fault(path, kind, spec))
    return faults


def fired_records(run_dir: str | os.PathLike[str], kind: str) -> list[dict[str, Any]]:
    """Fired faults of ``kind`` with what they did (``fired``), oldest first: chaos's ground truth."""
    out = []
    for path in sorted((Path(run_dir) / FAULTS_DIR).glob("*.fired")):
        try:
            spec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if spec.get("kind") == kind and "fired" in spec:
            out.append({**spec, "file": path.with_suffix(".json").name})
    return sorted(out, key=lambda s: s["fired"].get("ts", 0))


class FaultHooks:
    """Per-worker view of the run's fault files."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, events=None, poll_s: float = 0.0,
                 node: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.node = node if node is not None else os.environ.get(NODE_ID_ENV)
        self.events = events
        self.poll_s = poll_s
        self._cache: list[Fault] = []
        self._next_poll = 0.0

    def _faults(self) -> list[Fault]:
        now = time.monotonic()
        if now >= self._next_poll:
            self._cache = load_faults(self.run_dir)
            self._next_poll = now + self.poll_s
        return self._cache

    def _matching(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self._faults() if f.kind == kind and f.targets(self.rank, self.node) and f.active_at(step)]

    def _fire(self, fault: Fault, step: int | None) -> None:
        if self.events is not None:
            self.events.emit("fault.fired", fault=fault.kind, step=step, rank=self.rank, file=fault.path.name)
        if fault.once:
            try:
                fault.path.rename(fault.path.with_suffix(".fired"))
            except OSError:
                pass  # another rank consumed it first; it fires for us too this step
            self._next_poll = 0.0

    def before_step(self, step: int) -> None:
        """Straggle, hang or crash at the start of ``step``."""
        for fault in self._matching("straggle", step):
            self._fire(fault, step)
            time.sleep(float(fault.spec.get("delay_s", 0.5)))
        for fault in self._matching("exit", step):
            self._fire(fault, step)
            os._exit(int(fault.spec.get("code", 1)))
        for fault in self._matching("hang", step):
            self._fire(fault, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        for fault in self._matching("block", step):
            # Alive and asleep (like a worker stuck in I/O or on a lock): /proc cannot tell it from
            # a rank waiting on its peers; only where it sleeps can (elastic.agent.hangs).
            self._fire(fault, step)
            time.sleep(float(fault.spec.get("duration_s", 3600)))

    def joining(self) -> None:
        """A warm spare joining a generation, before it makes its checkpoint group: a ``block`` with
        ``"at": "join"`` sleeps here, so that a test can land a second fault while the spare forms
        (soak seed 3 found that race by chance: tests/test_slot_faults_e2e.py)."""
        for fault in self._faults():
            if fault.kind == "block" and fault.spec.get("at") == JOIN and fault.targets(self.rank, self.node):
                self._fire(fault, None)
                time.sleep(float(fault.spec.get("duration_s", 2)))

    def loss(self, step: int, value: Any) -> Any:
        """The loss, or NaN of the same type where a nan_loss fault says so."""
        faults = self._matching("nan_loss", step)
        if not faults:
            return value
        for fault in faults:
            self._fire(fault, step)
        try:
            return value * math.nan  # a tensor stays a tensor, with its graph
        except TypeError:
            return math.nan

    def sdc(self, step: int, at: str = "shard") -> Fault | None:
        """The ``sdc`` fault of this rank at ``step`` flipping ``at`` (``shard``: the reduced gradient
        shard before the optimizer; ``local``: the rank's own gradient before the reduce-scatter), if
        any (claimed: it fires on one rank, once)."""
        for fault in self._matching("sdc", step):
            if fault.spec.get("at", "shard") != at:
                continue
            fired = fault.path.with_suffix(".fired")
            try:
                fault.path.rename(fired)
            except OSError:
                continue  # another rank of the targeted set claimed it
            self._next_poll = 0.0
            return Fault(fired, fault.kind, fault.spec)
        return None

    def sdc_fired(self, fault: Fault, step: int, record: dict[str, Any]) -> None:
        """Write what the flip did into the fault's ``.fired`` file: the only trace it leaves."""
        done = {**fault.spec, "fired": {"step": step, "rank": self.rank, "node": self.node, "ts": time.time(),
                                        **record}}
        tmp = fault.path.with_name(f".{fault.path.name}.tmp")
        tmp.write_text(json.dumps(done))
        tmp.rename(fault.path)

    def checkpoint_write_error(self, step: int) -> OSError | None:
        """An ENOSPC error to raise from the checkpoint write of ``step``, if a fault says so."""
        for fault in self._matching("ckpt_write_error", step):
            self._fire(fault, step)
            import errno

            return OSError(errno.ENOSPC, f"No space left on device (injected at step {step})")
        return None

    def checkpoint_write_fails(self, step: int) -> bool:
        """The predicate of :class:`~elastic.checkpoint.storage.FaultInjectingStorage` (fires the fault)."""
        return self.checkpoint_write_error(step) is not None

    def snapshot_corrupt(self, step: int) -> bool:
        """Whether this rank's snapshot of ``step`` is stored with one byte changed after its checksum
        was taken (memory changed at rest: a restore must refuse it and fall back)."""
        for fault in self._matching("snapshot_corrupt", step):
            self._fire(fault, step)
            return True
        return False

    def snapshot_kill(self, step: int) -> bool:
        """Whether this rank dies halfway through pushing the snapshot of ``step`` (fires once)."""
        for fault in self._matching("snapshot_kill", step):
            self._fire(fault, step)
            return True
        return False
