"""In-process recovery on the agent side: supervise workers past torchrun, replace dead ones warm.

torchrun starts the workers and its rendezvous forms the first world.  Once every local worker
has trained a step, the agent *retires* torchrun: it is the workers' subreaper, so it SIGKILLs
torchrun (which would otherwise stop every local worker when one dies) and the workers become its
children.  From then on:

* a dead local worker is replaced by the node's **warm spare** (torch and the trainer already
  imported), which takes the dead worker's slot and joins the next generation in-process; the
  other workers of every node never restart (:mod:`elastic.worker.inprocess`);
* a **lost node** (its agent unreachable) is declared lost for the next generation by the agents
  whose workers are re-forming, after a direct probe of its agent (refused or timed out), so the
  survivors re-form without it at once instead of waiting out a lease;
* every snapshot a local worker pushes is replicated to the **buddy** node's agent (the next node
  in the ring of live nodes), so a lost node's state survives it.

When the in-process path cannot continue (no spare, a worker reporting that recovery failed, the
restart budget spent), the attempt ends as a failure and the agent falls back to the epoch path:
a full restart through a new torchrun, from the disk checkpoint.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from elastic.agent.attempt import AttemptResult, NodeSpec, Outcome, TorchrunAttempt
from elastic.agent.classify import FailureKind, stopping_failure
from elastic.agent.config import InProcessConfig
from elastic.checkpoint.memclient import MemStateClient
from elastic.checkpoint.memstate import MemStateError, MemStateServer, SnapMeta
from elastic.common.env import WorkerEnv
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NUMERICS, EXIT_RECOVERY_FAILED, EXIT_SCREEN_FAILED
from elastic.common.procs import reap, terminate_tree
from elastic.control.generations import Generations
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
        self._link: tuple[str, MemStateClient] | None = None  # the kept connection to the buddy's store

    def buddy(self) -> tuple[str, str, str] | None:
        if self._buddy is None or time.monotonic() - self._checked > 5.0:
            self._checked = time.monotonic()
            now = time.monotonic()
            try:
                nodes = {n: r for n, r in self.state.nodes().items() if self._failed.get(n, 0.0) < now}
                self._buddy = ring_successor(self.node_id, nodes)
            except StoreError:
                pass
        return self._buddy

    def forward(self, meta: SnapMeta, data: bytearray) -> None:
        buddy = self.buddy()
        if buddy is None:
            return
        node, addr, token = buddy
        try:
            self._client(node, addr, token).snap_put(meta, data, replica=True)
        except (MemStateError, OSError, ValueError) as exc:
            # The buddy may be gone: the next node of the ring takes over (its record may outlive it
            # until its lease expires, so it is skipped for a while).
            self._failed[node] = time.monotonic() + 30.0
            self._buddy = None
            self.events.emit("agent.buddy_push_failed", buddy=node, step=meta.step, error=str(exc)[:300])

    def _client(self, node: str, addr: str, token: str) -> MemStateClient:
        """One kept connection to the current buddy, shared by this store's forwarding threads."""
        link = self._link
        if link is None or link[0] != f"{node}@{addr}":
            if link is not None:
                link[1].close()
            link = self._link = (f"{node}@{addr}", MemStateClient(addr, token, self.timeout_s, peer=True,
                                                                   keep_alive=True))
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
        server.replicate = BuddyLink(spec.node_id, state, events, inprocess.probe_timeout_s * 5).forward
    return server


def peer_address(spec: NodeSpec, memstate: MemStateServer) -> dict[str, str]:
    """The node record's entry that tells peers where this node's snapshot store is."""
    return {"addr": f"{spec.local_addr}:{memstate.port}", "token": memstate.token}


def inprocess_env(memstate: MemStateServer | None, config: InProcessConfig | None) -> dict[str, str]:
    """The WorkerEnv fields of the memory store and in-process recovery (empty when off)."""
    return {"memstate_addr": memstate.addr if memstate else "", "memstate_token": memstate.token if memstate else "",
            "inprocess": f"{config.join_timeout_s:g}" if config else "",
            "snapshots": config.snapshots_env() if config else "",
            "agent_pid": str(os.getpid()) if config else ""}


