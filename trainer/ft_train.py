"""Replica-group trainer: ``python -m trainer.ft_train --config C --run-dir D`` under torchrun.

The MLP workload of :mod:`trainer.train` (same model, same deterministic batches),
trained data-parallel *across* replica groups with torchft: one replica group per
node agent, ``nproc_per_node`` ranks inside a group (FSDP2 when more than one).
The agent passes the Lighthouse address (``TORCHFT_LIGHTHOUSE``) and the group id
(``REPLICA_GROUP_ID``); the run config's ``replicas`` section gives the timeouts.

Per step: ``optimizer.zero_grad()`` runs the quorum synchronously and, for a group
that (re)joins behind its peers, live-recovers model, optimizer and step from a
healthy peer over the torchft process group (never from disk); the gradients are
averaged across the participating groups with ``Manager.allreduce``; the wrapped
optimizer steps only if every group of the quorum votes to commit.  A group whose
peer died mid-step throws that one step away and goes on with a smaller quorum.

torchft 0.2.0 specifics (see docs/architecture.md): ``use_async_quorum=False`` (async quorum races
FSDP2 state reads during recovery), and no torchft DDP (its comm hook crashes the
*survivor* when a peer dies inside the allreduce): the gradients go through one
flat ``manager.allreduce`` per step, or FSDP2's ``set_all_reduce_hook``.

Every step attempt is an event ``trainer.step`` with ``committed``, ``participants``
and ``quorum_id``; only committed steps count.  At the end each group prints
``FINAL_CHECKSUM <sha256>`` and writes ``final_checksum-<group>.txt``.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from elastic.api import WorkerSession, run_worker
from trainer.minimal_config import MLPTrainerConfig
from trainer.replica import (
    RunFinished,
    build_manager,
    exit_now,
    flat_allreduce,
    grads_of,
    install_fsdp_hook,
    release_peers,
    replica_group,
)
from trainer.train import batch_for, build_model, shard_model


def data_rank(replica_id: str, rank: int, world: int) -> int:
    """The batch stream of (group, rank): distinct per group, stable across the group's restarts."""
    return (zlib.crc32(replica_id.encode()) % 100_003) * world + rank


def train(session: WorkerSession) -> str | None:
    """Train until the run's last step; the checksum, or None when peers finished the run first."""
    import torchft

    cfg: MLPTrainerConfig = session.cfg.trainer
    # The group's own process group (FSDP inside the group); its rank 0 also hosts the
    # TCPStore that torchft's Manager joins (it connects with is_master=False).
    device, rank, world = session.device, session.rank, session.world
    replica_id = replica_group()
    model = build_model(cfg).to(device)
    if world > 1:
        model = shard_model(model, world, device.type)
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = build_manager(session.cfg.replicas, replica_id, device, state_dict, load_state_dict)
    try:
        if world > 1:
            install_fsdp_hook(model, manager)
        session.screen_gate()
        optim = torchft.Optimizer(manager, inner)
        session.emit_start(0, resumed=False, replica_group=replica_id, mode="replicas")
        if not train_steps(session, cfg, model, optim, manager, replica_id):
            return None  # these weights are not the run's: no checksum
        checksum = session.finish(model, manager.current_step(), replica_group=replica_id)
        if rank == 0:
            RunFinished().publish(manager.current_step(), replica_id)
            (session.run_dir / f"final_checksum-{replica_id}.txt").write_text(checksum + "\n")
        return checksum
    finally:
        manager.shutdown(wait=False)


def train_steps(session: WorkerSession, cfg: MLPTrainerConfig, model: nn.Module, optim: Any, manager: Any,
                replica_id: str) -> bool:
    """The step loop; False when the group stops because its peers already finished the run."""
    rank, world, device = session.rank, session.world, session.device
    params = list(model.parameters())
    loss_fn = nn.MSELoss()
    stream = data_rank(replica_id, rank, world)
    finished = RunFinished()
    while manager.current_step() < cfg.steps:
        t0 = time.monotonic()
        if cfg.step_sleep:
            time.sleep(cfg.step_sleep)
        before = manager.current_step()
        optim.zero_grad(set_to_none=True)  # quorum; heals from a peer if this group is behind
        t_quorum = time.monotonic() - t0
        if manager.current_step() != before:
            session.events.emit("trainer.healed", from_step=before, to_step=manager.current_step(),
                                quorum_id=manager._quorum_id)
        step = manager.current_step() + 1
        if finished.seen(step, manager.num_participants(), rank, world, device):
            session.events.emit("trainer.run_finished_by_peers", step=step, replica_group=replica_id)
            session.agent.report_done(step)
            return False
        x, y = batch_for(cfg, step, stream, device)
        loss = loss_fn(model(x), y)
        loss.backward()
        t_sync = time.monotonic()
        if world == 1:
            flat_allreduce(manager, grads_of(params))
        if manager.errored():
            release_peers(manager)
        optim.step()  # commits (and steps the inner optimizer) only if the whole quorum votes yes
        wait = t_quorum + time.monotonic() - t_sync
        step_time = time.monotonic() - t0
        loss_value = float(loss.detach())
        session.events.emit("trainer.step", step=step, loss=loss_value, step_time=step_time,
                            busy_time=step_time - wait, committed=manager.current_step() == step,
                            participants=manager.num_participants(), quorum_id=manager._quorum_id,
                            replica_group=replica_id)
        session.agent.report_step(step, loss_value, step_time, step_time - wait)
    return True


@record
def main(argv: list[str] | None = None) -> int:
    exit_now(run_worker("python -m trainer.ft_train", MLPTrainerConfig, train, argv, group=replica_group(),
                        checkpoints=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
