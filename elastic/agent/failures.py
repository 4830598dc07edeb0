"""After a failed attempt: what was it, does it count, and what does the policy say to do.

:class:`FailureHandler` turns an :class:`~elastic.agent.attempt.AttemptResult` into a
:class:`Decision` (class, detail, counted, action); the agent carries the action out.  A
failure caused by another node (a lost peer, a stall behind a hung peer) is not counted
against this node's restart budget or its lemon record.  A numerics failure is a rollback:
the bad batch range is recorded once for the run (:meth:`RunState.record_rollback`).  A counted
failure is this node's fault: it is recorded once as the run's fault record for the epoch
(:meth:`RunState.record_fault`) and announced as one ``run.fault`` event.  A rendezvous that
timed out says what the run is missing: which node was lost, how many nodes it needs.

:class:`ProgressGuard` stops a crash loop: too many restarts (any cause) without a new
committed checkpoint stop the run instead of burning the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.agent.attempt import AttemptResult
from elastic.agent.classify import UNCOUNTED, FailureKind, classify
from elastic.agent.config import FailurePolicy
from elastic.common.events import EventLog
from elastic.control.runstate import RollbackVerdict, RunState
from elastic.control.store import StoreError


@dataclass(frozen=True)
class Decision:
    kind: FailureKind
    detail: str
    counted: bool
    action: str  # restart | rescreen | exclude | stop (a rollback resolves to restart or stop)
    reason: str = ""  # for stop / exclude: the one line that says why


_PEER_FAULTS = frozenset({FailureKind.PEER_LOST, FailureKind.STALL, FailureKind.RECOVERY_FAILED})


class FailureHandler:
    def __init__(self, policy: FailurePolicy, node_id: str, state: RunState, events: EventLog,
                 needs: tuple[str, int] = ("", 0)) -> None:
        self.policy = policy
        self.node_id = node_id
        self.state = state
        self.events = events
        self.needs = needs  # (launch.nodes, rendezvous.join_timeout_s): what a rendezvous timeout waited for
        self.failures = 0  # counted failures of this node

    def decide(self, result: AttemptResult, epoch: int) -> Decision:
        kind, detail = (result.kind, result.detail) if result.kind else _classify(result)
        if kind == FailureKind.RENDEZVOUS_TIMEOUT:
            detail = self._missing_nodes(detail)
        action = self.policy.action(kind.value)
        counted = kind not in UNCOUNTED
        if action == "rollback":
            verdict = self._rollback(result.numerics_step, detail, epoch)
            if verdict.action == "stop":
                return Decision(kind, detail, False, "stop", verdict.reason)
            counted = counted and verdict.action != "duplicate"  # one NaN, reported by every node
            action = "restart"
        if counted:
            self.failures += 1
            self._record(kind, detail, epoch, result.step, result.gen)
        elif kind in _PEER_FAULTS:  # another node's fault: say where the run stood (the leader names the node)
            self._notice(kind, epoch, result.step)
        return Decision(kind, detail, counted, action, f"{kind.value}: {detail}")

    def _notice(self, kind: FailureKind, epoch: int, step: int | None) -> None:
        try:
            self.state.notice_fault(epoch, step, self.node_id, kind.value)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="notice_fault", error=str(exc))

    def _record(self, kind: FailureKind, detail: str, epoch: int, step: int | None, gen: int | None = None) -> None:
        """This node's counted failure: its lemon record, and the run's one record of this fault."""
        try:
            self.state.record_failure(self.node_id, kind.value, epoch)
            if self.state.record_fault(epoch, self.node_id, {"kind": kind.value, "detail": detail, "step": step,
                                                              "by": self.node_id}, gen):
                self.events.emit("run.fault", epoch=epoch, node=self.node_id, failure_kind=kind.value, detail=detail,
                                 step=step, by=self.node_id, **({"gen": gen} if gen is not None else {}))
        except StoreError as exc:
            self.events.emit("agent.store_error", op="record_failure", error=str(exc))

    def _missing_nodes(self, detail: str) -> str:
        """``node2 lost at step 7; the run needs 3 nodes (launch.nodes=3), none joined within 300s``."""
        nodes, timeout_s = self.needs
        if not nodes:
            return detail
        need = f"the run needs {nodes.split(':')[0]} nodes (launch.nodes={nodes})"
        try:
            lost = [f for f in self.state.faults() if f.get("kind") == "node_lost"]
        except StoreError:
            lost = []
        if not lost:
            return f"{need}; not enough joined within {timeout_s}s (rendezvous.join_timeout_s)"
        last = lost[-1]
        return (f"node {last.get('node')} lost at step {last.get('step')}; {need}, "
                f"none joined within {timeout_s}s (rendezvous.join_timeout_s)")

    def _rollback(self, bad_step: int | None, detail: str, epoch: int) -> RollbackVerdict:
        if bad_step is None:
            return RollbackVerdict("stop", f"numerics failure without a step ({detail})")
        verdict = self.state.record_rollback(bad_step, epoch, self.node_id, self.policy.skip_before,
                                             self.policy.max_rollbacks)
        if verdict.action == "rollback":
            self.events.emit("agent.rollback", bad_step=bad_step, skip=[list(r) for r in verdict.skip],
                             rollbacks=verdict.rollbacks, detail=detail)
        return verdict


def _classify(result: AttemptResult) -> tuple[FailureKind, str]:
    assert result.attempt_dir is not None
    try:
        log = (result.attempt_dir / "torchrun.log").read_text(errors="replace")
    except OSError:
        log = ""
    return classify(result.attempt_dir, result.rc, log, numerics_reported=result.numerics_step is not None)


class ProgressGuard:
    """Counts restarts since the last new committed checkpoint; says when to give up."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.last_commit = -1
        self.restarts_since_progress = 0

    def observe_commit(self, step: int) -> None:
        if step > self.last_commit:
            self.last_commit = step
            self.restarts_since_progress = 0

    def restarted(self) -> None:
        self.restarts_since_progress += 1

    def check(self, latest: dict | None) -> str | None:
        """After a restart: None to go on, or why the run should stop."""
        if latest and int(latest.get("step", -1)) > self.last_commit:
            self.last_commit = int(latest["step"])
            self.restarts_since_progress = 1  # progress since the last restart: only this one counts
        if self.limit and self.restarts_since_progress > self.limit:
            return (f"no progress: {self.restarts_since_progress - 1} restarts without a new "
                    f"committed checkpoint (no_progress_restarts={self.limit})")
        return None
