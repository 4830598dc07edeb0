"""Generations: re-forming the world in-process, without a new torchrun.

Within one run epoch, generation 0 is the world torchrun formed; every worker registers its
slot (node, local rank) and rank under ``gen/<epoch>/0/members/``.  When a peer is lost, the
surviving workers (and the warm spares that replace dead ones, with the dead worker's slot) join
generation g+1 (``gen/<epoch>/<g+1>/join/<node>/<local_rank>``), and agents that find a whole node
gone mark it lost (``.../lost/<node>``).  The round is complete when every slot of generation g
whose node is not lost has joined; the first joiner to see that writes the plan
(``.../plan``, one compare-and-swap, create-only, so all agree on one plan).  Ranks keep their
order: survivors keep their rank when the world size stays, and the ranks of a shrunk world are
the old ranks in order, renumbered from 0.  Waiters block on a watch of the generation's prefix,
never in a polling loop.

A generation that cannot complete (a slot neither joins nor is declared lost within the timeout,
or the run's epoch moved on because an agent fell back to a full restart) raises
:class:`GenerationFailed`; the caller then leaves and the agents restart the epoch from disk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from elastic.control.keys import RunKeys
from elastic.control.runstate import decode
from elastic.control.store import KVStore


class GenerationFailed(RuntimeError):
    """The next generation could not be formed in-process (the caller falls back to a restart)."""


@dataclass(frozen=True, order=True)
class Slot:
    node: str
    local_rank: int

    def key(self) -> str:
        return f"{self.node}/{self.local_rank}"

    @classmethod
    def parse(cls, text: str) -> Slot:
        node, _, local = text.rpartition("/")
        return cls(node, int(local))


@dataclass(frozen=True)
class Member:
    slot: Slot
    rank: int
    old_rank: int


@dataclass(frozen=True)
class Plan:
    gen: int
    members: tuple[Member, ...]

    @property
    def world(self) -> int:
        return len(self.members)

    def member(self, slot: Slot) -> Member | None:
        return next((m for m in self.members if m.slot == slot), None)

    def keeps_ranks(self, old_world: int) -> bool:
        """The world kept its size and every member its rank: local shards restore as they are."""
        return self.world == old_world and all(m.rank == m.old_rank for m in self.members)

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "members": [
            {"node": m.slot.node, "local_rank": m.slot.local_rank, "rank": m.rank, "old_rank": m.old_rank}
            for m in self.members]})

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Plan:
        return cls(int(record["gen"]), tuple(Member(Slot(m["node"], int(m["local_rank"])), int(m["rank"]),
                                                    int(m["old_rank"])) for m in record["members"]))


def plan_next(gen: int, previous: dict[Slot, int], joined: set[Slot], lost: set[str]) -> Plan | None:
    """The plan of generation ``gen`` once every expected slot joined, else None.

    ``previous`` maps the slots of generation ``gen - 1`` to their ranks.
    """
    expected = {slot for slot in previous if slot.node not in lost}
    if not expected or not expected <= joined:
        return None
    ordered = sorted(expected, key=lambda s: previous[s])
    return Plan(gen, tuple(Member(slot, rank, previous[slot]) for rank, slot in enumerate(ordered)))


class Generations:
    """The generation records of one epoch of a run."""

    def __init__(self, store: KVStore, keys: RunKeys, epoch: int) -> None:
        self.store = store
        self.keys = keys
        self.epoch = epoch

    def register(self, slot: Slot, rank: int) -> None:
        """Generation 0: this worker's slot and the rank torchrun gave it."""
        self.store.put(self.keys.gen_member(self.epoch, 0, slot.node, slot.local_rank), json.dumps({"rank": rank}))

    def ranks(self, gen: int) -> dict[Slot, int]:
        """Slot -> rank of generation ``gen`` (generation 0: the registrations; later: the plan)."""
        if gen > 0:
            record = decode(self.store.get(self.keys.gen_plan(self.epoch, gen)))
            return {m.slot: m.rank for m in Plan.from_record(record).members} if record else {}
        base = self.keys.generation(self.epoch, 0) + "members/"
        return {Slot.parse(RunKeys.tail(kv.key, base)): int(json.loads(kv.value)["rank"])
                for kv in self.store.get_prefix(base)}

    def join(self, gen: int, slot: Slot, **info: Any) -> None:
        record = json.dumps({**info, "ts": time.time()})
        self.store.put(self.keys.gen_join(self.epoch, gen, slot.node, slot.local_rank), record)

    def mark_lost(self, gen: int, node: str, by: str, reason: str) -> bool:
        """Declare ``node`` gone for generation ``gen`` (once; True if this call recorded it)."""
        record = json.dumps({"by": by, "reason": reason, "ts": time.time()})
        ok, _ = self.store.compare_and_swap(self.keys.gen_lost(self.epoch, gen, node), record, 0)
        return ok

    def _read(self, gen: int) -> tuple[set[Slot], set[str], Plan | None, int]:
        base = self.keys.generation(self.epoch, gen)
        joined, lost, plan, revision = set(), set(), None, 0
        for kv in self.store.get_prefix(base):
            revision = max(revision, kv.mod_revision)
            tail = RunKeys.tail(kv.key, base)
            if tail.startswith("join/"):
                joined.add(Slot.parse(tail[len("join/"):]))
            elif tail.startswith("lost/"):
                lost.add(tail[len("lost/"):])
            elif tail == "plan":
                plan = Plan.from_record(decode(kv) or {})
        return joined, lost, plan, revision

    def newest(self, since: int) -> int:
        """The newest generation of this epoch that has any record, from ``since`` on (one count
        request per generation: a replacement looks a generation or two ahead)."""
        gen = since
        while self.store.count_prefix(self.keys.generation(self.epoch, gen + 1)):
            gen += 1
        return gen

    def progress(self, gen: int) -> tuple[set[Slot], Plan | None]:
        """The slots that joined generation ``gen`` so far, and its plan once it has one."""
        joined, _, plan, _ = self._read(gen)
        return joined, plan

    def lost(self, gen: int) -> set[str]:
        return self._read(gen)[1]

    def ever_lost(self) -> set[str]:
        """Nodes some generation of this epoch re-formed without (the in-process path handled them)."""
        base = self.keys.generation(self.epoch, 0).rsplit("0/", 1)[0]  # gen/<epoch>/
        return {kv.key.rsplit("/lost/", 1)[1] for kv in self.store.get_prefix(base) if "/lost/" in kv.key}

    def wait_plan(self, gen: int, previous: dict[Slot, int], timeout_s: float) -> Plan:
        """Block until generation ``gen`` has its plan (writing it when this caller completes the round)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_epoch()
            revision = self.store.revision()
            joined, lost, plan, _ = self._read(gen)
            if plan is None:
                plan = self._try_close(gen, previous, joined, lost)
            if plan is not None:
                return plan
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(s.key() for s in previous if s.node not in lost and s not in joined)
                raise GenerationFailed(f"generation {gen}: {missing} neither joined nor were declared lost "
                                       f"within {timeout_s:g}s")
            self.store.watch_once(self.keys.generation(self.epoch, gen), revision + 1, min(remaining, 1.0),
                                  prefix=True)

    def _try_close(self, gen: int, previous: dict[Slot, int], joined: set[Slot], lost: set[str]) -> Plan | None:
        plan = plan_next(gen, previous, joined, lost)
        if plan is None:
            return None
        ok, current = self.store.compare_and_swap(self.keys.gen_plan(self.epoch, gen), plan.to_json(), 0)
        return plan if ok else Plan.from_record(decode(current) or {})

    def _check_epoch(self) -> None:
        kv = self.store.get(self.keys.epoch)
        current = int(kv.value) if kv else 0
        if current != self.epoch:
            raise GenerationFailed(f"the run moved to epoch {current} (a full restart) while re-forming epoch "
                                   f"{self.epoch}")
