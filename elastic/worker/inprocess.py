"""In-process recovery on the worker side: survive a lost peer without a new process.

When a collective fails because a peer went away (:func:`is_peer_failure`), a worker does not
exit.  It tears down its process groups and learns the next generation of the world from its node's
agent over the local channel (the agent joins the round for the whole node:
:mod:`elastic.control.generations`; no rank reads etcd on the way), opens new process groups on a
store served by the new rank 0, rebuilds its model wrapping for the new world (the trainer's build function) and restores its
state from the per-step memory snapshots (:mod:`elastic.checkpoint.snapshot`): its own from its
own memory, a replaced worker's from the node agent's store, a lost node's from its buddy's.  No
process starts except the warm spare that takes a dead worker's slot; nobody re-imports torch.

The restore is collective and all-or-nothing: the ranks agree on the newest step every old rank
can provide (at most one step behind the newest one trained); if some old rank's shard of that
step is nowhere to be found, every rank raises :class:`RecoveryUnavailable` and the agents fall
back to a full restart from the disk checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memory import as_state_dicts
from elastic.checkpoint.memstate import GenerationFaulted, MemStateError
from elastic.checkpoint.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotCosts,
    SnapshotPusher,
    SnapshotRing,
    capture,
    extra_of,
    snapshot_nbytes,
    wait_copied,
    from_bytes,
    load_tree,
    restore,
)
from elastic.common.collectives import check_device, group_device
from elastic.common.config import ConfigError
from elastic.common.env import WorkerEnv
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_RECOVERY_FAILED
from elastic.common.peers import is_peer_lost
from elastic.control.generations import Plan, Slot
from elastic.control.store import StoreError
from elastic.worker.faultwatch import FaultLatch, FaultMonitor, PeerAborted, install_hang_switch
from elastic.worker.generation import GenerationClient, RecoveryUnavailable
from elastic.worker.reshard import Layout, describe, plan, providers, shard_sources, transfer

T = TypeVar("T")



def is_peer_failure(exc: BaseException) -> bool:
    """A collective error caused by another rank going away (gloo/NCCL texts, or a pushed fault's
    abort: :class:`~elastic.worker.faultwatch.PeerAborted`; a wait for a generation a pushed fault
    broke: :class:`~elastic.checkpoint.memstate.GenerationFaulted`), not a bug here."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (PeerAborted, GenerationFaulted)):
            return True
        if isinstance(exc, (RuntimeError, OSError)) and is_peer_lost(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def ab_snapshot_step(step: int, block: int) -> bool:
    """Whether step ``step`` is snapshotted when snapshots alternate in blocks of ``block`` steps
    (on for steps 1..block, off for the next block, ...); always with ``block`` 0."""
    return block <= 0 or ((step - 1) // block) % 2 == 0


class PhaseClock:
    """Durations of a recovery's phases, for the ``trainer.recovered`` event."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self._t, 4)
        self._t = now


class InProcess:
    """One worker's part in in-process recovery: snapshots, generations, re-formation."""

    def __init__(self, env: WorkerEnv, local_rank: int, events: EventLog) -> None:
        self.env = env
        self.events = events
        self.slot = Slot(env.node_id, local_rank)
        self.epoch = int(env.epoch or 0)
        self.join_timeout_s = float(env.inprocess)
        self.rejoin_wait_s = float(env.rejoin_wait or 0)  # a fixed-size run's wait for a lost node's return
        self.client = (MemStateClient(env.memstate_addr, env.memstate_token, 30.0, keep_alive=True)
                       if env.memstate_addr else None)
        self.round = GenerationClient(env, local_rank, self.client)  # the rounds, over the local channel
        self.ring = SnapshotRing(shared=bool(env.memstate_addr))  # the agent maps its buffers
        self.snapshots_on = env.snapshots != "0"
        self.ab_block = int(env.snapshots[3:]) if env.snapshots.startswith("ab:") else 0
        self.costs = SnapshotCosts()
        self._pending_capture = False  # a deferred capture not yet waited for (captured())
        self.fit_bytes = 0  # the largest snapshot the agent's cap was checked for (check_fit)
        self.fetch_errors: list[str] = []  # why snapshots could not be read (trainer.recovery_failed says)
        self.pusher = SnapshotPusher(self.client, env.node_id, local_rank, self.epoch, events) if self.client else None
        self.rank = -1
        self.phases: dict[str, float] = {}  # the last re-formation's (PhaseClock)
        self.exact: tuple[bool, str] = (True, "")  # the last restore: bitwise the pre-fault state? (why not)
        self._base = 0  # the generation the last restore's snapshots were taken in
        self.device: torch.device | None = None  # set by the session: groups are bound to it (NCCL: eager init)
        self.latch = FaultLatch(self._abort_world)
        self.latch.gen = self.round.gen
        self.hang_switch = install_hang_switch(self.latch)
        self.monitor = (FaultMonitor(MemStateClient(env.memstate_addr, env.memstate_token, 30.0), self.epoch,
                                     self.latch, lambda kind, **f: self.events.emit(kind, **f),
                                     lambda: self.latch.gen).start() if env.memstate_addr else None)

    @classmethod
    def from_env(cls, local_rank: int, events: EventLog) -> InProcess | None:
        env = WorkerEnv.from_env()
        if not (env.inprocess and env.etcd_endpoint and env.run_prefix and env.node_id):
            return None
        return cls(env, local_rank, events)

    @property
    def joining(self) -> bool:
        """This process is a spare taking over a dead worker's slot (it joins a generation directly)."""
        return self.round.joining

    @property
    def gen(self) -> int:
        return self.round.gen

    @property
    def plan(self) -> Plan | None:
        return self.round.plan

    @property
    def old_rank(self) -> int:
        """This slot's rank in the generation before :attr:`plan`'s."""
        return self.round.old_rank

    # -- every step ------------------------------------------------------------------
    def register(self, rank: int) -> None:
        """The rank torchrun gave this worker (its agent registers the node's slots for generation 0)."""
        self.rank = rank

    def check_fit(self, state: dict[str, Any]) -> None:
        """Before training: this rank's snapshots, two steps of every local shard and of the buddy's,
        fit the agent's cap (``agent.inprocess.snapshot_mib``), else ConfigError, one line naming
        it.  A fresh optimizer has no state yet: the first capture checks again at its full size."""
        if self.snapshots_on and self.client is not None:
            self._fit(snapshot_nbytes(state))

    def _fit(self, nbytes: int) -> None:
        if nbytes <= self.fit_bytes:
            return
        try:
            error = self.client.snap_fit(nbytes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except MemStateError as exc:  # the store unreachable: its pushes will fail and say so, as before
            self.events.emit("snapshot.fit_unchecked", bytes=nbytes, error=str(exc)[:300])
            return
        if error is not None:
            field, _, message = error.partition(": ")
            raise ConfigError(field, message)
        self.fit_bytes = nbytes

    def snapshot(self, step: int, state: dict[str, Any], extra: dict[str, Any], world: int,
                 deferred: bool = False) -> None:
        """Take this rank's snapshot of ``step`` and push it.  ``deferred``: the copy is taken on the
        push thread while the training thread goes on to the next step's start (device work: the
        trainer's ``step_sleep`` here); the trainer's sync point (:meth:`captured`) then waits for it
        before the step changes any state.  Measured on the DiT benchmark (4 nodes, 2 shared cores):
        the copy was 1.3 ms of the training thread's CPU per step, the largest part of what a
        snapshot cost a step."""
        if not self.snapshots_on or not ab_snapshot_step(step, self.ab_block):
            return
        if deferred and self.pusher is not None and not self._device_copy:
            self.costs.deferred += 1
            self._pending_capture = True
            self.pusher.submit(lambda: self._capture(step, state, extra, world))
            return
        t0 = time.monotonic()
        snap = self._capture(step, state, extra, world)
        self.costs.blocked_s += time.monotonic() - t0
        if self.pusher is not None:
            self.pusher.push(snap)

    @property
    def _device_copy(self) -> bool:
        """GPU state: the capture only queues an asynchronous copy (elastic.checkpoint.snapshot.copy_path),
        so it runs on the training thread; deferring it to the push thread would gain nothing."""
        return self.device is not None and self.device.type == "cuda"

    def _capture(self, step: int, state: dict[str, Any], extra: dict[str, Any], world: int) -> Snapshot:
        t0, cpu0 = time.monotonic(), time.thread_time()
        snap = capture(state, step, self.gen, self.rank, world, extra, ring=self.ring)
        if self.client is not None:
            self._fit(snap.packed.flat.numel() if snap.packed is not None else 0)  # once it grows
        self.ring.add(snap)
        self.costs.capture_s.append(time.monotonic() - t0)
        self.costs.capture_cpu_s.append(time.thread_time() - cpu0)
        return snap

    def captured(self) -> None:
        """Before the step changes any state a snapshot holds: the deferred copy is taken (a GPU
        copy: the step's stream waits for it on the device)."""
        wait_copied(self.ring.newest())
        if self.pusher is None or not self._pending_capture:
            return
        t0 = time.monotonic()
        self.pusher.wait_captured()
        self._pending_capture = False
        waited = time.monotonic() - t0
        self.costs.capture_wait_s.append(waited)
        self.costs.blocked_s += waited

    def before_collectives(self) -> None:
        """The previous step's snapshot must be off-process before this step's last collectives."""
        wait_copied(self.ring.newest())
        if self.pusher is not None:
            t0 = time.monotonic()
            self.pusher.wait()
            self._pending_capture = False
            waited = time.monotonic() - t0
            self.costs.wait_s.append(waited)
            self.costs.blocked_s += waited
            self.pusher.wait_captured()  # raises what a deferred capture raised

    def snapshot_costs(self) -> dict[str, Any]:
        """For the done event: what the snapshots cost this rank's training thread (and the pushes)."""
        pusher = self.pusher
        return self.costs.summary(pusher.push_s if pusher else [], pusher.push_cpu_s if pusher else [])

    # -- a fault ---------------------------------------------------------------------------
    def reform(self, backend: str, pg_timeout: timedelta, min_nodes: int = 1) -> Plan:
        """Leave the failed generation and form the next one; returns its plan (process groups are up).
        A plan with fewer nodes than ``min_nodes`` (launch.nodes) raises RecoveryUnavailable on every
        member alike: a fixed-size run never shrinks in-process, it restarts and waits for the node."""
        clock = PhaseClock()
        self.leave()
        clock.lap("teardown_s")
        plan = self.round.next_plan()
        if plan.nodes < min_nodes and self.rejoin_wait_s > 0 and plan.gone:
            # A fixed-size world short of a node: the next generation's round holds for it to come
            # back (elastic.control.genround: rejoin_wait_s) and re-admits it with its old ranks.
            self.events.emit("recovery.rejoin_wait", gen=plan.gen, nodes=plan.nodes, needed=min_nodes,
                             away=list(plan.gone)[:20], wait_s=self.rejoin_wait_s)
            plan = self.round.next_plan()
        clock.lap("generation_s")
        if plan.nodes < min_nodes:
            raise RecoveryUnavailable(f"generation {plan.gen} has {plan.nodes} nodes; the run needs at least "
                                      f"{min_nodes} (launch.nodes): restarting from the disk checkpoint")
        self.latch.forming(plan.gen, set(plan.lost) | set(plan.gone))
        self._init_group(plan, backend, pg_timeout)
        clock.lap("process_group_s")
        self.round.adopt(plan)
        self.phases = clock.laps
        return plan

    def leave(self) -> None:
        """Leave the current generation (idempotent): the last snapshot push settled, every process
        group aborted and connection cut (unless the fault monitor did it already), the device
        drained.  A spare has no world to leave before its first plan."""
        self.latch.note_recovering()  # not stuck: the fault monitor's watch ends
        if self.pusher is not None:
            self.pusher.wait()
            self.pusher.take_error()  # the failed world's last capture: moot now
            self._pending_capture = False
        # The memo holds the failed world's model and optimizer tensors: on a GPU they would stay
        # allocated through the rebuild, beside the new model's (its snapshots stay for the restore).
        self.ring.memo.clear()
        figures = None if self.joining and self.plan is None else self.latch.teardown()
        if figures is not None:
            self.events.emit("recovery.severed", gen=self.gen, by="training thread", **figures)
        left = forget_leftover_groups()
        if left:
            self.events.emit("recovery.leftover_groups", gen=self.latch.gen, groups=left)
        _drain_device(self.device, self.join_timeout_s)

    def _abort_world(self) -> dict[str, Any]:
        """The latch's teardown (once per generation, from either thread)."""
        figures = abort_generation(self._keep_ports())
        if figures.pop("abort_error", None):
            self.events.emit("recovery.abort_failed", gen=self.latch.gen, error=figures.get("error", ""))
        return figures

    def _keep_ports(self) -> set[int]:
        """The etcd and memory-store ports: the connections recovery itself needs."""
        addrs = [*self.env.etcd_endpoint.split(","), self.env.memstate_addr]
        return {int(a.rpartition(":")[2]) for a in addrs if a.rpartition(":")[2].isdigit()}

    def _init_group(self, plan: Plan, backend: str, pg_timeout: timedelta) -> None:
        """The new generation's default group.  Bound to this rank's GPU (``device_id``) as on the
        first start: NCCL then initialises eagerly and the mesh's groups are split from it
        (``ncclCommSplit``) instead of each bootstrapping a communicator of its own."""
        rank = self.rank = self.round.rank_in(plan)
        self.latch.check(plan.gen)  # a pushed fault broke it before it formed: its store may be gone
        store = self._store(plan, rank)
        self.latch.check(plan.gen)  # torn down while the store formed: a peer of it failed
        cuda = self.device is not None and self.device.type == "cuda"
        dist.init_process_group(backend, store=store, rank=rank, world_size=plan.world, timeout=pg_timeout,
                                device_id=self.device if cuda else None)

    def _store(self, plan: Plan, rank: int) -> dist.Store:
        """The generation's c10d store, served by its rank 0: it publishes the address in etcd (one put
        a round), every other rank hears it from its agent, whose round watch sees that put."""
        if rank == 0:
            store = dist.TCPStore(self.env.local_addr or "127.0.0.1", 0, plan.world, True,
                                  timedelta(seconds=self.join_timeout_s), wait_for_workers=False)
            self.round.publish_store(plan.gen, f"{self.env.local_addr or '127.0.0.1'}:{store.port}")
            return store
        host, _, port = self.round.store_address(plan.gen).rpartition(":")
        return until_torn(self.latch, plan.gen, lambda: dist.TCPStore(
            host, int(port), plan.world, False, timedelta(seconds=self.join_timeout_s)))

    # -- restore ------------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
        """Collective over the new generation: load the agreed step into ``state``.

        The snapshots are read by the generation they were taken in (the *base*) and its ranks, not
        by the previous plan's: when a generation failed before it trained a step (a second fault
        while the world re-formed), every snapshot is still of the one before it.  Measured before
        this: a node lost (the world shrank 4 -> 3), then a survivor's worker killed before the
        shrunk world trained; the next generation looked for snapshots of the shrunk world's ranks,
        found none for the rank whose number had changed and fell back to disk
        (``tests/test_double_fault_e2e.py``).

        Returns (step, this rank's per-rank extra or {} when the world changed, where it came from).
        """
        assert self.plan is not None
        gathered = _all_gather(self._offers())
        self._base, base_world, step = _agree_base(gathered)
        old_world = list(range(base_world))
        offers = [_of_generation(offer, self._base) for offer in gathered]
        self.exact = self._exactness(old_world)
        if self.exact[0]:
            snap, source = self._own(step)
            _fail_together(snap is None, f"rank {self.rank}: no snapshot of step {step}")
            assert snap is not None
            restore(state, [snap], self.rank, self.plan.world)
            return step, extra_of(snap), source
        targets = as_state_dicts(state)  # a fresh optimizer's state is created here (DCP)
        tree = self._exchange(step, old_world, providers(offers, step, old_world), targets)
        load_tree(state, tree, self.rank, self.plan.world, targets)
        return step, {}, "memory, resharded"

    def _exactness(self, old_world: list[int]) -> tuple[bool, str]:
        """Whether the restore is bitwise the state every rank held after one step (so the run goes
        on exactly as without the fault), and when not, why.  Every rank restores the one step all
        agreed on; only a changed world (ranks renumbered, shards resharded, another data-parallel
        split of the batch) changes the trajectory.  Within an epoch a world only keeps its ranks
        or drops some (the rest renumbered in order), so the same size is the same ranks."""
        assert self.plan is not None
        if len(old_world) == self.plan.world:
            return True, ""
        return False, (f"the world changed from {len(old_world)} to {self.plan.world} ranks in generation "
                       f"{self.plan.gen}: state resharded, batches split anew")

    def _own(self, step: int) -> tuple[Snapshot | None, str]:
        snap = self.ring.get(step)
        if snap is not None and (snap.gen, snap.rank) == (self._base, self._base_rank()):
            return snap, "own memory"
        fetched = self._fetch(self.slot, step)
        return fetched, "agent memory"

    def _base_rank(self) -> int | None:
        """This slot's rank in the base generation: its own snapshots', or (a spare) those its agent
        holds for the slot; None when it holds none of that generation."""
        for snap in self.ring._items:
            if snap.gen == self._base:
                return snap.rank
        for meta in self._agent_metas():
            if (meta.node, meta.slot, meta.gen, meta.epoch) == (self.slot.node, self.slot.local_rank, self._base,
                                                                  self.epoch):
                return meta.rank
        return None

    def _offers(self) -> dict[tuple[int, int, int], list[int]]:
        """(generation, world, rank) -> the snapshot steps this rank can provide: its own (or, a spare,
        its agent's for its slot), and what its agent holds for the slots of lost nodes."""
        offers: dict[tuple[int, int, int], set[int]] = {}
        own = [(s.gen, s.world, s.rank, s.step) for s in self.ring._items]
        metas = self._agent_metas()
        if not own:
            own = [(m.gen, m.world_size, m.rank, m.step) for m in metas
                   if (m.node, m.slot) == (self.slot.node, self.slot.local_rank) and m.epoch == self.epoch]
        lost = self._lost_nodes()
        held = [(m.gen, m.world_size, m.rank, m.step) for m in metas if m.node in lost and m.epoch == self.epoch]
        for gen, world, rank, step in own + held:
            offers.setdefault((gen, world, rank), set()).add(step)
        return {key: sorted(steps) for key, steps in offers.items()}

    def _lost_nodes(self) -> set[str]:
        """Every node lost since generation 0 of the epoch: the base may be older than the last round."""
        plan = self.plan
        return self.round.lost_nodes() | (set(plan.gone) if plan is not None else set())

    def _agent_metas(self) -> list:
        if self.client is None:
            return []
        try:
            return self.client.snap_list()
        except MemStateError:
            return []

    def _fetch(self, slot: Slot, step: int) -> Snapshot | None:
        if self.client is None:
            return None
        try:
            got = self.client.snap_get(slot.node, slot.local_rank, step)
        except MemStateError as exc:
            self.events.emit("recovery.fetch_failed", slot=slot.key(), step=step, error=str(exc)[:300])
            self.fetch_errors.append(f"{slot.key()} step {step}: {type(exc).__name__}: {exc}"[:300])
            return None
        return from_bytes(*got) if got is not None else None

    def _exchange(self, step: int, expected: list[int], chosen: dict[int, int], targets: dict[str, Any]
                  ) -> dict[str, Any]:
        """Collective: fill this rank's fresh tensors (``targets``, in place) with the rows of the old
        ranks' snapshots of ``step`` its new shards cover, point to point; returns the tree to load
        (:mod:`elastic.worker.reshard`).  Each rank reads only the snapshots ``chosen`` gives it."""
        assert self.plan is not None
        held = self._held(step, chosen)
        layout = Layout.agree(_all_gather(describe(held, chosen.get(0) == self.rank)), expected)
        dests, sharded = self._destinations(layout, targets)
        pieces = plan(layout, sharded, chosen, expected, self.plan.world, self.rank)
        transfer(pieces, layout.leaves, self.rank, shard_sources(held), dests, group_device())
        return layout.tree(dests, sharded)

    def _destinations(self, layout: Layout, targets: dict[str, Any]) -> tuple[list[torch.Tensor], list[bool]]:
        """This rank's tensors the rows go to; if any rank's fresh state does not fit the snapshots,
        every rank raises here (nobody waits for rows that a failed rank would never send)."""
        assert self.plan is not None
        try:
            found, failed = layout.dests(targets, self.rank, self.plan.world), ""
        except SnapshotError as exc:
            found, failed = ([], []), f"rank {self.rank}: {exc}"
        _fail_together(bool(failed), failed)
        return found

    def _held(self, step: int, chosen: dict[int, int]) -> dict[int, Snapshot]:
        """The snapshots of ``step`` this rank provides: its own, and the lost slots' given to it."""
        held: dict[int, Snapshot] = {}
        base_rank = self._base_rank()
        if base_rank is not None and chosen.get(base_rank) == self.rank:
            own, _ = self._own(step)
            if own is not None:
                held[own.rank] = own
        for meta in self._agent_metas():
            if chosen.get(meta.rank) == self.rank and meta.rank not in held and meta.step == step \
                    and meta.gen == self._base and meta.node in self._lost_nodes() and meta.epoch == self.epoch:
                fetched = self._fetch(Slot(meta.node, meta.slot), step)
                if fetched is not None:
                    held[meta.rank] = fetched
        return held


def until_torn(latch: FaultLatch, gen: int, connect: Callable[[], T]) -> T:
    """``connect()`` (a c10d store client's connect), abandoned with PeerAborted as soon as
    generation ``gen`` is torn down.  Why: a client retries its connect in C until its timeout (the
    join timeout, 60 s), and nothing of the abort reaches it -- there is no socket to cut yet; when
    the generation's rank 0 left after publishing its store (a second fault), measured under a CPU
    hog, that wait outlived the whole recovery.  The abandoned attempt ends by its own timeout, in
    its thread, and its result is dropped."""
    done: dict[str, Any] = {}

    def attempt() -> None:
        try:
            done["value"] = connect()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=attempt, name=f"store-connect-g{gen}", daemon=True)
    thread.start()
    while thread.is_alive():
        latch.torn_event.wait(0.01)
        latch.check(gen)
        thread.join(0.0)
    if "error" in done:
        raise done["error"]
    return done["value"]


def abort_generation(keep_ports: set[int]) -> dict[str, Any]:
    """Tear this process's world down: every process group aborted together, as NCCL needs (one
    at a time can deadlock, pytorch#119797; ``destroy_process_group`` is the graceful path and
    blocks on a dead peer), then every TCP stream but those to ``keep_ports`` shut (gloo's abort
    leaves its pairs open; the c10d store is a plain socket under both backends)."""
    t0 = time.monotonic()
    figures: dict[str, Any] = {"groups_aborted": 0}
    if dist.is_initialized():
        figures["groups_aborted"] = len(dist.distributed_c10d._world.pg_names)
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # noqa: BLE001 - the sockets below are cut anyway
            figures.update(abort_error=True, error=f"{type(exc).__name__}: {exc}"[:300])
            _forget_world()
    figures["connections"] = sever_connections(keep_ports)
    figures["teardown_s"] = round(time.monotonic() - t0, 4)
    return figures


def forget_leftover_groups() -> int:
    """Process groups registered after their generation was torn down, aborted and forgotten; how
    many.  The fault monitor can abort a generation while the training thread is still forming it
    (``init_process_group`` done, the mesh's ``new_group`` calls under way): a group registered after
    the abort survives it, and ``_world.group_count`` runs on from it.  The next generation's groups
    then get other names, so other store keys, than its peers' -- and each side waits for the other's
    keys until the timeout.  (Soak seed 1: a worker kill, then its node's loss 0.39 s later while the
    in-place generation formed; the re-formed world waited 60 s, "wait timeout ... keys: /1//cpu//0/1"
    on one rank and "/0//cpu//0/0" on another, then fell back to disk.)"""
    c10d = dist.distributed_c10d
    groups = list(c10d._world.pg_map)
    if not groups and not c10d._world.group_count and not dist.is_initialized():
        return 0
    for pg in groups:
        with contextlib.suppress(Exception):  # a group of a torn-down world: its abort may fail too
            pg.abort()
    _forget_world()
    return len(groups)


_WORLD_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                 "pg_coalesce_state", "pg_flight_recorder_hooks")


def _forget_world() -> None:
    """What ``_abort_process_group`` does after its aborts, for when they raised: the default group
    unset and every table of groups cleared, so the next generation's ``init_process_group`` does not
    fail with "initialize the default process group twice".  Why it can raise: the aborts run inside
    a ``_coalescing_manager`` window, and a collective another thread issues on the default group in
    that window joins the window's op list; the window's end then runs it on the aborted group.  On
    gloo the GIL keeps that window shut (200 tries, never hit); ``ncclCommAbort`` may release it."""
    c10d = dist.distributed_c10d
    c10d._update_default_pg(None)
    for name in _WORLD_TABLES:
        table = getattr(c10d._world, name, None)
        if table is not None:
            table.clear()
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    c10d._world.group_count = 0


def _drain_device(device: torch.device | None, timeout_s: float) -> None:
    """After an abort, wait for the GPU's queued work (the aborted kernels exit) with a bound: the
    recovery's first CUDA call would otherwise block behind a kernel still spinning.  A device that
    does not drain in ``timeout_s`` fails the recovery (the process restarts)."""
    if device is None or device.type != "cuda":
        return
    done = threading.Event()

    def sync() -> None:
        torch.cuda.synchronize(device)
        done.set()

    threading.Thread(target=sync, name="device-drain", daemon=True).start()
    if not done.wait(timeout_s):
        raise RecoveryUnavailable(f"{device} did not finish its queued work within {timeout_s:g}s of the abort")


def sever_connections(keep_ports: set[int]) -> int:
    """Shut down every connected TCP stream of this process except those to ``keep_ports``.

    gloo has no working abort (``ProcessGroupGloo.abort()`` and ``shutdown()`` leave its pairs open,
    measured on torch 2.13): a peer blocked in a collective with this rank would wait out its whole
    timeout.  Shutting the sockets down makes every such peer fail at once with "Connection closed
    by peer", so the whole world reaches the next generation in well under a second.  The etcd and
    memory-store connections (``keep_ports``) stay.  Returns how many streams were shut.
    """
    shut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getpeername()[1] in keep_ports:
                    continue
                sock.shutdown(socket.SHUT_RDWR)  # acts on the connection, not only on this duplicate
                shut += 1
            except OSError:
                continue
    return shut


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree_base(gathered: list[dict[tuple[int, int, int], list[int]]]) -> tuple[int, int, int]:
    """(generation, world, step): the newest step of which some generation's every rank has a
    snapshot on offer; raises RecoveryUnavailable (naming the newest generation's gaps) when none."""
    bases: dict[tuple[int, int], dict[int, set[int]]] = {}
    for offers in gathered:
        for (gen, world, rank), steps in offers.items():
            bases.setdefault((gen, world), {}).setdefault(rank, set()).update(steps)
    found: list[tuple[int, int, int]] = []
    failure: RecoveryUnavailable | None = None
    for (gen, world), held in sorted(bases.items()):
        try:
            found.append((_agree(held, list(range(world))), gen, world))
        except RecoveryUnavailable as exc:
            failure = RecoveryUnavailable(f"generation {gen}: {exc}")
    if not found:
        raise failure or RecoveryUnavailable("no rank offers a snapshot")
    step, gen, world = max(found)
    return gen, world, step


def _of_generation(offers: dict[tuple[int, int, int], list[int]], gen: int) -> dict[int, list[int]]:
    """One rank's offers of generation ``gen``, by that generation's ranks."""
    return {rank: steps for (g, _, rank), steps in offers.items() if g == gen}


def _agree(held: dict[int, set[int]], expected: list[int]) -> int:
    """The newest step every expected old rank can provide; raises RecoveryUnavailable when none."""
    common: set[int] | None = None
    for rank in expected or sorted(held):
        steps = held.get(rank, set())
        common = steps if common is None else common & steps
    if not common:
        missing = [r for r in expected if not held.get(r)]
        raise RecoveryUnavailable(f"no snapshot step is held for every old rank (missing ranks {missing}, "
                                  f"held {dict(sorted((r, sorted(s)) for r, s in held.items()))})")
    return max(common)


def _fail_together(failed: bool, reason: str) -> None:
    """Collective: if any rank failed, every rank raises (nobody trains on a half-restored state)."""
    flag = torch.tensor([1 if failed else 0], device=group_device())  # NCCL serves only CUDA tensors
    dist.all_reduce(check_device(flag))
    if int(flag.item()):
        raise RecoveryUnavailable(reason if failed else "another rank could not restore its snapshot")


def wait_for_agent(agent_pid: int) -> bool:
    """True while the agent process lives (in-process mode workers outlive torchrun, not their agent)."""
    try:
        os.kill(agent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["EXIT_RECOVERY_FAILED", "InProcess", "RecoveryUnavailable", "SnapshotError", "StoreError",
           "is_peer_failure", "wait_for_agent"]
