"""Restart scopes: what a failure on this node restarts, and how torchrun forms again.

* :class:`RunScope` (the default): the whole run re-forms.  Every torchrun is started with
  rendezvous id ``<run>-e<epoch>``, so each recovery gets a fresh rendezvous: no stale
  participants to wait out, and torch closing the old round on exit cannot block the new one.
  A failing agent bumps the run-wide epoch (compare-and-swap, so concurrent failures bump it
  once); every other agent sees the bump, stops its healthy workers and rejoins.
* :class:`ReplicaScope` (``replicas.enabled``, torchft): this node is one replica group whose
  torchrun forms alone (``--nnodes=1``, a fresh rendezvous id per attempt); a failure restarts
  this group only, the others keep training and the restarted group heals from them.

The agent calls the scope instead of branching on the mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from elastic.agent.attempt import AttemptResult, NodeSpec, Outcome
from elastic.agent.classify import FailureKind
from elastic.common.events import EventLog
from elastic.control.runstate import RunState
from elastic.replicas.config import ReplicaConfig
from elastic.replicas.runtime import LighthouseUnavailable, ReplicaRuntime


@dataclass
class Preparation:
    """Before an attempt: extra worker environment, or the attempt's result without running it."""

    env: dict[str, str] = field(default_factory=dict)
    result: AttemptResult | None = None


class RestartScope(Protocol):
    name: str

    def target(self, epoch: int, attempt: int) -> tuple[str, str]:
        """torchrun's ``--nnodes`` and ``--rdzv-id`` for this attempt."""

    def bump(self, epoch: int) -> int:
        """Ask every node of this scope to re-form after ``epoch``; returns the current epoch."""

    def prepare(self, attempt: int, stopping: Callable[[], bool]) -> Preparation: ...

    def join_running(self, fresh_after_s: float) -> None:
        """A node (re)joining a run that trains without it: make the run grow."""

    def on_leader_tick(self, is_leader: bool, lease_id: int | None) -> None: ...

    def close(self, succeeded: bool) -> None: ...


class RunScope:
    """The whole run re-forms under a new epoch (see the module docstring)."""

    name = "run"

    def __init__(self, spec: NodeSpec, state: RunState, events: EventLog) -> None:
        self.spec = spec
        self.state = state
        self.events = events

    def target(self, epoch: int, attempt: int) -> tuple[str, str]:
        return self.spec.nnodes, f"{self.spec.run_id}-e{epoch}"

    def bump(self, epoch: int) -> int:
        current, moved = self.state.bump_epoch(epoch)
        if moved:
            self.events.emit("agent.epoch_bump", epoch=current)
        return current

    def prepare(self, attempt: int, stopping: Callable[[], bool]) -> Preparation:
        return Preparation()

    def join_running(self, fresh_after_s: float) -> None:
        if self.state.done_record() is not None:
            return
        epoch = self.state.epoch()
        fresh = time.time() - fresh_after_s
        for node, hb in self.state.heartbeats(epoch=epoch).items():
            if node != self.spec.node_id and hb.get("ts", 0) > fresh and hb.get("step", 0) > 0:
                self.events.emit("agent.join_running", epoch=epoch, seen=hb.get("node"))
                self.bump(epoch)
                return

    def on_leader_tick(self, is_leader: bool, lease_id: int | None) -> None:
        pass

    def close(self, succeeded: bool) -> None:
        pass


class ReplicaScope:
    """This node is one torchft replica group that restarts alone (see the module docstring)."""

    name = "replica_group"

    def __init__(self, runtime: ReplicaRuntime, state: RunState, events: EventLog) -> None:
        self.runtime = runtime
        self.state = state
        self.events = events

    def target(self, epoch: int, attempt: int) -> tuple[str, str]:
        return "1", self.runtime.rdzv_id(attempt)

    def bump(self, epoch: int) -> int:
        return epoch  # replica groups restart alone: nothing run-wide to re-form

    def prepare(self, attempt: int, stopping: Callable[[], bool]) -> Preparation:
        if self.state.done_record() is not None:
            # Another group finished the run: a group (re)starting now would train alone from scratch.
            self.events.emit("replicas.run_done_by_peers", attempt=attempt)
            return Preparation(result=AttemptResult(Outcome.SUCCEEDED, 0))
        try:
            return Preparation(env=self.runtime.worker_env(self.runtime.lighthouse_address(stopping)))
        except LighthouseUnavailable as exc:
            if stopping():
                return Preparation(result=AttemptResult(Outcome.STOPPED))
            return Preparation(result=AttemptResult(Outcome.FAILED, None, kind=FailureKind.RENDEZVOUS_TIMEOUT,
                                                    detail=str(exc)))

    def join_running(self, fresh_after_s: float) -> None:
        pass  # a restarted group heals from its peers through torchft; nobody else re-forms

    def on_leader_tick(self, is_leader: bool, lease_id: int | None) -> None:
        # The Lighthouse address is bound to this node's lease: it goes when this agent does.
        self.runtime.tick(is_leader, lease_id)

    def close(self, succeeded: bool) -> None:
        self.runtime.close(drain=succeeded)


def make_scope(spec: NodeSpec, state: RunState, events: EventLog, replicas: ReplicaConfig | None) -> RestartScope:
    """The restart scope of a node: its replica group in replica-group mode, else the whole run."""
    if replicas is None or not replicas.enabled:
        return RunScope(spec, state, events)
    runtime = ReplicaRuntime(replicas, state, spec.node_id, spec.run_id, spec.run_dir, events, spec.local_addr)
    return ReplicaScope(runtime, state, events)
