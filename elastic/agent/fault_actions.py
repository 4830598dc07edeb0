"""What a node agent does for each chaos fault delivered to it (see :mod:`elastic.agent.remote_faults`).

Every action works on this node only: its own workers (pids from their reports), its own torchrun
tree, its own shard of the newest checkpoint, its own fault files (restricted to this node) and its
own diag readings.  An action returns what it did (pids, files, steps) for the result record, or
raises :class:`NotYet` when its target does not exist at this moment (the request stays armed).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastic.checkpoint.corrupt import Corruption, NothingToCorrupt, committed_steps, corrupt_newest
from elastic.common.procs import alive, descendants, signal_all
from elastic.worker.faults import FAULTS_DIR, write_fault


class NotYet(RuntimeError):
    """The fault's target or moment is not there yet; try again on a later poll."""


class BadRequest(ValueError):
    """The request cannot be executed as written (unknown fault, bad parameter)."""


@dataclass
class NodeView:
    """What the agent knows of its running attempt, from the supervisor."""

    node_id: str
    run_dir: Path
    checkpoint_root: Path
    torchrun_pid: int | None = None
    epoch: int = 0
    workers: dict[int, dict[str, int]] = field(default_factory=dict)
    """local rank -> {"pid", "rank"} of this attempt's workers (from their reports)."""
    step: int = 0
    """Newest step any worker of this attempt reported."""
    running: bool = False
    """An attempt is being watched (with a torchrun, or a node rejoining in-process without one)."""

    def new_attempt(self, torchrun_pid: int | None, epoch: int) -> None:
        self.torchrun_pid, self.epoch, self.workers, self.step = torchrun_pid, epoch, {}, 0
        self.running = True

    def observe(self, report: dict[str, Any]) -> None:
        if "pid" in report and "local_rank" in report:
            self.workers[int(report["local_rank"])] = {"pid": int(report["pid"]), "rank": int(report.get("rank", -1))}
        if report.get("type") == "step":
            self.step = max(self.step, int(report.get("step", 0)))

    def worker(self, local_rank: int | None) -> dict[str, int]:
        live = {lr: w for lr, w in sorted(self.workers.items()) if alive(w["pid"])}
        if local_rank is not None:
            live = {lr: w for lr, w in live.items() if lr == local_rank}
        if not live:
            raise NotYet(f"no live worker{'' if local_rank is None else f' with local rank {local_rank}'} yet")
        lr, found = next(iter(live.items()))
        return {"local_rank": lr, **found}


Action = Callable[[NodeView, dict[str, Any]], dict[str, Any]]


def _int(params: dict[str, Any], name: str, default: int | None = None) -> int | None:
    value = params.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"params.{name}: expected an integer, got {value!r}")
    return value


def _signal_worker(view: NodeView, params: dict[str, Any], sig: int) -> dict[str, Any]:
    worker = view.worker(_int(params, "local_rank"))
    os.kill(worker["pid"], sig)
    return {"pids": [worker["pid"]], "rank": worker["rank"], "local_rank": worker["local_rank"]}


