"""Ulysses context parallelism: the differentiable all-to-all that swaps sequence sharding for
head sharding (and back) around attention.  See :mod:`trainer.parallel` for why it is exact.

Its own module so that the model (:mod:`trainer.dit`) and the parallelizer (:mod:`trainer.parallel`)
both import it without importing each other.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

CommMode = Literal["all_to_all", "all_gather"]
_COMM_MODE: CommMode = "all_to_all"


def set_comm_mode(mode: CommMode) -> None:
    global _COMM_MODE
    _COMM_MODE = mode


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into world chunks; chunk j goes to rank j; concatenate
    the chunks received from ranks 0..world-1 along ``gather_dim``."""
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim), dim=0).contiguous()
    if _COMM_MODE == "all_to_all":
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        parts = list(recv.unbind(0))
    else:
        me = dist.get_rank(group)
        gathered = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(gathered, send, group=group)
        parts = [g[me] for g in gathered]
    return torch.cat(parts, dim=gather_dim)


class _UlyssesAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):  # type: ignore[override]
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # The inverse exchange: what rank i sent as chunk j comes back from rank j.
        return _exchange(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def ulysses_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all (see :func:`_exchange`); backward is the inverse exchange."""
    return _UlyssesAllToAll.apply(x, scatter_dim, gather_dim, group)
