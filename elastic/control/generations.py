"""Generations: re-forming the world in-process, without a new torchrun, one participant per node.

Within one run epoch, generation 0 is the world torchrun formed: once its workers have trained a
step, each node's agent registers the node's slots and the ranks torchrun gave them
(``gen/<epoch>/0/members/<node>``).  When a peer is lost, every surviving node's agent joins
generation g+1 *for its node* (``gen/<epoch>/<g+1>/join/<node>``: its live local slots in one
record; a warm spare holds a dead worker's slot) and watches the round's control keys (``lost/*``,
``plan``, ``store``: one stream per node).  Its workers learn the plan from it over the local
channel, never from etcd.  :class:`~elastic.control.genround.NodeRound` is one node's part.

One coordinator closes the round: the first node of generation g (in key order) not lost.  It
alone reads every join, probes the nodes that have not joined (lost-node discovery once per round,
by one agent), declares the gone ones lost and writes the plan with one compare-and-swap.

The plan is a delta, not a member list: the ranks of generation g that are gone, and the nodes
lost (this round, and since generation 0).  Its size grows with the faults, not with the world, and
each node applies it to its own slots: ranks keep their order; the ranks of a shrunk world are the
old ranks in order, renumbered from 0.  Why: a member list of 8,192 ranks is ~0.5 MB, and every node
reading it is ~0.5 GB per round at 1,024 nodes.  Measured (``benchmarks/control_plane.py``, 64 nodes
x 8 ranks, 3 etcd members, 2 cores): with every rank joining and reading the round's prefix, a round
read 1.7-2.4 GB and sent ~13,000-17,000 requests, and a third to half of the ranks gave up on 2 s
read timeouts; with one participant per node it reads ~0.2 MB in ~200 requests (~3 per node).

A round that cannot complete (a node neither joins nor is found lost within the timeout, or this
node itself was declared lost) raises :class:`GenerationFailed`; the workers then leave and the run
restarts the epoch from disk.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.control.keys import RunKeys
from elastic.control.runstate import decode
from elastic.control.store import KeyValue, KVStore
from elastic.control.txn import Compare, Get, Put, Range, Txn

Roster = dict[str, dict[int, int]]
"""Generation 0: node -> local slot -> rank."""


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
class Plan:
    """Generation ``gen`` as a delta of generation ``gen - 1`` (see the module docstring)."""

    gen: int
    old_world: int
    dropped: tuple[int, ...] = ()
    """Ranks of generation ``gen - 1`` not in this one, sorted."""
    nodes: int = 0
    """Nodes in this generation."""
    lost: tuple[str, ...] = ()
    """Nodes declared lost in this round."""
    gone: tuple[str, ...] = ()
    """Every node lost since generation 0 of the epoch (the next round's coordinator reads it)."""
    dropped0: tuple[int, ...] = ()
    """Generation-0 ranks not in this generation, sorted."""
    by: str = ""
    added: tuple[int, ...] = ()
    """Generation-0 ranks back in this generation: a lost node's slots, its node returned (rejoined)."""
    returned: tuple[str, ...] = ()
    """Nodes this generation re-admitted (lost before, back now with the same slots)."""

    @property
    def world(self) -> int:
        return self.old_world - len(self.dropped) + len(self.added)

    def rank_of(self, old_rank: int) -> int | None:
        """The rank in this generation of the slot that held ``old_rank`` (None: it left).  Only for a
        plan that re-admitted no one (``added`` shifts the ranks after it): :meth:`rank_of0` always works."""
        i = bisect.bisect_left(self.dropped, old_rank)
        if not 0 <= old_rank < self.old_world or (i < len(self.dropped) and self.dropped[i] == old_rank):
            return None
        return old_rank - i

    def rank_of0(self, rank0: int) -> int | None:
        """The rank in this generation of the slot that held ``rank0`` in generation 0 (None: not in
        it).  Ranks keep generation 0's order, renumbered from 0 past the ranks not in the world."""
        i = bisect.bisect_left(self.dropped0, rank0)
        if rank0 < 0 or (i < len(self.dropped0) and self.dropped0[i] == rank0):
            return None
        return rank0 - i

    def keeps_ranks(self) -> bool:
        """The world kept its size and every member its rank: local shards restore as they are."""
        return not self.dropped

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "old_world": self.old_world, "dropped": list(self.dropped),
                           "nodes": self.nodes, "lost": list(self.lost), "gone": list(self.gone),
                           "dropped0": list(self.dropped0), "by": self.by, "added": list(self.added),
                           "returned": list(self.returned)})

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Plan:
        return cls(int(record["gen"]), int(record["old_world"]), tuple(int(r) for r in record.get("dropped", [])),
                   int(record.get("nodes", 0)), tuple(record.get("lost", [])), tuple(record.get("gone", [])),
                   tuple(int(r) for r in record.get("dropped0", [])), str(record.get("by", "")),
                   tuple(int(r) for r in record.get("added", [])), tuple(record.get("returned", [])))


