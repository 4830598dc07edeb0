"""Checkpoint manager: DCP checkpoints with an atomic commit.

Layout under ``CheckpointConfig.dir``::

    step-00000040/            committed checkpoint (DCP files + COMMIT marker)
        .metadata, __0_0.distcp, ...
        extra-rank00000.pt    per-rank state that DCP cannot merge (RNG, ...)
        COMMIT                JSON: step, world size, fingerprint, sha256 per file
    .step-00000050.tmp-XXXX/  a save in progress; never loaded, removed on start

A checkpoint becomes visible only by the rename of its temporary directory,
which happens after every rank has finished writing and rank 0 has written
the COMMIT marker.  A reader only considers directories that have a COMMIT
marker whose checksums match, newest first, so a partial, corrupt or foreign
(different config fingerprint) checkpoint is reported and skipped; a good
checkpoint is never replaced by a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic.checkpoint_config import CheckpointConfig
from elastic.events import EventLog

log = logging.getLogger(__name__)

COMMIT_FILE = "COMMIT"
_STEP_RE = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """Base class for checkpoint failures."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint failed verification (checksum, marker, fingerprint)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _broadcast_obj(obj: Any, group: dist.ProcessGroup | None) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointManager:
    """Save and load committed checkpoints of a set of DCP-stateful objects.

    ``state`` passed to :meth:`save` / :meth:`load_latest` maps names to
    objects with ``state_dict()`` / ``load_state_dict()`` (DCP ``Stateful``)
    or plain dicts of tensors.  ``extra`` is per-rank picklable state
    (RNG states, ...) stored beside the DCP files.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        root: str | os.PathLike[str],
        fingerprint: str = "",
        events: EventLog | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.events = events or EventLog(None, "checkpoint")
        self.group = group
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
        _barrier(group)

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

    def _remove_stale_tmp(self) -> None:
        for entry in self.root.glob(".step-*.tmp-*"):
            shutil.rmtree(entry, ignore_errors=True)
            self.events.emit("checkpoint.stale_tmp_removed", path=str(entry))

    # -- save --------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.config.interval_steps > 0 and step % self.config.interval_steps == 0

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
        """Collective: write, verify-by-checksum and atomically commit checkpoint ``step``."""
        final = self.root / step_dir_name(step)
        tmp_name = _broadcast_obj(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None, self.group)
        tmp = self.root / tmp_name
        self.events.emit("checkpoint.save_start", step=step)
        dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
        torch.save(extra or {}, tmp / f"extra-rank{_rank():05d}.pt")
        _barrier(self.group)
        if _rank() == 0:
            self._commit(tmp, final, step)
        _barrier(self.group)
        self.events.emit("checkpoint.committed", step=step, path=str(final))
        if _rank() == 0:
            self._retain()
        return final

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"step": step, "world_size": _world(), "fingerprint": self.fingerprint, "files": files}
        marker_tmp = tmp / (COMMIT_FILE + ".tmp")
        with open(marker_tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(marker, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        marker_tmp.rename(tmp / COMMIT_FILE)
        if final.exists():  # re-save of the same step after a rollback: replace atomically
            old = self.root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(self.root)

    def _retain(self) -> None:
        steps = self.committed_steps()
        for step in steps[: -self.config.keep_last]:
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)
            self.events.emit("checkpoint.deleted", step=step)

    # -- load --------------------------------------------------------------
    def verify(self, step: int) -> dict[str, Any]:
        """Return the COMMIT marker of ``step`` or raise CheckpointCorrupt."""
        path = self.root / step_dir_name(step)
        try:
            marker = json.loads((path / COMMIT_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointCorrupt(f"{path.name}: unreadable commit marker ({exc})") from exc
        if self.fingerprint and marker.get("fingerprint") != self.fingerprint:
            raise CheckpointCorrupt(f"{path.name}: written by a different run config (fingerprint mismatch)")
        if self.config.verify_on_load:
            for name, digest in marker.get("files", {}).items():
                file = path / name
                if not file.exists():
                    raise CheckpointCorrupt(f"{path.name}: missing file {name}")
                if sha256_file(file) != digest:
                    raise CheckpointCorrupt(f"{path.name}: checksum mismatch in {name}")
        return marker

    def load_latest(self, state: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Collective: load the newest verified checkpoint into ``state``.

        Returns (step, this rank's extra state) or None if no usable
        checkpoint exists.  Rank 0 verifies and picks the step, so every rank
        loads the same one.
        """
        chosen = None
        if _rank() == 0:
            for step in reversed(self.committed_steps()):
                try:
                    self.verify(step)
                except CheckpointCorrupt as exc:
                    log.error("skipping checkpoint: %s", exc)
                    self.events.emit("checkpoint.skipped_corrupt", step=step, reason=str(exc))
                    continue
                chosen = step
                break
        chosen = _broadcast_obj(chosen, self.group)
        if chosen is None:
            return None
        path = self.root / step_dir_name(chosen)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        extra_file = path / f"extra-rank{_rank():05d}.pt"
        extra = torch.load(extra_file, weights_only=False) if extra_file.exists() else {}
        self.events.emit("checkpoint.loaded", step=chosen, path=str(path))
        return chosen, extra


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
