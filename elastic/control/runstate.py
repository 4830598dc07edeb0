"""A run's shared state in etcd, read and written through one object.

:class:`RunState` is the only code that reads or writes a run's records (keys from
:class:`~elastic.control.keys.RunKeys`); the agent, the leader, the launcher, ``elastic status``,
chaos and the pre-flight screen all go through it.  It works on any
:class:`~elastic.control.store.KVStore`, so the policies built on it (epoch, exclusions,
rollback, leader) are tested against :class:`~elastic.control.memstore.MemoryStore` without an
etcd binary.  Store errors propagate; callers decide whether an operation may fail quietly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.control.keys import RunKeys
from elastic.control.store import KeyValue, KVStore
from elastic.control.txn import Get, Put, Txn

Clock = Callable[[], float]


def decode(kv: KeyValue | None) -> dict[str, Any] | None:
    """A JSON record, or None when absent; an unreadable record reads as ``{}`` (present, no fields)."""
    if kv is None:
        return None
    try:
        value = json.loads(kv.value)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


class Exclusions:
    """The run's exclusion list: ``excluded/<node>`` -> JSON {reason, until, by, ts}.

    ``until`` is wall-clock time (records are compared across hosts); ``clock`` is the seam
    that lets a test expire a record without sleeping.
    """

    def __init__(self, store: KVStore, keys: RunKeys | str, clock: Clock = time.time) -> None:
        self.store = store
        self.keys = keys if isinstance(keys, RunKeys) else RunKeys(keys)
        self.clock = clock

    def add(self, node_id: str, reason: str, ttl_s: float | None = None, by: str = "", **extra: Any) -> None:
        """Exclude ``node_id`` for ``ttl_s`` seconds (None or 0: until cleared); ``extra`` goes into the record."""
        now = self.clock()
        record = {"reason": reason, "until": now + ttl_s if ttl_s else None, "by": by, "ts": now, **extra}
        self.store.put(self.keys.excluded(node_id), json.dumps(record, default=str))

    def get(self, node_id: str) -> dict | None:
        """The active exclusion record of a node, or None (expired records count as absent)."""
        return self.active(self.store.get(self.keys.excluded(node_id)))

    def active(self, kv: KeyValue | None) -> dict | None:
        """The record in ``kv`` if it excludes now (see :meth:`get`)."""
        record = decode(kv)
        if record is None:
            return None
        if not record:
            return {"reason": "unreadable exclusion record", "until": None}
        until = record.get("until")
        if until is not None and until < self.clock():
            return None
        return record

    def clear(self, node_id: str) -> None:
        self.store.delete(self.keys.excluded(node_id))

    def all(self) -> dict[str, dict]:
        base = self.keys.exclusions
        nodes = (RunKeys.tail(kv.key, base) for kv in self.store.get_prefix(base))
        return {node: record for node in nodes if (record := self.get(node)) is not None}


@dataclass(frozen=True)
class RollbackVerdict:
    """What :meth:`RunState.record_rollback` decided: ``rollback`` (a new skip range was recorded),
    ``duplicate`` (another node recorded this failure in this epoch) or ``stop``."""

    action: str
    reason: str = ""
    skip: tuple[tuple[int, int], ...] = ()
    rollbacks: int = 0


@dataclass(frozen=True)
class RunSignals:
    """The run-wide signals a running agent watches for (:meth:`RunState.signals`)."""

    epoch: int
    excluded: dict[str, Any] | None
    stop: dict[str, Any] | None


class RunState:
    """Typed access to one run's records in a :class:`KVStore`."""

    def __init__(self, store: KVStore, keys: RunKeys, clock: Clock = time.time) -> None:
        self.store = store
        self.keys = keys
        self.clock = clock
        self.exclusions = Exclusions(store, keys, clock)

    def _record(self, key: str) -> dict[str, Any] | None:
        return decode(self.store.get(key))

    def _put(self, key: str, record: dict[str, Any], lease: int | None = None) -> None:
        self.store.put(key, json.dumps(record, default=str), lease=lease)

    def _records(self, prefix: str) -> dict[str, dict[str, Any]]:
        out = {}
        for kv in self.store.get_prefix(prefix):
            record = decode(kv)
            if record:
                out[RunKeys.tail(kv.key, prefix)] = record
        return out

    # -- epoch ----------------------------------------------------------------
    def epoch(self) -> int:
        kv = self.store.get(self.keys.epoch)
        return int(kv.value) if kv else 0

    def bump_epoch(self, seen: int) -> tuple[int, bool]:
        """Move the run to epoch ``seen + 1`` unless someone already moved it.

        Returns (current epoch, whether this call moved it).  One compare-and-swap, so concurrent
        failures of several nodes bump the epoch once.
        """
        kv = self.store.get(self.keys.epoch)
        current = int(kv.value) if kv else 0
        if current != seen:
            return current, False
        ok, now = self.store.compare_and_swap(self.keys.epoch, str(seen + 1), kv.mod_revision if kv else 0)
        if ok:
            return seen + 1, True
        return (int(now.value) if now else 0), False

    def signals(self, node_id: str) -> RunSignals:
        """What a running agent acts on (:mod:`elastic.control.signals` keeps it current)."""
        return self.signals_of(*self.signal_records(node_id)[0])

    def signal_keys(self, node_id: str, pushed_fault: bool = False, arbitration: bool = False) -> list[str]:
        """The records behind :meth:`signals`: the epoch, this node's exclusion, the stop (and, for
        an agent with in-process workers, the newest pushed fault and round note; with replay
        verification, the newest arbitration asked of this node)."""
        keys = [self.keys.epoch, self.keys.excluded(node_id), self.keys.stop]
        keys += [self.keys.pushed_fault, self.keys.round_note] if pushed_fault else []
        return [*keys, self.keys.sdc_arbitrate(node_id)] if arbitration else keys

    def signal_records(self, node_id: str, pushed_fault: bool = False,
                       arbitration: bool = False) -> tuple[list[KeyValue | None], int]:
        """The :meth:`signal_keys` records and the revision they were read at, in one read-only
        transaction (a linearizable read, not a raft proposal; three reads were three requests)."""
        keys = self.signal_keys(node_id, pushed_fault, arbitration)
        result = self.store.txn(Txn(success=[Get(key) for key in keys]))
        return list(result.results), result.revision

    def signals_of(self, epoch: KeyValue | None, excluded: KeyValue | None, stop: KeyValue | None) -> RunSignals:
        return RunSignals(int(epoch.value) if epoch else 0, self.exclusions.active(excluded), decode(stop))

    # -- the leader's membership view ----------------------------------------------
    def leader_view(self) -> tuple[int, set[str]] | None:
        record = self._record(self.keys.leader_view)
        if not record or "epoch" not in record:
            return None
        return int(record["epoch"]), set(record.get("members", []))

    def set_leader_view(self, epoch: int, members: set[str]) -> None:
        self._put(self.keys.leader_view, {"epoch": epoch, "members": sorted(members)})

    # -- stop / done ------------------------------------------------------------
    def stop_record(self) -> dict[str, Any] | None:
        return self._record(self.keys.stop)

    def request_stop(self, reason: str, by: str, code: int = 1) -> None:
        """Stop the run; ``code`` is what every agent (and launcher) exits with for it (1 unless the
        cause has a code of its own: failing saves, 88), on every host, not only the stopper's."""
        self._put(self.keys.stop, {"reason": reason, "by": by, "code": code, "ts": self.clock()})

    def done_record(self) -> dict[str, Any] | None:
        return self._record(self.keys.done)

    def mark_done(self, by: str) -> None:
        self._put(self.keys.done, {"by": by, "ts": self.clock()})

    def finished(self) -> bool:
        """Done or stopped: nothing is left to run."""
        return self.done_record() is not None or self.stop_record() is not None

    # -- nodes, heartbeats, failures, diag ------------------------------------------
    def put_node(self, node_id: str, record: dict[str, Any], lease: int | None = None) -> None:
        self._put(self.keys.node(node_id), record, lease)

    def node(self, node_id: str) -> dict[str, Any] | None:
        return self._record(self.keys.node(node_id))

    def nodes(self) -> dict[str, dict[str, Any]]:
        return self._records(self.keys.nodes)

    def node_records(self, nodes: list[str]) -> dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]]:
        """Each node's record and roster entry, in one transaction (for a few nodes; :meth:`nodes`
        and :meth:`members` read every node's)."""
        ops = [Get(key) for node in nodes for key in (self.keys.node(node), self.keys.member(node))]
        found = self.store.txn(Txn(success=ops)).results
        return {node: (decode(found[2 * i]), decode(found[2 * i + 1])) for i, node in enumerate(nodes)}

    def put_heartbeat(self, node_id: str, record: dict[str, Any], lease: int | None = None) -> None:
        self._put(self.keys.heartbeat(node_id), record, lease)

    def heartbeats(self, epoch: int | None = None) -> dict[str, dict[str, Any]]:
        """Node heartbeats, only those of ``epoch`` when given (nodes of the same membership)."""
        beats = self._records(self.keys.heartbeats)
        return beats if epoch is None else {n: hb for n, hb in beats.items() if hb.get("epoch") == epoch}

    def record_failure(self, node_id: str, kind: str, epoch: int) -> None:
        now = self.clock()
        self._put(self.keys.failure(node_id, int(now * 1000)), {"ts": now, "kind": kind, "epoch": epoch})

    def failures(self) -> dict[str, list[float]]:
        """Counted failure times per node (the lemon-node policy's input)."""
        out: dict[str, list[float]] = {}
        base = self.keys.failures
        for kv in self.store.get_prefix(base):
            node = RunKeys.tail(kv.key, base).split("/", 1)[0]
            try:
                out.setdefault(node, []).append(float(json.loads(kv.value)["ts"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return out

    # -- faults: one record per fault, whoever notices it first ------------------------
    def record_fault(self, epoch: int, node_id: str, record: dict[str, Any], gen: int | None = None) -> bool:
        """Record that ``node_id`` failed or was lost in ``epoch`` (in-process: generation ``gen``);
        True only for the one caller that created the record (create-only compare-and-swap), so one
        fault gives one run-level event."""
        body = json.dumps({"epoch": epoch, "node": node_id, "ts": self.clock(), **record}, default=str)
        ok, _ = self.store.compare_and_swap(self.keys.fault(epoch, node_id, gen), body, 0)
        return ok

    def faults(self) -> list[dict[str, Any]]:
        """Every fault record, oldest epoch first."""
        return sorted(self._records(self.keys.faults).values(), key=lambda r: (r.get("epoch", 0), r.get("ts", 0)))

    def push_fault(self, record: dict[str, Any]) -> None:
        """Tell every agent of a fault in a generation (one put; they watch :attr:`RunKeys.pushed_fault`)."""
        put = self.fault_put(record)
        self.store.put(put.key, put.value)

    def fault_put(self, record: dict[str, Any]) -> Put:
        """:meth:`push_fault`'s put, for a transaction that makes it with another write."""
        return Put(self.keys.pushed_fault, json.dumps(record, default=str))

    def notice_fault(self, epoch: int, step: int | None, by: str, kind: str, gen: int = 0) -> bool:
        """The first agent to notice a fault in ``epoch`` (generation ``gen`` of an in-process
        re-formation) records the step its workers stood at (create-only: the others' notices are
        the same fault)."""
        ok, _ = self.store.compare_and_swap(*self.notice(epoch, step, by, kind, gen), 0)
        return ok

    def notice(self, epoch: int, step: int | None, by: str, kind: str, gen: int = 0) -> tuple[str, str]:
        """The key and record of :meth:`notice_fault`, for a caller that writes it inside a transaction
        of its own (create-only there too: a node's generation join)."""
        body = json.dumps({"epoch": epoch, "gen": gen, "step": step, "by": by, "kind": kind, "ts": self.clock()})
        return self.keys.noticed(epoch, gen), body

    def noticed(self, epoch: int) -> dict[str, Any] | None:
        """The newest fault noticed in ``epoch`` (its latest generation)."""
        found = self._records(self.keys.noticed_in(epoch)).values()
        return max(found, key=lambda r: int(r.get("gen", 0)), default=None)

    def set_member(self, node_id: str, member_state: str) -> None:
        """The roster entry of a node (no lease, so it outlives the agent): ``joined`` when it
        registers, its final state when its agent leaves cleanly, ``lost`` when its lease expired."""
        self._put(self.keys.member(node_id), {"state": member_state, "ts": self.clock()})

    def members(self) -> dict[str, dict[str, Any]]:
        return self._records(self.keys.members)

    # -- hang attribution ------------------------------------------------------------
    def put_hang(self, epoch: int, node_id: str, record: dict[str, Any]) -> None:
        self._put(self.keys.hang(epoch, node_id), record)

    def hangs(self, epoch: int) -> dict[str, dict[str, Any]]:
        return self._records(self.keys.hangs(epoch))

    # -- replay verification ---------------------------------------------------------
    def put_replay_sum(self, rank: int, record: dict[str, Any]) -> None:
        self._put(self.keys.replay_sum(rank), record)

    def replay_sum(self, rank: int) -> dict[str, Any] | None:
        return self._record(self.keys.replay_sum(rank))

    def put_sdc_verified(self, node_id: str, record: dict[str, Any]) -> None:
        """The newest check ``node_id``'s spare verified: ``{step, rank, tag}`` (one key per verifier,
        one put per agreed check: as many writes as the checked ranks' ``put_replay_sum``)."""
        self._put(self.keys.sdc_verified(node_id), {**record, "ts": self.clock()})

    def sdc_verified_through(self, nodes: int, epoch: int) -> int | None:
        """The step through which the replay checks of ``epoch`` agreed: the lowest of the verifiers'
        newest agreed checks in that epoch's newest generation, once at least ``nodes`` verifiers
        have one there (each node verifies one rank of its neighbour per check step: fewer means some
        rank is not verified yet); None before.  A check verifies the trajectory of its epoch only
        (a restart retrains from a checkpoint, a rollback throws steps away), and counts in its
        generation only: a node that left in-process keeps its last record, which must not hold the
        run's verified step back for the rest of the epoch.  The keys hold each verifier's newest
        check, so an epoch's are readable until its verifiers check in the next (a resume reads them
        before any has)."""
        tags = [(_tag(r.get("tag")), int(r["step"])) for r in self._records(self.keys.sdc_verified_prefix).values()
                if "step" in r]
        gens = [gen for (e, gen), _ in tags if e == epoch]
        steps = [step for tag, step in tags if gens and tag == (epoch, max(gens))]
        return min(steps) if steps and len(steps) >= max(nodes, 1) else None

    def put_arbitration(self, node_id: str, record: dict[str, Any]) -> None:
        self._put(self.keys.sdc_arbitrate(node_id), record)

    def arbitration(self, node_id: str) -> dict[str, Any] | None:
        return self._record(self.keys.sdc_arbitrate(node_id))

    def arbitration_at(self, node_id: str) -> tuple[dict[str, Any], int]:
        """The arbitration record asked of ``node_id`` and its revision (({}, 0) when there is none)."""
        kv = self.store.get(self.keys.sdc_arbitrate(node_id))
        return (decode(kv) or {}, kv.mod_revision) if kv is not None else ({}, 0)

    def nudge_arbitration(self, node_id: str, record: dict[str, Any], revision: int) -> bool:
        """Put ``record`` again only if the key is still at ``revision`` (unanswered): a new event
        for the arbiter's watch.  True if it was put."""
        ok, _ = self.store.compare_and_swap(self.keys.sdc_arbitrate(node_id), json.dumps(record, default=str), revision)
        return ok

    def record_sdc_rollback(self, from_step: int, epoch: int, node: str, rank: int, by: str,
                            rescreen: bool = False) -> dict[str, Any]:
        """A silent corruption at ``from_step``, found in ``epoch``: what a resume must not trust
        (merged with an earlier record: the lower step, the later epoch).  ``rescreen``: ``node``
        screens itself before it trains again.  Returns the record now in force."""
        old = self.sdc_rollback() or {}
        record = {"from_step": min(from_step, int(old.get("from_step", from_step))),
                  "epoch": max(epoch, int(old.get("epoch", epoch))), "ts": self.clock(),
                  "node": node, "rank": rank, "by": by, "rescreen": rescreen}
        self._put(self.keys.sdc_rollback, record)
        return record

    def sdc_rollback(self) -> dict[str, Any] | None:
        return self._record(self.keys.sdc_rollback)

    def distrust_spec(self) -> str:
        """The rollback as the workers read it (``STEP@EPOCH``), or ``""``."""
        record = self.sdc_rollback()
        return f"{int(record['from_step'])}@{int(record['epoch'])}" if record else ""

    def put_diag(self, node_id: str, record: dict[str, Any] | str) -> None:
        value = record if isinstance(record, str) else json.dumps(record, default=str)
        self.store.put(self.keys.diag(node_id), value)

    def leader(self) -> str | None:
        return (self._record(self.keys.leader) or {}).get("node")

    # -- checkpoint pointer -----------------------------------------------------------
    def latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest committed checkpoint published by the trainers (a hint; disk is the truth)."""
        record = self._record(self.keys.checkpoint_latest)
        return record if record else None

    def publish_checkpoint(self, record: dict[str, Any]) -> None:
        self._put(self.keys.checkpoint_latest, record)

    # -- chaos faults delivered through etcd -------------------------------------------------
    def post_fault(self, node_id: str, request_id: str, request: dict[str, Any]) -> None:
        self._put(self.keys.chaos_request(node_id, request_id), request)

    def fault_requests(self, node_id: str) -> dict[str, dict[str, Any]]:
        """This node's fault requests by id (an unreadable one reads as ``{}``, refused later)."""
        base = self.keys.chaos_requests(node_id)
        return {RunKeys.tail(kv.key, base): decode(kv) or {} for kv in self.store.get_prefix(base)}

    def put_fault_result(self, node_id: str, request_id: str, result: dict[str, Any]) -> None:
        self._put(self.keys.chaos_result(node_id, request_id), result)

    def fault_results(self, node_id: str = "") -> dict[str, dict[str, Any]]:
        """Results by ``<node>/<id>`` (all nodes), or by id (one node)."""
        return self._records(self.keys.chaos_results(node_id))

    # -- numerics rollback ----------------------------------------------------------------
    def skip_ranges(self) -> list[tuple[int, int]]:
        record = self._record(self.keys.numerics) or {}
        return [(int(r["lo"]), int(r["hi"])) for r in record.get("ranges", [])]

    def skip_spec(self) -> str:
        """The skip ranges as the workers read them (``"12-12,30-31"``)."""
        return ",".join(f"{lo}-{hi}" for lo, hi in self.skip_ranges())

    def seed_skip_ranges(self, ranges: list[tuple[int, int]], by: str) -> None:
        """Before a run starts: the batches its workers skip (a fault-free replay of a run that rolled back)."""
        record = {"ranges": [{"lo": lo, "hi": hi, "epoch": -1, "by": by} for lo, hi in ranges], "rollbacks": 0}
        self.store.put(self.keys.numerics, json.dumps(record))

    def record_rollback(self, bad_step: int, epoch: int, by: str, skip_before: int,
                        max_rollbacks: int) -> RollbackVerdict:
        """Record the batch range to skip after bad numerics at ``bad_step``.

        Every rank of a synchronous job sees the same NaN, so several agents report one failure:
        the range is written with a compare-and-swap, and an agent finding its step already
        recorded *for this epoch* is looking at the same failure.  The same step failing in a
        later epoch is a repeat, and the run stops.
        """
        while True:
            kv = self.store.get(self.keys.numerics)
            record = json.loads(kv.value) if kv else {"ranges": [], "rollbacks": 0}
            verdict = _judge_rollback(record, bad_step, epoch, max_rollbacks)
            if verdict is not None:
                return verdict
            record["ranges"].append({"lo": max(1, bad_step - skip_before), "hi": bad_step, "epoch": epoch, "by": by})
            record["rollbacks"] += 1
            ok, _ = self.store.compare_and_swap(self.keys.numerics, json.dumps(record), kv.mod_revision if kv else 0)
            if ok:
                skip = tuple((r["lo"], r["hi"]) for r in record["ranges"])
                return RollbackVerdict("rollback", skip=skip, rollbacks=record["rollbacks"])


def _judge_rollback(record: dict[str, Any], bad_step: int, epoch: int, max_rollbacks: int) -> RollbackVerdict | None:
    """The verdict when the record already decides it (duplicate, repeat, budget spent), else None."""
    for r in record["ranges"]:
        if r["lo"] <= bad_step <= r["hi"]:
            if r["epoch"] == epoch:
                return RollbackVerdict("duplicate", f"step {bad_step} already rolled back by {r['by']}")
            return RollbackVerdict("stop", f"numerics failure repeats at step {bad_step} after skipping it")
    if record["rollbacks"] >= max_rollbacks:
        return RollbackVerdict("stop", f"numerics: {record['rollbacks']} rollbacks already "
                                       f"(max_rollbacks={max_rollbacks})")
    return None


def _tag(tag: Any) -> tuple[int, int]:
    """(epoch, generation) of a replay check's world tag (``epoch.generation``); (-1, -1) unreadable."""
    try:
        epoch, _, gen = str(tag).partition(".")
        return int(epoch), int(gen or 0)
    except ValueError:
        return -1, -1
