"""Checkpoint manager: async DCP saves, safetensors on disk, atomic commit.

Layout under the checkpoint root::

    step-00000040/              committed checkpoint
        shard-00000.safetensors   rank 0's tensor chunks, non-tensor values, extra blob
        shard-00001.safetensors   ...
        manifest.json             global shapes + chunk offsets (reshard), file checksums
        COMMIT                    JSON: step, world size, fingerprint, sha256 + size per file
    .step-00000050.tmp-XXXXXXXX/  a save in progress; never loaded, removed at start-up
    .step-00000050.tmp-XXXXXXXX-<owner>/  the same, of one writer among several (``owner``)

In replica-group mode (torchft) several groups share one root and any of them may be the
writer of the moment; each is a manager with its own ``owner`` name (the group id), so a group
that starts removes only its own stale directories, never a peer's save in progress.

(The shard/manifest format and why it is not DCP's HF writer: see
:mod:`elastic.checkpoint.format`.)

Life of a save
--------------
``save()`` runs on the training thread: it waits for the previous save to be
committed or failed, serializes this rank's ``extra``, and copies the state to
CPU ("staging", one copy into a buffer kept between saves:
:mod:`elastic.checkpoint.staging`), so the optimizer may mutate the weights as
soon as ``save()`` returns; then hands the copy to ``dcp.save`` on the
manager's kept upload thread (what ``dcp.async_save`` does, without a new
thread per save).  Everything else happens on background threads: the upload
thread plans, writes this rank's shard and gathers every rank's write results to the
coordinator, which writes the manifest; then the manager's finalize thread
(rank 0) writes the COMMIT marker, renames the temporary directory into
place, publishes the step, and applies retention.

The cross-rank "all ranks finished writing" signal is DCP's own final
collective, not an extra barrier or marker files: ``_save_state_dict`` ends
with ``all_reduce("write", write_data, finish)``, which gathers every rank's
write results (each produced only after that rank's shard was written and
fsynced) to the coordinator, runs ``finish`` there, and broadcasts the
outcome, so an exception on any rank fails the future on every rank.  Rank 0
therefore commits only after its future resolved successfully.  The sha256
of each shard is computed while it is written and travels in those results,
so the commit does not re-read the checkpoint.

That collective runs on ``group`` from the background thread.  This is safe
because the group is owned by the manager and used by one thread at a time:
every method that issues a collective on it (``save``, ``load_latest``,
``close``, construction) first waits for the in-flight save.  The group must
not be the training process group: FSDP's collectives would interleave with
the checkpoint's (measured: gloo "collective mismatch" abort).  With
``group=None`` the manager creates its own gloo group (construction is
collective anyway).

A checkpoint becomes visible only by the rename of its temporary directory,
after the COMMIT marker is written.  Loaders consider only directories with a
COMMIT marker whose checksums, sizes and fingerprint match, newest first; a
corrupt, partial or foreign checkpoint is reported
(``checkpoint.skipped_corrupt``) and skipped.  Save failures (a full disk, a
rank dying mid-save) never raise into training: they become
``checkpoint.save_failed`` events, an error log line and ``last_error``; the
previous checkpoint stays the newest valid one and the temporary directory is
removed by rank 0.  Failed saves in a row are counted by rank 0 (the committer)
and agreed by every rank at the start of each save (they travel with the save's
token); :meth:`failing` applies ``max_consecutive_failures`` / ``on_save_failure``.
An async save's failure is known to rank 0 when its finalize thread records it,
mid-step: :meth:`streak_reached` says so without a collective (the worker session
carries it to every rank on a collective each step already has) and
:meth:`agree_failing` then gives every rank rank 0's streak, so all of them stop
at the same step, not at the next save.

Per-rank ``extra`` state (RNG...) is restored to the rank with the same index.
When a checkpoint saved by N ranks is loaded by M > N ranks, ranks N..M-1 get
an empty dict (``checkpoint.loaded`` says ``extra_found: false``) and must
derive their RNG state from the seed, step and rank themselves.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.format import MANIFEST_FILE, SafetensorsShardWriter, read_manifest
from elastic.checkpoint.load import (
    _FAILURES,
    COMMIT_FILE,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CommittedCheckpoints,
    _error_fields,
    sha256_file,
    step_dir_name,
)
from elastic.checkpoint.memory import MemoryFastPath, as_state_dicts
from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.snapshot import snapshot_state_dicts
from elastic.checkpoint.staging import FlatStager
from elastic.checkpoint.verified import marker_field, newest_trusted, upgrade
from elastic.checkpoint.publish import EtcdCheckpointPublisher, LatestPublisher, publisher_from_env
from elastic.checkpoint.storage import CheckpointStorage, LocalStorage
from elastic.common import collectives
from elastic.common.events import EventLog

__all__ = [
    "COMMIT_FILE",
    "CheckpointConfig",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatch",
    "EtcdCheckpointPublisher",
    "publisher_from_env",
    "select_for_deletion",
    "sha256_file",
    "step_dir_name",
]

log = logging.getLogger(__name__)
PUBLISH_FLUSH_S = 5.0
"""How long :meth:`CheckpointManager.wait` and ``close`` wait for the newest commit's etcd record
(one attempt: the store's retry deadline, 5 s): the record is a hint, disk is the truth."""

_STALE_KINDS = ("tmp", "old")


def select_for_deletion(steps: Iterable[int], keep_last: int, protect: Iterable[int] = ()) -> list[int]:
    """Committed steps retention removes: all but the newest ``keep_last``.

    The newest step and every step in ``protect`` (the one just committed) are
    never returned, whatever ``keep_last`` says.
    """
    ordered = sorted(set(steps))
    if not ordered:
        return []
    keep = set(ordered[-max(1, keep_last):]) | set(protect) | {ordered[-1]}
    return [step for step in ordered if step not in keep]


class CheckpointManager(CommittedCheckpoints):
    """Save and load committed checkpoints of a set of DCP-stateful objects.

    ``state`` passed to :meth:`save` / :meth:`load_latest` maps names to
    objects with ``state_dict()`` / ``load_state_dict()`` (DCP ``Stateful``)
    or plain dicts of tensors.  ``extra`` is per-rank picklable state
    (RNG states, ...) stored in the rank's shard.

    ``publisher(step, path)`` is called by rank 0 after each commit (errors are
    events).  ``storage`` is the write seam; by default local files (the worker
    session wraps it with the run's checkpoint-write faults).
    With ``config.memory.enabled`` each saved state is also pushed to the node
    agent's in-memory cache and :meth:`load_latest` tries that first
    (:mod:`elastic.checkpoint.memory`); ``memory_client`` overrides the cache
    address taken from the agent's environment.
    Construction, :meth:`save`, :meth:`load_latest` and :meth:`close` are
    collective over ``group``.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        root: str | os.PathLike[str],
        fingerprint: str = "",
        events: EventLog | None = None,
        group: dist.ProcessGroup | None = None,
        publisher: Callable[[int, str], None] | None = None,
        storage: CheckpointStorage | None = None,
        memory_client: MemStateClient | None = None,
        fingerprint_basis: dict[str, Any] | None = None,
        owner: str = "",
    ) -> None:
        self.owner = owner
        self._finalizer: ThreadPoolExecutor | None = None
        self._uploader: ThreadPoolExecutor | None = None  # async saves' dcp.save, one at a time (_upload)
        self._latest: LatestPublisher | None = None  # rank 0: publishes commits off the save path
        self._inflight: Future[None] | None = None
        self._closed = False
        if group is None and dist.is_initialized():
            group = dist.new_group(backend="gloo")
        super().__init__(config, root, fingerprint, events, group, fingerprint_basis=fingerprint_basis)
        self.publisher = publisher
        self.storage: CheckpointStorage = storage or LocalStorage()
        self.last_error: BaseException | None = None
        self.last_committed: int | None = None
        self._verified_at_commit: int | None = None  # rank 0: the run's verified step read at the last commit
        self._streak: list[tuple[int, str]] = []  # rank 0: (step, error) of each save failed since the last commit
        self.failed_in_a_row: list[tuple[int, str]] = []  # the streak as every rank agreed at the last save
        self._agreed: tuple[int, str] | None = None  # (step, token) the step's sync point agreed on (agreed())
        self.last_save_token = ""  # the newest save's token (its temporary directory's name)
        self.memory = MemoryFastPath.from_env(config.memory, fingerprint, self.events, self.group, memory_client)
        self._stager = FlatStager()  # async saves: one copy into a buffer kept between saves (staging.py)
        if self._rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
        collectives.barrier(self.group)

    def _tag(self, token: str) -> str:
        """A temporary directory's suffix: the 8-character token, then the owner when there is one."""
        return f"{token}-{self.owner}" if self.owner else token

    def _remove_stale_tmp(self) -> None:
        # Without an owner every stale directory is ours (one writer per root).  With one, the name
        # must end in exactly "<token>-<owner>" (owner "a" must not match owner "b-a" or "a-b").
        scope = f"{'?' * 8}-{glob.escape(self.owner)}" if self.owner else "*"
        for kind in _STALE_KINDS:
            for entry in self.root.glob(f".step-*.{kind}-{scope}"):
                self.storage.remove_tree(entry)
                self.events.emit("checkpoint.stale_tmp_removed", path=str(entry))

    # -- save --------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.config.interval_steps > 0 and step % self.config.interval_steps == 0

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Collective: snapshot ``state`` and persist + commit it as checkpoint ``step``.

        Returns once the state is staged (copied); persisting and committing run
        in the background (synchronously if ``config.async_save`` is false).
        Never raises for I/O failures: see :meth:`wait` and ``last_error``.
        """
        if self._closed:
            raise CheckpointError("save() after close()")
        t_enter = time.monotonic()
        self._wait_inflight()
        waited_s = time.monotonic() - t_enter
        final = self.root / step_dir_name(step)
        agreed, self._agreed = self._agreed, None
        if agreed is not None and agreed[0] == step:
            token, self.failed_in_a_row = agreed[1], []  # rank 0 had no failed save to tell (agreed())
        else:
            token, self.failed_in_a_row = collectives.broadcast_object(
                (uuid.uuid4().hex[:8], list(self._streak)) if self._rank == 0 else None, self.group)
        self.last_save_token = token
        tmp = self.root / f".{final.name}.tmp-{self._tag(token)}"
        self.events.emit("checkpoint.save_start", step=step, path=str(tmp), waited_s=round(waited_s, 6))
        t0 = time.monotonic()
        try:
            blob = b""
            if extra:
                buf = io.BytesIO()
                torch.save(extra, buf)
                blob = buf.getvalue()
            writer = SafetensorsShardWriter(
                tmp, step, self._rank, self.storage, blob, nice=self.config.writer_nice
            )
            # The memory push reuses the staged copy (async) or the live state, which the
            # training thread does not touch until a synchronous save has finished.
            stager = self._stager if self.config.async_save else None
            if self.config.async_save:
                # The trees a per-step snapshot takes (checked once to be DCP's get_state_dict tree,
                # elastic.checkpoint.statedict): DCP's own call rebuilds its name maps every time,
                # 2 ms of the training thread per save of the tiny DiT on a quiet core.
                upload = self._upload(self._stager.stage(snapshot_state_dicts(state)), writer)
            else:
                upload = Future()
                try:
                    upload.set_result(
                        dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=not dist.is_initialized())
                    )
                except _FAILURES as exc:  # reported by _finalize like an async failure
                    upload.set_exception(exc)
        except _FAILURES as exc:
            # Staging failed on this rank (e.g. out of host memory).  Peers that staged
            # fine fail in their DCP collective (group timeout) and report it themselves.
            self._record_failure(step, tmp, exc, phase="stage")
            return final
        blocking_s = time.monotonic() - t0
        self.events.emit("checkpoint.staged", step=step, blocking_s=round(blocking_s, 6))
        if self._finalizer is None:
            self._finalizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-finalize")
        snapshot = None
        if self.memory is not None:
            snapshot = _Snapshot(token, blob, stager, None if stager is not None else state)
        self._inflight = self._finalizer.submit(self._finalize, step, upload, tmp, final, t0, token, snapshot)
        if not self.config.async_save:
            self._wait_inflight()
        return final

    def _upload(self, staged: Any, writer: SafetensorsShardWriter) -> Future[Any]:
        """``dcp.save`` of the staged copy on the manager's kept upload thread: what ``dcp.async_save``
        does once its stager returned, without its thread start per save.  Why not async_save: it
        makes a new ``ThreadPoolExecutor`` for every save (torch 2.15, ``_ThreadBasedAsyncCheckpoint
        Executor``), and ``Thread.start`` waits until the new thread runs: on the 4-node soak config
        (2 shared cores, py-spy at 200 Hz on rank 0) half of a save's blocking time, 13 of 26 samples."""
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        return self._uploader.submit(dcp.save, staged, storage_writer=writer, process_group=self.group,
                                     no_dist=not dist.is_initialized())

    def failing(self) -> str | None:
        """After :meth:`save`: the line to stop training with, when saves keep failing and the policy
        says stop; None otherwise (with ``warn``, a ``checkpoint.failing`` event once per streak)."""
        limit, failed = self.config.max_consecutive_failures, self.failed_in_a_row
        if not limit or len(failed) < limit:
            return None
        committed = self.committed_steps()
        line = (f"{len(failed)} checkpoint saves failed in a row (steps {', '.join(str(s) for s, _ in failed)}; "
                f"last error: {failed[-1][1]}); last committed step: {committed[-1] if committed else 'none'} "
                f"(checkpoint.max_consecutive_failures={limit})")
        if self.config.on_save_failure == "stop":
            return line
        if len(failed) == limit:
            log.warning("%s; training goes on (checkpoint.on_save_failure=warn)", line)
            self.events.emit("checkpoint.failing", failed_steps=[s for s, _ in failed], reason=line)
        return None

    @property
    def stops_on_failures(self) -> bool:
        """Whether failed saves in a row can stop training (``on_save_failure: stop`` with a limit)."""
        return self.config.on_save_failure == "stop" and self.config.max_consecutive_failures > 0

    def streak_reached(self) -> bool:
        """Rank 0, no collective, any time: its streak of failed saves reached the limit and the policy
        says stop.  False on the other ranks: only the committer's streak ends at a commit."""
        limit = self.config.max_consecutive_failures
        return self._rank == 0 and self.stops_on_failures and len(self._streak) >= limit

    def sync_contribution(self, saving: bool) -> tuple[float, float]:
        """Rank 0's part of the next save's agreement, summed into the step's sync point (the other
        ranks add 0): whether it has anything to tell the save (a failed save since the last commit,
        or a save still in flight that may fail) and a fresh token for its temporary directory.

        Why: the save's own broadcast of rank 0's token and streak was a collective of its own right
        after the step's last one, and on 2 shared cores it cost 13-18 ms a save on every rank of the
        4-node DiT (each rank waits to be scheduled twice: a size, then the pickle), 1% of a run
        saving every 10 steps.  The sync point's all-reduce happens every step anyway."""
        if self._rank != 0 or not saving:
            return 0.0, 0.0
        busy = bool(self._streak) or (self._inflight is not None and not self._inflight.done())
        return (1.0 if busy else 0.0), float(secrets.randbits(32) or 1)

    def agreed(self, step: int, busy: float, token: float) -> None:
        """Every rank, after the sync point of a step that saves: the save of ``step`` takes ``token``
        and an empty streak with no broadcast, unless rank 0 was busy (it then broadcasts as before).
        Every rank decides alike: they read the same all-reduced values."""
        self._agreed = (step, f"{int(token) & 0xFFFFFFFF:08x}") if busy == 0 and token > 0 else None

    def agree_failing(self) -> str | None:
        """Collective, after a rank learned that :meth:`streak_reached`: every rank takes rank 0's streak
        (once the save in flight has finished) and :meth:`failing` judges it."""
        self._wait_inflight()
        self.failed_in_a_row = collectives.broadcast_object(list(self._streak) if self._rank == 0 else None,
                                                            self.group)
        return self.failing()

    def _publishing(self) -> LatestPublisher:
        """Rank 0's publisher thread, started with the first commit (it calls whatever
        ``publisher`` is set then)."""
        if self._latest is None:
            self._latest = LatestPublisher(lambda step, path: self.publisher(step, path) if self.publisher else None,
                                           self.events.emit, _error_fields)
        return self._latest

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or has failed, and its commit is
        published (up to ``PUBLISH_FLUSH_S``: etcd down must not hold a caller longer).

        Never raises; a failure is in ``last_error`` and the event log.
        """
        self._wait_inflight()
        if self._latest is not None:
            self._latest.flush(PUBLISH_FLUSH_S)

    def _wait_inflight(self) -> None:
        """The in-flight save only: what the next save waits for (never the publish)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            inflight.result()
        except _FAILURES as exc:  # a bug in finalize itself: still never into training
            self.last_error = exc
            log.exception("checkpoint finalize thread failed")
            self.events.emit("checkpoint.finalize_error", **_error_fields(exc))

    def close(self) -> None:
        """Wait for the in-flight save and stop the background thread (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._wait_inflight()
        for pool in (self._finalizer, self._uploader):
            if pool is not None:
                pool.shutdown(wait=True)
        self._finalizer = self._uploader = None
        if self._latest is not None:
            self._latest.close(PUBLISH_FLUSH_S)
        self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _finalize(
        self, step: int, upload: Future, tmp: Path, final: Path, t0: float, token: str, snapshot: _Snapshot | None
    ) -> None:
        """Background: wait for DCP's upload, then (rank 0) commit, publish, retain."""
        try:
            self._finalize_inner(step, upload, tmp, final, t0, token, snapshot)
        finally:
            if snapshot is not None and snapshot.stager is not None:
                snapshot.stager.close()

    def _finalize_inner(
        self, step: int, upload: Future, tmp: Path, final: Path, t0: float, token: str, snapshot: _Snapshot | None
    ) -> None:
        try:
            upload.result()
            if self._rank != 0:
                self.events.emit("checkpoint.persisted", step=step, persist_s=round(time.monotonic() - t0, 6))
                self._push_memory(step, snapshot)
                return
            nbytes = self._commit(tmp, final, step, token)
        except _FAILURES as exc:
            self._record_failure(step, tmp, exc, phase="persist")
            return
        self.last_committed = step
        self._streak.clear()
        self.events.emit(
            "checkpoint.committed", step=step, path=str(final), persist_s=round(time.monotonic() - t0, 6), bytes=nbytes
        )
        log.info("checkpoint step %d committed (%d bytes) at %s", step, nbytes, final)
        self._push_memory(step, snapshot)
        if self.publisher is not None:
            self._publishing()(step, str(final))
        self._upgrade_verified()
        self._retain(protect=step)

    def _sdc_field(self, step: int) -> dict[str, Any]:
        """Replay verification on: whether the run was verified through ``step`` as it commits."""
        if self.sdc_verified is None:
            return {}
        through = self.verified_through()
        self._verified_at_commit = through(self.epoch) if through is not None and self.epoch is not None else None
        return marker_field(step, self._verified_at_commit)

    def _upgrade_verified(self) -> None:
        """Markers committed unverified that the run is now verified past (their check answered
        after their commit): upgraded, so a resume need not pass them over."""
        verified = self._verified_at_commit
        if verified is None:
            return
        for step in self.committed_steps():
            if step <= verified and upgrade(self.root / step_dir_name(step), verified, self.epoch):
                self.events.emit("checkpoint.verified", step=step, verified_step=verified)

    def _push_memory(self, step: int, snapshot: _Snapshot | None) -> None:
        """Hand this rank's saved state to the agent's cache (tagged with the save's token)."""
        if self.memory is None or snapshot is None:
            return
        tree = snapshot.stager.staged if snapshot.stager is not None else as_state_dicts(snapshot.live or {})
        self.memory.push(step, snapshot.token, tree, snapshot.extra)

    def _record_failure(self, step: int, tmp: Path, exc: BaseException, phase: str) -> None:
        self.last_error = exc
        fields = _error_fields(exc)
        log.error("checkpoint save of step %d failed (%s): %s", step, phase, fields["error"])
        self._streak.append((step, fields["error"] + (f" [{fields['errno']}]" if "errno" in fields else "")))
        self.events.emit("checkpoint.save_failed", step=step, phase=phase, **fields)
        if self._rank == 0:  # rank 0 owns the directory; peers are done with it (DCP failed everywhere)
            self.storage.remove_tree(tmp)

    def _commit(self, tmp: Path, final: Path, step: int, token: str) -> int:
        manifest = read_manifest(tmp)
        files: dict[str, dict[str, Any]] = {}
        for name, info in manifest["files"].items():
            size = (tmp / name).stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{tmp.name}/{name}: {size} bytes on disk, writer reported {info['bytes']}")
            files[name] = {"sha256": info["sha256"], "bytes": size}
        files[MANIFEST_FILE] = {"sha256": sha256_file(tmp / MANIFEST_FILE), "bytes": (tmp / MANIFEST_FILE).stat().st_size}
        marker = {
            "step": step,
            "id": token,
            "world_size": manifest["world_size"],
            "fingerprint": self.fingerprint,
            "fingerprint_basis": self.fingerprint_basis,
            **({"epoch": self.epoch} if self.epoch is not None else {}),
            **self._sdc_field(step),
            "ts": time.time(),
            "files": files,
        }
        text = json.dumps(marker, indent=1, sort_keys=True).encode()
        self.storage.write_file(tmp / (COMMIT_FILE + ".tmp"), [text], step)
        (tmp / (COMMIT_FILE + ".tmp")).rename(tmp / COMMIT_FILE)
        if final.exists():  # re-save of the same step after a rollback: swap, then drop the old one
            old = self.root / f".{final.name}.old-{self._tag(uuid.uuid4().hex[:8])}"
            final.rename(old)
            tmp.rename(final)
            self.storage.remove_tree(old)
        else:
            tmp.rename(final)
        _fsync_dir(self.root)
        return sum(info["bytes"] for info in files.values()) + len(text)

    def _retain(self, protect: int) -> None:
        """Runs on the finalize thread; a failed delete is logged and skipped."""
        steps = self.committed_steps()
        keep = newest_trusted([(s, self.root / step_dir_name(s)) for s in reversed(steps)],
                              self.verified_through()) if self.sdc_verified is not None else None
        for step in select_for_deletion(steps, self.config.keep_last, protect=(protect, *([keep] if keep else []))):
            path = self.root / step_dir_name(step)
            try:
                # Hide it first (a reader never sees a half-deleted checkpoint), then delete.
                doomed = self.root / f".{path.name}.old-{self._tag(uuid.uuid4().hex[:8])}"
                path.rename(doomed)
                self.storage.remove_tree(doomed)
            except OSError as exc:
                log.warning("retention could not delete %s: %s", path, exc)
                self.events.emit("checkpoint.delete_failed", step=step, **_error_fields(exc))
                continue
            self.events.emit("checkpoint.deleted", step=step)

@dataclass(frozen=True)
class _Snapshot:
    """What the memory push of one save needs: its token, extra blob and staged (or live) state."""

    token: str
    extra: bytes
    stager: FlatStager | None
    live: dict[str, Any] | None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
