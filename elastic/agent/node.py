"""The per-node agent: screens and registers the node, runs torchrun, supervises it, recovers.

One agent runs per node (``python -m elastic.agent ...``; ``elastic-launch`` starts them).
Its life::

    INIT -> (screen) -> REGISTERED -> RUNNING -> SUCCEEDED
      |                                  |-> FAILED -> decide -> act -> RUNNING
      |                                  |-> FAILED -> (budget spent / stop) GAVE_UP
      |                                  |-> EXCLUDED (leader or own policy) -> leaves
      |                                  '-> STOPPED (SIGTERM/SIGINT forwarded)
      '-> EXCLUDED (on the run's exclusion list, or the screen failed; never starts)

This class is only the state machine.  The parts: :class:`~elastic.agent.screener.Screener`
(the ``diag`` screen), :class:`~elastic.agent.attempt.TorchrunAttempt` (one torchrun tree),
:class:`~elastic.agent.supervise.Supervisor` (watching it), the restart scope
(:mod:`elastic.agent.scopes`: the whole run re-forms under a new epoch, or one replica group
restarts alone), :class:`~elastic.agent.failures.FailureHandler` (class, counted, action)
and :class:`~elastic.control.runstate.RunState` (everything shared through etcd).

torchrun itself runs with ``--max-restarts 0``: this agent owns the restart decision, so that
it can classify the failure and act on it.  Only a node's own failures consume its restart
budget: a restart caused by a peer is a membership change, not a failure of this node.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from elastic.agent.attempt import AttemptResult, NodeSpec, Outcome, ReportInbox, TorchrunAttempt
from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.agent.failures import Decision, FailureHandler, ProgressGuard
from elastic.agent.leaving import Leaving
from elastic.agent.metrics import AgentMetrics, MeteredEventLog
from elastic.agent.outage import EtcdUnreachable, EtcdWait
from elastic.agent.records import NodeRecords
from elastic.agent.inprocess import InProcessWorkers, WarmSpare, inprocess_env, memory_store, peer_address
from elastic.agent.metrics import serve_metrics
from elastic.agent.remote_faults import RemoteFaults
from elastic.agent.scopes import make_scope
from elastic.agent.screener import Screener
from elastic.agent.slots import Claimant, SlotClaims
from elastic.agent.supervise import Supervisor
from elastic.checkpoint.config import MemoryCacheConfig
from elastic.common.env import WorkerEnv
from elastic.common.exits import EXIT_EXCLUDED, EXIT_FAILURE
from elastic.common.procs import become_subreaper
from elastic.common.events import EventLog
from elastic.control.admission import Admission, Refused
from elastic.control.generations import Generations, Plan
from elastic.control.keys import RunKeys
from elastic.control.leader import ClusterPolicy, LeaderLoop, leader_excluder
from elastic.control.runstate import RunState
from elastic.control.lease import LeaseKeeper
from elastic.control.store import EtcdStore, KVStore, StoreError
from elastic.replicas.config import ReplicaConfig

EXIT_SUCCESS = 0
EXIT_INTERRUPTED = 130

__all__ = ["NodeAgent", "NodeSpec", "AgentState", "EXIT_EXCLUDED"]


class AgentState(str, Enum):
    INIT = "INIT"
    SCREENING = "SCREENING"
    REGISTERED = "REGISTERED"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    SUCCEEDED = "SUCCEEDED"
    STOPPED = "STOPPED"
    GAVE_UP = "GAVE_UP"
    EXCLUDED = "EXCLUDED"


class NodeAgent:
    def __init__(self, spec: NodeSpec, config: AgentConfig, rdzv: RendezvousConfig, admission: Admission | None = None,
                 memory: MemoryCacheConfig | None = None, replicas: ReplicaConfig | None = None,
                 store: KVStore | None = None, inprocess: bool = False,
                 checkpoint_root: Path | None = None, sdc_replay: bool = False,
                 claimant: Claimant | None = None, spares: list[WarmSpare] | None = None,
                 screened: bool = False) -> None:
        self.spec, self.config, self.rdzv, self.admission = spec, config, rdzv, admission
        self.sdc_replay = sdc_replay  # replay verification may roll the run back: read sdc/rollback per attempt
        # One store call gives up within etcd_wait_s at most; EtcdWait bounds the waiting in all.
        self.store = store if store is not None else EtcdStore(spec.endpoint,
                                                               retry_deadline=min(15.0, config.etcd_wait_s))
        self.keys = RunKeys.of(rdzv.key_prefix, spec.run_id)
        self.state = RunState(self.store, self.keys)
        self.metrics = AgentMetrics(spec.node_id, spec.run_dir)
        self.events: EventLog = MeteredEventLog(spec.run_dir / "events" / f"agent-{spec.node_id}.jsonl",
                                                f"agent/{spec.node_id}", self.metrics)
        self.status = AgentState.INIT
        self.attempt = 0
        self.current: TorchrunAttempt | None = None
        self._stop = threading.Event()
        self._stop_signal: int | None = None
        self._leader: LeaderLoop | None = None
        self.inbox = ReportInbox()
        self.scope = make_scope(spec, self.state, self.events, replicas)
        self.records = NodeRecords(self.state, spec.node_id, self.events, lambda: self.metrics.address)
        self.etcd = EtcdWait(spec.endpoint, config.etcd_wait_s, self.events, self._stop)
        self.leave = Leaving(spec, self.state, self.records, self.scope, self.events, self._set_state)
        # In-process recovery: the agent adopts its workers from torchrun (elastic.agent.inprocess).
        self.inprocess = config.inprocess if inprocess and become_subreaper() else None
        self.memstate = memory_store(spec, self.state, self.events,
                                     memory.max_mib if memory is not None and memory.enabled else 0, self.inprocess)
        if self.memstate is not None and self.inprocess is not None:
            self.records.extra["memstate"] = peer_address(spec, self.memstate)
        self.screener = Screener(config.preflight, spec.node_id, spec.run_dir, spec.endpoint, self.state, self.events)
        self.failures = FailureHandler(config.failure, spec.node_id, self.state, self.events,
                                       needs=(spec.nnodes, rdzv.join_timeout_s))
        self.progress = ProgressGuard(config.failure.no_progress_restarts)
        self.supervisor = Supervisor(spec.node_id, config, self.state, self.events, self.metrics, self.inbox,
                                     self.scope, self.records, self.progress, self._stop, lambda: self.status.value)
        self.supervisor.screener_record = self.screener.recorded
        self.supervisor.min_nodes = _min_nodes(spec.nnodes)
        self.supervisor.sdc_replay = sdc_replay
        self._screen_spec: dict | None = None
        self._rejoin: Rejoin | None = None  # set at the start when this node rejoins in-process
        # Who runs as this node id (elastic.agent.slots); a standby's agent holds its claim already.
        self.claims = SlotClaims(self.state, claimant or Claimant.this_process(spec.node_id))
        self._spares = list(spares or [])  # a standby's warm spares, for the slots it rejoins with
        # Set when another process runs as this node id (elastic.agent.slots): main waits as a standby.
        self.slot_taken = False
        self._screened = screened  # a standby that took a slot was screened while it waited
        self.remote = RemoteFaults(config.chaos, spec.node_id, spec.run_id, spec.run_dir,
                                   checkpoint_root or spec.run_dir / "checkpoints", self.state, self.events,
                                   admission.token if admission is not None else None)
        self.supervisor.faults = self.remote
        self.metrics.watch_silence(lambda: self.supervisor.monitor.silent_for()
                                   if self.status == AgentState.RUNNING else 0.0)

    # -- bookkeeping ------------------------------------------------------------
    def _set_state(self, state: AgentState | str, **fields) -> None:
        self.status = state = AgentState(state)
        self.events.emit("agent.state", state=state.value, **fields)
        self.records.publish_node(state.value, self.failures.failures)

    # -- signals ------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        self._stop_signal = signum
        self._stop.set()
        # Cleanup (lease revoke, leader resign) is best effort once we are told to stop: with the
        # launcher gone etcd is usually gone too, and retrying for the full deadline per call
        # would keep this agent (an orphan by then) alive for most of a minute.
        self.store.stop_retrying()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.request_stop(signum))

    # -- main loop ----------------------------------------------------------------
    def run(self) -> int:
        self.events.emit("agent.start", run_id=self.spec.run_id, endpoint=self.spec.endpoint,
                         nnodes=self.spec.nnodes, max_restarts=self.config.max_restarts)
        serve_metrics(self.metrics, self.config.metrics, self.events, self.leave.say)
        try:
            return self._run()
        except EtcdUnreachable as exc:
            return self.leave.give_up(str(exc))
        finally:
            self.metrics.close()
            if self.current is not None:
                self.supervisor.stop_attempt(self.current, "agent exit")
            self.scope.close(succeeded=self.status == AgentState.SUCCEEDED)
            if self._leader is not None:
                self._leader.close()
            if self.records.lease is not None:
                if not self.slot_taken:  # the node's membership is the claimant's now, not ours to end
                    self.records.left(self.status.value)  # a clean exit, not a lost node
                self.records.lease.close(revoke=True)
            if self.memstate is not None:
                self.memstate.close()
            self.inbox.close()
            self.events.emit("agent.exit", state=self.status.value, failures=self.failures.failures)
            self.events.close()

    def _run(self) -> int:
        code = self._admit()
        if code is not None:
            return code
        taken = self.etcd.call("slot check", self._slot_taken)
        if taken is not None:
            return taken
        self.records.lease = self.etcd.call("lease grant", lambda: LeaseKeeper(
            self.store, self.config.lease_ttl_s, on_lost=lambda: self.events.emit("agent.lease_lost")))
        self._set_state(AgentState.REGISTERED)
        self.records.joined()
        policy = ClusterPolicy(self.config.leader, leader_excluder(self.state, self.spec.node_id, self.events), self.events)
        self._leader = LeaderLoop(self.state, self.spec.node_id, self.config.leader, policy, self.events,
                                  on_tick=lambda leader: self.scope.on_leader_tick(leader, self.records.lease_id))
        self._leader.start()
        self._rejoin = self.etcd.call("rejoin check", self._rejoinable)
        if self._rejoin is not None and not self.etcd.call("slot claim", self._claim_slot):
            self.slot_taken = True
            self.events.emit("agent.slot_taken", node=self.spec.node_id, why="claimed by another as this node rejoined")
            return EXIT_FAILURE
        if self._rejoin is None:  # a node that rejoins in-process must not move the run to a new epoch
            self._drop_spares("this node does not rejoin a running world")
            self.etcd.call("join", lambda: self.scope.join_running(3 * self.config.heartbeat.publish_interval_s))
        while not self._stop.is_set():
            epoch = self.etcd.call("epoch read", self.state.epoch)
            code = self._after(self._run_once(epoch), epoch)
            if code is not None:
                return code
        self._set_state(AgentState.STOPPED, signal=self._stop_signal)
        return EXIT_INTERRUPTED

    def _admit(self) -> int | None:
        """Admission (token, fingerprint), exclusion list and screen: None if this node may train."""
        if self.admission is not None:
            try:
                self.etcd.call("admission", lambda: self.admission.check(self.store, self.keys, self.events))
            except Refused as exc:
                self.events.emit("agent.refused", reason=str(exc), rc=exc.code)
                self.leave.say(f"refused: {exc}")
                return exc.code
        self.remote.poll()  # faults planted before the start (bad readings for the screen) land now
        excluded = self.etcd.call("exclusion check", lambda: self.state.exclusions.get(self.spec.node_id))
        if excluded is not None:
            # A node excluded by a failed screen may come back by passing one (repaired); an
            # exclusion by the leader's policy or an operator only expires or is cleared.
            if not (self.config.preflight.enabled and excluded.get("by") in ("preflight", "rescreen")):
                return self.leave.excluded(excluded.get("reason"), excluded.get("until"))
            code = self._screen("re-screen of an excluded node", by="preflight", epoch=None)
            if code is None:
                self.state.exclusions.clear(self.spec.node_id)
                self.events.emit("agent.exclusion_cleared", previous_reason=excluded.get("reason"))
            return code
        if self._screened:
            return None
        if self.config.preflight.enabled and self.inprocess is not None:
            self._screen_spec = self.screener.worker_spec()  # runs inside the first worker, alongside its start
            return None
        if self.config.preflight.enabled:
            return self._screen("pre-flight", by="preflight", epoch=None)
        return None

    def _screen(self, why: str, by: str, epoch: int | None) -> int | None:
        """Screen this node; None when it passed, else the exit code after excluding it."""
        self._set_state(AgentState.SCREENING, why=why)
        result = self.screener.screen(why)
        if result.passed:
            return None
        return self.leave.exclude_self(result.reason, self.config.preflight.exclusion_ttl_s, by=by, epoch=epoch)

    def _rejoinable(self, settle_s: float = 2.0) -> Rejoin | None:
        """Whether this agent comes back to a fixed-size run that trains on in-process without it:
        the epoch's newest generation formed without this node, short of the nodes the run needs, so
        its survivors hold the next round open for it (``agent.inprocess.rejoin_wait_s``).  An agent
        back before its loss was declared waits up to ``settle_s`` for the round that declares it."""
        config = self.inprocess
        if config is None or self.memstate is None or config.rejoin_wait_s <= 0 or self.scope.name != "run":
            return None
        if self.state.done_record() is not None:
            return None
        epoch = self.state.epoch()
        gens = Generations(self.store, self.keys, epoch)
        ranks0 = gens.member(self.spec.node_id)  # one key: every agent starting reads it
        needed = int(str(self.spec.nnodes).partition(":")[0])
        deadline = time.monotonic() + settle_s
        while ranks0:
            plan = gens.newest_plan()
            if plan is not None and self.spec.node_id in plan.gone:
                return Rejoin(epoch, plan, ranks0) if plan.nodes < needed else None
            if time.monotonic() >= deadline or self._stop.wait(0.2):
                return None
        return None

    def _slot_taken(self) -> int | None:
        """An exit code when another process runs as this node id now (a standby took the slot while
        this node was away; :attr:`slot_taken` says so): this process must not register as the node
        (its record is the other's), and waits as a standby instead (elastic.agent.main)."""
        epoch = self.state.epoch()
        # The plan is read only when there is a claim: a node never taken over reads two keys here.
        newest = Generations(self.store, self.keys, epoch).newest_plan
        held = self.claims.held_by_other(self.spec.node_id, epoch, newest)
        if held is None:
            return None
        self.events.emit("agent.slot_taken", node=self.spec.node_id, by=held.get("by"), host=held.get("host"),
                         holder_pid=held.get("pid"), since_gen=held.get("gen"))
        self.slot_taken = True
        return EXIT_FAILURE

    def _claim_slot(self) -> bool:
        assert self._rejoin is not None
        return self.claims.try_claim(self.spec.node_id, self._rejoin.epoch, self._rejoin.plan)

    def _drop_spares(self, why: str) -> None:
        if not self._spares:
            return
        pids = [proc.pid for proc, _ in self._spares]
        for proc, _ in self._spares:
            proc.kill()
            proc.wait()
        self._spares = []
        self.events.emit("agent.spares_dropped", pids=pids, why=why)

    def _run_once(self, epoch: int) -> AttemptResult:
        self._drop_stale_reports(epoch)
        rejoin, self._rejoin = self._rejoin, None
        if rejoin is not None and rejoin.epoch == epoch:
            result = self._rejoin_once(rejoin)
            if result is not None:
                return result
            # Its processes did not start: the run grows back the usual way (a new epoch, from disk).
            self.etcd.call("join", lambda: self.scope.join_running(3 * self.config.heartbeat.publish_interval_s))
            return AttemptResult(Outcome.PEER_RESTART)
        self.attempt += 1
        prep = self.scope.prepare(self.attempt, self._stop.is_set)
        if prep.result is not None:
            return prep.result
        attempt = self.current = self.new_attempt(epoch, prep.env)
        pid = attempt.start()
        self._set_state(AgentState.RUNNING, epoch=epoch, attempt=self.attempt, torchrun_pid=pid)
        workers = (InProcessWorkers(self.spec, self.inprocess, self.state, self.events, self.memstate, epoch)
                   if self.inprocess is not None and self.memstate is not None else None)
        try:
            return self.supervisor.watch(attempt, epoch, lambda: f"signal {self._stop_signal}", workers,
                                         lambda result: self._replace_in_process(result, epoch))
        finally:
            self.current = None

    def _drop_stale_reports(self, epoch: int) -> None:
        """What the last attempt's processes sent before they were stopped and nobody read (the
        agent was re-screening its node): never this attempt's.  A stale step report once counted
        as the new attempt's first step, 12 s before its workers had even started, and the agent
        declared its node a stall victim: a second restart from disk (chaos soak, seed 1)."""
        stale = self.inbox.drain()
        if stale:
            self.events.emit("agent.stale_reports", epoch=epoch, count=len(stale),
                             pids=sorted({int(r.get("pid", 0)) for r in stale})[:16])

    def _rejoin_once(self, rejoin: Rejoin) -> AttemptResult | None:
        """Rejoin the running world in-process (:meth:`InProcessWorkers.rejoin`): no torchrun, the
        node's slots taken by fresh processes that join the survivors' next generation.  None when
        its processes could not be started (the caller starts torchrun as usual)."""
        self.attempt += 1
        attempt = self.current = self.new_attempt(rejoin.epoch)
        attempt.dir.mkdir(parents=True, exist_ok=True)
        attempt.started = time.monotonic()
        assert self.inprocess is not None
        workers = InProcessWorkers(self.spec, self.inprocess, self.state, self.events, self.memstate, rejoin.epoch)
        workers.adopt_spares(self._spares)
        self._spares = []
        self.events.emit("agent.rejoin_start", epoch=rejoin.epoch, gen=rejoin.plan.gen, nodes=rejoin.plan.nodes,
                         gone=list(rejoin.plan.gone)[:20])
        if not workers.rejoin(attempt, attempt.worker_env, rejoin.plan, rejoin.ranks0, attempt.worker_env.screen):
            self.events.emit("agent.stop_workers", reason="rejoin failed", pids=workers.stop(self.config.term_grace_s))
            self.current = None
            return None
        self._set_state(AgentState.RUNNING, epoch=rejoin.epoch, attempt=self.attempt, path="rejoin")
        try:
            return self.supervisor.watch(attempt, rejoin.epoch, lambda: f"signal {self._stop_signal}", workers,
                                         lambda result: self._replace_in_process(result, rejoin.epoch))
        finally:
            self.current = None

    def new_attempt(self, epoch: int, extra_env: dict[str, str] | None = None) -> TorchrunAttempt:
        """The torchrun attempt number ``self.attempt`` of ``epoch`` (not started)."""
        return TorchrunAttempt(
            self.spec, self.attempt, self.spec.run_dir / "torchrun" / self.spec.node_id / f"e{epoch}-a{self.attempt}",
            ",".join([self.rdzv.torchrun_conf(), *self.store.security.rdzv_conf()]), self._worker_env(epoch),
            self.scope.target(epoch, self.attempt), self.config.term_grace_s, extra_env=extra_env)

    def _worker_env(self, epoch: int) -> WorkerEnv:
        screen = json.dumps(self._screen_spec) if self._screen_spec and self.attempt == 1 else ""
        return WorkerEnv(agent_addr=self.inbox.address, node_id=self.spec.node_id, run_id=self.spec.run_id,
                         etcd_endpoint=self.spec.endpoint, run_prefix=self.keys.prefix, epoch=str(epoch),
                         pg_timeout=str(self.config.pg_timeout_s), skip_steps=self.state.skip_spec(),
                         distrust=self.state.distrust_spec() if self.sdc_replay else "",
                         local_addr=self.spec.local_addr, screen=screen,
                         **inprocess_env(self.memstate, self.inprocess))

    def _after(self, result: AttemptResult, epoch: int) -> int | None:
        """The exit code once this node is finished, or None to run another attempt."""
        if result.outcome == Outcome.STOPPED:
            self._set_state(AgentState.STOPPED, signal=self._stop_signal)
            return EXIT_INTERRUPTED
        if result.outcome == Outcome.SUCCEEDED:
            self._set_state(AgentState.SUCCEEDED, epoch=epoch)
            self.records.quietly("done", lambda: self.state.mark_done(self.spec.node_id))
            return EXIT_SUCCESS
        if result.outcome == Outcome.RUN_STOPPED:
            record = self.records.quietly("stop_record", self.state.stop_record) or {}
            return self.leave.give_up(f"run stopped by {record.get('by')}: {record.get('reason')}",
                                      code=int(record.get("code") or EXIT_FAILURE))
        if result.outcome == Outcome.SCREEN_FAILED:
            return self.leave.exclude_self(result.detail, self.config.preflight.exclusion_ttl_s, by="preflight",
                                           epoch=epoch)
        if result.outcome == Outcome.EXCLUDED:
            record = self.state.exclusions.get(self.spec.node_id) or {}
            return self.leave.excluded(record.get("reason"), record.get("until"))
        self.progress.restarted()
        if result.outcome == Outcome.PEER_RESTART:
            if (code := self._sdc_rescreen(epoch)) is not None:
                return code
            self.events.emit("agent.restart", reason="peer", epoch=epoch, counted=False, fault=self._fault_id(epoch))
            return self._progress_check()
        return self._act(result.decision or self.failures.decide(result, epoch), result, epoch)

    def _replace_in_process(self, result: AttemptResult, epoch: int) -> bool:
        """A local worker died after torchrun retired: may the warm spare take its slot?  Not once
        this agent moved the run on (the attempt ends as a peer restart, nothing counted)."""
        if self.supervisor.moved_on(epoch):
            return False
        result.decision = decision = self.failures.decide(result, epoch)
        if decision.action not in ("restart", "rescreen") or self.failures.failures > self.config.max_restarts:
            return False  # the attempt ends; _after acts on the decision already taken
        self._set_state(AgentState.FAILED, rc=result.rc, failure_kind=decision.kind.value, detail=decision.detail,
                        failures=self.failures.failures, epoch=epoch, action="replace", counted=decision.counted)
        self.events.emit("agent.restart", reason=decision.kind.value, epoch=epoch, counted=decision.counted,
                         failures=self.failures.failures, action="replace", path="inprocess",
                         fault=f"{self.spec.node_id}/e{epoch}-a{self.attempt}-{self.failures.failures}")
        self._set_state(AgentState.RUNNING, epoch=epoch, attempt=self.attempt, path="inprocess")
        return True

    def _act(self, decision: Decision, result: AttemptResult, epoch: int) -> int | None:
        self._set_state(AgentState.FAILED, rc=result.rc, failure_kind=decision.kind.value, detail=decision.detail,
                        failures=self.failures.failures, epoch=epoch, action=decision.action, counted=decision.counted)
        if decision.action == "stop":
            return self.leave.stop_run(decision.reason, decision.kind.value)
        if decision.action == "exclude":
            return self.leave.exclude_self(decision.reason, self.config.failure.exclusion_ttl_s, by="policy",
                                           epoch=epoch)
        if decision.action == "rescreen" and self.config.preflight.enabled:
            code = self._screen(f"after {decision.kind.value}", by="rescreen", epoch=epoch)
            if code is not None:
                return code
        new_epoch = self.scope.bump(epoch)
        if self.failures.failures > self.config.max_restarts:
            return self.leave.give_up(f"{self.failures.failures} failures, the last {decision.reason} "
                                      f"(agent.max_restarts={self.config.max_restarts})",
                                      failures=self.failures.failures, max_restarts=self.config.max_restarts)
        self.events.emit("agent.restart", reason=decision.kind.value, epoch=new_epoch, counted=decision.counted,
                         failures=self.failures.failures, action=decision.action, fault=self._fault_id(epoch))
        return self._progress_check()

    def _sdc_rescreen(self, epoch: int) -> int | None:
        """A replay named this node's rank as computing wrong and rolled the run back: the node
        screens itself before it trains again (GEMM correctness checks, ``diag burnin``); failing,
        it is excluded and leaves.  Without a pre-flight screen configured it rejoins, said so."""
        record = self.records.quietly("sdc_rollback", self.state.sdc_rollback) if self.sdc_replay else None
        if not record or record.get("node") != self.spec.node_id or not record.get("rescreen") \
                or int(record.get("epoch", -1)) != epoch:
            return None
        if not self.config.preflight.enabled:
            self.events.emit("sdc.rescreen", screened=False, reason="agent.preflight.enabled is false")
            return None
        code = self._screen(f"after sdc at step {record.get('from_step')}", by="rescreen", epoch=epoch)
        self.events.emit("sdc.rescreen", screened=True, passed=code is None)
        return code

    def _fault_id(self, epoch: int) -> str:
        """Names one fault across agents: the epoch it ended (a replica group restarts alone)."""
        return f"e{epoch}" if self.scope.name == "run" else f"{self.spec.node_id}/a{self.attempt}"

    def _progress_check(self) -> int | None:
        try:
            latest = self.state.latest_checkpoint()
        except (StoreError, ValueError):
            latest = None
        reason = self.progress.check(latest)
        return self.leave.stop_run(reason) if reason else None


@dataclass(frozen=True)
class Rejoin:
    """A node back in a run whose world formed without it (:meth:`NodeAgent._rejoinable`)."""

    epoch: int
    plan: Plan
    """The newest generation's plan: the one formed without this node."""
    ranks0: dict[int, int]
    """This node's slots and their generation-0 ranks (the roster's)."""


def _min_nodes(nnodes: str) -> int | None:
    """``launch.nodes`` ``MIN:MAX`` with MIN < MAX: MIN (the run may shrink to it); else None."""
    low, _, high = str(nnodes).partition(":")
    return int(low) if high and int(low) < int(high) else None
