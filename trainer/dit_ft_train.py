"""The DiT trainer in replica-group mode: ``python -m trainer.dit_ft_train --config C --run-dir D``.

The run of :mod:`trainer.dit_train` (same model, optimizer, data, numerics guard: a
:class:`~trainer.dit_train.DiTRun`), trained data-parallel *across* replica groups with torchft
(HSDP-style): one group per node agent, FSDP2 and Ulysses CP inside the group over the group's
own process groups, gradients averaged across the groups once per step: after FSDP2's
reduce-scatter inside the group, every rank averages its shards with the same rank of the other
groups in one flat ``manager.allreduce`` (together with the loss).

Per step attempt:

1. **Quorum** (synchronous, ``use_async_quorum=False``): a group behind its peers heals here
   from a live one: model, optimizer, sampler position, RNG, numerics-guard state and the torchft
   step (:class:`~trainer.dit_train.TrainState` is what healing moves).
2. **Data**: the next global batch, split at this quorum (see :mod:`trainer.data`: committed
   step s always trains on the s-th global batch; each group takes its part by quorum rank).
3. **Forward/backward** with this rank's loss weighted by its share; gradients and the loss
   averaged across the groups; the global grad norm from the averaged gradients.
4. **Numerics guard** on the averaged loss and norm, so every group of the quorum reaches the
   same verdict: a NaN in one group makes the average NaN everywhere, and every group skips that
   step (no optimizer update anywhere) while still committing it, so the bad batch is consumed.
5. **Vote** (``should_commit``): only a committed step moves the optimizer, the sampler and the
   guard; an attempt that does not commit (a peer died during it) is undone and retried.
6. **Agreement** (``sdc.check_every``, off by default): on a committed step it names, the groups
   compare CRC32s of their parameter shards (:mod:`trainer.agreement`); a group in the minority is
   named (``sdc.suspect``), does not save, and heals from a live peer at the next quorum.
7. **Disk checkpoint**: the group of quorum rank 0 saves committed steps on the checkpoint
   interval (and the last step) through the worker session's CheckpointManager, on the group's
   own gloo group; the other groups skip.  Each group owns its temporary directories.  When
   every group died, each restarts from the newest committed checkpoint (model, optimizer,
   sampler, RNG, guard, torchft step), so the run resumes bitwise on its fault-free trajectory.

Every attempt is a ``trainer.step`` event (``committed``, ``participants``, ``quorum_id``,
``quorum_rank``, ``slice``: the group's [lo, hi) of the global batch, ``batch_crc``) and a step
report to the agent, so hang detection sees a survivor waiting in a quorum as alive.  At the
end each group prints ``FINAL_CHECKSUM <sha256>`` and writes ``final_checksum-<group>.txt``.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic.api import WorkerSession, dump_run_file, run_worker
from trainer.agreement import AgreementCheck, CheckOutcome
from trainer.data import GlobalSampler
from trainer.dit_config import DiTTrainerConfig
from trainer.dit_train import RESOLVED_CONFIG_NAME, DiTRun
from trainer.fp8 import fp8_stats
from trainer.numerics import Verdict
from trainer.replica import (
    FTStep,
    RunFinished,
    build_manager,
    exit_now,
    first_quorum_timeout,
    flat_allreduce,
    grads_of,
    release_peers,
    replica_group,
)

ROLLBACK_SKIP = Verdict("skip", "numerics rollback: batch skipped")


class Undo:
    """What a step attempt changes before its vote (sampler, guard, RNG), to put back if it does not commit."""

    def __init__(self, run: DiTRun) -> None:
        self.run = run
        self.sampler = run.sampler.state_dict()
        self.guard = {k: v.clone() if torch.is_tensor(v) else v for k, v in run.guard.state_dict().items()}
        self.rng = torch.get_rng_state()

    def __call__(self) -> None:
        self.run.sampler.load_state_dict(self.sampler)
        self.run.guard.load_state_dict(self.guard)
        torch.set_rng_state(self.rng)
        self.run.optim.zero_grad(set_to_none=True)


class ReplicaDiTRun(DiTRun):
    """A :class:`DiTRun` whose steps go through this group's torchft Manager."""

    def __init__(self, session: WorkerSession) -> None:
        super().__init__(session)
        self.replica_id = replica_group()
        self.ft_step = FTStep()
        self.manager: Any = None
        self.finished = RunFinished()
        self.sync_s = 0.0
        self.agreement = AgreementCheck(session.cfg.sdc, session, self.replica_id)

    def state(self) -> dict[str, Any]:
        return {"app": self.train_state, "ft": self.ft_step}

    def connect(self) -> None:
        """Build the Manager (it starts heartbeating the Lighthouse) once the state is loaded."""
        cfg = self.session.cfg.replicas
        self.manager = build_manager(cfg, self.replica_id, self.session.device, self.train_state.state_dict,
                                     self.train_state.load_state_dict)
        self.ft_step.apply(self.manager)
        self._quorum_timeout = first_quorum_timeout(cfg, self.session.cfg.agent.heartbeat.init_timeout_s)

    # -- one step attempt ------------------------------------------------------------------
    def quorum(self) -> None:
        before = self.manager.current_step()
        self.manager.start_quorum(timeout=self._quorum_timeout)  # heals here when behind
        self._quorum_timeout = None  # later quorums: replicas.quorum_timeout_s
        if self.manager.current_step() != before:
            self.session.events.emit("trainer.healed", from_step=before, to_step=self.manager.current_step(),
                                     quorum_id=self.manager._quorum_id)

    def attempt(self) -> bool:
        """One step attempt; False when the group stops because its peers already finished the run."""
        session, manager = self.session, self.manager
        session.begin_step(manager.current_step() + 1)
        session.sync_point()
        t0 = time.monotonic()
        self.quorum()
        session.waited(time.monotonic() - t0)
        step, groups = manager.current_step() + 1, manager.num_participants()
        if self.finished.seen(step, groups, session.rank, session.world, session.device):
            session.events.emit("trainer.run_finished_by_peers", step=step, replica_group=self.replica_id)
            session.agent.report_done(step)
            return False
        undo = Undo(self)
        batch = self.sampler.next_global_batch()
        group = manager.participating_rank()
        indices, weight, bounds = GlobalSampler.group_slice(batch, group, groups, self.dp_rank, self.dp)
        verdict, loss, norm = self.judge(step, indices, weight)
        committed = self.vote(step, verdict, undo)
        check = self.check_agreement(step) if committed else None
        self.record(step, committed, verdict, loss, norm, bounds, batch, group)
        if committed and group == 0 and not (check is not None and check.suspect):
            self.save(step)  # a suspect writer's weights are bad: the next interval's save is the next one
        AgreementCheck.heal(self.manager, check)
        return True

    def check_agreement(self, step: int) -> CheckOutcome | None:
        """The cross-replica check of the weights just committed, when due (``sdc.check_every``): before
        they are saved and before the next step's gradients are shared, so bad weights reach no one."""
        if not self.agreement.due(step, self.last_step, self.manager.num_participants()):
            return None
        t0 = time.monotonic()
        outcome = self.agreement.run(self.manager, self.model, step)
        self.session.waited(time.monotonic() - t0)
        if outcome is None:
            release_peers(self.manager)  # a peer was lost in the check: as after a failed allreduce
        return outcome

    def judge(self, step: int, indices: list[int], weight: float) -> tuple[Verdict, float, float]:
        """Forward/backward and the guard's verdict on the averaged loss and grad norm."""
        if self.session.skip_step(step):
            return ROLLBACK_SKIP, float("nan"), float("nan")  # rolled back past this batch: consume it only
        self.sync_s = 0.0
        loss, norm = self.forward_backward(step, indices, weight)
        self.session.waited(self.sync_s)
        if self.manager.errored():
            release_peers(self.manager)
            return Verdict("skip", "peer lost during the step"), loss, norm  # not committed: undone
        verdict = self.guard.check(loss, norm)
        if verdict.action == "rollback":
            self.rollback(step, verdict.reason)  # every group reaches it; raises before any commit
        return verdict, loss, norm

    def average_replicas(self, loss: torch.Tensor) -> None:
        """Every rank averages its gradient shards (FSDP2 reduce-scattered them inside the group; the
        same rank of every group holds the same shard) and the loss across the groups, in one collective."""
        t0 = time.monotonic()
        with torch.no_grad():
            shards = [local_view(g) for g in grads_of(list(self.model.parameters()))]
            flat_allreduce(self.manager, [*shards, loss.view(1)])
        self.sync_s = time.monotonic() - t0

    def vote(self, step: int, verdict: Verdict, undo: Undo) -> bool:
        """The group's commit vote; the optimizer steps only on a committed, healthy step."""
        if not self.manager.should_commit():
            undo()
            return False
        if verdict.ok:
            self.optimizer_step(self.lr(step))
        else:
            self.optim.zero_grad(set_to_none=True)  # the bad gradients never reach the weights
        self.train_state.step = step
        return True

    def record(self, step: int, committed: bool, verdict: Verdict, loss: float, norm: float,
               bounds: tuple[int, int], batch: list[int], group: int) -> None:
        session, manager = self.session, self.manager
        if committed and not verdict.ok:
            session.events.emit("trainer.numerics", step=step, action=verdict.action, reason=verdict.reason,
                                loss=loss, grad_norm=norm, total_skips=self.guard.total_skips)
        if self.cfg.step_sleep:
            time.sleep(self.cfg.step_sleep)
        step_time = session.step_time()
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 and committed else None
        session.end_step(step, loss, scalars={"grad_norm": norm, "tokens_per_s": tokens_per_s, "lr": self.lr(step)}
                         if committed else None, tokens_per_s=tokens_per_s, grad_norm=norm, lr=self.lr(step),
                         skipped=not verdict.ok, samples_seen=self.sampler.samples_seen, fp8=fp8_stats(self.model),
                         committed=committed, participants=manager.num_participants(),
                         quorum_id=manager._quorum_id, quorum_rank=group, replica_group=self.replica_id,
                         slice=list(bounds), batch_crc=batch_crc(batch))

    def save(self, step: int) -> None:
        """The writer of this quorum (rank 0) saves on the interval and at the last step."""
        ckpt = self.session.ckpt
        if ckpt is not None and (ckpt.should_save(step) or step == self.last_step):
            ckpt.save(step, self.state(), extra=self.extra())

    def train_steps(self) -> bool:
        while self.manager.current_step() < self.last_step:
            if not self.attempt():
                return False
        return True


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def batch_crc(batch: list[int]) -> int:
    """A short fingerprint of a global batch (events: every group of a step must name the same one)."""
    return zlib.crc32(torch.tensor(batch, dtype=torch.int64).numpy().tobytes())


