"""Trainer entry point run by torchrun: ``python -m trainer.train --config C --run-dir D``.

This is the minimal workload of the runtime: a small MLP regression trained
with FSDP2 (``fully_shard``) on gloo (CPU) or NCCL (GPU), checkpointed with
the runtime's :class:`~elastic.checkpoint.manager.CheckpointManager` and resumed from
the newest committed checkpoint after any restart.

Determinism: the batch of step ``s`` on rank ``r`` is generated from
``(seed, s, r)`` alone, and model + optimizer state come back bitwise from
DCP, so a run killed and resumed ends with exactly the weights of an
uninterrupted run (same world size and thread count).  The final parameter
checksum is printed (``FINAL_CHECKSUM <sha256>``) and written to
``<run-dir>/final_checksum.txt``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from elastic.api import NumericsRollback, SnapshotStateDict, WorkerSession, exit_process, run_worker
from trainer.collectives import all_finite
from trainer.minimal_config import MLPTrainerConfig


def build_model(cfg: MLPTrainerConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)  # same init on every rank before sharding
    layers: list[nn.Module] = []
    for _ in range(cfg.depth - 1):
        layers += [nn.Linear(cfg.dim, cfg.dim), nn.GELU()]
    layers.append(nn.Linear(cfg.dim, cfg.dim))
    return nn.Sequential(*layers)


def shard_model(model: nn.Module, world_size: int, device_type: str) -> nn.Module:
    mesh = init_device_mesh(device_type, (world_size,))
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch_for(cfg: MLPTrainerConfig, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batch of (step, rank): resumes need no data-loader state."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(cfg.batch_size, cfg.dim, generator=gen)
    # A fixed smooth target function, so the loss really falls.
    y = torch.sin(x) + 0.5 * x.roll(1, dims=1)
    return x.to(device), y.to(device)


class AppState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (FSDP2-aware, reshardable)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, step: int = 0) -> None:
        self.model = model
        self.optim = optim
        self.step = step
        self._snapshot_sd = SnapshotStateDict(model, optim)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def snapshot_state_dict(self) -> dict[str, Any]:
        """The same tree for a per-step memory snapshot, without DCP's per-call cost."""
        model_sd, optim_sd = self._snapshot_sd()
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )
        self.step = int(state_dict["step"])


class MLPRun:
    """The MLP trainer for the current world (built again after an in-process re-formation)."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.cfg: MLPTrainerConfig = session.cfg.trainer
        self.model = shard_model(build_model(self.cfg).to(session.device), session.world, session.device.type)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.app = AppState(self.model, self.optim)
        self.loss_fn = nn.MSELoss()
        self.last_step = self.cfg.steps

    def state(self) -> dict[str, Any]:
        return {"app": self.app}

    def extra(self) -> dict[str, Any]:
        return {}  # batches depend on (seed, step, rank) only: no RNG state to carry

    def resumed(self, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        return {}

    def done_fields(self) -> dict[str, Any]:
        return {}

    def step(self, step: int) -> None:
        session = self.session
        session.begin_step(step)
        if self.cfg.step_sleep:
            time.sleep(self.cfg.step_sleep)
        session.sync_point()
        if not session.skip_step(step):  # a skipped step advances, its data is never used
            self.train_step(step)
        self.app.step = step

    def train_step(self, step: int) -> None:
        x, y = batch_for(self.cfg, step, self.session.rank, self.session.device)
        loss = self.session.loss(step, self.loss_fn(self.model(x), y))
        if not all_finite(loss):
            # Never let a NaN reach the weights: no backward, no optimizer step; the agent rolls back.
            self.session.events.emit("trainer.numerics", step=step, reason="non-finite loss")
            self.session.agent.report_numerics(step, "non-finite loss")
            raise NumericsRollback(step, "non-finite loss")
        self.optim.zero_grad(set_to_none=True)
        self.session.commit_point()  # the backward's reduce-scatters are the step's last collectives
        loss.backward()
        self.optim.step()
        self.session.end_step(step, float(loss.detach()))


def train(session: WorkerSession) -> str:
    return session.train(MLPRun)


@record
def main(argv: list[str] | None = None) -> int:
    return run_worker("python -m trainer.train", MLPTrainerConfig, train, argv)


if __name__ == "__main__":
    exit_process(main())
