"""Chaos faults delivered through etcd, executed by this node's agent.

The ``chaos`` tool cannot signal a process on another host, so it writes a request under
``chaos/requests/<node>/<id>`` (:class:`~elastic.control.keys.RunKeys`) and the target node's
agent carries it out locally (:mod:`elastic.agent.fault_actions`): kill or SIGSTOP a worker,
kill its own tree and itself, corrupt its shard of the newest checkpoint, plant bad readings
for its next screen, slow a step, inject a NaN.  A request is::

    {"id": "0003", "fault": "kill_worker", "params": {"local_rank": 0}, "at_step": 18,
     "after": "0002", "wait_s": 120, "node": "node1", "run_id": "r1", "ts": ..., "mac": "..."}

``at_step`` fires it on the first step report at or past that step (the agent sees every
report; a remote poller would not be that precise), ``after`` waits for another request of this
node to have run, ``wait_s`` bounds how long it may wait for its moment.  Every request gets one
result record under ``chaos/results/<node>/<id>``: what was done (pids, files, step), or why it
was refused.  Refused: this agent was not started with ``--allow-chaos`` (``agent.chaos.enabled``,
off by default), the run has a token and the MAC does not verify (:mod:`elastic.control.faultauth`),
the request is stale or for another node, or it names an unknown fault.

The supervisor drives this object: :meth:`attach` at each attempt, :meth:`observe` per worker
report, :meth:`poll` every loop; the agent calls :meth:`poll` once before its pre-flight screen.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.agent.config import ChaosConfig
from elastic.agent.fault_actions import ACTIONS, NEEDS_WORKERS, BadRequest, NodeView, NotYet, kill_tree
from elastic.common.events import EventLog
from elastic.control.faultauth import refusal
from elastic.control.runstate import RunState
from elastic.control.store import StoreError

DISABLED = "chaos faults are disabled on this node (start it with --allow-chaos or agent.chaos.enabled: true)"


@dataclass
class _Armed:
    request_id: str
    request: dict[str, Any]
    since: float
    last_wait: str = ""


class RemoteFaults:
    def __init__(self, config: ChaosConfig, node_id: str, run_id: str, run_dir: Path, checkpoint_root: Path,
                 state: RunState, events: EventLog, token: str | None) -> None:
        self.config = config
        self.node_id = node_id
        self.run_id = run_id
        self.state = state
        self.events = events
        self._token = token  # in memory only, like the admission's
        self.view = NodeView(node_id, run_dir, checkpoint_root)
        self.armed: dict[str, _Armed] = {}
        self.handled: set[str] = set()
        self._next_fetch = 0.0

    # -- fed by the supervisor ---------------------------------------------------------
    def attach(self, torchrun_pid: int | None, epoch: int) -> None:
        self.view.new_attempt(torchrun_pid, epoch)

    def observe(self, report: dict[str, Any]) -> None:
        self.view.observe(report)
        if report.get("type") == "step" and self.armed:
            self._fire_ready()

    def poll(self) -> None:
        now = time.monotonic()
        if now >= self._next_fetch:
            self._next_fetch = now + self.config.poll_s
            self._fetch()
        if self.armed:
            self._fire_ready()

    # -- requests ---------------------------------------------------------------------
    def _fetch(self) -> None:
        try:
            requests = self.state.fault_requests(self.node_id)
            fresh = {i: r for i, r in requests.items() if i not in self.handled and i not in self.armed}
            done = set(self.state.fault_results(self.node_id)) if fresh else set()
        except StoreError:
            return  # etcd unreachable: the requests wait for the next poll
        for request_id in sorted(fresh):
            if request_id in done:  # handled before this agent (re)started
                self.handled.add(request_id)
                continue
            self._accept(request_id, fresh[request_id])

    def _accept(self, request_id: str, request: dict[str, Any]) -> None:
        why = DISABLED if not self.config.enabled else refusal(
            request, self._token, self.run_id, self.node_id, self.config.max_age_s)
        if why is None and request.get("fault") not in ACTIONS:
            why = f"unknown fault {request.get('fault')!r} (this agent executes: {', '.join(sorted(ACTIONS))})"
        if why is not None:
            self._finish(request_id, request, refused=why)
            return
        self.armed[request_id] = _Armed(request_id, request, time.monotonic())
        self.events.emit("agent.chaos_armed", id=request_id, fault=request["fault"], at_step=request.get("at_step"),
                         after=request.get("after"))

    def _fire_ready(self) -> None:
        for request_id in sorted(self.armed):
            armed = self.armed.get(request_id)
            if armed is not None:
                self._try(armed)

    def _try(self, armed: _Armed) -> None:
        request = armed.request
        try:
            self._check_moment(request)
            detail = ACTIONS[request["fault"]](self.view, dict(request.get("params") or {}))
        except NotYet as exc:
            armed.last_wait = str(exc)
            if time.monotonic() - armed.since > float(request.get("wait_s", 300)):
                self._finish(armed.request_id, request, refused=f"its moment never came: {exc}")
            return
        except (BadRequest, OSError, ValueError, TypeError) as exc:
            self._finish(armed.request_id, request, refused=f"could not execute: {exc}")
            return
        self._finish(armed.request_id, request, detail=detail)
        if detail.get("kill_self"):
            self._kill_self()

    def _check_moment(self, request: dict[str, Any]) -> None:
        at_step = request.get("at_step")
        if at_step is not None and self.view.step < int(at_step):
            raise NotYet(f"step {self.view.step} < {at_step}")
        after = request.get("after")
        if after and after not in self.handled:
            raise NotYet(f"waits for request {after}")
        if request["fault"] in NEEDS_WORKERS and not self.view.running:
            raise NotYet("no running attempt")

    def _finish(self, request_id: str, request: dict[str, Any], detail: dict[str, Any] | None = None,
                refused: str | None = None) -> None:
        self.armed.pop(request_id, None)
        self.handled.add(request_id)
        result = {"id": request_id, "fault": request.get("fault"), "node": self.node_id, "executed": refused is None,
                  "refused": refused, "detail": detail or {}, "pids": (detail or {}).get("pids", []),
                  "step": self.view.step, "epoch": self.view.epoch, "ts": time.time(), "agent_pid": os.getpid()}
        kind = "agent.chaos_executed" if refused is None else "agent.chaos_refused"
        self.events.emit(kind, id=request_id, fault=request.get("fault"), reason=refused, step=self.view.step,
                         detail=detail or {})
        try:
            self.state.put_fault_result(self.node_id, request_id, result)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="chaos_result", error=str(exc))

    def _kill_self(self) -> None:
        """A lost node: no clean-up, no lease revoke; the tree first so nothing is orphaned."""
        self.events.close()
        kill_tree(self.view)
        os.kill(os.getpid(), signal.SIGKILL)
