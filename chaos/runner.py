"""Run one launch under a fault plan.

:class:`ChaosRunner` starts ``elastic-launch`` as a subprocess, follows the
run directory's events, fires each planned fault when its trigger is reached
(``at_step``: the newest ``trainer.step`` seen; ``at_time_s``: seconds since
``launcher.start``; ``at_time_s: 0``: written before the launch, for file
faults), and waits for the launch to end.  Every injection (or the reason a
fault was not injected) becomes an event of source ``chaos`` in
``<run_dir>/events/chaos.jsonl``.

The launcher moves a previous launch's ``events/`` to ``history/`` when it
starts, so this runner writes its own events only after it has seen the
``launcher.start`` of the process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.follow import RunFollower
from chaos.injectors import InjectionContext, Injector, TargetNotFound
from chaos.plan import FaultSpec
from elastic.common.events import EventLog, read_run_events
from elastic.worker.faults import FAULTS_DIR
from elastic.control.keys import RunKeys, run_prefix

CHAOS_DIR = "chaos"


@dataclass
class LaunchSpec:
    """What ``-- elastic-launch CONFIG [flags]`` resolves to."""

    argv: list[str]
    run_dir: Path
    nodes: list[str]
    steps: int
    etcd_prefix: str = ""
    """The run's root key in etcd (exclusion records live below it)."""
    world_size: int = 0
    """The most ranks the launch can have (max nodes x workers per node)."""


def resolve_launch(command: list[str]) -> LaunchSpec:
    """Accept ``elastic-launch ARGS`` or ``python -m launch ARGS``; run it with this interpreter."""
    from launch.cli import build_parser, resolve_config

    if not command:
        raise ValueError("no launch command after --")
    if Path(command[0]).name == "elastic-launch":
        rest = command[1:]
    elif len(command) >= 3 and command[1:3] == ["-m", "launch"]:
        rest = command[3:]
    else:
        raise ValueError(f"expected `elastic-launch ...` or `python -m launch ...`, got {command[0]!r}")
    cfg = resolve_config(build_parser().parse_args(rest))
    if cfg.launch.etcd_endpoint:
        raise ValueError("chaos run drives local launches only (no --etcd-endpoint)")
    nodes = [f"node{i}" for i in range(cfg.launch.max_nodes)]
    return LaunchSpec([sys.executable, "-m", "launch", *rest], Path(cfg.run_dir()).resolve(), nodes,
                      cfg.trainer_steps(), run_prefix(cfg.rendezvous.key_prefix, cfg.run.id),
                      cfg.launch.max_nodes * cfg.launch.nproc_per_node)


@dataclass
class Outcome:
    rc: int
    run_dir: Path
    wall_s: float
    fired: list[dict] = field(default_factory=list)
    missed: list[dict] = field(default_factory=list)
    timed_out: bool = False


@dataclass
class _Pending:
    spec: FaultSpec
    injector: Injector
    index: int
    first_miss: float | None = None
    last_error: str = ""
    due: bool = False
    """Its trigger was reached (a fault whose trigger the run never reached is not a failure)."""