def ranks_at(roster: Roster, previous: Plan | None) -> dict[Slot, int]:
    """Slot -> rank in the generation ``previous`` formed (generation 0 without one)."""
    dropped0 = previous.dropped0 if previous else ()
    gone = set(dropped0)
    return {Slot(node, local): rank0 - bisect.bisect_left(dropped0, rank0)
            for node, slots in roster.items() for local, rank0 in slots.items() if rank0 not in gone}


def plan_next(gen: int, roster: Roster, previous: Plan | None, joined: dict[str, dict[int, int]],
              lost: set[str], by: str = "") -> Plan | None:
    """The plan of generation ``gen`` once every node of generation ``gen - 1`` joined or was lost,
    else None.  ``joined``: node -> the slots its join record lists (a slot it left out is gone).
    A node lost before that joined again (its agent came back: :func:`returning`) is re-admitted with
    its generation-0 slots and ranks."""
    gone_before = set(previous.gone) if previous else set()
    expected = set(roster) - gone_before
    if not expected or not expected <= set(joined) | lost:
        return None
    ranks = ranks_at(roster, previous)
    leaving = [Slot(n, local) for n in sorted(expected) for local in roster[n]
               if n in lost or local not in joined.get(n, {})]
    leaving = [s for s in leaving if s in ranks]
    remaining = expected - lost
    back = returning(roster, previous, joined, lost)
    if not remaining:
        return None
    added = {roster[n][local] for n in back for local in joined[n] if local in roster[n]}
    dropped0 = (set(previous.dropped0 if previous else ()) | {roster[s.node][s.local_rank] for s in leaving}) - added
    return Plan(gen, len(ranks), tuple(sorted(ranks[s] for s in leaving)), len(remaining) + len(back),
                tuple(sorted(lost & expected)), tuple(sorted((gone_before | (lost & expected)) - set(back))),
                tuple(sorted(dropped0)), by, tuple(sorted(added)), tuple(back))


def returning(roster: Roster, previous: Plan | None, joined: dict[str, dict[int, int]], lost: set[str]) -> list[str]:
    """Nodes a generation before ``previous`` lost that joined this round (sorted)."""
    gone_before = set(previous.gone) if previous else set()
    return sorted(n for n in set(joined) & gone_before if n in roster and n not in lost)


def plan_in_place(gen: int, roster: Roster, previous: Plan | None, by: str) -> Plan:
    """Generation ``gen`` when a node's warm spare took a dead worker's slot and nothing else
    changed: every node of ``gen - 1`` stays, every rank keeps its number.  The node that replaced
    the worker writes it at once (:meth:`Generations.close`), so the round needs no coordinator's
    wait for every join: each node's join reads the plan back in its own transaction.  Should
    another node have been lost meanwhile, the generation fails to form (that node's ranks never
    come), the loss is pushed as a fault of ``gen``, and ``gen + 1`` forms by the full round."""
    gone = set(previous.gone) if previous else set()
    joined: dict[str, dict[int, int]] = {}
    for slot, rank in ranks_at(roster, previous).items():
        if slot.node not in gone:
            joined.setdefault(slot.node, {})[slot.local_rank] = rank
    plan = plan_next(gen, roster, previous, joined, set(), by=by)
    if plan is None:
        raise GenerationFailed(f"generation {gen}: no node of generation {gen - 1} to keep")
    return plan


def plan_kept(gen: int, previous: Plan, by: str) -> Plan:
    """:func:`plan_in_place` from the plan held, without the roster: every node and rank of
    ``previous`` stays (``previous`` may be generation 0 as ``Plan(0, world0, nodes=n)``).  The
    roster is one record per node (~290 KB at 1,024 nodes x 8), and the node that closes in place
    reads it while every agent of the run is busy hearing the fault: measured with 1,024 simulated
    nodes on 2 cores, that read and the close took 0.3-0.8 s of a 1.5-1.8 s round."""
    return Plan(gen, previous.world, (), previous.nodes, (), previous.gone, previous.dropped0, by)