def train(session: WorkerSession) -> str | None:
    """Train until the run's last step; the checksum, or None when peers finished the run first."""
    if session.rank == 0:
        session.run_dir.mkdir(parents=True, exist_ok=True)
        dump_run_file(session.cfg, session.run_dir / RESOLVED_CONFIG_NAME)
    run = ReplicaDiTRun(session)
    loaded = session.resume(run.state())
    start = loaded[0] if loaded else 0
    fields = run.resumed(start, loaded[1] if loaded else None)
    session.screen_gate()
    run.connect()
    try:
        session.emit_start(start, resumed=loaded is not None, replica_group=run.replica_id, mode="replicas",
                           ft_step=run.manager.current_step(), **fields)
        if not run.train_steps():
            return None  # these weights are not the run's: no checksum
        step = run.manager.current_step()
        checksum = session.finish(run.model, step, replica_group=run.replica_id, **run.done_fields())
        if session.rank == 0:
            RunFinished().publish(step, run.replica_id)
            (session.run_dir / f"final_checksum-{run.replica_id}.txt").write_text(checksum + "\n")
        return checksum
    finally:
        run.manager.shutdown(wait=False)


@record
def main(argv: list[str] | None = None) -> int:
    exit_now(run_worker("python -m trainer.dit_ft_train", DiTTrainerConfig, train, argv, group=replica_group()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
