"""Damage a committed checkpoint behind the runtime's back: the fault primitive chaos needs.

It lives here, below both users, because two programs corrupt checkpoints: the ``chaos`` tool
on a shared run directory, and a node agent executing a fault delivered through etcd
(:mod:`elastic.agent.remote_faults`), which corrupts *its own* shard of the newest commit.
Neither touches the COMMIT marker: the damage must be found by the loader's checksum check.
No torch import: the agent and the chaos CLI use this without loading it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

COMMIT_NAME = "COMMIT"
_SHARD_RANK = re.compile(r"shard-(\d+)\.")


class NothingToCorrupt(RuntimeError):
    """No committed checkpoint (or no file in it) to damage yet."""


@dataclass(kw_only=True)
class Corruption:
    mode: Literal["flip", "truncate"] = "flip"
    """flip: invert ``num_bytes`` bytes in the middle of the file; truncate: cut the file in half."""
    num_bytes: int = 16
    file: str | None = None
    """File inside the checkpoint to damage; default: the largest listed file (of ``ranks`` when given)."""


def committed_steps(root: Path) -> list[int]:
    """Steps under ``root`` that have a COMMIT marker, oldest first."""
    return sorted(int(p.name.split("-")[1]) for p in Path(root).glob("step-*") if (p / COMMIT_NAME).is_file())


def newest_committed(root: Path) -> Path | None:
    steps = committed_steps(root)
    return Path(root) / f"step-{steps[-1]:08d}" if steps else None


def shard_rank(name: str) -> int | None:
    """The rank whose shard file this is (``shard-00001.safetensors`` -> 1), None for other files."""
    match = _SHARD_RANK.match(name)
    return int(match.group(1)) if match else None


def pick_victim(step_dir: Path, how: Corruption, ranks: set[int] | None = None) -> Path:
    if how.file is not None:
        return step_dir / how.file
    listed = json.loads((step_dir / COMMIT_NAME).read_text()).get("files", {})
    files = [step_dir / name for name in listed if (step_dir / name).is_file()]
    if ranks:
        own = [p for p in files if shard_rank(p.name) in ranks]
        files = own or files  # a node whose ranks wrote nothing here still damages the checkpoint
    if not files:
        raise NothingToCorrupt(f"{step_dir.name} lists no files")
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def corrupt_newest(root: Path, how: Corruption, ranks: set[int] | None = None) -> dict[str, Any]:
    """Damage one file of the newest committed checkpoint; what was done (step, file, offset...)."""
    newest = newest_committed(root)
    if newest is None:
        raise NothingToCorrupt(f"no committed checkpoint under {root}")
    victim = pick_victim(newest, how, ranks)
    size = victim.stat().st_size
    if how.mode == "truncate":
        os.truncate(victim, size // 2)
        detail: dict[str, Any] = {"truncated_to": size // 2}
    else:
        offset = max(size // 2 - how.num_bytes // 2, 0)
        with open(victim, "r+b") as fh:
            fh.seek(offset)
            data = fh.read(how.num_bytes)
            fh.seek(offset)
            fh.write(bytes(b ^ 0xFF for b in data))
        detail = {"offset": offset, "flipped": len(data)}
    return {"checkpoint_step": int(newest.name.split("-")[1]), "file": str(victim), "size": size,
            "mode": how.mode, **detail}
