"""Watching one running torchrun attempt until it ends.

While torchrun runs, the :class:`Supervisor` drains the workers' reports (steps, commits,
numerics), judges silence (:mod:`elastic.agent.heartbeat`: hang, stall, slow start; a silence
with every rank asleep is attributed first, :mod:`elastic.agent.hangs`),
publishes the node heartbeat for the leader, and acts on the run's shared state: a new epoch
(a peer failed), this node's exclusion, the run's stop key, watched over one stream
(:class:`~elastic.control.signals.SignalWatch`: an idle run costs etcd no request per loop).
Whatever ends the attempt comes back as one :class:`~elastic.agent.attempt.AttemptResult`.
"""

from __future__ import annotations

import contextlib

import threading
import time
from collections.abc import Callable

from elastic.agent.attempt import AttemptResult, Outcome, ReportInbox, TorchrunAttempt
from elastic.agent.classify import FailureKind
from elastic.agent.config import AgentConfig
from elastic.agent.failures import ProgressGuard
from elastic.agent.hangs import HangAttribution
from elastic.agent.heartbeat import HeartbeatMonitor, Silence
from elastic.agent.inprocess import InProcessWorkers
from elastic.agent.metrics import AgentMetrics
from elastic.agent.records import NodeRecords
from elastic.agent.remote_faults import RemoteFaults
from elastic.agent.replays import ReplayChecks
from elastic.agent.scopes import RestartScope
from elastic.common.events import EventLog
from elastic.control.runstate import RunState
from elastic.control.signals import SignalWatch
from elastic.control.store import StoreError

def _sdc_detail(suspect: dict) -> str:
    units = ", ".join(u or "<root>" for u in suspect.get("units") or [])
    who = (f"{suspect.get('verifier')}'s spare replayed rank {suspect['rank']}'s step {suspect['step']} wrong"
           if suspect.get("role") == "verifier" else f"replay of rank {suspect['rank']}'s step {suspect['step']} "
           f"on {suspect.get('verifier')}'s spare disagrees")
    how = (f"arbitrated by {suspect.get('arbiter')}" if suspect.get("arbitrated")
           else f"not arbitrated: {suspect.get('arbitration')}")
    return f"{who} in {units} ({how})"


_SILENCE_KIND = {Silence.CULPRIT: FailureKind.HANG, Silence.VICTIM: FailureKind.STALL,
                 Silence.INIT: FailureKind.INIT_TIMEOUT}


