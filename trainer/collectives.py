"""The trainers' own collectives, with every tensor on a device the process group serves.

The worker session binds the default group to the compute device's type (``cuda:nccl`` /
``cpu:gloo``, :func:`elastic.common.collectives.backend_for`); these helpers derive their
tensor's device from the loss or from the group, and check it before the backend sees it
(:func:`~elastic.common.collectives.check_device`), so a misplaced tensor fails the same way on
a CPU-only group in tests as on NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic.common.collectives import check_device, group_device


def all_finite(loss: torch.Tensor) -> bool:
    """Collective: True iff ``loss`` is finite on every rank (so all ranks agree to stop).

    The flag is derived from the loss, so it lives on the loss's (compute) device.
    """
    bad = (~torch.isfinite(loss.detach())).any().to(torch.float32).reshape(1)
    dist.all_reduce(check_device(bad))
    return float(bad.item()) == 0.0


def broadcast_flag(flag: bool, src: int = 0, device: torch.device | None = None) -> bool:
    """Collective: rank ``src``'s flag on every rank of the default group (device: the group's own)."""
    tensor = torch.tensor([1.0 if flag else 0.0], device=device or group_device())
    dist.broadcast(check_device(tensor), src=src)
    return bool(tensor.item() > 0)
