"""Cross-replica agreement: which replica group's weights disagree with the majority.

In replica-group mode every group applies the same averaged gradients to the same weights, so in a
fault-free run rank ``r`` of every group holds bitwise the same parameter shard (same sharding inside
each group).  A CRC32 of each rank's shard, compared across the groups of a quorum, finds a group that
computed wrong; CRC32 catches every single-bit error, which is what a silent flip is.  The verdict is a
pure function of the checksum matrix, so every rank of every group reaches the same one from the same
bytes without a further vote.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def shard_checksum(tensors: Iterable[Any]) -> int:
    """CRC32 over the bytes of this rank's local parameter shards, in the order given (a model's
    ``parameters()`` order is the same in every group).  A GPU shard is copied to the host first."""
    import torch

    crc = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        data = local.detach().contiguous().cpu()
        if data.numel():
            crc = zlib.crc32(data.view(-1).view(torch.uint8).numpy(), crc)
    return crc


@dataclass(frozen=True)
class Agreement:
    """The verdict on one check: ``checksums[g][r]`` is rank ``r``'s CRC in the group of quorum rank ``g``."""

    checksums: list[list[int]]
    suspects: dict[int, list[int]] = field(default_factory=dict)
    """Quorum rank of each group in the minority -> the ranks whose shard disagrees."""
    majority: dict[int, int] = field(default_factory=dict)
    """Rank -> the checksum a strict majority of the groups holds (ranks where they all agree too)."""
    no_majority: list[int] = field(default_factory=list)
    """Ranks whose checksums differ with no strict majority (two groups, a tie): nobody can be named."""

    @property
    def agree(self) -> bool:
        return not self.suspects and not self.no_majority

    def checksum_of(self, group: int) -> list[int]:
        return self.checksums[group]


def judge(checksums: list[list[int]]) -> Agreement:
    """Per rank: the value more than half the groups hold is right; a group holding another is a suspect."""
    if not checksums:
        return Agreement([])
    groups, ranks = len(checksums), len(checksums[0])
    if any(len(row) != ranks for row in checksums):
        raise ValueError(f"every group must give {ranks} checksums, got {[len(row) for row in checksums]}")
    suspects: dict[int, list[int]] = {}
    majority: dict[int, int] = {}
    no_majority: list[int] = []
    for rank in range(ranks):
        value, count = Counter(row[rank] for row in checksums).most_common(1)[0]
        if count == groups or 2 * count > groups:
            majority[rank] = value
            for g in range(groups):
                if checksums[g][rank] != value:
                    suspects.setdefault(g, []).append(rank)
        else:
            no_majority.append(rank)
    return Agreement([list(row) for row in checksums], suspects, majority, no_majority)
