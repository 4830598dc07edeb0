"""Whose checkpoint is this: the COMMIT marker's fingerprint and basis, read without torch.

A committed checkpoint's COMMIT marker holds the run config's checkpoint fingerprint and, since
it names what differs, the *basis* the fingerprint was hashed from
(:meth:`elastic.run.schema.RunConfig.fingerprint_basis`: the workload and the trainer fields that
change the meaning of saved state).  A loader that finds a checkpoint of another config must not
silently train from step 0 over it; :func:`mismatch` says in one line which fields differ, so the
trainer (and, before anything starts, the launcher) can stop with that line.  ``elastic-launch
--fresh`` starts over on purpose: :func:`move_aside` renames the checkpoint root to
``<root>.old-<n>``, it never deletes.

Importable without torch: the launcher checks a run directory before it starts anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

COMMIT_FILE = "COMMIT"
_STEP_RE = re.compile(r"^step-(\d{8})$")
_MAX_SHOWN = 4


def read_marker(step_dir: Path) -> dict[str, Any] | None:
    """The COMMIT marker of a checkpoint directory, or None when absent or unreadable."""
    try:
        marker = json.loads((step_dir / COMMIT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def committed_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint with a COMMIT marker under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), entry) for entry in root.iterdir()
             if (m := _STEP_RE.match(entry.name)) and (entry / COMMIT_FILE).exists()]
    return sorted(found, reverse=True)


def newest_marker(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose marker reads, with the marker."""
    for step, path in committed_dirs(root):
        marker = read_marker(path)
        if marker is not None and marker.get("step") == step:
            return path, marker
    return None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def basis_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field: saved -> current`` for every leaf that differs (absent leaves show as ``-``)."""
    old, new = flatten(saved), flatten(current)
    missing = object()
    lines = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            lines.append(f"{key}: {'-' if a is missing else json.dumps(a)} -> {'-' if b is missing else json.dumps(b)}")
    return lines


def mismatch(step_dir: Path, marker: dict[str, Any], fingerprint: str, basis: dict[str, Any] | None) -> str | None:
    """One line naming the differing fields when ``marker`` is another config's, else None."""
    if not fingerprint or marker.get("fingerprint") == fingerprint:
        return None
    saved = marker.get("fingerprint_basis")
    if isinstance(saved, dict) and basis is not None:
        diff = basis_diff(saved, basis)
        more = f" (and {len(diff) - _MAX_SHOWN} more)" if len(diff) > _MAX_SHOWN else ""
        fields = "; ".join(diff[:_MAX_SHOWN]) + more if diff else "fingerprint rule changed"
    else:
        fields = "fields unknown (its COMMIT marker has no fingerprint basis)"
    return (f"checkpoint {step_dir.name} in {step_dir.parent} was written by a different run config: {fields}; "
            f"relaunch with --fresh to move the old checkpoints aside and start from step 0")


def move_aside(root: Path) -> Path:
    """Rename ``root`` to the first free ``<root>.old-<n>`` (nothing is deleted); returns the new path."""
    n = 0
    while (dest := root.with_name(f"{root.name}.old-{n}")).exists():
        n += 1
    root.rename(dest)
    return dest
