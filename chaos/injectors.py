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

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import yaml

from chaos.follow import RunFollower, parse_target
from elastic.run.schema import RESOLVED_NAME, load_run_file
from elastic.worker.faults import FAULTS_DIR, write_fault
from elastic.common.procs import alive

REGISTRY: dict[str, type["Injector"]] = {}


class TargetNotFound(RuntimeError):
    """The fault's target does not exist at this moment (try again later)."""


def register(name: str) -> Callable[[type["Injector"]], type["Injector"]]:
    """Class decorator: make an injector available under ``name`` (names are unique)."""

    def deco(cls: type[Injector]) -> type[Injector]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"fault {name!r} is already registered by {REGISTRY[name].__name__}")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


@dataclass
class InjectionContext:
    run_dir: Path
    follower: RunFollower
    endpoint: str | None = None
    nodes: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.follower.max_step()


@dataclass
class InjectionRecord:
    fault: str
    target: str
    pids: list[int] = field(default_factory=list)
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def event_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["injected_ts"] = fields.pop("ts")
        return fields


@dataclass(kw_only=True)
class NoParams:
    pass


class Injector:
    """One fault kind.  Subclasses set ``Params`` and implement :meth:`inject`."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    needs_run: ClassVar[bool] = True
    """False for faults that can be planted before the launch starts (files only)."""
    restarts_workers: ClassVar[bool] = True
    """Whether the runtime is expected to restart workers to recover (drives the metrics)."""

    def __init__(self, target: str, params: Any = None) -> None:
        self.target = target
        self.params = params if params is not None else self.Params()

    def ready(self, ctx: InjectionContext) -> bool:
        return True

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Undo anything still in effect (called once, after the run)."""

    def _record(self, ctx: InjectionContext, pids: list[int] | None = None, **detail: Any) -> InjectionRecord:
        return InjectionRecord(self.name, self.target, pids or [], ctx.step, detail)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise TargetNotFound(f"pid {pid} exited before signal {signal.Signals(sig).name}") from None


def _rank_of(source: str) -> int | None:
    return int(source.rsplit("rank", 1)[1]) if "rank" in source else None


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


# -- in-worker hooks (elastic.worker.faults files) ---------------------------------------
@dataclass(kw_only=True)
class StraggleParams:
    delay_s: float = 0.3
    """Extra seconds per step on the target rank."""
    num_steps: int = 4
    """Steps the slowdown lasts, starting at the fault's step."""


def _worker_rank(target: str) -> int | None:
    """Rank named by a target; a bare ``nodeN`` maps to rank N (one worker per node locally)."""
    node, rank = parse_target(target)
    if rank is not None:
        return rank
    if node is not None and node.startswith("node") and node[4:].isdigit():
        return int(node[4:])
    return None


def _fault_step(ctx: InjectionContext, at: int | None) -> int:
    # A file fault names a future step; +2 because the fastest rank may already be inside step+1.
    return max(ctx.step + 2, at or 0)


@register("straggler")
class Straggler(Injector):
    """A slow rank: write a ``straggle`` fault file for the next ``num_steps`` steps."""

    Params = StraggleParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        start = _fault_step(ctx, None)
        spec = {"kind": "straggle", "from_step": start, "to_step": start + self.params.num_steps - 1,
                "delay_s": self.params.delay_s}
        rank = _worker_rank(self.target)
        if rank is not None:
            spec["rank"] = rank
        path = write_fault(ctx.run_dir, f"chaos-straggle-{start}", spec)
        return self._record(ctx, file=str(path), spec=spec)


@dataclass(kw_only=True)
class AtStepParams:
    step: int | None = None
    """Step at which the worker-side fault fires; default: the step after the newest one seen."""


