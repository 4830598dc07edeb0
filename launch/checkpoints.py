"""Before a launch: the run directory's checkpoints must be this config's, or moved aside on purpose.

A relaunch in the same run directory resumes from its newest committed checkpoint.  When that
checkpoint was written by another run config (a changed model, optimizer or data definition; run
length and pacing do not count, see :meth:`~elastic.run.schema.RunConfig.fingerprint_basis`), the
launch stops before anything starts, with one line naming the differing fields.  ``--fresh``
starts over on purpose: the checkpoint root is renamed to ``<root>.old-<n>``, never deleted.
In cluster mode every node's launcher runs this against the shared run directory at its own
time, so there ``--fresh`` only moves *another config's* checkpoints aside: a late node must not
move away what the nodes of the fresh run have saved since.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from elastic.checkpoint.identity import mismatch, move_aside, newest_marker
from elastic.run.schema import RunConfig


class CheckpointConflict(Exception):
    """The run directory holds another config's checkpoints (one line, names the fields)."""


def check_checkpoints(cfg: RunConfig, run_dir: Path, fresh: bool, say: Callable[[str], None]) -> None:
    """Refuse (CheckpointConflict) or, with ``fresh``, move aside the run dir's checkpoints."""
    root = cfg.checkpoint.root(run_dir)
    newest = newest_marker(root)
    if newest is None:
        return
    path, marker = newest
    problem = mismatch(path, marker, cfg.compute_fingerprint(), cfg.fingerprint_basis())
    if not fresh:
        if problem is not None:
            raise CheckpointConflict(problem)
        return
    if cfg.launch.etcd_endpoint and problem is None:
        say(f"--fresh: the checkpoints in {root} are this config's; in cluster mode --fresh moves only "
            f"another config's checkpoints aside (move {root} yourself to start over)")
        return
    dest = move_aside(root)
    say(f"--fresh: moved the checkpoints of {root} (newest {path.name}) aside to {dest}")
