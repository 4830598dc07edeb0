"""The fault catalogue: one injector class per fault kind, registered by name.

An injector gets an :class:`InjectionContext` (the run directory, the events
seen so far, the etcd endpoint, the node list) and does one thing to the run:
signal a process (a worker, a warm spare, an agent), write an in-worker fault
file, corrupt a checkpoint, freeze etcd or one member of it, or plant a bad
hardware reading.  It returns an :class:`InjectionRecord` saying exactly what it
did (which pids, which file, which step), which the runner writes to
``<run_dir>/events/chaos.jsonl`` as a ``chaos.inject`` event.

Some faults only make sense at a moment the runner cannot name by step or
time (while agents are in a rendezvous, while a checkpoint is being written);
their injector says so through :meth:`Injector.ready`, and the runner fires
them at the first poll where ``ready`` holds after their trigger.

An injector that cannot find its target right now (no live worker during a
restart, no committed checkpoint yet) raises :class:`TargetNotFound`; the
runner retries it for a while and then records the fault as not injected.
Injectors that leave something to undo (a stopped process, a respawned etcd)
undo it in :meth:`Injector.cleanup`, which the runner always calls.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Literal

from chaos.follow import parse_target
from chaos.injection import (  # noqa: F401  (the catalogue's public names)
    REGISTRY,
    InjectionContext,
    InjectionRecord,
    Injector,
    NoParams,
    TargetNotFound,
    _kill,
    _rank_of,
    register,
)
from elastic.common.procs import alive


# -- process signals -------------------------------------------------------------
@register("kill_worker")
class KillWorker(Injector):
    """SIGKILL one training worker (target ``nodeN``, ``rankR`` or ``nodeN/rankR``)."""

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        worker = ctx.follower.worker(self.target)
        if worker is None:
            raise TargetNotFound(f"no live worker for {self.target!r}")
        _kill(int(worker["pid"]), signal.SIGKILL)
        return self._record(ctx, [int(worker["pid"])], node=worker.get("node"), rank=_rank_of(worker["source"]))


@register("kill_during_recovery")
class KillDuringRecovery(KillWorker):
    """SIGKILL one worker while the run re-forms after an earlier fault (a second fault mid-recovery).

    Under ``chaos run`` it waits for the moment in the events: a replacement worker (a spare that
    took a dead worker's slot, or a restarted worker) has started but not trained a step yet.  In
    ``chaos suite`` / ``chaos soak`` plans it follows another kill (``after`` and ``delay_s``): the
    soak fires it 0.1 s after a ``kill_worker`` (``chaos.soak.RECOVERY_KILL_DELAY_S``), on any node.
    """

    def ready(self, ctx: InjectionContext) -> bool:
        return bool(reforming(ctx))


def reforming(ctx: InjectionContext) -> list[int]:
    """Pids of live replacement workers that have not trained a step yet (the run is re-forming)."""
    steps = ctx.follower.of_kind("trainer.step")
    if not steps:
        return []  # the run's first start is no recovery
    stepped = {e["pid"] for e in steps}
    first = steps[0]["ts"]
    joining = {int(e["pid"]) for e in ctx.follower.of_kind("trainer.start") if e["ts"] > first}
    joining |= {int(e["spare_pid"]) for e in ctx.follower.of_kind("agent.inprocess_replace") if e.get("spare_pid")}
    return sorted(pid for pid in joining if pid not in stepped and alive(pid))


@register("kill_spare")
class KillSpare(Injector):
    """SIGKILL a node's warm spare (``python -m elastic.worker.spare``, in-process recovery's standby).

    The pid is the one in the node agent's newest ``agent.spare_started`` event; a spare that has
    since taken a dead worker's slot (``agent.inprocess_replace``) is a worker, never this target.
    Training goes on: the agent has to notice the death and start another spare before the next
    worker death needs one.
    """

    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        node, _ = parse_target(self.target)
        found = live_spare(ctx, node)
        if found is None:
            raise TargetNotFound(f"no live warm spare for {self.target!r}")
        spare_node, pid = found
        _kill(pid, signal.SIGKILL)
        return self._record(ctx, [pid], node=spare_node)


def live_spare(ctx: InjectionContext, node: str | None) -> tuple[str, int] | None:
    """(node, pid) of a live, unassigned warm spare of ``node`` (any node when None)."""
    taken = {int(e["spare_pid"]) for e in ctx.follower.of_kind("agent.inprocess_replace") if e.get("spare_pid")}
    newest: dict[str, int] = {}
    for e in ctx.follower.of_kind("agent.spare_started"):
        newest[e.get("source", "").partition("/")[2]] = int(e.get("spare_pid") or 0)
    for name, pid in sorted(newest.items()):
        if (node is None or name == node) and pid not in taken and _is_spare(pid):
            return name, pid
    return None


def _is_spare(pid: int) -> bool:
    # The pid must still be the spare the event named (a zombie's cmdline is empty; pids get reused).
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"elastic.worker.spare" in fh.read() and alive(pid)
    except OSError:
        return False


@register("kill_agent")
class KillAgent(Injector):
    """SIGKILL a node agent: the whole node is lost (its torchrun and workers die with it)."""

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        node, _ = parse_target(self.target)
        pid = ctx.follower.agent_pid(node or "")
        if pid is None or not alive(pid):
            raise TargetNotFound(f"no live agent for {self.target!r}")
        below = [int(w["pid"]) for w in ctx.follower.workers() if w.get("node") == node]
        _kill(pid, signal.SIGKILL)
        return self._record(ctx, [pid], node=node, workers=below)


@dataclass(kw_only=True)
class HangParams:
    resume_after_s: float | None = None
    """SIGCONT the worker after this many seconds; None leaves it stopped for the runtime to find."""


@register("hang_worker")
class HangWorker(Injector):
    """SIGSTOP one worker: it stays alive but makes no progress (a hung collective, a stuck kernel)."""

    Params = HangParams

    def __init__(self, target: str, params: Any = None) -> None:
        super().__init__(target, params)
        self._stopped: list[int] = []
        self._timer: threading.Timer | None = None

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        worker = ctx.follower.worker(self.target)
        if worker is None:
            raise TargetNotFound(f"no live worker for {self.target!r}")
        pid = int(worker["pid"])
        _kill(pid, signal.SIGSTOP)
        self._stopped.append(pid)
        if self.params.resume_after_s is not None:
            self._timer = threading.Timer(self.params.resume_after_s, self._resume)
            self._timer.daemon = True
            self._timer.start()
        return self._record(ctx, [pid], node=worker.get("node"), rank=_rank_of(worker["source"]),
                            resume_after_s=self.params.resume_after_s)

    def _resume(self) -> None:
        for pid in self._stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def cleanup(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._resume()  # a stopped process never handles SIGTERM; never leave one behind


@dataclass(kw_only=True)
class WhatParams:
    what: Literal["torchrun", "agent"] = "torchrun"
    """Which process of the target node to SIGKILL."""
    min_epoch: int = 1
    """Only a rendezvous of this epoch or later counts (0 includes the first one)."""


@register("kill_during_rendezvous")
class KillDuringRendezvous(Injector):
    """SIGKILL a node's torchrun (or agent) while its agents are in a rendezvous.

    "In a rendezvous" is read from events: the node's agent reported RUNNING
    for an epoch but no worker of that epoch has reported ``trainer.start``.
    """

    Params = WhatParams

    def _pending_round(self, ctx: InjectionContext) -> dict | None:
        node, _ = parse_target(self.target)
        running = ctx.follower.torchrun(node or "")
        if running is None or int(running.get("epoch", 0)) < self.params.min_epoch:
            return None
        started = [e for e in ctx.follower.of_kind("trainer.start") if e.get("ts", 0) > running["ts"]]
        return None if started else running

    def ready(self, ctx: InjectionContext) -> bool:
        return self._pending_round(ctx) is not None

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        running = self._pending_round(ctx)
        if running is None:
            raise TargetNotFound(f"{self.target!r} is not in a rendezvous")
        node, _ = parse_target(self.target)
        pid = int(running["torchrun_pid"]) if self.params.what == "torchrun" else ctx.follower.agent_pid(node or "")
        if pid is None or not alive(pid):
            raise TargetNotFound(f"{self.params.what} of {self.target!r} is not alive")
        _kill(pid, signal.SIGKILL)
        return self._record(ctx, [pid], node=node, what=self.params.what, epoch=running.get("epoch"),
                            running_ts=running["ts"])


@dataclass(kw_only=True)
class CheckpointKillParams:
    min_step: int = 1
    """Only a checkpoint save of this step or later is a target."""


@register("kill_during_checkpoint")
class KillDuringCheckpoint(Injector):
    """SIGKILL a worker between its ``checkpoint.save_start`` and ``checkpoint.committed`` events."""

    Params = CheckpointKillParams

    def _saving(self, ctx: InjectionContext) -> dict | None:
        node, rank = parse_target(self.target)
        live = {int(w["pid"]): w for w in ctx.follower.workers()}
        committed = {(e["pid"], e["step"]) for e in ctx.follower.of_kind("checkpoint.committed")}
        for e in reversed(ctx.follower.of_kind("checkpoint.save_start")):
            worker = live.get(int(e["pid"]))
            if worker is None or e["step"] < self.params.min_step or (e["pid"], e["step"]) in committed:
                continue
            if node is not None and worker.get("node") != node:
                continue
            if rank is not None and e["source"] != f"trainer/rank{rank}":
                continue
            return e
        return None

    def ready(self, ctx: InjectionContext) -> bool:
        return self._saving(ctx) is not None

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        saving = self._saving(ctx)
        if saving is None:
            raise TargetNotFound(f"no worker of {self.target!r} is saving a checkpoint")
        _kill(int(saving["pid"]), signal.SIGKILL)
        return self._record(ctx, [int(saving["pid"])], rank=_rank_of(saving["source"]),
                            checkpoint_step=saving["step"], save_start_ts=saving["ts"])


# The other fault families register themselves on import; their names are part of the catalogue.
from chaos.state_faults import (  # noqa: E402,F401
    BadHardware,
    CorruptCheckpoint,
    EtcdMemberStop,
    EtcdOutage,
    MemberStopParams,
    OutageParams,
    checkpoint_root,
    newest_committed,
)
from chaos.worker_faults import CheckpointWriteError, NanLoss, Straggler  # noqa: E402,F401
from chaos.netfaults import EtcdLatency, Partition  # noqa: E402,F401
