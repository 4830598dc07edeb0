"""The fault catalogue: one injector class per fault kind, registered by name.

An injector gets an :class:`InjectionContext` (the run directory, the events
seen so far, the etcd endpoint, the node list) and does one thing to the run:
signal a process, write an in-worker fault file, corrupt a checkpoint, freeze
etcd, or plant a bad hardware reading.  It returns an :class:`InjectionRecord`
saying exactly what it did (which pids, which file, which step), which the
runner writes to ``<run_dir>/events/chaos.jsonl`` as a ``chaos.inject`` event.

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
    EtcdOutage,
    OutageParams,
    checkpoint_root,
    newest_committed,
)
from chaos.worker_faults import CheckpointWriteError, NanLoss, Straggler  # noqa: E402,F401
from chaos.netfaults import EtcdLatency, Partition  # noqa: E402,F401