def kill_worker(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    return _signal_worker(view, params, signal.SIGKILL)


def hang_worker(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    done = _signal_worker(view, params, signal.SIGSTOP)
    resume = params.get("resume_after_s")
    if resume is not None:
        timer = threading.Timer(float(resume), signal_all, args=(done["pids"], signal.SIGCONT))
        timer.daemon = True
        timer.start()
    return {**done, "resume_after_s": resume}


def kill_tree(view: NodeView) -> list[int]:
    """SIGKILL this node's torchrun, the workers that reported (they outlive a retired torchrun, and
    a node that rejoined in-process has none) and everything below them; the pids killed."""
    roots = [view.torchrun_pid] if view.torchrun_pid is not None else []
    roots += [w["pid"] for _, w in sorted(view.workers.items())]
    pids = list(dict.fromkeys(p for root in roots for p in (root, *descendants(root))))
    signal_all(pids, signal.SIGKILL)
    return pids


def kill_during_rendezvous(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    if view.torchrun_pid is None or view.step > 0 or view.epoch < (_int(params, "min_epoch", 1) or 0):
        raise NotYet("not in a rendezvous of the wanted epoch")
    what = params.get("what", "torchrun")
    if what not in ("torchrun", "agent"):
        raise BadRequest(f"params.what: expected torchrun or agent, got {what!r}")
    if what == "agent":
        return {"pids": [os.getpid()], "what": what, "epoch": view.epoch, "kill_self": True}
    return {"pids": kill_tree(view), "what": what, "epoch": view.epoch}


def kill_during_checkpoint(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    every, min_step = _int(params, "every", 0) or 0, _int(params, "min_step", 1) or 1
    if every <= 0:
        raise BadRequest("params.every: the checkpoint interval (> 0) is needed to tell a saving step")
    if view.step < min_step or view.step % every:
        raise NotYet(f"step {view.step} is not a checkpoint step >= {min_step}")
    return {**kill_worker(view, params), "checkpoint_step": view.step}


def corrupt_checkpoint(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    steps = committed_steps(view.checkpoint_root)
    if not steps or steps[-1] < (_int(params, "min_step", 0) or 0):
        raise NotYet(f"no committed checkpoint at or after step {params.get('min_step', 0)} yet")
    how = Corruption(mode=params.get("mode", "flip"), num_bytes=_int(params, "num_bytes", 16) or 16,
                     file=params.get("file"))
    ranks = {w["rank"] for w in view.workers.values()}
    try:
        return corrupt_newest(view.checkpoint_root, how, ranks or None)
    except NothingToCorrupt as exc:
        raise NotYet(str(exc)) from None


def bad_hardware(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    """Bad readings for this node's next diag screen (what the screener reads)."""
    readings = params.get("readings") or {"gemm": {"tflops_scale": 0.1}}
    directory = view.run_dir / FAULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path, tmp = directory / f"diag-{view.node_id}.yaml", directory / f".diag-{view.node_id}.yaml.tmp"
    tmp.write_text(yaml.safe_dump(readings, sort_keys=True))
    tmp.rename(path)
    return {"file": str(path), "readings": readings}


def _fault_file(view: NodeView, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec = {**spec, "node": view.node_id}  # only this node's workers fire it
    path = write_fault(view.run_dir, f"chaos-{view.node_id}-{name}", spec)
    return {"file": str(path), "spec": spec}


def _future_step(view: NodeView, params: dict[str, Any]) -> int:
    # A file fault names a future step; +2 because the fastest rank may already be inside step+1.
    return _int(params, "step") or view.step + 2


def straggler(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    start = _future_step(view, params)
    count = _int(params, "num_steps", 4) or 4
    return _fault_file(view, f"straggle-{start}", {"kind": "straggle", "from_step": start,
                                                   "to_step": start + count - 1,
                                                   "delay_s": float(params.get("delay_s", 0.3))})


def nan(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    step = _future_step(view, params)
    return _fault_file(view, f"nan-{step}", {"kind": "nan_loss", "step": step})


def ckpt_write_error(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    """The save of the asked step, or without one the first save from two steps on: a step picked
    from the clock is rarely a save step (soak seed 2 planted step 642 with saves every 10, and it
    never fired)."""
    step = _future_step(view, params)
    when = {"step": step} if _int(params, "step") else {"from_step": step}
    return _fault_file(view, f"ckpt-write-{step}", {"kind": "ckpt_write_error", **when})


def sdc(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    """One bit flipped in one gradient shard of this node's workers at a step (silent: no event)."""
    step = _future_step(view, params)
    spec: dict[str, Any] = {"kind": "sdc", "step": step}
    for name in ("rank", "bit", "param", "element"):
        value = _int(params, name)
        if value is not None:
            spec[name] = value
    at = params.get("at", "shard")
    if at not in ("shard", "local", "replay"):
        raise BadRequest(f"params.at: expected 'shard', 'local' or 'replay', got {at!r}")
    if at != "shard":
        spec["at"] = at
    return _fault_file(view, f"sdc-{step}", spec)


def kill_agent(view: NodeView, params: dict[str, Any]) -> dict[str, Any]:
    """The node is lost: the agent records what it does, then kills its tree and itself."""
    return {"pids": [os.getpid()], "workers": [w["pid"] for w in view.workers.values()], "kill_self": True}


ACTIONS: dict[str, Action] = {
    "kill_worker": kill_worker, "hang_worker": hang_worker, "kill_agent": kill_agent,
    "kill_during_rendezvous": kill_during_rendezvous, "kill_during_checkpoint": kill_during_checkpoint,
    "corrupt_checkpoint": corrupt_checkpoint, "bad_hardware": bad_hardware, "straggler": straggler,
    "nan": nan, "ckpt_write_error": ckpt_write_error, "sdc": sdc,
}
NEEDS_WORKERS = frozenset({"kill_worker", "hang_worker", "kill_during_checkpoint"})
