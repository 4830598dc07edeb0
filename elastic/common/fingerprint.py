"""Hashes that say whether two processes run "the same job": config and code.

Two uses share :func:`config_hash`:

* the checkpoint fingerprint (:meth:`elastic.run.schema.RunConfig.compute_fingerprint`):
  only what changes the meaning of saved state, so a checkpoint of another
  config is never loaded;
* the join fingerprint (:mod:`elastic.control.admission`): the whole run config minus
  per-node fields, plus :func:`code_hash` of this project's packages, so a node
  started with different settings or different code is refused instead of
  silently training a different job next to the others.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any

CODE_PACKAGES = ("elastic", "trainer", "launch", "diagnostics", "chaos")


def config_hash(basis: Any) -> str:
    """16 hex digits of sha256 over canonical JSON (sorted keys); stable across processes and hosts."""
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


@cache
def code_hash(packages: tuple[str, ...] = CODE_PACKAGES) -> str:
    """16 hex digits of sha256 over every ``.py`` file of ``packages`` (path relative to the package, content).

    The files are found where Python imports them from, so an installed copy and a
    checkout hash alike when their sources agree.  ``__pycache__`` is ignored.
    """
    digest = hashlib.sha256()
    for name in packages:
        spec = importlib.util.find_spec(name)
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in roots:
            for path in sorted(Path(root).rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                rel = f"{name}/{path.relative_to(root).as_posix()}"
                digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
