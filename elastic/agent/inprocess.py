"""In-process recovery on the agent side: supervise workers past torchrun, replace dead ones warm.

torchrun starts the workers and its rendezvous forms the first world.  Once every local worker
has trained a step, the agent *retires* torchrun: it is the workers' subreaper, so it SIGKILLs
torchrun (which would otherwise stop every local worker when one dies) and the workers become its
children.  From then on:

* a dead local worker is replaced by the node's **warm spare** (torch and the trainer already
  imported), which takes the dead worker's slot and joins the next generation in-process; the
  other workers of every node never restart (:mod:`elastic.worker.inprocess`);
* the agent **joins each generation round for its node** (its live local slots in one record) and
  hands the plan to its workers over the local channel (the memory store's RoundBoard): one
  participant per node, one watch per node (:mod:`elastic.control.genround`);
* a **lost node** (its agent unreachable) is declared lost for the next generation by the round's
  coordinator (or, when the coordinator itself is gone, its deputy), after a direct probe of its
  agent (refused or timed out), so the survivors re-form without it at once instead of waiting out
  a lease;
* every snapshot a local worker pushes is replicated to the **buddy** node's agent (the next node
  in the ring of live nodes), so a lost node's state survives it.

When the in-process path cannot continue (no spare, a worker reporting that recovery failed, the
restart budget spent), the attempt ends as a failure and the agent falls back to the epoch path:
a full restart through a new torchrun, from the disk checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic.agent.attempt import AttemptResult, NodeSpec, Outcome, TorchrunAttempt
from elastic.agent.classify import FailureKind, stopping_failure
from elastic.agent.config import InProcessConfig
from elastic.agent.peerwatch import PeerWatch
from elastic.agent.roundnotes import RoundNotes
from elastic.agent.sparefork import ForkedSpare, SpareFactory
from elastic.checkpoint.memclient import ClientPool, MemStateClient
from elastic.checkpoint.memstate import Chunk, MemStateError, MemStateServer, RoundBoard, SnapMeta
from elastic.common.env import WorkerEnv
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NUMERICS, EXIT_RECOVERY_FAILED, EXIT_SCREEN_FAILED
from elastic.common.procs import UNKNOWN_EXIT, NotOurChild, reap, reap_quietly, terminate_tree
from elastic.control.generations import (
    GenerationFailed,
    Generations,
    Plan,
    plan_kept,
    plan_without,
)
from elastic.control.genround import NodeRound
from elastic.control.runstate import RunState
from elastic.control.store import StoreError


class BuddyLink:
    """Forwards this node's snapshots to the next live node of the ring (its buddy)."""

    def __init__(self, node_id: str, state: RunState, events: EventLog, timeout_s: float) -> None:
        self.node_id = node_id
        self.state = state
        self.events = events
        self.timeout_s = timeout_s
        self._buddy: tuple[str, str, str] | None = None  # (node, addr, token)
        self._checked = 0.0
        self._failed: dict[str, float] = {}  # node -> until when it is skipped (its store did not answer)
        self._link: tuple[str, ClientPool] | None = None  # the kept connections to the buddy's store
        self._stale = True

    def buddy(self) -> tuple[str, str, str] | None:
        """The ring successor, read from the node records only when the ring may have changed (a
        new attempt, a buddy gone) and at most once per 5 s while there is none: a read every 5 s
        by every agent was ~200 reads/s of every node record at 1,024 nodes."""
        now = time.monotonic()
        if (self._stale or self._buddy is None) and now - self._checked > (0.0 if self._stale else 5.0):
            self._checked = now
            try:
                nodes = {n: r for n, r in self.state.nodes().items() if self._failed.get(n, 0.0) < now}
                self._buddy, self._stale = ring_successor(self.node_id, nodes), False
            except StoreError:
                pass
        return self._buddy

    def invalidate(self) -> None:
        """The ring may have changed (a new attempt: nodes joined or left): read it again."""
        self._stale = True

    def skip(self, node: str) -> None:
        """``node`` is gone: the next node of the ring is the buddy (its record outlives it until its
        lease expires, so it is skipped for a while)."""
        self._failed[node] = time.monotonic() + 30.0
        self._buddy, self._stale = None, True

    def forward(self, meta: SnapMeta, *chunks: Chunk) -> None:
        buddy = self.buddy()
        if buddy is None:
            return
        node, addr, token = buddy
        try:
            self._pool(node, addr, token).replicate(meta, *chunks)
        except (MemStateError, OSError, ValueError) as exc:
            self.skip(node)  # the buddy may be gone: the next node of the ring takes over
            self.events.emit("agent.buddy_push_failed", buddy=node, step=meta.step, error=str(exc)[:300])

    def _pool(self, node: str, addr: str, token: str) -> ClientPool:
        """Kept connections to the current buddy, one per forwarding thread in flight (the workers'
        pushes travel side by side, not one at a time behind one connection's lock)."""
        link = self._link
        if link is None or link[0] != f"{node}@{addr}":
            if link is not None:
                link[1].close()
            link = self._link = (f"{node}@{addr}", ClientPool(addr, token, self.timeout_s))
        return link[1]


def memory_store(spec: NodeSpec, state: RunState, events: EventLog, memory_mib: int,
                 inprocess: InProcessConfig | None) -> MemStateServer | None:
    """The agent's memory store: its workers' newest checkpoint (fast path) and, in in-process mode,
    every step's snapshot, replicated to the buddy node (then reachable by peers at the node's address)."""
    if inprocess is None and not memory_mib:
        return None
    size = max(memory_mib, inprocess.snapshot_mib if inprocess else 0) << 20
    # Peers (buddy replication, probes) reach it at the node's address, the node's own workers on
    # loopback: on a cluster it listens on every interface (token-protected), locally on loopback.
    loopback = spec.local_addr.startswith("127.") or spec.local_addr == "localhost"
    server = MemStateServer(size, events, host="127.0.0.1" if inprocess is None or loopback else "0.0.0.0")
    if inprocess is not None:
        server.buddy_link = BuddyLink(spec.node_id, state, events, inprocess.probe_timeout_s * 5)
        server.replicate = server.buddy_link.forward
    return server


def peer_address(spec: NodeSpec, memstate: MemStateServer) -> dict[str, str]:
    """The node record's entry that tells peers where this node's snapshot store is."""
    return {"addr": f"{spec.local_addr}:{memstate.port}", "token": memstate.token}