class ChaosRunner:
    def __init__(self, launch: LaunchSpec, faults: list[FaultSpec], env: dict[str, str] | None = None,
                 timeout_s: float = 600.0, retry_s: float = 30.0, poll_s: float = 0.02) -> None:
        self.launch = launch
        self.faults = faults
        self.env = env
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.poll_s = poll_s
        self.injectors: list[Injector] = []

    def run(self) -> Outcome:
        run_dir = self.launch.run_dir
        (run_dir / CHAOS_DIR).mkdir(parents=True, exist_ok=True)
        _clear_chaos_faults(run_dir)
        pending = [_Pending(spec, spec.build(), i) for i, spec in enumerate(self.faults)]
        self.injectors = [p.injector for p in pending]
        early_ctx = InjectionContext(run_dir, RunFollower(run_dir), None, list(self.launch.nodes))
        early = []
        for p in [p for p in pending if p.spec.before_launch]:
            early.append((p, p.injector.inject(early_ctx)))
        pending = [p for p in pending if not p.spec.before_launch]

        started = time.monotonic()
        with open(run_dir / CHAOS_DIR / "launch.log", "wb") as log:
            proc = subprocess.Popen(self.launch.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        outcome = Outcome(rc=-1, run_dir=run_dir, wall_s=0.0)
        events: EventLog | None = None
        watcher: ExclusionWatcher | None = None
        try:
            start_event = self._wait_launcher_start(proc)
            follower = RunFollower(run_dir)
            follower.poll()
            events = EventLog(run_dir / "events" / "chaos.jsonl", "chaos")
            events.emit("chaos.start", launcher_pid=proc.pid, plan=[s.describe() for s in self.faults])
            for p, record in early:
                outcome.fired.append(events.emit("chaos.inject", index=p.index, before_launch=True,
                                                 **record.event_fields()))
            ctx = InjectionContext(run_dir, follower, follower.etcd()[1], list(self.launch.nodes))
            if ctx.endpoint and self.launch.etcd_prefix:
                watcher = ExclusionWatcher(ctx.endpoint, self.launch.etcd_prefix, events)
                watcher.start()
            t0 = start_event["ts"] if start_event else time.time()
            while proc.poll() is None:
                if time.monotonic() - started > self.timeout_s:
                    outcome.timed_out = True
                    events.emit("chaos.timeout", timeout_s=self.timeout_s)
                    proc.send_signal(signal.SIGTERM)
                    break
                follower.poll()
                pending = self._fire_due(pending, ctx, t0, events, outcome)
                time.sleep(self.poll_s)
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if watcher is not None:
                watcher.stop()
            for injector in self.injectors:
                injector.cleanup()
        outcome.rc = rc
        outcome.wall_s = time.monotonic() - started
        if events is None:
            events = EventLog(run_dir / "events" / "chaos.jsonl", "chaos")
        for p in pending:
            outcome.missed.append(events.emit("chaos.not_injected", index=p.index, fault=p.spec.fault,
                                              target=p.spec.target, trigger_reached=p.due,
                                              reason=p.last_error or "the run ended before its trigger"))
        events.emit("chaos.end", rc=rc, wall_s=outcome.wall_s, timed_out=outcome.timed_out)
        events.close()
        return outcome

    def _wait_launcher_start(self, proc: subprocess.Popen) -> dict | None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            for e in read_run_events(self.launch.run_dir):
                if e.get("kind") == "launcher.start" and e.get("pid") == proc.pid:
                    return e
            time.sleep(0.05)
        return None

    def _fire_due(self, pending: list[_Pending], ctx: InjectionContext, t0: float, events: EventLog,
                  outcome: Outcome) -> list[_Pending]:
        left = []
        for p in pending:
            spec = p.spec
            due = (ctx.step >= spec.at_step) if spec.at_step is not None else (time.time() - t0 >= spec.at_time_s)
            if not due:
                left.append(p)
                continue
            p.due = True
            if not p.injector.ready(ctx):
                # Event-conditioned faults wait (without a deadline) for their moment.
                p.last_error = "its moment (see the fault's description) never came"
                left.append(p)
                continue
            try:
                record = p.injector.inject(ctx)
            except TargetNotFound as exc:
                now = time.monotonic()
                p.first_miss = p.first_miss or now
                p.last_error = str(exc)
                if now - p.first_miss > self.retry_s:
                    outcome.missed.append(events.emit("chaos.not_injected", index=p.index, fault=spec.fault,
                                                      target=spec.target, trigger_reached=True,
                                                      reason=p.last_error))
                else:
                    left.append(p)
                continue
            fired = events.emit("chaos.inject", index=p.index, at_step=spec.at_step, at_time_s=spec.at_time_s,
                                **record.event_fields())
            outcome.fired.append(fired)
            print(f"chaos: injected {spec.describe()}: pids={record.pids} step={record.step}",
                  file=sys.stderr, flush=True)
        return left


def _clear_chaos_faults(run_dir: Path) -> None:
    """Remove fault files a previous chaos run left behind (they would fire again)."""
    directory = run_dir / FAULTS_DIR
    if not directory.is_dir():
        return
    for path in list(directory.glob("chaos-*")) + list(directory.glob("diag-*.yaml")):
        try:
            os.unlink(path)
        except OSError:
            pass


class ExclusionWatcher(threading.Thread):
    """Copies the run's exclusion records from etcd into ``chaos.exclusions`` events while it runs.

    The embedded etcd is gone once the launch has ended, so the suite's
    "excluded nodes" invariant reads these events.  Runs in its own thread
    because an etcd outage (one of the faults) would otherwise stall fault
    injection; a read that fails is skipped.
    """

    def __init__(self, endpoint: str, prefix: str, events: EventLog, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="chaos-exclusions")
        from elastic.control.store import EtcdStore

        self.store = EtcdStore(endpoint, request_timeout=1.0, retry_deadline=1.0)
        self.prefix = RunKeys(prefix).exclusions
        self.events = events
        self.interval_s = interval_s
        self._halt = threading.Event()
        self.seen: dict[str, str] = {}

    def run(self) -> None:
        from elastic.control.store import StoreError

        while not self._halt.is_set():
            try:
                records = {RunKeys.tail(kv.key, self.prefix): _text(kv.value) for kv in self.store.get_prefix(self.prefix)}
            except StoreError:
                records = self.seen
            if records != self.seen:
                self.seen = records
                self.events.emit("chaos.exclusions", nodes=sorted(records), records=records)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