@register("nan")
class NanLoss(Injector):
    """A NaN loss on the target rank at one step (``nan_loss`` fault file, fires once)."""

    Params = AtStepParams
    needs_run = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        step = self.params.step if self.params.step is not None else _fault_step(ctx, None)
        spec: dict[str, Any] = {"kind": "nan_loss", "step": step}
        rank = _worker_rank(self.target)
        if rank is not None:
            spec["rank"] = rank
        path = write_fault(ctx.run_dir, f"chaos-nan-{step}", spec)
        return self._record(ctx, file=str(path), spec=spec)


@register("ckpt_write_error")
class CheckpointWriteError(Injector):
    """One checkpoint save fails with ENOSPC (``ckpt_write_error`` fault file, fires once)."""

    Params = AtStepParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        step = self.params.step if self.params.step is not None else _fault_step(ctx, None)
        spec = {"kind": "ckpt_write_error", "step": step}
        path = write_fault(ctx.run_dir, f"chaos-ckpt-write-{step}", spec)
        return self._record(ctx, file=str(path), spec=spec)


# -- checkpoint corruption ------------------------------------------------------------
@dataclass(kw_only=True)
class CorruptParams:
    mode: Literal["flip", "truncate"] = "flip"
    """flip: invert ``num_bytes`` bytes in the middle of the file; truncate: cut the file in half."""
    num_bytes: int = 16
    file: str | None = None
    """File inside the checkpoint to damage; default: the largest data file."""

    def __post_init__(self) -> None:
        if self.num_bytes < 1:
            from elastic.common.config import ConfigError

            raise ConfigError("num_bytes", "must be >= 1")


def newest_committed(checkpoint_root: Path) -> Path | None:
    steps = sorted(p for p in checkpoint_root.glob("step-*") if (p / "COMMIT").is_file())
    return steps[-1] if steps else None