class Supervisor:
    def __init__(self, node_id: str, config: AgentConfig, state: RunState, events: EventLog, metrics: AgentMetrics,
                 inbox: ReportInbox, scope: RestartScope, records: NodeRecords, progress: ProgressGuard,
                 stop: threading.Event, agent_state: Callable[[], str]) -> None:
        self.node_id = node_id
        self.config = config
        self.state = state
        self.events = events
        self.metrics = metrics
        self.inbox = inbox
        self.scope = scope
        self.records = records
        self.progress = progress
        self.stop = stop
        self.agent_state = agent_state
        self.monitor = HeartbeatMonitor(config.heartbeat)
        self.workers: InProcessWorkers | None = None
        self.on_failure: Callable[[AttemptResult], bool] = lambda result: False
        self.screened = None  # the verdict of the node screen run inside the first worker
        self.screener_record = lambda report: None  # set by the agent: records that verdict
        self.run_ended = False
        """The workers finished the run: a late replay verdict can no longer roll it back."""
        self.sdc_replay = False
        """Replay verification runs: the run signals watch this node's arbitration key too."""
        self.min_nodes: int | None = None
        """An elastic run's minimum node count (``launch.nodes: MIN:MAX``); None: fixed size."""
        self.faults: RemoteFaults | None = None
        """Chaos faults delivered through etcd: fed this node's reports, polled every loop."""
        self.hangs = HangAttribution(node_id, metrics.run_dir, state, events,
                                     wait_s=config.heartbeat.step_timeout_s / 2)
        self.replays = ReplayChecks(node_id, state, events)
        """Replay verification: this node's checked ranks' checksums, its spare's replays."""
        self._noticed: set[tuple[int, int]] = set()  # (epoch, generation) faults this agent recorded
        self._numerics_step: int | None = None  # the step of this attempt's first numerics report
        self._bumped = -1
        """The epoch this agent itself last moved the run to: its own watch says so a round trip later."""
        self.signals: SignalWatch | None = None
        """The run-wide signals of the attempt being watched (one watch stream, closed with it)."""

    def stop_attempt(self, attempt: TorchrunAttempt, reason: str) -> None:
        workers = self.workers
        if workers is not None and workers.detached:
            self.events.emit("agent.stop_workers", reason=reason, pids=workers.stop(self.config.term_grace_s))
        elif attempt.running:
            pids = attempt.stop()
            self.events.emit("agent.stop_workers", reason=reason, pids=pids)

    def watch(self, attempt: TorchrunAttempt, epoch: int, stop_reason: Callable[[], str],
              workers: InProcessWorkers | None = None,
              on_failure: Callable[[AttemptResult], bool] = lambda result: False) -> AttemptResult:
        """Until the attempt ends: its result.  With ``workers`` the attempt may outlive its torchrun
        (in-process recovery): ``on_failure`` then decides whether a dead worker is replaced."""
        grace = self.config.inprocess.join_timeout_s + self.config.heartbeat.step_timeout_s
        self.monitor = HeartbeatMonitor(self.config.heartbeat, recovery_grace_s=grace if workers else 0.0)
        if workers is not None:
            workers.on_replace = self.monitor.recovering
            workers.drain_reports = lambda: self._drain(attempt, epoch)

        self.workers, self.on_failure = workers, on_failure
        self.replays.attach(workers)
        self.replays.on_suspect = lambda suspect: self.sdc_rollback(suspect, epoch)
        self.replays.nodes = lambda: list(self.state.heartbeats(epoch))
        self.hangs.reset()
        self._numerics_step: int | None = None
        self.screened = None
        if self.faults is not None:
            self.faults.attach(attempt.proc.pid if attempt.proc else None, epoch)
        with self.open_signals():
            result = self._loop(attempt, epoch, stop_reason)
            if result.outcome == Outcome.SUCCEEDED:
                self._settle_checks()
            return result

    def _settle_checks(self, limit_s: float = 15.0) -> None:
        """The run's last checks are replayed after its workers finished: wait for their answers
        (and arbitrations) a bounded while, so a flip on the last checked steps is said, not dropped
        with the node's exit.  A suspect found now cannot roll back a finished run: it is recorded
        as the run's fault (the summary lists it) with the step to resume from."""
        self.run_ended = True
        deadline = time.monotonic() + limit_s
        while self.replays.busy() and time.monotonic() < deadline:
            if self.signals is not None:
                with contextlib.suppress(StoreError):
                    self.signals.current()  # an arbitration asked of this node arrives here
            self.replays.poll()
            time.sleep(0.1)
        self.replays.end_of_run()

    def open_signals(self) -> SignalWatch:
        """The run-wide signals for the attempt about to be watched: one stream, read and opened on
        first use (so etcd being down at the start does not delay the attempt)."""
        workers = self.workers
        self.signals = SignalWatch(self.state, self.node_id, idle_s=self.config.watch_idle_s,
                                   retry_s=self.config.epoch_poll_s,
                                   on_fault=workers.heard_fault if workers is not None else None,
                                   arbitration=self.sdc_replay,
                                   on_note=workers.heard_note if workers is not None else None)
        if workers is not None:
            workers.notes_heard = True  # a round's members may take its plan from the round note
        self.replays.requests = self.signals.arbitration_request
        self.replays.heard = lambda: self.signals.heard_ts if self.signals is not None else 0.0
        return self.signals

    def _loop(self, attempt: TorchrunAttempt, epoch: int, stop_reason: Callable[[], str]) -> AttemptResult:
        next_beat = time.monotonic()
        while True:
            self._drain(attempt, epoch)
            result = self._exited(attempt, epoch)
            if result is not None:
                return result
            if self.stop.is_set():
                self.stop_attempt(attempt, stop_reason())
                return AttemptResult(Outcome.STOPPED)
            if self.faults is not None:
                self.faults.poll()
            self.replays.poll()
            result = self._poll_run(attempt, epoch)
            if result is not None:
                return result
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.config.heartbeat.publish_interval_s
                self.records.heartbeat(epoch, self.agent_state(), self.monitor.summary())
                self.metrics.tick()
            result = self._silence(attempt, epoch) or self._screen_failed(attempt)
            if result is not None:
                return result
            # Detached workers are this agent's children: it wakes when one exits (its pidfd), so a
            # death is reaped and pushed at once, not at the next look (monitor_interval_s).
            self.inbox.wait(self.config.monitor_interval_s, self.workers.exit_fds() if self.workers else None)

    def _drain(self, attempt: TorchrunAttempt, epoch: int) -> None:
        for report in self.inbox.drain():
            self.metrics.observe_report(report)
            self._on_report(report, attempt, epoch)
            self.replays.observe(report)
            if self.faults is not None:
                self.faults.observe(report)

    def moved_on(self, epoch: int) -> bool:
        """Has this agent itself moved the run past ``epoch`` (an SDC rollback)?  Its own watch says
        so a round trip later, and a worker that dies meanwhile died of the move (its peers stopped
        their workers for the new epoch), not of a fault of its own (CI, loaded: the arbiter of a
        rollback counted its own worker's death, a signal, as its fault).  Another node's bump is
        not guessed from a read here: a node whose worker really died may see the epoch moved by
        a peer that noticed first, and must still count its fault."""
        return self._bumped > epoch

    def _exited(self, attempt: TorchrunAttempt, epoch: int) -> AttemptResult | None:
        result = self._ended(attempt, epoch)
        if result is None or result.outcome != Outcome.FAILED:
            return result
        if self.moved_on(epoch):
            self.events.emit("agent.failed_after_move", epoch=epoch, rc=result.rc, detail=result.detail)
            result = AttemptResult(Outcome.PEER_RESTART)
        if self.workers is not None and self.workers.detached:
            result.numerics_step = self._numerics_step
            self.stop_attempt(attempt, f"fall back: {result.detail}" if result.detail else f"epoch after {epoch}")
        return result

    def _ended(self, attempt: TorchrunAttempt, epoch: int) -> AttemptResult | None:
        if self.workers is not None and self.workers.detached:
            return self.workers.poll(self.on_failure)
        rc = attempt.poll()
        if rc is None:
            return None
        self.events.emit("agent.torchrun_exit", rc=rc, epoch=epoch, attempt=attempt.number,
                         runtime_s=attempt.runtime_s())
        self.metrics.tick()  # the attempt's last checkpoint events (the final commit)
        if rc == 0:
            return AttemptResult(Outcome.SUCCEEDED, rc)
        return AttemptResult(Outcome.FAILED, rc, numerics_step=self._numerics_step, attempt_dir=attempt.dir,
                             step=self.monitor.summary()["step"])

    def _on_report(self, report: dict, attempt: TorchrunAttempt, epoch: int) -> None:
        kind = report.get("type")
        if self.workers is not None:
            self.workers.observe(report)
            if self.workers.ready() and attempt.holds(self.workers.pids.values()):
                self.workers.detach(attempt, attempt.worker_env)
        if kind in ("fault", "recovered"):
            self.monitor.observe(report)  # a re-formation under way, or over: silence is expected
        if kind == "step":
            first = self.monitor.first_step_at is None
            self.monitor.observe(report)
            self.hangs.reset()
            if first:
                self.events.emit("agent.first_step", step=report.get("step"), epoch=epoch,
                                 attempt=attempt.number, since_start_s=attempt.runtime_s())
        elif kind == "done":
            self.monitor.observe(report)
        elif kind == "commit":
            self.progress.observe_commit(int(report.get("step", -1)))
        elif kind == "fault" and self.workers is None:
            # A peer was lost and the workers re-form in-process: say where the run stood.  With the
            # in-process workers attached, their agent's join of the round writes this note (first
            # joiner only, in the join's own transaction): no request of its own per agent.
            gen = int(report.get("gen", 0))
            if (epoch, gen) not in self._noticed:  # its other workers report the same fault: one write a node
                self._noticed.add((epoch, gen))
                self.records.quietly("notice_fault", lambda: self.state.notice_fault(
                    epoch, report.get("step"), self.node_id, "peer_lost", gen=gen))
        elif kind == "screen":
            self.screened = self.screener_record(report)
        elif kind == "numerics":
            self.events.emit("agent.numerics_report", step=report.get("step"), rank=report.get("rank"),
                             reason=report.get("reason"))
            if self._numerics_step is None:
                self._numerics_step = int(report.get("step", 0))

    def _poll_run(self, attempt: TorchrunAttempt, epoch: int) -> AttemptResult | None:
        """Run-wide signals in etcd: a new epoch, this node's exclusion, a stop of the run (from the
        watch, so every loop may look; etcd is read only when the watch must be re-established)."""
        if self.signals is None:
            self.open_signals()
        assert self.signals is not None
        try:
            signals = self.signals.current()
            current, excluded, stop = signals.epoch, signals.excluded, signals.stop
        except StoreError as exc:
            # etcd unreachable: keep training; the workers do not need etcd between rendezvous.
            self.events.emit("agent.store_error", op="poll", error=str(exc))
            return None
        if stop is not None:
            self.stop_attempt(attempt, "run stopped")
            return AttemptResult(Outcome.RUN_STOPPED)
        if excluded is not None:
            self.events.emit("agent.excluded_seen", reason=excluded.get("reason"), by=excluded.get("by"))
            self.records.quietly("bump_epoch", lambda: self.scope.bump(epoch))  # the others re-form now
            self.stop_attempt(attempt, "excluded")
            return AttemptResult(Outcome.EXCLUDED)
        current = max(current, self._bumped)
        if current > epoch:
            self.events.emit("agent.epoch_seen", epoch=current, previous=epoch)
            self.stop_attempt(attempt, f"epoch {current}")
            return AttemptResult(Outcome.PEER_RESTART)
        return None

    def sdc_rollback(self, suspect: dict, epoch: int) -> None:
        """A replay verdict (:class:`~elastic.agent.replays.ReplayChecks`).  ``role`` ``rank``: the
        checked rank computed wrong, and every step from it on was trained on its corrupted gradient
        (the reduce-scatter spread it to every rank); ``verifier``: the verifying node's replay was
        wrong (nothing to roll back); None: no two replays agreed (roll back, blame nobody).  The
        suspect node gets a counted failure (the lemon policy excludes a node that does it again)
        and, in a run that can shrink, is excluded at once; a rollback records what a resume must not
        trust (checkpoints after the rank's last verified step, committed in this epoch or before)
        and moves the epoch on: every node restarts from the newest checkpoint before the corruption,
        the suspect re-screened first (:meth:`NodeAgent._sdc_rescreen`)."""
        node, step = str(suspect["node"]), int(suspect["step"])
        if self.run_ended and suspect.get("rollback", True):
            suspect = {**suspect, "rollback": False}  # nothing trains any more: say what to resume from
            self.events.emit("sdc.after_end", node=node, step=step, verified_step=suspect.get("verified_step"),
                             detail="the run had finished: its final weights hold the corruption; resume from a "
                                    f"checkpoint at or before step {suspect.get('verified_step') or step - 1}")
        detail = _sdc_detail(suspect)
        if suspect.get("role") is not None:
            self._sdc_fault(node, detail, step, epoch)
        if suspect.get("rollback", True) and not self._record_rollback(suspect, epoch):
            return  # etcd unreachable: the next check that sees it suspects again
        if suspect.get("role") is not None:
            self._sdc_exclude(node, detail, epoch)
        if suspect.get("rollback", True):
            moved = self.records.quietly("bump_epoch", lambda: self.scope.bump(epoch))
            self._bumped = max(self._bumped, moved if moved is not None else -1)

    def _sdc_fault(self, node: str, detail: str, step: int, epoch: int) -> None:
        self.records.quietly("record_failure", lambda: self.state.record_failure(node, "sdc", epoch))
        if self.records.quietly("record_fault", lambda: self.state.record_fault(
                epoch, node, {"kind": "sdc", "detail": detail, "step": step, "by": self.node_id})):
            self.events.emit("run.fault", epoch=epoch, node=node, failure_kind="sdc", detail=detail, step=step,
                             by=self.node_id)

    def _record_rollback(self, suspect: dict, epoch: int) -> bool:
        step, verified = int(suspect["step"]), suspect.get("verified_step")
        from_step = int(verified) + 1 if verified is not None and int(verified) < step else step
        record = self.records.quietly("sdc_rollback", lambda: self.state.record_sdc_rollback(
            from_step, epoch, str(suspect["node"]), int(suspect["rank"]), self.node_id,
            rescreen=suspect.get("role") == "rank"))
        if record is None:
            return False
        self.events.emit("sdc.rollback", from_step=record["from_step"], detected_step=step, verified_step=verified,
                         node=suspect["node"], rank=suspect["rank"], epoch=epoch)
        return True

    def _sdc_exclude(self, node: str, detail: str, epoch: int) -> None:
        """In an elastic run with a node to spare: the suspect leaves now (it sees its exclusion
        and goes; the others re-form without it).  A fixed-size run cannot train without it: it
        re-screens at the restart instead (and the lemon policy excludes a repeat offender)."""
        low = self.min_nodes
        if low is None:
            return
        nodes = self.records.quietly("heartbeats", lambda: self.state.heartbeats(epoch)) or {}
        if len(set(nodes) - {node}) < low:
            self.events.emit("sdc.kept", node=node, reason=f"the run needs {low} nodes and has {len(nodes)}")
            return
        ttl_s = self.config.failure.exclusion_ttl_s
        def exclude() -> bool:
            self.state.exclusions.add(node, f"sdc: {detail}", ttl_s=ttl_s, by=f"sdc/{self.node_id}")
            return True

        if self.records.quietly("exclude", exclude):
            self.events.emit("sdc.excluded", node=node, ttl_s=ttl_s, epoch=epoch)

    def _replace_hung(self, detail: str) -> bool:
        """In-process: the hung rank's process is killed and its slot goes to the spare like any
        dead worker's (the fault is pushed, the others re-form); the rest of the run goes on."""
        workers, pid = self.workers, self.monitor.culprit_pid
        if workers is None or not workers.detached or pid is None or workers.spare is None:
            return False
        if not workers.kill_hung(pid, detail):
            return False
        self.monitor.recovering()
        self.hangs.reset()
        return True

    def _screen_failed(self, attempt: TorchrunAttempt) -> AttemptResult | None:
        if self.screened is None or self.screened.passed:
            return None
        self.stop_attempt(attempt, self.screened.reason)
        return AttemptResult(Outcome.SCREEN_FAILED, detail=self.screened.reason)

    def _silence(self, attempt: TorchrunAttempt, epoch: int) -> AttemptResult | None:
        if self.monitor.first_step_at is None and attempt.in_rendezvous():
            # The warm-up clock starts when the rendezvous completes.  Waiting for nodes (a
            # fixed-size run short of one) ends as torchrun's rendezvous timeout, which names what
            # the run is missing and counts against no one, never as this node's init_timeout.
            self.monitor.started = self.monitor.clock()
            return None
        # The reports that came while this loop was blocked (a heartbeat put waits out an etcd
        # leader change, ~5 s) are read first: that time is the agent's silence, not the workers'.
        self._drain(attempt, epoch)
        verdict, detail = self.monitor.check()
        if verdict == Silence.NONE or self._numerics_step is not None:
            return None
        if verdict == Silence.SUSPECT:
            blame = self.hangs.step(epoch, {rank: view.pid for rank, view in self.monitor.ranks.items()})
            if blame is None:
                return None
            verdict, detail = Silence.CULPRIT, blame.detail
        kind = _SILENCE_KIND[verdict]
        self.events.emit("agent.hang_detected", verdict=verdict.value, detail=detail, epoch=epoch,
                         silent_s=round(self.monitor.silent_for(), 3))
        if verdict == Silence.CULPRIT and self._replace_hung(detail):
            return None
        # Tell the peers first: they are blocked behind this hang and should not each
        # wait out their own stall timeout while this node tears its workers down.
        self.records.quietly("bump_epoch", lambda: self.scope.bump(epoch))
        self.stop_attempt(attempt, f"{kind.value}: {detail}")
        return AttemptResult(Outcome.FAILED, None, kind=kind, detail=detail, attempt_dir=attempt.dir,
                             step=self.monitor.summary()["step"])
