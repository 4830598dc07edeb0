"""DiT flow-matching trainer run by torchrun: ``python -m trainer.dit_train --config C --run-dir D``.

Same protocol as :mod:`trainer.train` (the minimal MLP workload): reads the
``trainer`` (here :class:`~trainer.dit_config.DiTTrainerConfig`),
``checkpoint`` and ``fingerprint`` sections of the run YAML; writes events to
``<run-dir>/events/trainer-rank{R}.jsonl``; reports steps, commits and bad
numerics to the node agent; checkpoints through
:class:`~elastic.checkpoint.manager.CheckpointManager` on its own gloo group; resumes
from the newest committed checkpoint; prints ``FINAL_CHECKSUM <sha256>``.

Determinism (CPU, same seed, world size and thread count): initial weights
come from the seed; the data order is a seeded permutation walked by a
global position (:class:`~trainer.data.GlobalSampler`); per-sample noise,
timestep and label dropout come from (seed, step, global sample index)
(:func:`~trainer.flow.per_sample_noise`).  Model, optimizer, sampler
position, numerics-guard history and RNG state are checkpointed, so a run
killed and resumed ends bitwise equal to an uninterrupted one.  A resume at a
different dp size continues with exactly the next unseen samples (the global
batch is fixed); its weights then differ from an uninterrupted run only by
floating-point reduction order.
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
from torch.distributed.elastic.multiprocessing.errors import record

from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
from elastic.common.config import ConfigError, from_dict, to_dict
from elastic.common.events import EventLog
from elastic.checkpoint.publish import publisher_from_env
from elastic.checkpoint.storage import FAIL_WRITE_ENV
from elastic.worker.faults import FaultHooks
from trainer.checksum import param_checksum, publish_checksum
from elastic.worker.channel import EXIT_NUMERICS, WorkerContext, skip_steps
from trainer.data import GlobalSampler, build_dataset, collate
from trainer.dit import DiT, build_dit
from trainer.dit_config import DiTTrainerConfig
from trainer.flow import flow_loss, interpolate, per_sample_noise, velocity_target
from trainer.fp8 import convert_to_fp8, fp8_stats
from trainer.numerics import NumericsGuard
from trainer.parallel import parallelize
from trainer.entry import EXIT_CONFIG, init_worker_process, parse_trainer_args, read_trainer_config
from trainer.tensorboard import ScalarLog, TensorBoardConfig

RESOLVED_CONFIG_NAME = "dit_trainer.yaml"
"""Written to the run directory by rank 0: what trainer.sample needs to rebuild the model."""


@dataclass(kw_only=True)
class DiTTrainerFile:
    """The parts of the run config the trainer reads; other sections are ignored."""

    trainer: DiTTrainerConfig = field(default_factory=DiTTrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    fingerprint: str = ""


def load_trainer_config(path: str | os.PathLike[str]) -> DiTTrainerFile:
    data = yaml.safe_load(Path(path).read_text()) or {}
    picked = {k: data[k] for k in ("trainer", "checkpoint", "tensorboard", "fingerprint") if k in data}
    return from_dict(DiTTrainerFile, picked)


def checkpoint_root(cfg_file: DiTTrainerFile, run_dir: Path) -> Path:
    root = Path(cfg_file.checkpoint.dir)
    return root if root.is_absolute() else run_dir / root


class NumericsRollback(Exception):
    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step}: {reason}")
        self.step = step
        self.reason = reason


class TrainState(Stateful):
    """Everything a resume needs, in DCP form (model/optim resharded on load)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, sampler: GlobalSampler,
                 guard: NumericsGuard) -> None:
        self.model = model
        self.optim = optim
        self.sampler = sampler
        self.guard = guard
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "step": self.step,
            "data": self.sampler.state_dict(),
            "numerics": self.guard.state_dict(),
            # Global RNG: identical on all ranks (seeded the same way); per-rank state goes to `extra`.
            "rng": {"torch_cpu": torch.get_rng_state()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.step = int(state_dict["step"])
        self.sampler.load_state_dict(state_dict["data"])
        self.guard.load_state_dict(state_dict["numerics"])
        torch.set_rng_state(state_dict["rng"]["torch_cpu"])


def rank_rng_state() -> dict[str, Any]:
    extra: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "world_size": dist.get_world_size()}
    if torch.cuda.is_available():
        extra["torch_cuda"] = torch.cuda.get_rng_state()
    return extra


