"""Collectives that also work in a single process, and the device a process group serves.

The checkpoint code runs both under torchrun and in plain single-process tools (the sampler,
tests, the chaos injectors); every helper here degrades to the one-rank answer there.

Device placement: on NCCL a collective over a CPU tensor raises "No backend type associated
with device type cpu", so a flag or sync tensor made with a bare ``torch.zeros(1)`` crashes the
first GPU run while every CPU test passes.  :func:`backend_for` binds a worker's default group
to its compute device's type (``cuda:nccl``, ``cpu:gloo``), so the CPU suite runs on a group
that, like NCCL, serves exactly one device type; :func:`check_device` raises
:class:`CollectiveDeviceError`, naming both devices, before a backend sees a misplaced tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Backend


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective is on a device type its process group does not serve."""


def backend_for(device: torch.device) -> str:
    """A default group's backend bound to one device type: ``cuda:nccl`` or ``cpu:gloo``."""
    return "cuda:nccl" if device.type == "cuda" else f"{device.type}:gloo"


def served_device_types(group: dist.ProcessGroup | None = None) -> set[str] | None:
    """Device types ``group``'s backends serve (``cpu:gloo`` -> {cpu}, ``nccl`` -> {cuda}); None if unknown."""
    served: set[str] = set()
    for part in str(dist.get_backend(group)).split(","):
        device, sep, _name = part.strip().partition(":")
        if sep:
            served.add(device)
        elif device in Backend.backend_capability:
            served.update(Backend.backend_capability[device])
        else:
            return None  # a third-party backend: nothing to check against
    return served


def check_device(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor``, or CollectiveDeviceError when ``group`` does not serve its device type."""
    served = served_device_types(group)
    if served is not None and tensor.device.type not in served:
        raise CollectiveDeviceError(
            f"collective tensor on {tensor.device}, but the process group ({dist.get_backend(group)}) serves "
            f"{', '.join(sorted(served))}: on NCCL this is 'No backend type associated with device type "
            f"{tensor.device.type}'")
    return tensor


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """A device ``group`` serves: the CPU when it can, else this process's current GPU."""
    served = served_device_types(group)
    if served is None or "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(sorted(served)[0])


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
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())
