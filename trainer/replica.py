"""torchft pieces shared by the replica-group trainers (:mod:`trainer.ft_train`, :mod:`trainer.dit_ft_train`).

* :func:`build_manager`: the torchft ``Manager`` of this replica group, from the run config's
  ``replicas`` section (torchft 0.2.0 settings, see docs/architecture.md, replica-group mode);
* :func:`flat_allreduce`: average tensors across the quorum in one collective (torchft 0.2.0's DDP
  comm hook crashes the *survivor* when a peer dies inside the allreduce, so no torchft DDP);
* :func:`install_fsdp_hook`: the same average for FSDP2 shards, once per step after the
  reduce-scatter inside the group;
* :class:`RunFinished`: the run's "training finished" mark, so a late group does not train alone;
* :class:`FTStep`: the torchft step counter as a DCP-stateful object (disk checkpoints carry it);
* :func:`first_quorum_timeout`: how long a group's first quorum may wait for its peers;
* :func:`exit_now`: leave without torchft 0.2.0's slow native teardown.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from elastic.common.env import ETCD_ENDPOINT_ENV, RUN_PREFIX_ENV
from elastic.control.keys import RunKeys
from elastic.control.store import EtcdStore, StoreError
from elastic.replicas.config import ReplicaConfig
from elastic.api import exit_process
from trainer.collectives import broadcast_flag

_STARTED = time.monotonic()


def replica_group() -> str:
    """This group's id (the node id the agent passes), which names its events and files."""
    return os.environ.get("REPLICA_GROUP_ID", "rg0")


def build_manager(cfg: ReplicaConfig, replica_id: str, device: torch.device,
                  state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None]) -> Any:
    """The group's torchft Manager; ``state_dict``/``load_state_dict`` are what live healing moves."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=cfg.timeout_s)
    pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=device) if cfg.transport == "pg" else None
    return Manager(
        pg=pg, min_replica_size=cfg.min_replicas, load_state_dict=load_state_dict, state_dict=state_dict,
        # Async quorum races FSDP2 state reads during recovery in 0.2.0 (measured crashes).
        use_async_quorum=False, replica_id=replica_id,
        # The group's own address (torchrun's --local-addr): HTTP recovery and peers reach it there.
        hostname=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=cfg.quorum_timeout_s), checkpoint_transport=transport,
    )


def first_quorum_timeout(cfg: ReplicaConfig, init_timeout_s: float) -> timedelta:
    """A (re)started group's first quorum may wait for peers that are still starting.

    Per step, ``replicas.quorum_timeout_s`` bounds the quorum (it sits below the hang timeout).
    The first quorum of a process instead falls under the agent's start-up allowance
    (``agent.heartbeat.init_timeout_s``, counted from torchrun's start): what is left of it, less
    a second so that the quorum gives up before the agent calls the start a hang.
    """
    left = init_timeout_s - (time.monotonic() - _STARTED) - 1.0
    return timedelta(seconds=max(cfg.quorum_timeout_s, left))


def flat_allreduce(manager: Any, tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` across the quorum in one collective, in place.

    On a peer failure the work completes without error and the manager votes not to commit."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    manager.allreduce(flat).wait()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def release_peers(manager: Any) -> None:
    """After a failed cross-group collective: drop this group's torchft process group at once.

    In a ring of four or more groups, a survivor that is not a neighbour of the dead group does not
    see the failure: it waits on a live neighbour that has already given up.  It would wait until
    that neighbour's next quorum reconfigures (after the Lighthouse's join timeout, since the waiting
    group still heartbeats) or its own collective timeout.  Dropping the failed process group now
    closes this group's connections, so its neighbours fail too, and every survivor is in the next
    quorum within a heartbeat timeout.  The next quorum configures a fresh process group anyway."""
    import gc

    pg = getattr(manager, "_pg", None)
    if pg is not None and hasattr(pg, "abort"):
        pg.abort()
        gc.collect()  # the gloo context closes its pairs when the last reference goes


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def install_fsdp_hook(model: nn.Module, manager: Any) -> None:
    """FSDP2 reduce-scatters inside the group; the hook averages each shard across the groups.

    The hook is per FSDP module (each sharded module holds its own parameters), not inherited."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(lambda grad: manager.allreduce(grad).wait())


class FTStep:
    """The torchft step counter (``Manager.state_dict()``) as a DCP-stateful checkpoint entry.

    Loaded before the Manager exists (the Manager starts heartbeating the Lighthouse when built,
    so a group builds it only once it is ready to join a quorum); :meth:`apply` hands it over."""

    def __init__(self) -> None:
        self.manager: Any = None
        self.loaded: dict[str, int] = {"step": 0, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return dict(self.manager.state_dict()) if self.manager is not None else dict(self.loaded)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = {"step": int(state["step"]), "batches_committed": int(state["batches_committed"])}

    def apply(self, manager: Any) -> None:
        manager.load_state_dict(dict(self.loaded))
        self.manager = manager


class RunFinished:
    """The run's "training finished" mark in etcd, set by the first group to reach the last step.

    A group that restarts so late that its peers are already done finds no one to heal from
    and would train the whole run again alone (measured: a 61 s restart on a loaded host).
    While it trains alone it looks for the mark every ``every`` steps, and stops if it is set.
    """

    def __init__(self, every: int = 10) -> None:
        endpoint, prefix = os.environ.get(ETCD_ENDPOINT_ENV), os.environ.get(RUN_PREFIX_ENV)
        self.store = EtcdStore(endpoint, request_timeout=2.0, retry_deadline=2.0) if endpoint and prefix else None
        self.key = RunKeys(prefix or "").replicas_finished
        self.every = every

    def seen(self, step: int, participants: int, rank: int, world: int, device: torch.device) -> bool:
        """Collective within the group when world > 1 (every rank sees the same step and quorum)."""
        if self.store is None or participants > 1 or step % self.every:
            return False
        flag = 0.0
        if rank == 0:
            try:
                flag = 1.0 if self.store.get(self.key) is not None else 0.0
            except StoreError:
                flag = 0.0  # etcd unreachable: keep training
        if world > 1:
            flag = float(broadcast_flag(flag > 0, device=device))
        return flag > 0

    def publish(self, step: int, replica_id: str) -> None:
        if self.store is None:
            return
        try:
            self.store.put(self.key, json.dumps({"step": step, "group": replica_id, "ts": time.time()}))
        except StoreError:
            pass


def exit_now(code: int) -> None:
    """torchft 0.2.0's native teardown at interpreter exit takes 8-13 s (measured on 2 loaded
    cores): leave without it (see :func:`elastic.worker.session.exit_process`)."""
    exit_process(code)