def restore_rank_rng(extra: dict[str, Any]) -> bool:
    """Per-rank RNG only makes sense at the same world size; otherwise the global state stands."""
    if extra.get("world_size") != dist.get_world_size() or "torch_cpu" not in extra:
        return False
    torch.set_rng_state(extra["torch_cpu"])
    if "torch_cuda" in extra and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["torch_cuda"])
    return True


def global_grad_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def _inject_nan(cfg: DiTTrainerConfig, run_dir: Path, step: int, rank: int) -> bool:
    if step not in cfg.numerics.inject_nan_steps:
        return False
    if not cfg.numerics.inject_nan_once:
        return True
    marker = run_dir / "faults" / f"nan-step{step:08d}-rank{rank:05d}"
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True


def micro_batches(indices: list[int], size: int) -> list[list[int]]:
    if size <= 0 or size >= len(indices):
        return [indices]
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def micro_batch_loss(model: DiT, cfg: DiTTrainerConfig, dataset: Any, step: int, indices: list[int],
                     device: torch.device) -> torch.Tensor:
    """Flow-matching loss of these global sample indices (this rank's tokens of them)."""
    shape = (cfg.model.in_channels, cfg.model.input_size, cfg.model.input_size)
    x0, labels = collate(dataset, indices)
    noise, t, drop = per_sample_noise(cfg.seed, step, indices, shape, cfg.flow.t_logit_mean, cfg.flow.t_logit_std,
                                      cfg.model.class_dropout_prob)
    labels = torch.where(drop, torch.full_like(labels, model.null_class), labels)
    x_t = interpolate(x0, noise, t).to(device)
    target = model.local_tokens(velocity_target(x0, noise)).to(device)
    y = labels.to(device) if cfg.model.num_classes else None
    return flow_loss(model(x_t, t.to(device), y), target)


def build_model(cfg: DiTTrainerConfig, device: torch.device) -> tuple[DiT, list[str]]:
    model = build_dit(cfg.model, cfg.seed).to(device)
    converted: list[str] = []
    if cfg.fp8.enabled:
        converted = convert_to_fp8(model, cfg.fp8.include, cfg.fp8.exclude, cfg.fp8.recipe, cfg.fp8.backend)
    return model, converted


