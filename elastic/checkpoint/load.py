"""Reading committed checkpoints: discovery, verification, and the collective load.

:class:`CommittedCheckpoints` is the read side of :class:`~elastic.checkpoint.manager.CheckpointManager`
(which adds saving, commit and retention); ``trainer.sample`` uses it alone.  A checkpoint is
considered only with a COMMIT marker whose checksums, sizes and fingerprint match, newest first;
a corrupt or partial one is reported (``checkpoint.skipped_corrupt``) and skipped.  One written by
another run config is never skipped silently: the load stops with :class:`CheckpointMismatch`,
whose one line names the differing fields (:mod:`elastic.checkpoint.identity`), because training
from an older checkpoint or from step 0 would throw that run's progress away.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.format import MANIFEST_FILE, SafetensorsShardReader, read_extra, read_manifest
from elastic.checkpoint.identity import COMMIT_FILE, mismatch
from elastic.checkpoint.memory import MemoryFastPath
from elastic.checkpoint.verified import VerifiedThrough, trusted
from elastic.common import collectives
from elastic.common.events import EventLog

log = logging.getLogger(__name__)

# DCP's CheckpointException derives from BaseException, not Exception.
_FAILURES = (Exception, CheckpointException)

_STEP_RE = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """Base class for checkpoint failures."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint failed verification (checksum, size, marker)."""