def inprocess_env(memstate: MemStateServer | None, config: InProcessConfig | None) -> dict[str, str]:
    """The WorkerEnv fields of the memory store and in-process recovery (empty when off)."""
    return {"memstate_addr": memstate.addr if memstate else "", "memstate_token": memstate.token if memstate else "",
            "inprocess": f"{config.join_timeout_s:g}" if config else "",
            "snapshots": config.snapshots_env() if config else "",
            "rejoin_wait": f"{config.rejoin_wait_s:g}" if config else "",
            "agent_pid": str(os.getpid()) if config else ""}


def ring_successor(node_id: str, nodes: dict[str, dict]) -> tuple[str, str, str] | None:
    """The next node after ``node_id`` (by id, wrapping) that publishes a snapshot store."""
    ring = _successors(node_id, nodes)
    return ring[0] if ring else None


def _successors(node_id: str, nodes: dict[str, dict]) -> list[tuple[str, str, str]]:
    """Every other node that publishes a snapshot store, in ring order after ``node_id``."""
    stores = {n: r["memstate"] for n, r in nodes.items() if isinstance(r.get("memstate"), dict) and n != node_id}
    order = sorted(stores)
    ring = [n for n in order if n > node_id] + [n for n in order if n < node_id]
    return [(n, stores[n]["addr"], stores[n]["token"]) for n in ring]


_FEW = 8
"""Probing more nodes than this, a round reads every node record in one range instead of each one."""

# Exit codes a worker leaves with on purpose: the agent's usual path decides (classify, roll back, exclude).
_DELIBERATE = frozenset({EXIT_NUMERICS, EXIT_SCREEN_FAILED, EXIT_CONFIG, EXIT_CHECKPOINT})



def _exit_status(pid: int) -> int | None:
    try:
        return reap(pid)
    except NotOurChild:
        return UNKNOWN_EXIT


def _ended(rc: int | None) -> str:
    if rc == UNKNOWN_EXIT:
        return "ended with an unknown status (not this agent's child to wait for)"
    if rc == 0:
        return "exited 0 before reporting the run's final step"
    return f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exited {rc}"


def _death_kind(rc: int) -> FailureKind | None:
    if rc == EXIT_RECOVERY_FAILED:
        return FailureKind.RECOVERY_FAILED
    if rc in _DELIBERATE:
        return None  # classified from the worker's reports and error files
    return FailureKind.WORKER_SIGNAL if rc < 0 else FailureKind.WORKER_ERROR


WarmSpare = tuple["subprocess.Popen[bytes] | ForkedSpare", Path]
"""A started spare process and its log (its "ready" and "warm" lines)."""


