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

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from elastic.worker.session import NumericsRollback, WorkerSession, run_worker
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

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )
        self.step = int(state_dict["step"])


def _all_finite(loss: torch.Tensor) -> bool:
    """Collective: True iff the loss is finite on every rank (all ranks then agree to stop)."""
    flag = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=loss.device)
    dist.all_reduce(flag)
    return flag.item() == 0.0


def train(session: WorkerSession) -> str:
    cfg: MLPTrainerConfig = session.cfg.trainer
    device = session.device
    model = shard_model(build_model(cfg).to(device), session.world, device.type)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    app = AppState(model, optim)
    loaded = session.resume({"app": app})
    start = app.step if loaded else 0
    session.emit_start(start, resumed=loaded is not None)
    loss_fn = nn.MSELoss()
    for step in range(start + 1, cfg.steps + 1):
        session.begin_step(step)
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
        session.sync_point()
        if session.skip_step(step):
            # Rolled back past a bad batch: the step number advances, its data is never used.
            app.step = step
        else:
            train_step(session, cfg, model, optim, loss_fn, step)
            app.step = step
        session.maybe_save(step, cfg.steps, {"app": app})  # commits in the background; published to etcd
    return session.finish(model, cfg.steps)


def train_step(session: WorkerSession, cfg: MLPTrainerConfig, model: nn.Module, optim: torch.optim.Optimizer,
               loss_fn: nn.Module, step: int) -> None:
    x, y = batch_for(cfg, step, session.rank, session.device)
    loss = session.loss(step, loss_fn(model(x), y))
    if not _all_finite(loss):
        # Never let a NaN reach the weights: no backward, no optimizer step; the agent rolls back.
        session.events.emit("trainer.numerics", step=step, reason="non-finite loss")
        session.agent.report_numerics(step, "non-finite loss")
        raise NumericsRollback(step, "non-finite loss")
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    session.end_step(step, float(loss.detach()))


@record
def main(argv: list[str] | None = None) -> int:
    return run_worker("python -m trainer.train", MLPTrainerConfig, train, argv)


if __name__ == "__main__":
    sys.exit(main())