def plan_without(gen: int, previous: Plan, node: str, slots0: dict[int, int], by: str) -> Plan:
    """Generation ``gen`` when ``node`` (its generation-0 slots ``slots0``: local -> rank) was lost
    and nothing else changed: :func:`plan_next` with every other node joined with all its slots, from
    the plan held (``previous`` may be generation 0 as ``Plan(0, world0, nodes=n)``) and the lost
    node's one roster record, instead of every node's join.  The agent that pushes the loss writes
    it in the push's transaction; should another node be lost too, the generation fails to form
    and the next one forms by the full round, as for :func:`plan_kept`."""
    if node in previous.gone:
        raise GenerationFailed(f"generation {gen}: node {node} was lost before generation {previous.gen}")
    dropped0 = set(previous.dropped0)
    live0 = sorted(rank0 for rank0 in slots0.values() if rank0 not in dropped0)
    if not live0 or previous.nodes < 2:
        raise GenerationFailed(f"generation {gen}: node {node} holds no rank of generation {previous.gen}, "
                               "or no node would be left")
    dropped = tuple(rank0 - bisect.bisect_left(previous.dropped0, rank0) for rank0 in live0)
    return Plan(gen, previous.world, dropped, previous.nodes - 1, (node,), tuple(sorted({*previous.gone, node})),
                tuple(sorted(dropped0 | set(live0))), by)


@dataclass
class JoinView:
    """What a node's join transaction read back, at one revision."""

    revision: int
    plan: Plan | None
    store: str | None
    lost: set[str]
    head: list[str]
    """The first nodes of the generation-0 roster, in key order (enough to know the coordinator)."""
    head_limit: int


@dataclass
class RoundState:
    """Everything of one round (the coordinator's read): joins, lost nodes, plan, store."""

    revision: int
    joined: dict[str, dict[int, int]] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    plan: Plan | None = None
    store: str | None = None


