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

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard

from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
from elastic.common.config import from_dict
from elastic.common.events import EventLog
from elastic.checkpoint.publish import publisher_from_env
from elastic.checkpoint.storage import FAIL_WRITE_ENV
from elastic.worker.faults import FaultHooks
from trainer.checksum import param_checksum, publish_checksum
from elastic.worker.channel import EXIT_NUMERICS, WorkerContext, skip_steps
from trainer.minimal_config import MLPTrainerConfig
from trainer.entry import EXIT_CONFIG, init_worker_process, parse_trainer_args, read_trainer_config
from trainer.tensorboard import ScalarLog, TensorBoardConfig


@dataclass(kw_only=True)
class _TrainerFile:
    """The parts of the run config the trainer reads; other sections are ignored."""

    trainer: MLPTrainerConfig = field(default_factory=MLPTrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    fingerprint: str = ""


def load_trainer_config(path: str | os.PathLike[str]) -> _TrainerFile:
    data = yaml.safe_load(Path(path).read_text()) or {}
    picked = {k: data[k] for k in ("trainer", "checkpoint", "tensorboard", "fingerprint") if k in data}
    return from_dict(_TrainerFile, picked)


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
    flag = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0])
    dist.all_reduce(flag)
    return flag.item() == 0.0


def train(cfg_file: _TrainerFile, run_dir: Path) -> str:
    cfg = cfg_file.trainer
    device, rank, world = init_worker_process()
    worker = WorkerContext.from_env(run_dir)
    events = EventLog(run_dir / "events" / f"trainer-rank{rank}.jsonl", f"trainer/rank{rank}")

    model = shard_model(build_model(cfg).to(device), world, device.type)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    app = AppState(model, optim)
    ckpt_root = Path(cfg_file.checkpoint.dir)
    if not ckpt_root.is_absolute():
        ckpt_root = run_dir / ckpt_root
    # Checkpoint collectives get their own gloo group, so they can never interleave with
    # FSDP's collectives on the default group (measured crash otherwise).
    ckpt_group = dist.new_group(backend="gloo")
    manager = CheckpointManager(cfg_file.checkpoint, ckpt_root, cfg_file.fingerprint, events, ckpt_group,
                                publisher=publisher_from_env())

    loaded = manager.load_latest({"app": app})
    start = app.step if loaded else 0
    events.emit("trainer.start", step=start, world_size=world, resumed=loaded is not None,
                node=os.environ.get("ELASTIC_NODE_ID"),
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    loss_fn = nn.MSELoss()
    scalars = ScalarLog(cfg_file.tensorboard, run_dir, rank)
    hooks = FaultHooks(run_dir, rank, events)
    skipped = skip_steps()
    sync = torch.zeros(1)
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.monotonic()
        hooks.before_step(step)
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
        # The step's sync point: time spent here is waiting for slower peers, not work.
        t_sync = time.monotonic()
        dist.all_reduce(sync)
        wait = time.monotonic() - t_sync
        if step in skipped:
            # Rolled back past a bad batch: the step number advances, its data is never used.
            app.step = step
            events.emit("trainer.step_skipped", step=step, reason="numerics rollback")
        else:
            x, y = batch_for(cfg, step, rank, device)
            loss = hooks.loss(step, loss_fn(model(x), y))
            if not _all_finite(loss):
                # Never let a NaN reach the weights: no backward, no optimizer step; the agent rolls back.
                events.emit("trainer.numerics", step=step, reason="non-finite loss")
                worker.report_numerics(step, "non-finite loss")
                sys.stdout.flush()
                os._exit(EXIT_NUMERICS)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            app.step = step
            step_time = time.monotonic() - t0
            loss_value = float(loss.detach())
            events.emit("trainer.step", step=step, loss=loss_value, step_time=step_time, busy_time=step_time - wait)
            worker.report_step(step, loss_value, step_time, step_time - wait)
            scalars.step(step, loss_value, step_time)
        if manager.should_save(step) or step == cfg.steps:
            if hooks.checkpoint_write_error(step) is not None:
                os.environ[FAIL_WRITE_ENV] = f"{step}:{rank}"  # this rank's write of this save hits ENOSPC
            manager.save(step, {"app": app})  # commits in the background; published to etcd when done

    manager.close()  # the final save must commit before the process group goes away
    scalars.close()
    worker.report_done(cfg.steps)
    checksum = param_checksum(model)
    publish_checksum(run_dir, rank, checksum)
    events.emit("trainer.done", step=cfg.steps, checksum=checksum)
    dist.barrier()
    dist.destroy_process_group()
    return checksum


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_trainer_args("python -m trainer.train", argv)
    cfg_file = read_trainer_config(load_trainer_config, args.config)
    if cfg_file is None:
        return EXIT_CONFIG
    train(cfg_file, Path(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
