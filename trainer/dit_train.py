"""DiT flow-matching trainer run by torchrun: ``python -m trainer.dit_train --config C --run-dir D``.

Same protocol as :mod:`trainer.train` (the minimal MLP workload): reads the
``trainer`` (here :class:`~trainer.dit_config.DiTTrainerConfig`),
``checkpoint`` and ``fingerprint`` sections of the run YAML; writes events to
``<run-dir>/events/trainer-rank{R}.jsonl``; reports steps, commits and bad
numerics to the node agent; checkpoints through
the worker session (:mod:`elastic.worker.session`); resumes from the newest committed
checkpoint; prints ``FINAL_CHECKSUM <sha256>``.

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

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.elastic.multiprocessing.errors import record

from elastic.api import (ConfigError, NumericsRollback, ReplayVerification, SnapshotStateDict, WorkerSession,
                         dump_run_file, exit_process, run_worker, silent_fault)
from trainer.data import GlobalSampler, build_dataset, collate
from trainer.dit import DiT, build_dit
from trainer.dit_config import DiTTrainerConfig
from trainer.flow import flow_loss, interpolate, per_sample_noise, velocity_target
from trainer.fp8 import convert_to_fp8, fp8_stats
from trainer.numerics import NumericsGuard
from trainer.parallel import TORCH_DTYPES, parallelize

RESOLVED_CONFIG_NAME = "dit_trainer.yaml"
"""Written to the run directory by rank 0: what trainer.sample needs to rebuild the model."""
REPLAY_MODULE = "trainer.dit_replay"
"""Where a warm spare finds ``replay_gradients`` (replay verification): named, not imported, so this
module does not import its own replay."""

__all__ = ["NumericsRollback", "TrainState", "train", "main"]


class TrainState(Stateful):
    """Everything a resume needs, in DCP form (model/optim resharded on load)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, sampler: GlobalSampler,
                 guard: NumericsGuard) -> None:
        self.model = model
        self.optim = optim
        self.sampler = sampler
        self.guard = guard
        self.step = 0
        self._snapshot_sd = SnapshotStateDict(model, optim)

    def state_dict(self) -> dict[str, Any]:
        return self._with(*get_state_dict(self.model, self.optim))

    def snapshot_state_dict(self) -> dict[str, Any]:
        """The same tree for a per-step memory snapshot, without DCP's per-call cost."""
        return self._with(*self._snapshot_sd())

    def _with(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
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


def build_model(cfg: DiTTrainerConfig, device: torch.device, on_meta: bool = False) -> tuple[DiT, list[str]]:
    """The DiT (fp8-converted where configured) on ``device``, its weights from the seed.

    ``on_meta``: shapes only, no storage and no initial values (a 10B-parameter model is 40 GB in
    fp32 before sharding): for a world re-formed in-process, whose state a restore fills right
    after the model is sharded and materialised (:func:`materialize`)."""
    if on_meta:
        with torch.device("meta"):
            model = build_dit(cfg.model, cfg.seed)
    else:
        model = build_dit(cfg.model, cfg.seed).to(device)
    converted: list[str] = []
    if cfg.fp8.enabled:
        converted = convert_to_fp8(model, cfg.fp8.include, cfg.fp8.exclude, cfg.fp8.recipe, cfg.fp8.backend,
                                   device=device)
    return model, converted


def materialize(model: DiT, device: torch.device) -> None:
    """Give a meta-built model storage on ``device``, after sharding: each rank allocates its own
    shards only.  The parameters hold garbage until the restore writes every one of them (and the
    optimizer state); the buffers outside the state dict are computed here."""
    model.to_empty(device=device)
    model.reset_buffers()


def restores_from_memory(session: WorkerSession) -> bool:
    """This build is for a world re-formed in-process: the session restores every parameter and
    optimizer state from the memory snapshots right after it (``WorkerSession._recover``, and a
    warm spare's start), so the model need not be initialised, nor built full-size."""
    inproc = session.inproc
    return inproc is not None and inproc.plan is not None


class DiTRun:
    """One DiT training run inside a worker session: model, optimizer, data, guard, and the step."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.cfg: DiTTrainerConfig = session.cfg.trainer
        cfg, device = self.cfg, session.device
        self.dp, self.cp = cfg.check_world(session.world)
        if session.world > 1 and not cfg.parallel.fsdp:
            raise ConfigError("parallel.fsdp", "must be true with more than one rank (gradients are averaged by FSDP)")
        torch.manual_seed(cfg.seed)
        # A first start initialises from the seed as ever (a run's weights do not depend on how it
        # is launched); a re-formed world builds on the meta device and restores into its shards.
        on_meta = restores_from_memory(session)
        self.model, self.converted = build_model(cfg, device, on_meta)
        mesh = parallelize(self.model, cfg.parallel, self.dp, self.cp, device.type)
        if on_meta:
            materialize(self.model, device)
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                       eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        self.dataset = build_dataset(cfg.data, cfg.model, cfg.seed)
        self.sampler = GlobalSampler(len(self.dataset), cfg.global_batch_size, cfg.seed, cfg.data.shuffle)
        self.guard = NumericsGuard(cfg.numerics)
        self.train_state = TrainState(self.model, self.optim, self.sampler, self.guard)
        self.tokens_per_step = cfg.global_batch_size * cfg.model.num_tokens
        self.last_step = cfg.steps
        self.replay = ReplayVerification.open(session, self.model, cfg.seed, self.cp,
                                              TORCH_DTYPES[cfg.parallel.reduce_dtype])
        self._batch: list[int] = []

    def state(self) -> dict[str, Any]:
        return {"app": self.train_state}

    def extra(self) -> dict[str, Any]:
        return rank_rng_state()

    def resumed(self, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        rank_rng = restore_rank_rng(extra) if extra else False
        return {"dp": self.dp, "cp": self.cp, "rank_rng_restored": rank_rng, "samples_seen": self.sampler.samples_seen,
                "fp8_layers": len(self.converted)}

    def done_fields(self) -> dict[str, Any]:
        if self.replay is not None:
            self.replay.close()  # the last checks' sums and inputs are reported before the run ends
        return {"total_skips": self.guard.total_skips}

    def step(self, step: int) -> None:
        session, cfg = self.session, self.cfg
        session.begin_step(step)
        if cfg.step_sleep:
            # Stands in for device time (as in trainer.train): the CPU is free meanwhile, as it
            # is while a GPU computes; the previous step's snapshot push runs beside it.
            time.sleep(cfg.step_sleep)
        session.sync_point()
        self._batch = self.sampler.next_global_batch()
        indices = GlobalSampler.rank_slice(self._batch, self.dp_rank, self.dp)
        if session.skip_step(step):
            # Rolled back past a bad batch: the sampler moves on, the batch is never used.
            self.train_state.step = step
            return
        if self.replay is not None:
            self.replay.begin(step)
        loss_value, norm_value = self.forward_backward(step, indices)
        if self.replay is not None:
            self.replay.end(self.replay_inputs)
        verdict = self.guard.check(loss_value, norm_value)
        lr = self.lr(step)
        if verdict.ok:
            self.optimizer_step(lr)
        else:
            self.optim.zero_grad(set_to_none=True)  # the bad gradients never reach the weights
            session.events.emit("trainer.numerics", step=step, action=verdict.action, reason=verdict.reason,
                                loss=loss_value, grad_norm=norm_value, total_skips=self.guard.total_skips)
            if verdict.action == "rollback":
                self.rollback(step, verdict.reason)
        self.train_state.step = step
        step_time = session.step_time()
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else None
        fp8 = fp8_stats(self.model)
        session.end_step(step, loss_value, scalars={"grad_norm": norm_value, "tokens_per_s": tokens_per_s, "lr": lr,
                                                    "fp8": fp8},
                         tokens_per_s=tokens_per_s, grad_norm=norm_value, lr=lr, skipped=not verdict.ok,
                         samples_seen=self.sampler.samples_seen, fp8=fp8)

    def replay_inputs(self, rank: int) -> dict[str, Any]:
        """What a spare needs besides the weights to replay ``rank``'s step: its samples (cp is 1)."""
        return {"indices": GlobalSampler.rank_slice(self._batch, rank, self.dp)}

    def lr(self, step: int) -> float:
        optim = self.cfg.optim
        return optim.lr * min(1.0, step / optim.warmup_steps) if optim.warmup_steps else optim.lr

    def forward_backward(self, step: int, indices: list[int], weight: float = 1.0) -> tuple[float, float]:
        """Loss over this rank's micro-batches with gradients; (global loss, global grad norm).

        ``weight`` scales this rank's loss (replica-group mode: unequal shares of the batch)."""
        inject = self.session.loss(step, 1.0) != 1.0
        self.optim.zero_grad(set_to_none=True)
        chunks = micro_batches(indices, self.cfg.micro_batch_size)
        loss = torch.zeros((), device=self.session.device)
        for i, chunk in enumerate(chunks):
            if len(chunks) > 1 and hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(i == len(chunks) - 1)  # reduce-scatter after the last one
            part = micro_batch_loss(self.model, self.cfg, self.dataset, step, chunk, self.session.device)
            part = part * (len(chunk) / len(indices) * weight)
            if inject:
                part = part * float("nan")
            part.backward()
            loss += part.detach()
        global_loss = loss.detach().clone()
        self.session.commit_point()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        self.average_replicas(global_loss)
        self.grad_norm = global_grad_norm(self.model)
        # After the replicas' average and the norm: a flip here reaches only this rank's shard.
        silent_fault(self.session, step, self.model)
        return float(global_loss), float(self.grad_norm)

    def average_replicas(self, loss: torch.Tensor) -> None:
        """Replica-group mode averages gradients and ``loss`` across the groups here; one world: nothing."""

    def optimizer_step(self, lr: float) -> None:
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.optim.grad_clip, self.grad_norm)
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.step()

    def rollback(self, step: int, reason: str) -> None:
        """Every rank reaches the same verdict (global loss and norm), so all of them leave here."""
        self.session.agent.report_numerics(step, reason)
        self.session.events.emit("trainer.rollback", step=step, reason=reason)
        raise NumericsRollback(step, reason)


def train(session: WorkerSession) -> str:
    if session.rank == 0:
        session.run_dir.mkdir(parents=True, exist_ok=True)
        dump_run_file(session.cfg, session.run_dir / RESOLVED_CONFIG_NAME)
    return session.train(DiTRun)


@record
def main(argv: list[str] | None = None) -> int:
    return run_worker("python -m trainer.dit_train", DiTTrainerConfig, train, argv)


if __name__ == "__main__":
    exit_process(main())