class Generations:
    """The generation records of one epoch of a run."""

    def __init__(self, store: KVStore, keys: RunKeys, epoch: int) -> None:
        self.store = store
        self.keys = keys
        self.epoch = epoch

    # -- generation 0 -------------------------------------------------------------------
    def register_node(self, node: str, ranks: dict[int, int]) -> None:
        """Generation 0: this node's slots and the ranks torchrun gave them."""
        self.store.put(self.keys.gen_member(self.epoch, node), json.dumps({"ranks": _str_keys(ranks)}))

    def member(self, node: str) -> dict[int, int] | None:
        """``node``'s generation-0 slots and ranks (one key), None when it was not in generation 0."""
        kv = self.store.get(self.keys.gen_member(self.epoch, node))
        return _slots(decode(kv), "ranks") if kv is not None else None

    def roster(self) -> Roster:
        """Every node's generation-0 slots (one read of N small records: the coordinator's, once a round)."""
        base = self.keys.gen_members(self.epoch)
        return {RunKeys.tail(kv.key, base): _slots(decode(kv), "ranks") for kv in self.store.get_prefix(base)}

    def roster_nodes(self) -> int:
        """How many nodes the generation-0 roster has (a count-only read: no record comes back)."""
        return self.store.count_prefix(self.keys.gen_members(self.epoch))

    def head(self, limit: int) -> list[str]:
        """The first ``limit`` nodes of the generation-0 roster, in key order."""
        base = self.keys.gen_members(self.epoch)
        return [RunKeys.tail(kv.key, base) for kv in self.store.get_prefix(base, limit=limit)]

    # -- a round ----------------------------------------------------------------------------
    def join_node(self, gen: int, node: str, slots: dict[int, int], head_limit: int,
                  notice: tuple[str, str] | None = None) -> JoinView:
        """Join generation ``gen`` for ``node`` (``slots``: local slot -> its rank in ``gen - 1``) and
        read, in the same transaction (one request, one raft write), what a node needs next: the
        plan and store address if the round already closed, who was declared lost, the roster's head.
        ``notice`` (key, record): the run's note of this fault, written only by the first node to join
        (:meth:`RunState.notice`; it was a compare-and-swap of every agent of its own)."""
        record = json.dumps({"slots": _str_keys(slots), "ts": time.time()})
        noticed = [Txn(compare=[Compare.absent(notice[0])], success=[Put(*notice)])] if notice else []
        txn = Txn(success=[Put(self.keys.gen_join(self.epoch, gen, node), record), *noticed,
                           Get(self.keys.gen_plan(self.epoch, gen)), Get(self.keys.gen_store(self.epoch, gen)),
                           Range(self.keys.gen_losts(self.epoch, gen)),
                           Range(self.keys.gen_members(self.epoch), limit=head_limit)])
        result = self.store.txn(txn)
        plan, store, lost, head = result.results[1 + len(noticed):]
        members = self.keys.gen_members(self.epoch)
        return JoinView(result.revision, _plan(plan), _text(store),
                        {RunKeys.tail(kv.key, self.keys.gen_losts(self.epoch, gen)) for kv in lost},
                        [RunKeys.tail(kv.key, members) for kv in head], head_limit)

    def round_state(self, gen: int) -> RoundState:
        """Every record of round ``gen`` (the coordinator's one read of the joins)."""
        base = self.keys.generation(self.epoch, gen)
        kvs = self.store.get_prefix(base)
        state = RoundState(max((kv.mod_revision for kv in kvs), default=0))
        for kv in kvs:
            self.apply(state, RunKeys.tail(kv.key, base), kv.value)
        return state

    def apply(self, state: RoundState, tail: str, value: bytes | None) -> None:
        """One record (``tail`` under the round's prefix; ``value`` None: deleted) into ``state``."""
        if tail.startswith("join/"):
            node = tail[len("join/"):]
            if value is None:
                state.joined.pop(node, None)
            else:
                state.joined[node] = _slots(_json(value), "slots")
        elif tail.startswith("lost/") and value is not None:
            state.lost.add(tail[len("lost/"):])
        elif tail == "plan" and value is not None:
            state.plan = Plan.from_record(_json(value))
        elif tail == "store" and value is not None:
            state.store = value.decode()

    def mark_lost(self, gen: int, node: str, by: str, reason: str) -> bool:
        """Declare ``node`` gone for generation ``gen`` (once; True if this call recorded it)."""
        put = self.lost_put(gen, node, by, reason)
        ok, _ = self.store.compare_and_swap(put.key, put.value, 0)
        return ok

    def lost_put(self, gen: int, node: str, by: str, reason: str) -> Put:
        """:meth:`mark_lost`'s record, for a transaction that closes the round with it."""
        return Put(self.keys.gen_lost(self.epoch, gen, node), json.dumps({"by": by, "reason": reason, "ts": time.time()}))

    def close(self, plan: Plan, note: bool = False, also: Sequence[Put] = (), with_plan: Sequence[Put] = ()) -> Plan:
        """Write ``plan`` (create-only): the plan of its generation, this one or the one already there.
        ``note``: the same transaction puts it on the run's round note, which every agent's signal
        watch delivers (a plan closed in place: the other nodes take it from there, no join, no watch).
        ``also``: puts made whether the plan is written or not (a pushed fault: one raft write for both);
        ``with_plan``: puts made only with it (the lost node's record of a plan that drops it)."""
        key = self.keys.gen_plan(self.epoch, plan.gen)
        record = plan.to_json()
        notes = [Put(self.keys.round_note, self._note("plan", plan.gen, plan=json.loads(record)))] if note else []
        result = self.store.txn(Txn(compare=[Compare.absent(key)], success=[Put(key, record), *notes, *also, *with_plan],
                                    failure=[*also, Get(key)]))
        return plan if result.succeeded else Plan.from_record(decode(result.results[-1]) or {})

    def _note(self, kind: str, gen: int, **fields: Any) -> str:
        return json.dumps({"kind": kind, "epoch": self.epoch, "gen": gen, **fields})

    def plan(self, gen: int) -> Plan | None:
        return _plan(self.store.get(self.keys.gen_plan(self.epoch, gen)))

    def newest_plan(self, gaps: int = 3) -> Plan | None:
        """The plan of the epoch's newest generation (None: no generation re-formed yet), one read per
        generation: a round that failed wrote no plan, so up to ``gaps`` missing ones in a row are
        passed over.  (A read of the epoch's prefix would return every join of every round.)"""
        newest, gen, missed = None, 1, 0
        while missed < gaps:
            plan = self.plan(gen)
            newest, missed = (plan, 0) if plan is not None else (newest, missed + 1)
            gen += 1
        return newest

    def put_store(self, gen: int, addr: str) -> None:
        """Where generation ``gen``'s c10d store listens (its rank 0 serves it): for the round's
        watchers, and on the run's round note for the nodes that took a plan closed in place from
        theirs (one transaction, one raft write, as the put alone was)."""
        self.store.txn(Txn(success=[Put(self.keys.gen_store(self.epoch, gen), addr),
                                    Put(self.keys.round_note, self._note("store", gen, addr=addr))]))

    def store_at(self, gen: int) -> str | None:
        """Generation ``gen``'s c10d store address, if its rank 0 published it (one read)."""
        return _text(self.store.get(self.keys.gen_store(self.epoch, gen)))

    def ever_lost(self) -> set[str]:
        """Nodes some generation of this epoch re-formed without (the in-process path handled them)."""
        base = self.keys.generation(self.epoch, 0).rsplit("0/", 1)[0]  # gen/<epoch>/
        return {kv.key.rsplit("/lost/", 1)[1] for kv in self.store.get_prefix(base) if "/lost/" in kv.key}


def _str_keys(slots: dict[int, int]) -> dict[str, int]:
    return {str(local): int(rank) for local, rank in sorted(slots.items())}


def _slots(record: dict[str, Any] | None, field_name: str) -> dict[int, int]:
    return {int(local): int(rank) for local, rank in ((record or {}).get(field_name) or {}).items()}


def _json(value: bytes) -> dict[str, Any]:
    try:
        loaded = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _plan(kv: KeyValue | None) -> Plan | None:
    record = decode(kv)
    return Plan.from_record(record) if record else None


def _text(kv: KeyValue | None) -> str | None:
    return kv.value.decode() if kv is not None else None
