"""Lost nodes: the leader names a node whose agent vanished, once per fault.

Every agent keeps its node record (``nodes/<node>``) and heartbeat on its lease, and an entry on
the run's roster (``members/<node>``, no lease): ``joined`` when it registers, its final state
when it leaves cleanly.  A roster entry still ``joined`` without a live node record means the
lease expired: the agent, and with it the node, is gone.  The roster outlives every agent, so a
leader elected after the loss (the lost node may have been the leader) still finds it.  The
leader then

* writes the run's fault record for the epoch the node was last seen in
  (:meth:`RunState.record_fault`, create-only: a second leader or a second look writes nothing),
* emits one ``run.fault`` event naming the node and the step it was lost at: where the first
  surviving agent to notice the fault found its workers (:meth:`RunState.notice_fault`), else the
  lost node's last heartbeat (published every few seconds, so it may lag),
* records a counted ``node_lost`` failure of that node, so the lemon-node policy
  (:class:`~elastic.control.leader.ClusterPolicy`) excludes a node that keeps vanishing, and
* marks the roster entry ``lost`` (a node that comes back registers as ``joined`` again).

A missing record is judged (:class:`Absences`) before any of that: lost once it has stayed away
``agent.leader.lost_grace_s``, and never while the leader's own record is missing too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic.common.events import EventLog
from elastic.control.runstate import RunState


class Absences:
    """Nodes whose record is missing, and since when: which of them count as lost now.

    Lost after ``grace_s`` away; none while the judge's own node is among them: its agent is alive
    (it judges), so etcd dropped live agents' leases (a paused leader member that resumed revoked
    every lease at once: the leader declared three of four live nodes lost and the run restarted,
    chaos soak), and the others are as likely alive: their agents register again on a new lease."""

    def __init__(self, me: str, grace_s: float, clock: Callable[[], float]) -> None:
        self.me, self.grace_s, self.clock = me, grace_s, clock
        self._since: dict[str, float] = {}

    def judge(self, missing: set[str]) -> set[str]:
        now = self.clock()
        self._since = {node: self._since.get(node, now) for node in missing}
        if self.me in missing:
            return set()
        return {node for node, since in self._since.items() if now - since >= self.grace_s}


class LostNodes:
    """The leader's check of the roster against the live node records."""

    def __init__(self, state: RunState, leader_id: str, events: EventLog, grace_s: float = 0.0) -> None:
        self.state = state
        self.leader_id = leader_id
        self.events = events
        self.absences = Absences(leader_id, grace_s, state.clock)
        self._beats: dict[str, dict[str, Any]] = {}  # node -> newest heartbeat seen (epoch, step)

    def evaluate(self, nodes: dict[str, dict[str, Any]], heartbeats: dict[str, dict[str, Any]]) -> list[str]:
        """One look; the nodes this look reported lost (each fault once)."""
        self._beats.update(heartbeats)
        gone = self.absences.judge({node for node, member in self.state.members().items()
                                    if member.get("state") == "joined" and node not in nodes})
        if not gone or self.state.done_record() is not None:
            return []
        return [node for node in sorted(gone) if self._report(node)]

    def _report(self, node: str) -> bool:
        beat = self._beats.pop(node, {})
        epoch = int(beat["epoch"]) if "epoch" in beat else self._last_noticed_epoch()
        noticed = self.state.noticed(epoch) or {}
        step = noticed.get("step") if noticed.get("step") is not None else beat.get("step")
        detail = f"agent of {node} vanished (its lease expired) in epoch {epoch}"
        record = {"kind": "node_lost", "step": step, "detail": detail, "by": f"leader/{self.leader_id}"}
        created = self.state.record_fault(epoch, node, record)
        self.state.set_member(node, "lost")
        if not created:
            return False  # another leader reported this fault already
        self.events.emit("run.fault", epoch=epoch, node=node, failure_kind="node_lost", step=step, detail=detail,
                         by=f"leader/{self.leader_id}")
        self.state.record_failure(node, "node_lost", epoch)
        return True

    def _last_noticed_epoch(self) -> int:
        """This leader never saw the node's heartbeat: the newest epoch whose fault a survivor noticed."""
        current = self.state.epoch()
        return next((e for e in range(current, max(current - 8, -1), -1) if self.state.noticed(e)), current)
