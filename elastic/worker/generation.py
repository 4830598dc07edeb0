"""A worker's side of a generation round, without torch: what its agent says the next world is.

A worker never reads etcd to re-form: its node's agent joins the round for the node
(:mod:`elastic.control.genround`) and posts the plan, then the new c10d store's address, on the
memory store's RoundBoard; the worker waits for each with one request over the local channel
(:meth:`~elastic.checkpoint.memclient.MemStateClient.round_wait`).  Only the new rank 0 writes to
etcd: where the store it serves listens (one put a round).

Kept apart from :mod:`elastic.worker.inprocess` (process groups, snapshots: torch) so that
``benchmarks/control_plane.py`` can run thousands of simulated ranks in processes without torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from elastic.checkpoint.memstate import MemStateError
from elastic.common.env import WorkerEnv
from elastic.control.generations import Generations, Plan, Slot
from elastic.control.keys import RunKeys
from elastic.control.store import EtcdStore


class RecoveryUnavailable(RuntimeError):
    """In-process recovery cannot proceed; the run falls back to a restart from disk."""


class RoundChannel(Protocol):
    """What a worker asks its agent during a round (the memory store's client)."""

    def round_wait(self, epoch: int, gen: int, name: str, timeout_s: float) -> Any: ...


class GenerationClient:
    """One worker's generation: its slot, the newest plan it joined, its rank before that plan."""

    def __init__(self, env: WorkerEnv, local_rank: int, channel: RoundChannel | None) -> None:
        self.slot = Slot(env.node_id, local_rank)
        self.epoch = int(env.epoch or 0)
        self.timeout_s = float(env.inprocess)
        self.joining = bool(env.join_gen)
        """This process is a spare taking over a dead worker's slot (it joins a generation directly)."""
        self.channel = channel
        self.gens = Generations(EtcdStore(env.etcd_endpoint, request_timeout=2.0, retry_deadline=10.0),
                                RunKeys(env.run_prefix), self.epoch)
        self.gen = int(env.join_gen) if env.join_gen else 0
        self.plan: Plan | None = None
        self.old_rank = -1  # this slot's rank in the generation before the newest plan's
        self.rank0 = -1  # this slot's rank in generation 0 (its agent says it with every plan)
        self.attempted = -1  # the newest generation this worker asked the plan of

    def next_plan(self) -> Plan:
        """The next generation's plan, from this node's agent, and this slot's rank before it
        (``old_rank``; a spare learns it here: the agent knows its slot's)."""
        target = self.gen + (0 if self.joining and self.plan is None else 1)
        if self.attempted >= target:  # that generation failed while forming (a peer of it died): the next
            target = self.attempted + 1
        self.attempted = target
        reply = self.from_agent(target, "plan")
        plan = Plan.from_record(reply["plan"])
        self.old_rank = int(reply["slots"].get(str(self.slot.local_rank), -1))
        self.rank0 = int((reply.get("slots0") or {}).get(str(self.slot.local_rank), -1))
        return plan

    def rank_in(self, plan: Plan) -> int:
        """This slot's rank in ``plan``'s generation: from its generation-0 rank, which a slot whose
        node rejoined (it has no rank in the generation before) has too."""
        rank = plan.rank_of0(self.rank0) if self.rank0 >= 0 else plan.rank_of(self.old_rank)
        if rank is None:
            raise RecoveryUnavailable(f"slot {self.slot.key()} (rank {self.old_rank}) is not in generation {plan.gen}")
        return rank

    def adopt(self, plan: Plan) -> None:
        """This worker is a member of ``plan``'s generation now."""
        self.gen, self.plan = plan.gen, plan

    def publish_store(self, gen: int, addr: str) -> None:
        """The new rank 0: where generation ``gen``'s c10d store listens (its agents' watches see it)."""
        self.gens.put_store(gen, addr)

    def store_address(self, gen: int) -> str:
        return str(self.from_agent(gen, "store"))

    def lost_nodes(self) -> set[str]:
        """The nodes the newest generation formed without: the plan names them (no etcd read)."""
        return set(self.plan.lost) if self.plan is not None else set()

    def from_agent(self, gen: int, name: str) -> Any:
        """What the agent posted for generation ``gen`` (elastic.checkpoint.memstate.RoundBoard)."""
        if self.channel is None:
            raise RecoveryUnavailable("no agent channel (memory store) to learn the next generation from")
        try:
            return self.channel.round_wait(self.epoch, gen, name, self.timeout_s)
        except MemStateError as exc:
            raise RecoveryUnavailable(f"generation {gen}: {exc}") from exc
