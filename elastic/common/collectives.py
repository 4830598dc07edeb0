"""Collectives that also work in a single process (no process group initialised).

The checkpoint code runs both under torchrun and in plain single-process tools (the sampler,
tests, the chaos injectors); every helper here degrades to the one-rank answer there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_object(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """``obj`` as the group's first rank has it."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def all_true(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True only if ``flag`` is true on every rank of the group."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())
