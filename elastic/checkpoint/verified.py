"""Whether a checkpoint was verified by replay when it was written, and which one a resume prefers.

With replay verification on (``sdc.replay_every``), every node's warm spare replays one rank of its
neighbour at each check step; an epoch is *verified through* step V when every verifier's newest
check in that epoch agreed at V or later (:meth:`~elastic.control.runstate.RunState.sdc_verified_through`;
a check verifies its epoch's trajectory only: a restart retrains from a checkpoint, a rollback
throws steps away).  A checkpoint of a step after V may hold a corruption no check has reached yet.
Rank 0 writes that fact into the COMMIT marker as it commits::

    "sdc": {"verified_step": V, "verified": step <= V}

A check answers a few hundred milliseconds after its step (a spare's replay; ``docs/benchmarks.md``)
while a save's commit can come before or after it, so an unverified marker is upgraded when a later
commit of the same epoch finds it verified past (the marker is rewritten whole and renamed over:
never a torn marker).  A resume prefers the newest checkpoint whose marker says verified, or whose
epoch's checks have since reached its step; it says so for each newer one it passes over
(``checkpoint.skipped_unverified``), and with none verified takes the newest and says that
(``checkpoint.resume_unverified``).  Markers without the field (verification off) are unaffected.
Retention keeps the verified checkpoint a resume would take.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.checkpoint.identity import COMMIT_FILE, read_marker

FIELD = "sdc"


def marker_field(step: int, verified_step: int | None) -> dict[str, Any]:
    """The COMMIT marker's ``sdc`` entry for a checkpoint of ``step``."""
    return {FIELD: {"verified_step": verified_step, "verified": verified_step is not None and step <= verified_step}}


VerifiedThrough = Callable[[int], "int | None"]
"""epoch -> the step that epoch's replay checks agree through now (None: not yet, or unknown)."""


def trusted(marker: dict[str, Any], verified: VerifiedThrough | None) -> bool:
    """A checkpoint a resume may prefer: verification off when it was written (no field), verified
    then, or verified since (its epoch's checks have reached its step)."""
    field = marker.get(FIELD)
    if not isinstance(field, dict) or field.get("verified"):
        return True
    if verified is None or marker.get("epoch") is None:
        return False
    through = verified(int(marker["epoch"]))
    return through is not None and int(marker.get("step", -1)) <= through


def upgrade(step_dir: Path, verified_step: int, epoch: int | None) -> bool:
    """Rewrite an unverified marker of ``epoch`` and a step at or before ``verified_step`` as
    verified (atomic rename over the old one); True if it was upgraded."""
    marker = read_marker(step_dir)
    field = marker.get(FIELD) if marker is not None else None
    if marker is None or not isinstance(field, dict) or field.get("verified") or marker.get("epoch") != epoch \
            or int(marker.get("step", -1)) > verified_step:
        return False
    marker[FIELD] = {**field, "verified": True, "verified_step": verified_step, "verified_after_commit": True}
    tmp = step_dir / f"{COMMIT_FILE}.verified.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(marker, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(step_dir / COMMIT_FILE)
    return True


def newest_trusted(step_dirs: list[tuple[int, Path]], verified: VerifiedThrough | None) -> int | None:
    """The newest of ``step_dirs`` ((step, directory), newest first) whose marker a resume prefers."""
    for step, step_dir in step_dirs:
        marker = read_marker(step_dir)
        if marker is not None and trusted(marker, verified):
            return step
    return None
