"""The trainers' own collectives, with every tensor on a device the process group serves.

On NCCL a collective over a CPU tensor raises "No backend type associated with device type
cpu", so a flag or sync tensor made with a bare ``torch.zeros(1)`` crashes the first GPU run
while every CPU test passes.  The trainers call these helpers instead of ``torch.distributed``
directly:

* each helper puts its tensor on the device it is given (or derives it from the loss, which
  is already on the compute device), never on a default one;
* :func:`backend_for` binds the default group's backend to one device type (``cuda:nccl``,
  ``cpu:gloo``), so the CPU suite runs on a group that, like NCCL, serves exactly one device
  type;
* every helper checks its tensor against the device types the group serves
  (:func:`served_device_types`) and raises :class:`CollectiveDeviceError`, naming both,
  before the backend sees it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed import Backend


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective is on a device type its process group does not serve."""


def backend_for(device: torch.device) -> str:
    """The default group's backend bound to one device type: ``cuda:nccl`` or ``cpu:gloo``."""
    return "cuda:nccl" if device.type == "cuda" else f"{device.type}:gloo"


def served_device_types(group: dist.ProcessGroup | None = None) -> set[str] | None:
    """Device types ``group``'s backends serve (``cpu:gloo`` -> {cpu}, ``nccl`` -> {cuda}); None if unknown."""
    served: set[str] = set()
    for part in str(dist.get_backend(group)).split(","):
        device, sep, name = part.strip().partition(":")
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


def all_finite(loss: torch.Tensor) -> bool:
    """Collective: True iff ``loss`` is finite on every rank (so all ranks agree to stop).

    The flag is derived from the loss, so it lives on the loss's (compute) device.
    """
    bad = (~torch.isfinite(loss.detach())).any().to(torch.float32).reshape(1)
    dist.all_reduce(check_device(bad))
    return float(bad.item()) == 0.0


class StepSync:
    """The step's sync point: one tiny all-reduce on the compute device."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(1, device=device)

    def wait(self) -> float:
        """Seconds spent waiting for the slowest rank."""
        start = time.monotonic()
        dist.all_reduce(check_device(self.tensor))
        return time.monotonic() - start


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """A device ``group`` serves: the CPU when it can, else this process's current GPU."""
    served = served_device_types(group)
    if served is None or "cpu" in served:
        return torch.device("cpu")
    if "cuda" in served:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(sorted(served)[0])


def broadcast_flag(flag: bool, src: int = 0, device: torch.device | None = None) -> bool:
    """Collective: rank ``src``'s flag, on every rank of the default group (device: :func:`group_device`)."""
    tensor = torch.tensor([1.0 if flag else 0.0], device=device or group_device())
    dist.broadcast(check_device(tensor), src=src)
    return bool(tensor.item() > 0)