class CheckpointMismatch(CheckpointError):
    """The newest committed checkpoint was written by another run config (the message names the fields)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _root_cause(exc: BaseException) -> BaseException:
    """The first OSError under ``exc`` (through DCP's per-rank failures and causes), else ``exc``."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        # DCP's CheckpointException keeps per-rank failures as (exception, traceback) pairs.
        for failure in getattr(cur, "failures", {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                stack.append(inner)
        stack.extend(nxt for nxt in (cur.__cause__, cur.__context__) if nxt is not None)
    return exc


def _error_fields(exc: BaseException) -> dict[str, Any]:
    """Event fields for a failure: one-line ``error`` and, for an OSError, its ``errno`` name."""
    root = _root_cause(exc)
    first_line = (str(root).strip().splitlines() or [""])[0]
    text = f"{type(root).__name__}: {first_line}"
    if root is not exc:
        ranks = sorted(getattr(exc, "failures", {}))
        text = f"{type(exc).__name__}" + (f" on ranks {ranks}" if ranks else "") + f": {text}"
    fields: dict[str, Any] = {"error": text[:1000]}
    if isinstance(root, OSError) and root.errno is not None:
        fields["errno"] = errno.errorcode.get(root.errno, str(root.errno))
    return fields


class CommittedCheckpoints:
    """The committed checkpoints under ``root`` (see the module docstring).

    ``memory`` is the in-memory fast path tried before the disk, ``group`` the process group the
    load is collective over (None: this process alone).  ``fingerprint_basis`` is what
    ``fingerprint`` was hashed from; it goes into every COMMIT marker so that a later loader of
    another config can say which fields differ.
    """

    def __init__(self, config: CheckpointConfig, root: str | Path, fingerprint: str = "",
                 events: EventLog | None = None, group: dist.ProcessGroup | None = None,
                 memory: MemoryFastPath | None = None, fingerprint_basis: dict[str, Any] | None = None) -> None:
        self.config = config
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.fingerprint_basis = fingerprint_basis
        self.events = events or EventLog(None, "checkpoint")
        self.group = group
        self.memory = memory
        self.epoch: int | None = None
        """The run's restart epoch, written into each COMMIT marker (what a rollback compares)."""
        self.distrust: tuple[int, int] | None = None
        """(step, epoch): a silent corruption was found at ``step`` in ``epoch``; a checkpoint of that
        step or later committed in that epoch or before holds it and is skipped
        (``checkpoint.skipped_suspect``).  Not the finding's time: a save under way then commits after
        it (measured: step 90's save committed 0.2 s after the finding and was resumed from)."""
        self.sdc_verified: VerifiedThrough | None = None
        """Replay verification on: epoch -> the step that epoch's replay checks agree through now
        (read from etcd by rank 0 at a commit and a resume; None when not yet).  A resume prefers the
        newest verified checkpoint (:mod:`elastic.checkpoint.verified`)."""
        self.sdc_verified_within = 0
        """How many steps before the newest usable checkpoint a resume looks for a verified one (0: no
        limit).  Checks trail their steps by one check interval and a replay; verification lagging
        further has stalled (a spare that cannot keep up, a verifier gone quiet after a mismatch), and
        a resume then takes the newest rather than throw that much training away."""
        self._rank = collectives.rank()

    def wait(self) -> None:
        """Hook: the writer waits for its in-flight save before any collective on ``group``."""

    # -- discovery ---------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps with a COMMIT marker, oldest first (not yet verified)."""
        steps = []
        if not self.root.exists():
            return steps
        for entry in self.root.iterdir():
            match = _STEP_RE.match(entry.name)
            if match and (entry / COMMIT_FILE).exists():
                steps.append(int(match.group(1)))
        return sorted(steps)

    # -- load --------------------------------------------------------------
    def verify(self, step: int) -> dict[str, Any]:
        """Return the COMMIT marker of ``step``; CheckpointCorrupt, or CheckpointMismatch for another config's."""
        path = self.root / step_dir_name(step)
        try:
            marker = json.loads((path / COMMIT_FILE).read_text(encoding="utf-8"))
            files = marker["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(f"{path.name}: unreadable commit marker ({exc})") from exc
        if marker.get("step") != step:
            raise CheckpointCorrupt(f"{path.name}: commit marker is for step {marker.get('step')}")
        foreign = mismatch(path, marker, self.fingerprint, self.fingerprint_basis)
        if foreign is not None:
            raise CheckpointMismatch(foreign)
        if MANIFEST_FILE not in files:
            raise CheckpointCorrupt(f"{path.name}: commit marker lists no {MANIFEST_FILE}")
        for name, info in files.items():
            file = path / name
            if not file.is_file():
                raise CheckpointCorrupt(f"{path.name}: missing file {name}")
            if file.stat().st_size != info["bytes"]:
                raise CheckpointCorrupt(f"{path.name}: size mismatch in {name} (truncated?)")
            if self.config.verify_on_load and sha256_file(file) != info["sha256"]:
                raise CheckpointCorrupt(f"{path.name}: checksum mismatch in {name}")
        return marker

    def _newest_commit(self) -> tuple[int, str] | None:
        """Rank 0: (step, id) of the newest COMMIT marker of this run, read but not hashed.

        The memory fast path needs only the proof that the cached save was committed;
        the bytes it loads carry their own sha256.
        """
        verified, newest = self.verified_through(), None
        for step in reversed(self.committed_steps()):
            try:
                marker = json.loads((self.root / step_dir_name(step) / COMMIT_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(marker, dict) or marker.get("step") != step:
                continue
            if self.fingerprint and marker.get("fingerprint") != self.fingerprint:
                continue
            if self._distrusted(marker):
                continue
            newest = newest or (step, str(marker.get("id", "")))
            if 0 < self.sdc_verified_within < newest[0] - step:
                return newest  # verification has stalled (the disk pick says so)
            if trusted(marker, verified):
                return step, str(marker.get("id", ""))
        return newest  # none verified (within reach): the newest (the disk pick says so)

    def verified_through(self) -> VerifiedThrough | None:
        """Rank 0, for one pick: :attr:`sdc_verified`, read once per epoch; a failed read (etcd
        unreachable) counts as nothing verified since: only the markers' own verdicts count."""
        if self.sdc_verified is None:
            return None
        read = self.sdc_verified

        @functools.cache
        def through(epoch: int) -> int | None:
            try:
                return read(epoch)
            except Exception as exc:  # noqa: BLE001 - a resume never fails for want of this hint
                log.warning("reading epoch %d's verified step: %s", epoch, exc)
                return None
        return through

    def _distrusted(self, marker: dict[str, Any]) -> bool:
        """Written after a silent corruption it holds, before the corruption was found."""
        if self.distrust is None:
            return False
        from_step, found_epoch = self.distrust
        epoch = marker.get("epoch")  # None: written before markers carried it: not trusted either
        return int(marker.get("step", -1)) >= from_step and (epoch is None or int(epoch) <= found_epoch)

    def _pick(self, rejected: set[int]) -> int | str | None:
        """Rank 0: newest committed step that verifies, reporting each one skipped; the mismatch
        line (a str) when the newest readable one is another config's."""
        verified, newest = self.verified_through(), None
        for step in reversed(self.committed_steps()):
            if step in rejected:
                continue
            try:
                marker = self.verify(step)
            except CheckpointMismatch as exc:
                self.events.emit("checkpoint.foreign", step=step, reason=str(exc))
                return str(exc)
            except CheckpointCorrupt as exc:
                self._report_skipped(step, str(exc))
                rejected.add(step)
                continue
            if self._distrusted(marker):
                assert self.distrust is not None
                self.events.emit("checkpoint.skipped_suspect", step=step, corrupted_from=self.distrust[0],
                                 committed_epoch=marker.get("epoch"), found_epoch=self.distrust[1])
                rejected.add(step)
                continue
            newest = step if newest is None else newest
            if not self._looks_further(newest, step):
                return newest
            if trusted(marker, verified):
                return step
            self._report_unverified(step, marker, verified)
        if newest is not None:
            self.events.emit("checkpoint.resume_unverified", step=newest,
                             reason="no checkpoint of this run is verified by replay: the newest is taken")
        return newest

    def _looks_further(self, newest: int, step: int) -> bool:
        """Whether a resume passes over ``step`` for an older verified one (within the window)."""
        within = self.sdc_verified_within
        if not 0 < within < newest - step:
            return True
        self.events.emit("checkpoint.resume_unverified", step=newest, reason=(
            f"verification lags more than {within} steps behind (stalled): the newest is taken"))
        return False

    def _report_unverified(self, step: int, marker: dict[str, Any], verified: VerifiedThrough | None) -> None:
        epoch = marker.get("epoch")
        self.events.emit("checkpoint.skipped_unverified", step=step, epoch=epoch,
                         marker_verified_step=marker["sdc"].get("verified_step"),
                         verified_step=verified(int(epoch)) if verified is not None and epoch is not None else None)

    def _report_skipped(self, step: int, reason: str) -> None:
        log.error("skipping checkpoint step %d: %s", step, reason)
        self.events.emit("checkpoint.skipped_corrupt", step=step, reason=reason)

    def load_latest(self, state: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Collective: load the newest verified checkpoint into ``state``.

        Returns (step, this rank's extra state) or None if no usable checkpoint
        exists.  Rank 0 verifies and picks the step, so every rank loads the
        same one; if loading it fails on any rank, every rank moves on to the
        next older one (``state`` is then overwritten again by that load).
        """
        self.wait()
        memory_s = 0.0
        if self.memory is not None:
            t0 = time.monotonic()
            newest = collectives.broadcast_object(self._newest_commit() if self._rank == 0 else None, self.group)
            got = self.memory.try_load(state, *newest) if newest is not None else None
            memory_s = time.monotonic() - t0
            if got is not None:
                step, extra, fields = got
                world = collectives.world_size()  # a memory entry is only used at the world size it was saved at
                self.events.emit("checkpoint.loaded", step=step, path=str(self.root / step_dir_name(step)),
                                 saved_world_size=world, world_size=world, extra_found=True, loaded_from="memory",
                                 load_s=round(memory_s, 6), **fields)
                return step, extra
        t_disk = time.monotonic()
        rejected: set[int] = set()
        while True:
            chosen = self._pick(rejected) if self._rank == 0 else None
            chosen = collectives.broadcast_object(chosen, self.group)
            if isinstance(chosen, str):
                raise CheckpointMismatch(chosen)
            if chosen is None:
                self.events.emit("checkpoint.none_loaded", rejected=sorted(rejected))
                return None
            path = self.root / step_dir_name(chosen)
            error: BaseException | None = None
            extra: dict[str, Any] = {}
            found = False
            try:
                dcp.load(
                    state, storage_reader=SafetensorsShardReader(path), process_group=self.group,
                    no_dist=not dist.is_initialized(),
                )
                blob = read_extra(path, read_manifest(path), self._rank)
                found = blob is not None
                if blob:
                    extra = torch.load(io.BytesIO(blob), weights_only=False)
            except _FAILURES as exc:
                error = exc
            if collectives.all_true(error is None, self.group):
                marker_world = read_manifest(path)["world_size"]
                self.events.emit(
                    "checkpoint.loaded", step=chosen, path=str(path), saved_world_size=marker_world,
                    world_size=collectives.world_size(), extra_found=found, loaded_from="disk",
                    load_s=round(time.monotonic() - t_disk, 6), memory_tried_s=round(memory_s, 6),
                )
                return chosen, extra
            reason = f"load failed: {_error_fields(error)['error']}" if error else "load failed on another rank"
            if error is not None or self._rank == 0:
                self._report_skipped(chosen, reason)
            rejected.add(chosen)