@register("corrupt_checkpoint")
class CorruptCheckpoint(Injector):
    """Damage one file of the newest committed checkpoint, behind the runtime's back."""

    Params = CorruptParams
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        root = checkpoint_root(ctx.run_dir)
        newest = newest_committed(root)
        if newest is None:
            raise TargetNotFound(f"no committed checkpoint under {root}")
        if self.params.file is not None:
            victim = newest / self.params.file
        else:
            listed = json.loads((newest / "COMMIT").read_text()).get("files", {})
            candidates = [newest / name for name in listed if (newest / name).is_file()]
            if not candidates:
                raise TargetNotFound(f"{newest.name} lists no files")
            victim = max(candidates, key=lambda p: (p.stat().st_size, p.name))
        size = victim.stat().st_size
        if self.params.mode == "truncate":
            os.truncate(victim, size // 2)
            detail = {"truncated_to": size // 2}
        else:
            offset = max(size // 2 - self.params.num_bytes // 2, 0)
            with open(victim, "r+b") as fh:
                fh.seek(offset)
                data = fh.read(self.params.num_bytes)
                fh.seek(offset)
                fh.write(bytes(b ^ 0xFF for b in data))
            detail = {"offset": offset, "flipped": len(data)}
        step = int(newest.name.split("-")[1])
        return self._record(ctx, checkpoint_step=step, file=str(victim), size=size, mode=self.params.mode, **detail)


def checkpoint_root(run_dir: Path) -> Path:
    """The run's checkpoint directory: ``checkpoint.dir`` of the run file the launcher wrote into the
    run directory (relative to the run directory unless absolute); the default when there is none."""
    resolved = Path(run_dir) / RESOLVED_NAME
    cfg = load_run_file(resolved) if resolved.is_file() else load_run_file(None)
    return cfg.checkpoint.root(run_dir)


# -- etcd -------------------------------------------------------------------------------
@dataclass(kw_only=True)
class OutageParams:
    duration_s: float = 3.0
    mode: Literal["stop", "kill"] = "stop"
    """stop: SIGSTOP then SIGCONT (requests hang); kill: SIGKILL then restart it on its data dir."""

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            from elastic.common.config import ConfigError

            raise ConfigError("duration_s", "must be > 0")


@register("etcd_outage")
class EtcdOutage(Injector):
    """Make etcd unresponsive for ``duration_s`` (the run's only shared service).

    ``mode: kill`` restarts etcd from the killed process's own command line
    (same data dir, same ports), so every lease and key survives; the
    restarted server is this tool's child and is stopped in :meth:`cleanup`
    if the launcher has not stopped it by then.
    """

    Params = OutageParams
    restarts_workers = False

    def __init__(self, target: str, params: Any = None) -> None:
        super().__init__(target, params)
        self._stopped: int | None = None
        self._respawned: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.resumed_ts: float | None = None
        self.error: str | None = None

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        pid, _ = ctx.follower.etcd()
        if pid is None or not alive(pid):
            raise TargetNotFound("no live etcd server in the run's events")
        if self.params.mode == "stop":
            _kill(pid, signal.SIGSTOP)
            self._stopped = pid
            self._thread = threading.Thread(target=self._resume_later, daemon=True)
        else:
            cmdline, cwd = _proc_cmdline(pid), os.readlink(f"/proc/{pid}/cwd")
            _kill(pid, signal.SIGKILL)
            self._thread = threading.Thread(target=self._respawn_later, args=(pid, cmdline, cwd), daemon=True)
        self._thread.start()
        return self._record(ctx, [pid], mode=self.params.mode, duration_s=self.params.duration_s)

    def _resume_later(self) -> None:
        time.sleep(self.params.duration_s)
        self._cont()

    def _cont(self) -> None:
        if self._stopped is not None:
            try:
                os.kill(self._stopped, signal.SIGCONT)
                self.resumed_ts = time.time()
            except ProcessLookupError:
                pass
            self._stopped = None

    def _respawn_later(self, old_pid: int, cmdline: list[str], cwd: str) -> None:
        deadline = time.monotonic() + 10
        while alive(old_pid) and time.monotonic() < deadline:
            time.sleep(0.02)  # the ports are free only once the old server is gone
        time.sleep(self.params.duration_s)
        try:
            self._respawned = subprocess.Popen(cmdline, cwd=cwd, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True)
            self.resumed_ts = time.time()
        except OSError as exc:
            self.error = f"etcd restart failed: {exc}"

    @property
    def respawned_pid(self) -> int | None:
        return self._respawned.pid if self._respawned else None

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def cleanup(self) -> None:
        self._cont()
        self.join(timeout=self.params.duration_s + 15)
        if self._respawned is not None and self._respawned.poll() is None:
            self._respawned.terminate()
            try:
                self._respawned.wait(10)
            except subprocess.TimeoutExpired:
                self._respawned.kill()
                self._respawned.wait()


def _proc_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return [part.decode() for part in fh.read().split(b"\0") if part]


# -- hardware readings --------------------------------------------------------------------
def _default_readings() -> dict[str, Any]:
    # A GEMM running at a tenth of its expected speed: fails the screen on CPU-only hosts too.
    return {"gemm": {"tflops_scale": 0.1}}


@dataclass(kw_only=True)
class HardwareParams:
    readings: dict[str, Any] = field(default_factory=_default_readings)
    """Reading overlay for the node's next diagnostics screen, e.g. {gemm: {tflops_scale: 0.2}}."""


@register("bad_hardware")
class BadHardware(Injector):
    """Plant bad hardware readings (``faults/diag-<node>.yaml``) for the node's next diag screen."""

    Params = HardwareParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        node, _ = parse_target(self.target)
        if node is None:
            raise TargetNotFound(f"bad_hardware needs a node target, got {self.target!r}")
        directory = Path(ctx.run_dir) / FAULTS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"diag-{node}.yaml"
        tmp = directory / f".diag-{node}.yaml.tmp"
        tmp.write_text(yaml.safe_dump(self.params.readings, sort_keys=True))
        tmp.rename(path)
        return self._record(ctx, node=node, file=str(path), readings=self.params.readings)
