"""Faults on the run's state outside the processes: a corrupt checkpoint, an etcd outage or one etcd
member stopped, bad hardware readings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from chaos.follow import parse_target
from chaos.injection import InjectionContext, InjectionRecord, Injector, TargetNotFound, _kill, register
from elastic.checkpoint.corrupt import Corruption, NothingToCorrupt, corrupt_newest, newest_committed  # noqa: F401
from elastic.common.procs import alive
from elastic.run.schema import RESOLVED_NAME, load_run_file
from elastic.worker.faults import FAULTS_DIR


@dataclass(kw_only=True)
class CorruptParams(Corruption):
    """How to damage the newest committed checkpoint (see :class:`elastic.checkpoint.corrupt.Corruption`)."""

    min_step: int = 0
    """Delivered through etcd: wait until a checkpoint of this step or later is committed."""

    def __post_init__(self) -> None:
        if self.num_bytes < 1:
            from elastic.common.config import ConfigError

            raise ConfigError("num_bytes", "must be >= 1")


@register("corrupt_checkpoint")
class CorruptCheckpoint(Injector):
    """Damage one file of the newest committed checkpoint, behind the runtime's back."""

    Params = CorruptParams
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        root = checkpoint_root(ctx.run_dir)
        try:
            detail = corrupt_newest(root, Corruption(mode=self.params.mode, num_bytes=self.params.num_bytes,
                                                     file=self.params.file))
        except NothingToCorrupt as exc:
            raise TargetNotFound(str(exc)) from None
        return self._record(ctx, **detail)


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

    def _target(self, ctx: InjectionContext) -> tuple[int, dict[str, Any]]:
        """The etcd process to stop, and what to record about it."""
        pid, _ = ctx.follower.etcd()
        if pid is None or not alive(pid):
            raise TargetNotFound("no live etcd server in the run's events")
        return pid, {}

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        pid, detail = self._target(ctx)
        if self.params.mode == "stop":
            _kill(pid, signal.SIGSTOP)
            self._stopped = pid
            self._thread = threading.Thread(target=self._resume_later, daemon=True)
        else:
            cmdline, cwd = _proc_cmdline(pid), os.readlink(f"/proc/{pid}/cwd")
            _kill(pid, signal.SIGKILL)
            self._thread = threading.Thread(target=self._respawn_later, args=(pid, cmdline, cwd), daemon=True)
        self._thread.start()
        return self._record(ctx, [pid], mode=self.params.mode, duration_s=self.params.duration_s, **detail)

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


@dataclass(kw_only=True)
class MemberStopParams(OutageParams):
    duration_s: float = 10.0
    member: int | None = None
    """Index of the member to stop (0..2, in ``--etcd-endpoint`` order); None: the raft leader now."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.member is not None and self.member < 0:
            from elastic.common.config import ConfigError

            raise ConfigError("member", "must be >= 0")


@register("etcd_member_stop")
class EtcdMemberStop(EtcdOutage):
    """Stop one member of a 3-member etcd (``launch.etcd_members: 3``) for ``duration_s``.

    The other two keep a quorum (electing a new leader when the stopped one led), so the run must
    go on: its clients move to a live member.  ``mode: kill`` restarts the member on its data dir.
    """

    Params = MemberStopParams

    def _target(self, ctx: InjectionContext) -> tuple[int, dict[str, Any]]:
        started = ctx.follower.of_kind("launcher.etcd_started")
        pids = [int(p) for p in (started[-1].get("etcd_pids") or []) if p] if started else []
        if len(pids) < 3:
            raise TargetNotFound("etcd_member_stop needs a 3-member etcd (launch.etcd_members: 3)")
        endpoints = str(started[-1].get("endpoint", "")).split(",")
        leader = etcd_leader(endpoints)
        index = self.params.member if self.params.member is not None else (leader or 0)
        if index >= len(pids) or not alive(pids[index]):
            raise TargetNotFound(f"etcd member {index} is not alive (members: {pids})")
        return pids[index], {"member": index, "leader": index == leader, "members": len(pids)}


def etcd_leader(endpoints: list[str], timeout_s: float = 1.0) -> int | None:
    """Index of the member the reachable members name as raft leader (None when none answers)."""
    ids: dict[int, str] = {}
    leaders: set[str] = set()
    for i, endpoint in enumerate(endpoints):
        request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                status = json.loads(resp.read())
        except (OSError, ValueError):
            continue
        ids[i] = str(status.get("header", {}).get("member_id"))
        leaders.add(str(status.get("leader")))
    return next((i for i, member in sorted(ids.items()) if member in leaders), None)


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