def train(cfg_file: DiTTrainerFile, run_dir: Path) -> str:
    cfg = cfg_file.trainer
    device, rank, world = init_worker_process()
    worker = WorkerContext.from_env(run_dir)
    events = EventLog(run_dir / "events" / f"trainer-rank{rank}.jsonl", f"trainer/rank{rank}")
    dp, cp = cfg.check_world(world)
    if world > 1 and not cfg.parallel.fsdp:
        raise ConfigError("parallel.fsdp", "must be true with more than one rank (gradients are averaged by FSDP)")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESOLVED_CONFIG_NAME).write_text(yaml.safe_dump(to_dict(cfg_file), sort_keys=False))

    torch.manual_seed(cfg.seed)
    model, converted = build_model(cfg, device)
    mesh = parallelize(model, cfg.parallel, dp, cp, device.type)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                              eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    dataset = build_dataset(cfg.data, cfg.model, cfg.seed)
    sampler = GlobalSampler(len(dataset), cfg.global_batch_size, cfg.seed, cfg.data.shuffle)
    guard = NumericsGuard(cfg.numerics)
    state = TrainState(model, optim, sampler, guard)

    # Checkpoint collectives get their own gloo group, so they can never interleave with
    # FSDP's collectives on the default group (measured crash otherwise).
    ckpt_group = dist.new_group(backend="gloo")
    manager = CheckpointManager(cfg_file.checkpoint, checkpoint_root(cfg_file, run_dir), cfg_file.fingerprint,
                                events, ckpt_group, publisher=publisher_from_env())
    loaded = manager.load_latest({"app": state})
    rank_rng = restore_rank_rng(loaded[1]) if loaded else False
    start = state.step if loaded else 0
    events.emit("trainer.start", step=start, world_size=world, dp=dp, cp=cp, resumed=loaded is not None,
                node=os.environ.get("ELASTIC_NODE_ID"),
                rank_rng_restored=rank_rng, samples_seen=sampler.samples_seen, fp8_layers=len(converted),
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    tokens_per_step = cfg.global_batch_size * cfg.model.num_tokens
    hooks = FaultHooks(run_dir, rank, events)
    scalars = ScalarLog(cfg_file.tensorboard, run_dir, rank)
    skipped_steps = skip_steps()
    sync = torch.zeros(1, device=device)
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.monotonic()
            hooks.before_step(step)
            # The step's sync point: time spent here is waiting for slower peers, not work.
            t_sync = time.monotonic()
            dist.all_reduce(sync)
            wait = time.monotonic() - t_sync
            indices = GlobalSampler.rank_slice(sampler.next_global_batch(), dp_rank, dp)
            if step in skipped_steps:
                # Rolled back past a bad batch: the sampler moves on, the batch is never used.
                state.step = step
                events.emit("trainer.step_skipped", step=step, reason="numerics rollback")
                if manager.should_save(step) or step == cfg.steps:
                    manager.save(step, {"app": state}, extra=rank_rng_state())
                continue
            inject = _inject_nan(cfg, run_dir, step, rank) or hooks.loss(step, 1.0) != 1.0
            optim.zero_grad(set_to_none=True)
            chunks = micro_batches(indices, cfg.micro_batch_size)
            loss = torch.zeros((), device=device)
            for i, chunk in enumerate(chunks):
                if len(chunks) > 1 and hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(i == len(chunks) - 1)  # reduce-scatter after the last one
                part = micro_batch_loss(model, cfg, dataset, step, chunk, device) * (len(chunk) / len(indices))
                if inject:
                    part = part * float("nan")
                part.backward()
                loss += part.detach()

            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            grad_norm = global_grad_norm(model)
            loss_value, norm_value = float(global_loss), float(grad_norm)
            verdict = guard.check(loss_value, norm_value)
            lr = cfg.optim.lr * min(1.0, step / cfg.optim.warmup_steps) if cfg.optim.warmup_steps else cfg.optim.lr
            if verdict.ok:
                if cfg.optim.grad_clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.optim.grad_clip, grad_norm)
                for group in optim.param_groups:
                    group["lr"] = lr
                optim.step()
            else:
                optim.zero_grad(set_to_none=True)  # the bad gradients never reach the weights
                events.emit("trainer.numerics", step=step, action=verdict.action, reason=verdict.reason,
                            loss=loss_value, grad_norm=norm_value, total_skips=guard.total_skips)
                if verdict.action == "rollback":
                    raise NumericsRollback(step, verdict.reason)
            state.step = step
            if cfg.step_sleep:
                time.sleep(cfg.step_sleep)
            step_time = time.monotonic() - t0
            tokens_per_s = tokens_per_step / step_time if step_time > 0 else None
            fp8 = fp8_stats(model)
            events.emit("trainer.step", step=step, loss=loss_value, step_time=step_time, tokens_per_s=tokens_per_s,
                        grad_norm=norm_value, lr=lr, skipped=not verdict.ok, samples_seen=sampler.samples_seen, fp8=fp8)
            scalars.step(step, loss_value, step_time, grad_norm=norm_value, tokens_per_s=tokens_per_s, lr=lr, fp8=fp8)
            worker.report_step(step, loss_value, step_time, step_time - wait)
            if manager.should_save(step) or step == cfg.steps:
                if hooks.checkpoint_write_error(step) is not None:
                    os.environ[FAIL_WRITE_ENV] = f"{step}:{rank}"  # this rank's write of this save hits ENOSPC
                # Commits in the background; published to etcd (the agents' progress signal) when done.
                manager.save(step, {"app": state}, extra=rank_rng_state())
    except NumericsRollback as exc:
        worker.report_numerics(exc.step, exc.reason)
        events.emit("trainer.rollback", step=exc.step, reason=exc.reason)
        scalars.close()
        manager.close()
        # Every rank reaches the same verdict (global loss and norm), so all of them get here.
        dist.destroy_process_group()
        raise

    manager.close()
    scalars.close()
    worker.report_done(cfg.steps)
    checksum = param_checksum(model)
    publish_checksum(run_dir, rank, checksum)
    events.emit("trainer.done", step=cfg.steps, checksum=checksum, total_skips=guard.total_skips)
    dist.barrier()
    dist.destroy_process_group()
    return checksum


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_trainer_args("python -m trainer.dit_train", argv)
    cfg_file = read_trainer_config(load_trainer_config, args.config)
    if cfg_file is None:
        return EXIT_CONFIG
    try:
        train(cfg_file, Path(args.run_dir))
    except NumericsRollback as exc:
        print(f"trainer: numerics rollback: {exc}", file=sys.stderr, flush=True)
        return EXIT_NUMERICS
    except ConfigError as exc:
        print(f"trainer: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
