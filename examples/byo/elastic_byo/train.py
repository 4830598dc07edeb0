"""A user's own training loop under the runtime: ``python -m elastic_byo.train --config C --run-dir D``.

A plain residual MLP sharded with FSDP2 (``fully_shard``), deterministic data from a seed, AdamW.
Everything it takes from the runtime comes through :mod:`elastic.api`: the session it runs in,
the step hooks, the Stateful that registers model, optimizer and data position, the NaN guard,
``run_worker``.  With those it gets in-process recovery, per-step snapshots, checkpoint resume,
the numerics rollback and hang stacks, as the built-in trainers do.

Determinism: the global batch of a step is made from (seed, data position) alone and each rank
takes its slice, so a run resumed from a snapshot or a checkpoint trains bitwise as a fault-free
one at the same world size (the final checksum is in ``<run-dir>/final_checksum.txt``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from elastic.api import Loop, TrainState, WorkerSession, exit_process, nan_guard, run_worker
from elastic_byo.config import ByoConfig


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(cfg: ByoConfig, world: int, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(*(Block(cfg.dim) for _ in range(cfg.blocks)), nn.Linear(cfg.dim, cfg.dim)).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class SeededBatches:
    """The data: global batches made from (seed, position); the position is checkpointed."""

    def __init__(self, cfg: ByoConfig) -> None:
        self.seed, self.size, self.dim = cfg.seed, cfg.global_batch_size, cfg.dim
        self.position = 0  # samples consumed so far, over all ranks

    def next_batch(self, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch (the position moves even if it goes unused)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        x = torch.randn(self.size, self.dim, generator=gen)
        self.position += self.size
        x = x.chunk(world)[rank]
        return x.to(device), (torch.sin(x) + 0.5 * x.roll(1, dims=1)).to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


class ByoRun(Loop):
    """Built for the current world by the session (again after an in-process re-formation)."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.cfg: ByoConfig = session.cfg.trainer
        self.model = build_model(self.cfg, session.world, session.device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.data = SeededBatches(self.cfg)
        self.train_state = TrainState(self.model, self.optim, data=self.data)
        self.last_step = self.cfg.steps

    def state(self) -> dict[str, Any]:
        return {"app": self.train_state}  # model, optimizer, data position, step

    def resumed(self, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        return {"data_position": self.data.position}  # a field of trainer.start

    def step(self, step: int) -> None:
        session = self.session
        session.begin_step(step)
        if self.cfg.step_sleep:
            time.sleep(self.cfg.step_sleep)
        session.sync_point()  # before the data position (state a snapshot holds) moves
        x, y = self.data.next_batch(session.rank, session.world, session.device)
        if not session.skip_step(step):  # a batch skipped after a numerics rollback is never used
            self.train_step(step, x, y)
        self.train_state.step = step

    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = self.session.loss(step, nn.functional.mse_loss(self.model(x), y))
        nan_guard(self.session, step, loss)  # a NaN on any rank: every rank rolls back, nothing applied
        self.optim.zero_grad(set_to_none=True)
        self.session.commit_point()  # the backward's reduce-scatters are the step's last collectives
        loss.backward()
        self.optim.step()
        self.session.end_step(step, float(loss.detach()))


def train(session: WorkerSession) -> str:
    return session.train(ByoRun)


@record
def main(argv: list[str] | None = None) -> int:
    return run_worker("python -m elastic_byo.train", ByoConfig, train, argv)


if __name__ == "__main__":
    exit_process(main())