def ring_successor(node_id: str, nodes: dict[str, dict]) -> tuple[str, str, str] | None:
    """The next node after ``node_id`` (by id, wrapping) that publishes a snapshot store."""
    stores = {n: r["memstate"] for n, r in nodes.items() if isinstance(r.get("memstate"), dict) and n != node_id}
    if not stores:
        return None
    order = sorted(stores)
    after = [n for n in order if n > node_id]
    node = (after or order)[0]
    return node, stores[node]["addr"], stores[node]["token"]


# Exit codes a worker leaves with on purpose: the agent's usual path decides (classify, roll back, exclude).
_DELIBERATE = frozenset({EXIT_NUMERICS, EXIT_SCREEN_FAILED, EXIT_CONFIG, EXIT_CHECKPOINT})


def _death_kind(rc: int) -> FailureKind | None:
    if rc == EXIT_RECOVERY_FAILED:
        return FailureKind.RECOVERY_FAILED
    if rc in _DELIBERATE:
        return None  # classified from the worker's reports and error files
    return FailureKind.WORKER_SIGNAL if rc < 0 else FailureKind.WORKER_ERROR


class InProcessWorkers:
    """The node's workers once torchrun is retired (see the module docstring)."""

    def __init__(self, spec: NodeSpec, config: InProcessConfig, state: RunState, events: EventLog,
                 memstate: MemStateServer, epoch: int) -> None:
        self.spec, self.config, self.state, self.events = spec, config, state, events
        self.memstate = memstate
        self.epoch = epoch
        self.gens = Generations(state.store, state.keys, epoch)
        self.pids: dict[int, int] = {}  # local rank -> worker pid
        self.finished: set[int] = set()
        self.detached = False
        self.gen = 0
        self.spare: subprocess.Popen[bytes] | None = None
        self.worker_env: WorkerEnv | None = None
        self._probing: set[int] = set()
        self._attempt: TorchrunAttempt | None = None
        self.on_replace = lambda: None  # the supervisor's heartbeat monitor: the slot is re-forming

    # -- reports --------------------------------------------------------------------------
    def observe(self, report: dict) -> None:
        kind, local = report.get("type"), report.get("local_rank")
        if kind == "step" and local is not None and int(local) not in self.finished:
            self.pids[int(local)] = int(report.get("pid", 0))
            self.gen = max(self.gen, int(report.get("gen", 0)))
        elif kind == "fault":
            self._probe_later(int(report.get("gen", self.gen)) + 1)
        elif kind == "recovered":
            self.gen = max(self.gen, int(report.get("gen", 0)))
            if self.detached and self.spare is None and self.config.spare:
                self.start_spare()

    def ready(self) -> bool:
        """Every local worker has trained a step: the world formed, torchrun may retire."""
        return not self.detached and len(self.pids) >= self.spec.nproc_per_node

    # -- retiring torchrun ------------------------------------------------------------------------
    def detach(self, attempt: TorchrunAttempt, worker_env: WorkerEnv) -> None:
        self._attempt = attempt
        self.worker_env = worker_env
        attempt.retire(set(self.pids.values()))
        self.detached = True
        self.events.emit("agent.torchrun_retired", workers={str(k): v for k, v in sorted(self.pids.items())},
                         gen=self.gen)
        if self.config.spare:
            self.start_spare()

    def start_spare(self) -> None:
        assert self._attempt is not None
        log = open(self._attempt.dir / f"spare-{int(time.time() * 1000)}.log", "ab")
        cmd = [sys.executable, "-m", "elastic.worker.spare", *self.spec.entrypoint]
        self.spare = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                      env=self._attempt.env(), start_new_session=True)
        log.close()
        self.events.emit("agent.spare_started", spare_pid=self.spare.pid)

    # -- supervision --------------------------------------------------------------------------------
    def poll(self, on_failure) -> AttemptResult | None:
        """Reap ended workers: the attempt's result when the node is done or cannot go on, else None.

        ``on_failure(result) -> bool`` decides (and accounts) whether a dead worker may be replaced.
        """
        for local, pid in sorted(self.pids.items()):
            if local in self.finished:
                continue
            rc = reap(pid)
            if rc is None:
                continue
            if rc == 0:
                self.finished.add(local)
                continue
            result = self._death(local, pid, rc, on_failure)
            if result is not None:
                return result
        if len(self.finished) >= self.spec.nproc_per_node:
            self.events.emit("agent.workers_done", gen=self.gen)
            return AttemptResult(Outcome.SUCCEEDED, 0)
        return None

    def _death(self, local: int, pid: int, rc: int, on_failure) -> AttemptResult | None:
        detail = f"worker local rank {local} (pid {pid}) " + (f"killed by signal {-rc}" if rc < 0 else f"exited {rc}")
        # A config error or failing saves: a spare would fail the same way (the worker said why in its log).
        stopping = stopping_failure(rc, self._attempt.log_text() if self._attempt else "")
        kind, detail = stopping if stopping is not None else (_death_kind(rc), detail)
        result = AttemptResult(Outcome.FAILED, rc, kind=kind, detail=detail,
                               attempt_dir=self._attempt.dir if self._attempt else None)
        if stopping is not None or rc in _DELIBERATE:  # the worker chose to leave: the agent's usual path decides
            return result
        if result.kind == FailureKind.RECOVERY_FAILED or self.spare is None or not on_failure(result):
            self.events.emit("agent.inprocess_fallback", local_rank=local, rc=rc, detail=detail,
                             reason="recovery failed" if result.kind == FailureKind.RECOVERY_FAILED else
                             ("no warm spare" if self.spare is None else "failure policy"))
            return result
        self._replace(local, detail)
        return None

    def _replace(self, local: int, detail: str) -> None:
        assert self.spare is not None and self.worker_env is not None and self._attempt is not None
        spare, self.spare = self.spare, None
        gen = self.gen + 1
        env = {**self.worker_env.to_env(), "ELASTIC_JOIN_GEN": str(gen), "LOCAL_RANK": str(local), "ELASTIC_SCREEN": "",
               "TORCHELASTIC_ERROR_FILE": str(self._attempt.dir / f"error-spare-{spare.pid}.json")}
        try:
            assert spare.stdin is not None
            spare.stdin.write((json.dumps({"slot": local, "env": env}) + "\n").encode())
            spare.stdin.flush()
        except OSError as exc:
            self.events.emit("agent.spare_failed", error=str(exc))
            return
        self.pids[local] = spare.pid
        self.on_replace()
        self.events.emit("agent.inprocess_replace", local_rank=local, spare_pid=spare.pid, gen=gen, detail=detail)

    # -- lost nodes ---------------------------------------------------------------------------------------
    def _probe_later(self, gen: int) -> None:
        if gen in self._probing:
            return
        self._probing.add(gen)
        threading.Thread(target=self._probe, args=(gen,), name=f"probe-g{gen}", daemon=True).start()

    def _probe(self, gen: int) -> None:
        """Until generation ``gen`` has its plan: declare nodes whose agent cannot be reached lost."""
        deadline = time.monotonic() + self.config.join_timeout_s
        while time.monotonic() < deadline:
            try:
                if self.state.store.get(self.state.keys.gen_plan(self.epoch, gen)) is not None:
                    return
                members = {slot.node for slot in self.gens.ranks(gen - 1)}
                records = self.state.nodes()
            except StoreError:
                time.sleep(0.2)
                continue
            for node in sorted(members - {self.spec.node_id}):
                reason = self._unreachable(records.get(node))
                if reason and self.gens.mark_lost(gen, node, self.spec.node_id, reason):
                    self.events.emit("agent.node_lost", node=node, gen=gen, reason=reason)
            time.sleep(0.2)

    def _unreachable(self, record: dict | None) -> str:
        store = (record or {}).get("memstate")
        if not isinstance(store, dict):
            return "its agent's record is gone (lease expired)"
        host, _, port = str(store.get("addr", "")).rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=self.config.probe_timeout_s):
                return ""
        except (OSError, ValueError) as exc:
            return f"its agent does not answer at {host}:{port} ({type(exc).__name__})"

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self, grace_s: float) -> list[int]:
        pids = [pid for local, pid in self.pids.items() if local not in self.finished]
        if self.spare is not None:
            pids.append(self.spare.pid)
            self.spare = None
        terminate_tree(None, pids, grace_s)
        for pid in pids:
            reap(pid)
        return sorted(pids)