def spawn_spare(entrypoint: list[str], env: dict[str, str], log_dir: Path) -> WarmSpare:
    """Start a warm spare (``elastic.worker.spare``): it imports torch and the trainer now and takes
    a slot (or a replay check) when a line on its stdin says so."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"spare-{int(time.time() * 1000)}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "elastic.worker.spare", *entrypoint], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path


class InProcessWorkers:
    """The node's workers once torchrun is retired (see the module docstring).

    A slot is a process and a rank, kept apart: whether a slot's process lives comes only from
    ``waitpid`` on this agent's own children (:func:`~elastic.common.procs.reap`), and whether its
    rank is done only from that process's report of the run's final step.  Before torchrun retires,
    step reports tell the agent its workers' pids; after, a slot changes hands only when the spare
    takes it, so a dead worker's late reports (drained after an agent stall) cannot re-point it.
    """

    def __init__(self, spec: NodeSpec, config: InProcessConfig, state: RunState, events: EventLog,
                 memstate: MemStateServer | None, epoch: int) -> None:
        self.spec, self.config, self.state, self.events = spec, config, state, events
        self.memstate = memstate
        self.epoch = epoch
        self.gens = Generations(state.store, state.keys, epoch)
        self.pids: dict[int, int] = {}  # local rank -> worker pid
        self.finished: set[int] = set()
        self.done: dict[int, int] = {}  # local rank -> the pid that reported the run's final step
        self.detached = False
        self.gen = 0
        self.step = 0  # the newest step a slot's worker reported (where a fault hits)
        self.spare: subprocess.Popen[bytes] | ForkedSpare | None = None
        self.factory: SpareFactory | None = None  # the node's spare zygote (elastic.agent.sparefork)
        self._zygote_off = ""  # why this attempt forks no spares
        self._asked: set[int] = set()  # spares handed a replay check (never swapped: _upgrade_spare)
        self.adopted: list[WarmSpare] = []
        self.spare_log = Path()
        self._ready_pid = 0  # the spare whose log said "ready"
        self.spare_deaths: list[float] = []  # when spares died unassigned (a node that keeps killing them)
        self.worker_env: WorkerEnv | None = None
        self.ranks: dict[int, int] = {}  # local slot -> its rank in generation self.gen
        self.ranks0: dict[int, int] = {}  # local slot -> its rank in generation 0 (the roster's)
        self.world0 = 0  # generation 0's world, from the workers' reports (0: not reported)
        self.needed_nodes = int(str(spec.nnodes).partition(":")[0])  # launch.nodes (MIN of MIN:MAX)
        self.plan: Plan | None = None  # the newest generation's plan (the next round builds on it)
        self.wanted = 0  # the newest generation a worker asked for (a fault report, a wait, a replacement)
        self._rounds: set[int] = set()  # generations this node joined (one round thread each)
        self._offered: dict[int, set[int]] = {}  # generation -> the slot processes this node joined it with
        self._in_place: set[int] = set()  # generations this node closes at once: its spare took a slot (plan_in_place)
        self._closed_with_fault: dict[int, Plan] = {}  # generations this node closed in its fault's push
        self.notes_heard = False  # the supervisor's signal watch hands this agent the round notes (heard_note)
        self._gone: dict[str, str] = {}  # nodes this agent found lost (its ring watch, its round's probes) -> why
        self._fault_steps: dict[int, int] = {}  # generation -> the step its fault hit (a worker's report)
        self.notes = RoundNotes(epoch)  # plans closed in place and store addresses, from the signal watch
        self.board = memstate.board if memstate is not None else RoundBoard()
        self.board.on_wait = lambda epoch, gen, name: self.want(gen) if epoch == self.epoch else None
        self._closed = threading.Event()  # set when the node's workers are done or stopped: rounds end
        self._attempt: TorchrunAttempt | None = None
        self.on_replace = lambda: None  # the supervisor's heartbeat monitor: the slot is re-forming
        self._hung: dict[int, str] = {}  # pid -> the hang verdict it was killed for
        self._pidfds: dict[int, int] = {}  # slot process pid -> its pidfd (exit_fds)
        self.peers = PeerWatch(spec.node_id, self._buddy, self._peer_gone, config.probe_timeout_s)
        self.drain_reports = lambda: None  # the supervisor: read the reports queued so far (observe())

    # -- reports --------------------------------------------------------------------------
    def observe(self, report: dict) -> None:
        kind, local, pid = report.get("type"), report.get("local_rank"), int(report.get("pid", 0))
        if kind == "step" and local is not None and int(local) not in self.finished:
            if not self.detached:
                self.pids[int(local)] = pid
                if report.get("rank") is not None and int(report.get("gen", 0)) == 0:
                    self.ranks[int(local)] = int(report["rank"])
                    self.world0 = int(report.get("world", 0) or 0)
            if self.detached and self.pids.get(int(local)) != pid:
                return  # a process that no longer holds the slot (its late reports)
            self.gen = max(self.gen, int(report.get("gen", 0)))
            self.step = max(self.step, int(report.get("step", 0)))
        elif kind == "done" and local is not None and self.pids.get(int(local)) == pid:
            self.done[int(local)] = pid
        elif kind == "fault":
            gen = int(report.get("gen", self.gen)) + 1
            if report.get("step") is not None:
                self._fault_steps.setdefault(gen, int(report["step"]))
            self.want(gen)
        elif kind == "recovered":
            self.gen = max(self.gen, int(report.get("gen", 0)))
            if self.detached and self.spare is None and self.config.spare:
                self._new_spare()

    def ready(self) -> bool:
        """Every local worker has trained a step: the world formed, torchrun may retire."""
        return not self.detached and len(self.pids) >= self.spec.nproc_per_node

    # -- retiring torchrun ------------------------------------------------------------------------
    def detach(self, attempt: TorchrunAttempt, worker_env: WorkerEnv) -> None:
        self._attempt = attempt
        self.worker_env = worker_env
        attempt.retire(set(self.pids.values()))
        self.detached = True
        if self.memstate is not None and self.memstate.buddy_link is not None:
            self.memstate.buddy_link.invalidate()  # this attempt's world: its ring
        self.register()
        self.events.emit("agent.torchrun_retired", workers={str(k): v for k, v in sorted(self.pids.items())},
                         gen=self.gen)
        if self.config.spare:
            self.start_spare()

    def register(self) -> None:
        """Generation 0 of this epoch: this node's slots and their ranks, in one record (the roster
        every round's coordinator starts from)."""
        self.ranks0 = dict(self.ranks)
        try:
            self.gens.register_node(self.spec.node_id, self.ranks)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="register_node", error=str(exc)[:300])

    def start_spare(self) -> None:
        """A new warm spare: forked from the node's zygote when it is ready (milliseconds), else
        started (it imports torch and the trainer: seconds); then the zygote, if there is none yet."""
        assert self._attempt is not None
        t0 = time.monotonic()
        forked = self._fork_spare()
        self.spare, self.spare_log = forked or spawn_spare(self.spec.entrypoint, self._attempt.env(), self._attempt.dir)
        self.events.emit("agent.spare_started", spare_pid=self.spare.pid, forked=forked is not None,
                         start_ms=round((time.monotonic() - t0) * 1000, 1))
        self._start_zygote()

    def _fork_spare(self) -> WarmSpare | None:
        factory = self.factory
        if factory is None or self._attempt is None:
            return None
        log_path = self._attempt.dir / f"spare-{int(time.time() * 1000)}.log"
        spare = factory.fork(self._attempt.env(), log_path)
        if spare is None and factory.state in ("gone", "unforkable"):
            self._drop_zygote(factory.state, factory.error or json.dumps(factory.hello))
        return (spare, log_path) if spare is not None else None  # type: ignore[return-value]

    def _start_zygote(self) -> None:
        if self.factory is not None or self._zygote_off or not self.config.spare_fork or self._attempt is None:
            return
        self.factory = SpareFactory(self.spec.entrypoint, self._attempt.env(), self._attempt.dir)
        self.events.emit("agent.spare_zygote_started", zygote_pid=self.factory.pid)

    def _watch_zygote(self) -> None:
        """Say once when the zygote is ready (a spare lost after that is replaced at once)."""
        factory = self.factory
        if factory is None:
            return
        ready = factory.ready()
        if factory.state in ("gone", "unforkable"):
            self._drop_zygote(factory.state, factory.error or json.dumps(factory.hello))
        if not ready:
            return
        if not factory.announced:
            factory.announced = True
            self.events.emit("agent.spare_zygote_ready", zygote_pid=factory.pid, import_s=factory.hello.get("import_s"))
        self._upgrade_spare()

    def _upgrade_spare(self) -> None:
        """A started spare still importing once the zygote is ready gives way to a forked one, warm
        at once.  Measured (10-minute soak, seed 1): a spare killed 1 s before its node's zygote was
        ready was replaced by a started one; the worker killed 2 s later waited for its import, and
        that recovery took 5.7 s against 0.8-0.9 s for the same pair with a forked spare.  Not a
        spare that was handed a replay check (the check would be lost with it)."""
        spare = self.spare
        if spare is None or isinstance(spare, ForkedSpare) or spare.pid in self._asked or self._spare_ready():
            return
        t0 = time.monotonic()
        forked = self._fork_spare()
        if forked is None:
            return
        self.spare, self.spare_log = forked
        spare.kill()
        spare.wait()
        self.events.emit("agent.spare_started", spare_pid=self.spare.pid, forked=True,
                         start_ms=round((time.monotonic() - t0) * 1000, 1), replaced_importing=spare.pid)

    def _drop_zygote(self, state: str, why: str) -> None:
        """This attempt's spares are started again (no second zygote: one that died or could not
        fork would only cost another import)."""
        if self.factory is None:
            return
        self.events.emit("agent.spare_zygote_failed", zygote_pid=self.factory.pid, state=state, error=why[:300])
        self.factory.close()
        self.factory, self._zygote_off = None, why or state

    def adopt_spares(self, spares: list[WarmSpare]) -> None:
        """Spares this process started before it knew its node (a standby's: elastic.agent.standby),
        warm by now; a node that rejoins gives its slots to them before it starts any."""
        self.adopted = list(spares)

    def _next_spare(self) -> None:
        if self.adopted:
            self.spare, self.spare_log = self.adopted.pop(0)
            self.events.emit("agent.spare_adopted", spare_pid=self.spare.pid)
        else:
            self.start_spare()

    def _new_spare(self) -> None:
        """Start a spare unless three died unassigned within a minute (something kills them: stop
        feeding it; a worker death then falls back to a full restart, saying there is no spare)."""
        now = time.monotonic()
        self.spare_deaths = [t for t in self.spare_deaths if now - t < 60.0]
        if len(self.spare_deaths) >= 3:
            self.events.emit("agent.spare_given_up", deaths=len(self.spare_deaths), within_s=60)
            return
        self.start_spare()

    def spare_state(self) -> str:
        """``none``, ``importing`` (started, its first line not written yet) or ``ready``."""
        self._check_spare()
        if self.spare is None or self.spare.stdin is None:
            return "none"
        return "ready" if self._spare_ready() else "importing"

    def ask_spare(self, request: dict) -> tuple[int | None, str]:
        """A line for the warm spare to act on while it waits (a replay check): (its pid, "") or
        (None, why it cannot take one)."""
        self._check_spare()
        spare = self.spare
        if spare is None or spare.stdin is None:
            return None, "no warm spare on this node"
        try:
            spare.stdin.write((json.dumps(request) + "\n").encode())
            spare.stdin.flush()
        except OSError as exc:
            return None, f"the spare's stdin: {exc}"  # it died: the next look reaps and replaces it
        self._asked.add(spare.pid)
        return spare.pid, ""

    def _spare_ready(self) -> bool:
        """The spare's log says it has imported everything (``{"spare": "warm", ...}``, its second
        line; until then its warm-up thread holds the import lock, and a first replay waited 2.8 s
        behind it while the next checks piled up); read until it does."""
        assert self.spare is not None
        if self._ready_pid == self.spare.pid:
            return True
        try:
            with open(self.spare_log, "rb") as fh:
                ready = any(b'"spare": "warm"' in fh.readline() for _ in range(3))
        except OSError:
            return False
        if ready:
            self._ready_pid = self.spare.pid
        return ready

    def spare_pid(self) -> int | None:
        return self.spare.pid if self.spare is not None else None

    def _check_spare(self) -> None:
        """A spare that died while waiting is noticed now (reaped) and replaced by a new one."""
        spare = self.spare
        if spare is None or spare.poll() is None:
            return
        self.spare = None
        self.spare_deaths.append(time.monotonic())
        self.events.emit("agent.spare_failed", spare_pid=spare.pid, rc=spare.returncode,
                         error=_ended(spare.returncode), assigned=False)
        self._new_spare()

    # -- supervision --------------------------------------------------------------------------------
    def poll(self, on_failure) -> AttemptResult | None:
        """Reap ended workers: the attempt's result when the node is done or cannot go on, else None.

        ``on_failure(result) -> bool`` decides (and accounts) whether a dead worker may be replaced.
        """
        self._check_spare()
        self._watch_zygote()
        for local, pid in sorted(self.pids.items()):
            if local in self.finished:
                continue
            rc = _exit_status(pid)
            if rc is None:
                continue
            if rc == 0 and self.done.get(local) != pid:
                # Its "done" went out before it exited, so it is queued by now if it was sent.
                self.drain_reports()
            if rc == 0 and self.done.get(local) == pid:
                self.finished.add(local)
                continue
            result = self._death(local, pid, rc, on_failure)
            if result is not None:
                return result
        if len(self.finished) >= self.spec.nproc_per_node:
            self._closed.set()
            self.peers.close()
            self._close_fds()
            self._close_zygote()
            self.events.emit("agent.workers_done", gen=self.gen)
            return AttemptResult(Outcome.SUCCEEDED, 0)
        self.join_wanted()
        self.peers.check()
        return None

    def exit_fds(self) -> list[int]:
        """A pidfd per live slot process once torchrun retired (readable when it exits), for the
        supervisor's wait; none where the kernel has no pidfd_open."""
        if not self.detached or not hasattr(os, "pidfd_open"):
            return []
        live = {pid for local, pid in self.pids.items() if local not in self.finished}
        for pid in set(self._pidfds) - live:
            os.close(self._pidfds.pop(pid))
        for pid in live - set(self._pidfds):
            with contextlib.suppress(OSError):
                self._pidfds[pid] = os.pidfd_open(pid)
        return list(self._pidfds.values())

    def _close_fds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def _death(self, local: int, pid: int, rc: int, on_failure) -> AttemptResult | None:
        detail = f"worker local rank {local} (pid {pid}) " + _ended(rc)
        # A config error or failing saves: a spare would fail the same way (the worker said why in its log).
        stopping = stopping_failure(rc, self._attempt.log_text() if self._attempt else "")
        kind, detail = stopping if stopping is not None else (_death_kind(rc), detail)
        if pid in self._hung:  # killed here after a hang verdict: the hang is the failure
            kind, detail = FailureKind.HANG, f"{self._hung[pid]} (killed, its slot replaced in-process)"
        broken = self._broken_gen(pid)
        result = AttemptResult(Outcome.FAILED, rc, kind=kind, detail=detail, gen=broken + 1, step=self.step,
                               attempt_dir=self._attempt.dir if self._attempt else None)
        if stopping is not None or rc in _DELIBERATE:  # the worker chose to leave: the agent's usual path decides
            return result
        # The survivors first, before any policy or etcd record: under NCCL nothing of theirs
        # raises, they wait in the dead worker's collective until told (elastic.worker.faultwatch),
        # whether the spare takes the slot or the run falls back to a restart.
        held = self.plan.gen if self.plan is not None else 0
        self.push_fault(self.spec.node_id, "hang" if pid in self._hung else "worker_died", detail, gen=broken,
                        in_place=self.spare is not None and held == broken)
        reason = self._no_replacement(result, on_failure)
        if reason is None and self._replace(local, detail, broken + 1):
            return None
        self.events.emit("agent.inprocess_fallback", local_rank=local, rc=rc, detail=detail,
                         reason=reason or "the warm spare failed")
        return result

    def _broken_gen(self, pid: int) -> int:
        """The newest generation a dead slot process belonged to: the node's current one, or a newer
        round this node joined with it in its slots -- a worker can die after its node joined the
        next round for it (its peers' errors arrive before its exit can be reaped: the sockets close
        first), and that round's plan then counts a rank that will never come (measured under a CPU
        hog: the survivors waited out the new store's 60 s timeout, then the run fell back to disk)."""
        return max([self.gen, *(gen for gen, pids in self._offered.items() if pid in pids)])

    def _no_replacement(self, result: AttemptResult, on_failure) -> str | None:
        """Why the dead worker's slot cannot go to the spare (None: it may)."""
        if result.kind == FailureKind.RECOVERY_FAILED:
            return "recovery failed"
        self._check_spare()  # a spare that died unnoticed is no spare
        if self.spare is None:
            return "no warm spare"
        return None if on_failure(result) else "failure policy"

    def _replace(self, local: int, detail: str, gen: int) -> bool:
        """Hand the slot to the spare, to join generation ``gen``; False when the spare cannot take it
        (the attempt falls back: a replacement that failed never passes for a recovery)."""
        if not self._assign(local, gen):
            return False
        self.replaced_in_place(gen)
        self.on_replace()
        self.events.emit("agent.inprocess_replace", local_rank=local, spare_pid=self.pids[local], gen=gen,
                         detail=detail)
        return True

    def _assign(self, local: int, gen: int, screen: str = "") -> bool:
        """The spare takes slot ``local`` and joins generation ``gen``; False (a new spare started)
        when it cannot take it.  ``screen``: the node screen's spec, for the first slot of a node
        that rejoins (its first step waits for the verdict, as a first worker's does)."""
        assert self.spare is not None and self.worker_env is not None and self._attempt is not None
        spare, self.spare = self.spare, None
        # LOCAL_WORLD_SIZE as torchrun gives its workers: the snapshot budget and replay verification's
        # roles divide by it (a spare without it took itself for its node's only rank).
        env = {**self.worker_env.to_env(), "ELASTIC_JOIN_GEN": str(gen), "LOCAL_RANK": str(local),
               "ELASTIC_SCREEN": screen, "LOCAL_WORLD_SIZE": str(self.spec.nproc_per_node),
               "TORCHELASTIC_ERROR_FILE": str(self._attempt.dir / f"error-spare-{spare.pid}.json")}
        try:
            assert spare.stdin is not None
            spare.stdin.write((json.dumps({"slot": local, "env": env}) + "\n").encode())
            spare.stdin.flush()
        except OSError as exc:
            spare.kill()
            self.events.emit("agent.spare_failed", spare_pid=spare.pid, rc=spare.wait(), error=str(exc),
                             assigned=True)
            self._new_spare()
            return False
        self.pids[local] = spare.pid
        return True

    # -- a node that comes back -------------------------------------------------------------------
    def rejoin(self, attempt: TorchrunAttempt, worker_env: WorkerEnv, plan: Plan, ranks0: dict[int, int],
               screen: str = "") -> bool:
        """This node's agent came back (restarted with the same node id) to a fixed-size run whose
        newest generation ``plan`` formed without it, its survivors holding the next round open for
        it (``agent.inprocess.rejoin_wait_s``).  No torchrun: the node's snapshots come back from the
        buddy node that holds their copies, a fresh process per slot joins the next generation with
        the slot's generation-0 rank, and the round re-admits the node (the survivors keep theirs).
        False when a slot's process could not be started (the agent then starts torchrun as usual)."""
        self._attempt, self.worker_env = attempt, worker_env
        self.ranks0, self.ranks, self.plan, self.gen = dict(ranks0), {}, plan, plan.gen
        self.detached = True
        if self.memstate is not None and self.memstate.buddy_link is not None:
            self.memstate.buddy_link.invalidate()
        for local in sorted(ranks0):
            self._next_spare()
            if not self._assign(local, plan.gen + 1, screen if local == min(ranks0) else ""):
                return False
        # While the slots' processes import (seconds): no worker can restore before this node joins
        # the round, which it does only once this returns.
        self._fetch_own_snapshots()
        self.want(plan.gen + 1)
        self.events.emit("agent.rejoin", gen=plan.gen + 1, slots={str(k): v for k, v in sorted(ranks0.items())},
                         workers={str(k): v for k, v in sorted(self.pids.items())})
        return True

    def _fetch_own_snapshots(self) -> None:
        """This node's snapshots of the epoch, copied back from the first of its ring successors that
        holds them (its buddy while it was away: each step's push was replicated there before it
        completed), into this agent's store, where its workers' restore reads them."""
        t0 = time.monotonic()
        try:
            nodes = self.state.nodes()
        except StoreError as exc:
            self.events.emit("agent.rejoin_snapshots", copied=0, error=f"node records: {exc}"[:300])
            return
        for holder, addr, token in _successors(self.spec.node_id, nodes)[:3]:
            try:
                copied = self._copy_from(addr, token)
            except (MemStateError, OSError, ValueError) as exc:
                self.events.emit("agent.rejoin_snapshots", holder=holder, copied=0, error=str(exc)[:300])
                continue
            if copied:
                self.events.emit("agent.rejoin_snapshots", holder=holder, copied=len(copied),
                                 steps=sorted({m.step for m in copied}), bytes=sum(m.nbytes for m in copied),
                                 copy_s=round(time.monotonic() - t0, 4))
                return
        self.events.emit("agent.rejoin_snapshots", copied=0, error="no ring successor holds this node's snapshots")

    def _copy_from(self, addr: str, token: str) -> list[SnapMeta]:
        assert self.memstate is not None
        client = MemStateClient(addr, token, self.config.probe_timeout_s * 5, peer=True)
        mine = [m for m in client.snap_list() if m.node == self.spec.node_id and m.epoch == self.epoch]
        copied = []
        for meta in mine:
            got = client.snap_get(meta.node, meta.slot, meta.step)
            if got is not None:
                self.memstate.snapshots.put(got[0], got[1])
                copied.append(got[0])
        return copied

    # -- generation rounds ----------------------------------------------------------------------
    def replaced_in_place(self, gen: int) -> None:
        """A spare holds a dead worker's slot: generation ``gen`` is the last one with every rank
        kept, and this node writes its plan as its round starts (:meth:`_close_in_place`)."""
        self._in_place.add(gen)
        self.want(gen)

    def want(self, gen: int) -> None:
        """A worker needs generation ``gen`` (its fault report, its wait for the plan, a replacement)."""
        self.wanted = max(self.wanted, gen)

    def join_wanted(self) -> None:
        """Join the round a worker needs, once every local slot has a live process (the supervisor
        loop calls this after reaping, so a dead worker's slot is the spare's by then)."""
        gen = self.gen + 1
        if not self.detached or self.wanted < gen or gen in self._rounds or self._closed.is_set():
            return
        self._rounds.add(gen)
        slots = {local: self.ranks.get(local, -1) for local in sorted(self.pids) if local not in self.finished}
        self._offered[gen] = {self.pids[local] for local in slots}
        threading.Thread(target=self._round, args=(gen, slots), name=f"round-g{gen}", daemon=True).start()

    def _round(self, gen: int, slots: dict[int, int]) -> None:
        """This node's part in round ``gen``: the plan, then the new c10d store's address, each handed
        to the workers as soon as it is known; a round that fails fails the workers' wait too.  A
        plan another node closed in place comes from the round note (:mod:`elastic.agent.roundnotes`):
        no join, no watch; without it, the node joins the round."""
        closed = self._closed_with_fault.pop(gen, None)
        noted = closed or self._noted_plan(gen)
        round_ = self._node_round(gen, slots) if noted is None else None
        try:
            if round_ is not None:
                self._close_in_place(gen)
            plan = round_.run() if round_ is not None else self._take_noted(noted)  # type: ignore[arg-type]
            self._adopt(plan, slots)
            self._check_counts(plan)
            self.board.post(self.epoch, gen, "plan", {"plan": json.loads(plan.to_json()),
                                                      "slots": {str(local): old for local, old in slots.items()},
                                                      "slots0": {str(local): self.ranks0.get(local, -1)
                                                                 for local in slots}})
            self.events.emit("agent.round_plan", gen=gen, world=plan.world, nodes=plan.nodes, lost=list(plan.lost),
                             by=plan.by, role=(round_.role or "member") if round_ is not None else
                             "closed_with_fault" if closed is not None else "noted")
            timeout = self.config.join_timeout_s
            self.board.post(self.epoch, gen, "store", round_.wait_store(timeout) if round_ is not None else
                            self.notes.store(gen, timeout, self._closed.is_set, lambda: self.gens.store_at(gen)))
        except (GenerationFailed, StoreError) as exc:
            self.events.emit("agent.round_failed", gen=gen, error=str(exc)[:300])
            self.board.fail(self.epoch, gen, ("plan", "store"), str(exc))
        finally:
            if round_ is not None:
                round_.close()

    def _node_round(self, gen: int, slots: dict[int, int]) -> NodeRound:
        notice = self.state.notice(self.epoch, self._fault_steps.get(gen), self.spec.node_id, "peer_lost", gen=gen - 1)
        return NodeRound(self.gens, self.spec.node_id, gen, slots, self.plan, self._prober(gen),
                         self.config.join_timeout_s, on_lost=lambda node, why: self._name_lost(node, gen, why),
                         emit=self.events.emit, stopped=self._closed.is_set, notice=notice,
                         min_nodes=self.needed_nodes, rejoin_wait_s=self.config.rejoin_wait_s,
                         notes=self.notes if self.notes_heard else None,
                         note_watch_after_s=self.config.member_note_wait_s)

    def _noted_plan(self, gen: int) -> Plan | None:
        """Generation ``gen``'s plan from the round note, when a pushed fault said another node closes
        it in place (waiting up to ``in_place_wait_s`` for it), or when it is noted already.  Never
        for a round this node closes itself, nor one that does not follow the plan this node holds."""
        held = self.plan.gen if self.plan is not None else 0
        if gen in self._in_place or held != gen - 1:
            return None
        t0 = time.monotonic()
        wait_s = self.config.in_place_wait_s if self.notes.expects(gen) else 0.0
        plan = self.notes.plan(gen, wait_s, self._closed.is_set)
        if plan is None and wait_s:
            self.events.emit("round.note_missed", gen=gen, waited_s=round(time.monotonic() - t0, 3))
        elif plan is not None:
            self.events.emit("round.noted", gen=gen, by=plan.by, wait_s=round(time.monotonic() - t0, 4))
        return plan

    def _take_noted(self, plan: Plan) -> Plan:
        """A noted plan, checked as a join's read-back is (:meth:`NodeRound._check_self`)."""
        node = self.spec.node_id
        if node in plan.lost or node in plan.gone:
            raise GenerationFailed(f"generation {plan.gen} formed without this node ({node})")
        return plan

    def _close_in_place(self, gen: int) -> None:
        """Write generation ``gen``'s plan now when this node's spare took a slot and ``gen`` follows
        the plan it holds (:func:`~elastic.control.generations.plan_in_place`): the round then ends
        as each node's join reads the plan back, with no coordinator waiting for every join (one
        read of the roster and one compare-and-swap, by this node alone).  A round another node
        closed first keeps its plan; a failure here leaves the round to run as usual."""
        held = self.plan.gen if self.plan is not None else 0
        if gen not in self._in_place or held != gen - 1:
            return
        t0 = time.monotonic()
        try:
            plan = self.gens.close(self._kept_plan(gen), note=True)
        except (GenerationFailed, StoreError) as exc:
            self.events.emit("round.in_place_failed", gen=gen, error=str(exc)[:300])
            return
        self.events.emit("round.in_place", gen=gen, by=plan.by, world=plan.world, nodes=plan.nodes,
                         close_s=round(time.monotonic() - t0, 4))

    def _plan0(self) -> Plan:
        """Generation 0 as a plan: its world from the workers' reports and the roster's node count,
        or (workers that never reported their world) both from the roster, one read of N records."""
        if self.world0 > 0:
            return Plan(0, self.world0, nodes=self.gens.roster_nodes())
        roster = self.gens.roster()
        return Plan(0, sum(len(slots) for slots in roster.values()), nodes=len(roster))

    def _kept_plan(self, gen: int) -> Plan:
        """Generation ``gen`` with every node and rank of ``gen - 1`` kept, without reading the roster
        (:func:`~elastic.control.generations.plan_kept`): from the plan this node holds, or for
        generation 1 from generation 0 (:meth:`_plan0`)."""
        return plan_kept(gen, self.plan or self._plan0(), self.spec.node_id)

    def _check_counts(self, plan: Plan) -> None:
        """A plan that still counts a node this agent found lost breaks as it forms (that node's ranks
        never come): push it as a fault of the plan's generation at once, so the next round, a full
        one, leaves the node out.  It happens when a worker's death and a node's loss meet: the
        in-place plan, or a round closed before the loss was seen, keeps every node, and the
        loss's own fault was of the older generation (one per generation: it went unheard)."""
        counted = sorted(set(self._gone) - set(plan.gone))
        if counted:
            node = counted[0]
            self.push_fault(node, "node_lost", f"generation {plan.gen} counts lost node {node}: {self._gone[node]}"[:300],
                            gen=plan.gen)

    def _adopt(self, plan: Plan, slots: dict[int, int]) -> None:
        """This node's slots' ranks in the new generation (the plan is a delta: applied locally)."""
        self.plan = plan
        self.gen = max(self.gen, plan.gen)  # a fault right after this plan is a fault of plan.gen
        self.ranks = {local: rank for local in slots if (rank := plan.rank_of0(self.ranks0.get(local, -1))) is not None}
        for node in plan.returned:
            self._gone.pop(node, None)  # back in the world: no longer a loss to push (_check_counts)

    def _prober(self, gen: int) -> Callable[[list[str]], dict[str, str]]:
        """The probe of round ``gen``: why each node's agent is gone, or "" while it may only be slow
        or left cleanly (a node that finished; its closed store is no loss).  Records are read once a
        round, and only by the agents that probe: the coordinator reads every node's (one range each
        of node records and roster), its deputy and reserves the few they probe (one transaction)."""
        strikes: dict[str, int] = {}
        records: dict[str, tuple[dict | None, dict | None]] = {}  # node -> (node record, roster entry)

        def probe(nodes: list[str]) -> dict[str, str]:
            missing = [n for n in nodes if n not in records]
            if len(missing) > _FEW:
                found, roster = self.state.nodes(), self.state.members()
                records.update({n: (found.get(n), roster.get(n)) for n in {*found, *roster, *missing}})
            elif missing:
                records.update(self.state.node_records(missing))
            return {node: self._verdict(node, records[node], strikes) for node in nodes}

        return probe

    def _verdict(self, node: str, records: tuple[dict | None, dict | None], strikes: dict[str, int]) -> str:
        record, member = records
        if (member or {}).get("state", "joined") not in ("joined", "lost"):
            return ""
        return self._unreachable(node, record, strikes)

    def _unreachable(self, node: str, record: dict | None, strikes: dict[str, int]) -> str:
        """Why ``node``'s agent is gone, or "" while it may only be slow.  Its record gone (lease
        expired) or its store refusing connections (the process is gone) is final; a connect that
        times out (a loaded host, a full accept backlog) is a strike, and only three in a row make
        a loss: one slow accept once cost a 4-node run its world size and its bitwise result."""
        store = (record or {}).get("memstate")
        if not isinstance(store, dict):
            return "its agent's record is gone (lease expired)"
        host, _, port = str(store.get("addr", "")).rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.config.probe_timeout_s):
                strikes.pop(node, None)
                return ""
        except (ConnectionRefusedError, ValueError) as exc:
            return f"its agent refuses connections at {host}:{port} ({type(exc).__name__})"
        except OSError as exc:
            strikes[node] = strikes.get(node, 0) + 1
            if strikes[node] < 3:
                return ""
            return f"its agent did not answer at {host}:{port} {strikes[node]} times ({type(exc).__name__})"

    def _name_lost(self, node: str, gen: int, reason: str) -> None:
        """The run's one record of this loss, written by the agent that declared it (the leader's
        later look finds it and writes nothing): named even when the run ends within a lease TTL."""
        self.events.emit("agent.node_lost", node=node, gen=gen, reason=reason)
        self._gone[node] = reason
        step = self._fault_steps.get(gen)
        detail = f"{node} lost in generation {gen}: {reason}"
        try:
            if self.state.record_fault(self.epoch, node, {"kind": "node_lost", "step": step, "detail": detail,
                                                          "by": self.spec.node_id, "gen": gen}):
                self.events.emit("run.fault", epoch=self.epoch, node=node, failure_kind="node_lost", step=step,
                                 detail=detail, by=self.spec.node_id, gen=gen)
                self.state.record_failure(node, "node_lost", self.epoch)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="record_fault", error=str(exc)[:300])

    # -- pushed faults ------------------------------------------------------------------------------
    def push_fault(self, node: str, kind: str, reason: str, gen: int | None = None, in_place: bool = False) -> None:
        """Tell every worker of the run that generation ``gen`` (default ``self.gen``) broke, and so
        every older one: this node's through the board at once, every other agent through one etcd
        put its signal watch delivers.  A fault of this generation already posted (pushed by another
        agent) is not put again.  ``in_place``: this node's spare takes the slot, and this node will
        close the next generation in place (the others wait for its round note instead of joining)."""
        gen = self.gen if gen is None else gen
        record = {"epoch": self.epoch, "gen": gen, "node": node, "kind": kind, "reason": reason[:300],
                  "by": self.spec.node_id, "ts": time.time(), "in_place": in_place}
        self.want(gen + 1)  # this node's workers need the next generation: join it for them
        if not self.board.post_fault(self.epoch, record):
            return
        lost = node if kind == "node_lost" and not in_place else None
        try:
            if not ((in_place or lost) and self._push_closed(record, gen + 1, lost)):
                self.state.push_fault(record)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="push_fault", error=str(exc)[:300])
        self.events.emit("agent.fault_pushed", gen=gen, node=node, fault_kind=kind, reason=reason[:300],
                         put_s=round(time.time() - record["ts"], 4))

    def _push_closed(self, record: dict, gen: int, lost: str | None = None) -> bool:
        """Push the fault and close generation ``gen`` in one transaction: in place (this node's spare
        took the slot), or without the ``lost`` node.  The plan, its round note and the fault reach
        every agent in one event batch of its signal watch (the record says ``closed``), and this
        node takes the plan with no join (False: no plan could be made; push the fault alone, and
        the round runs as before).

        Why not the fault first and the close from this node's round, as before: with 1,024
        simulated nodes on 2 cores, every agent hearing the fault kept this node's round thread off
        the CPU, and the note went out 0.3-0.9 s after the fault, a second wave of wake-ups after
        the first.  The plan is written before the spare takes the slot (the survivors hear the
        fault first, as before): should the spare then fail, the attempt falls back to a restart,
        a new epoch whose plans start afresh."""
        try:
            plan = self._kept_plan(gen) if lost is None else self._plan_without(gen, lost)
        except (GenerationFailed, StoreError):
            return False
        if plan is None:
            return False
        record["closed"] = True  # the others wait for the plan's note instead of joining (RoundNotes)
        t0 = time.monotonic()
        # The lost node is declared lost for the generation with its plan, as a coordinator's round does.
        declared = [self.gens.lost_put(gen, lost, self.spec.node_id, str(record["reason"]))] if lost else []
        closed = self.gens.close(plan, note=True, also=[self.state.fault_put(record)], with_plan=declared)
        if closed is plan:  # else another node closed it first: this node's round joins as before
            self._closed_with_fault[gen] = closed
            if lost is not None:
                self._name_lost(lost, gen, str(record["reason"]))
            self.events.emit("round.in_place" if lost is None else "round.closed_without", gen=gen, by=plan.by,
                             world=plan.world, nodes=plan.nodes, lost=list(plan.lost),
                             close_s=round(time.monotonic() - t0, 4), with_fault=True)
        return True

    def _plan_without(self, gen: int, lost: str) -> Plan | None:
        """Generation ``gen`` without the ``lost`` node, pushed with its loss
        (:func:`~elastic.control.generations.plan_without`: the plan held and the lost node's roster
        record, one read), or None where the full round must decide: a generation this node does not
        hold broke (a round it joined already), or a fixed-size run's round that waits for an
        earlier lost node to come back (``rejoin_wait_s``: the coordinator holds it)."""
        held = self.plan.gen if self.plan is not None else 0
        if held != gen - 1 or lost == self.spec.node_id:
            return None
        previous = self.plan or self._plan0()
        if previous.gone and previous.nodes - 1 < self.needed_nodes and self.config.rejoin_wait_s > 0:
            return None
        slots0 = self.gens.member(lost)
        return plan_without(gen, previous, lost, slots0, self.spec.node_id) if slots0 else None

    def heard_fault(self, record: dict) -> None:
        """Another agent's pushed fault (from the signal watch's thread): to this node's workers."""
        if int(record.get("epoch", -1)) != self.epoch or not self.detached:
            return
        self.notes.heard_fault(record)
        if int(record.get("gen", -1)) >= self.gen:
            # Every worker of this node needs the next generation now: join it for them at once
            # (a cold spare on this node would ask only once it has imported, after the others'
            # round had waited out its timeout).
            self.want(int(record["gen"]) + 1)
        if self.board.post_fault(self.epoch, record):
            self.events.emit("agent.fault_heard", gen=record.get("gen"), node=record.get("node"),
                             fault_kind=record.get("kind"), by=record.get("by"),
                             since_push_s=round(time.time() - float(record.get("ts", time.time())), 4))

    def heard_note(self, note: dict) -> None:
        """A round note (from the signal watch's thread): a plan closed in place, a store's address."""
        self.notes.heard(note)

    def kill_hung(self, pid: int, verdict: str) -> bool:
        """A hang verdict named this slot's process: kill it (SIGKILL ends a stopped process too);
        its death is then handled as any other (pushed, replaced by the spare).  False when the pid
        is not one of this agent's workers."""
        if pid not in self.pids.values() or pid in self._hung:
            return False
        self._hung[pid] = verdict
        self.events.emit("agent.hang_kill", worker_pid=pid, verdict=verdict)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def _buddy(self) -> tuple[str, str, str] | None:
        link = self.memstate.buddy_link if self.memstate is not None else None
        return link.buddy() if link is not None else None

    def _peer_gone(self, node: str, addr: str, reason: str) -> None:
        """The ring successor's hold broke: if its agent is really gone (record gone, or refusing:
        the round's own verdict), push the fault and join the next round, whose coordinator probes
        whoever does not join.  A node that left the roster cleanly (it finished) is no loss."""
        if self._closed.is_set():
            return
        try:
            verdict = self._verdict(node, self.state.node_records([node])[node], {})
        except StoreError as exc:
            self.events.emit("agent.store_error", op="peer_gone", error=str(exc)[:300])
            return
        if not verdict:
            return  # it answers, or finished: the watch re-holds the ring's successor
        if self.memstate is not None and self.memstate.buddy_link is not None:
            self.memstate.buddy_link.skip(node)
        self._gone[node] = verdict
        if self.plan is not None and node in self.plan.gone and self.plan.gen >= max(self._rounds, default=0):
            return  # the newest generation was formed without it: its loss is counted already
        # The newest round this node joined may count it (it died after joining): that generation
        # broke, not only the one it trained in.  A fault of an older one is posted already (the
        # board keeps one per generation), so a second loss in a round would go unheard: measured,
        # two adjacent nodes killed 0.2 s apart under a CPU hog, the round formed with the second,
        # and only its lease's expiry (11 s later) ended the wait.
        self.push_fault(node, "node_lost", f"node {node}: {reason}; {verdict}",
                        gen=max(self.gen, max(self._rounds, default=0)))

    def _close_zygote(self) -> None:
        if self.factory is not None:
            self.factory.close()
            self.factory = None

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self, grace_s: float) -> list[int]:
        pids = [pid for local, pid in self.pids.items() if local not in self.finished]
        self._close_zygote()
        if self.spare is not None:
            pids.append(self.spare.pid)
            self.spare = None
        self._closed.set()
        self.peers.close()
        self._close_fds()
        terminate_tree(None, pids, grace_s)
        for pid in pids:
            reap_quietly(pid)
        return sorted(pids)


