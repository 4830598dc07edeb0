"""The per-node agent: screens and registers the node, runs torchrun, supervises it.

One agent runs per node (``python -m elastic.agent ...``; ``elastic-launch``
starts them).  Its life::

    INIT -> (pre-flight) -> REGISTERED -> RUNNING -> SUCCEEDED
      |                                     |-> FAILED -> classify -> action -> RUNNING
      |                                     |-> FAILED -> (budget spent / stop) GAVE_UP
      |                                     |-> EXCLUDED (leader or own policy) -> leaves
      |                                     '-> STOPPED (SIGTERM/SIGINT forwarded)
      '-> EXCLUDED (on the run's exclusion list, or the screen failed; never starts)

Restart coordination uses a run-wide **epoch** in etcd.  Every torchrun is
started with rendezvous id ``<run>-e<epoch>``, so each recovery gets a fresh
rendezvous: no stale participants to wait out, and torch closing the old
round on exit cannot block the new one.  An agent whose torchrun fails bumps
the epoch (compare-and-swap, so concurrent failures bump it once); every
other agent sees the bump within ``epoch_poll_s``, stops its healthy workers
(SIGTERM, grace, SIGKILL) and rejoins under the new epoch.  Only a node's own
failures consume its restart budget: a restart caused by a peer is a
membership change, not a failure of this node.

Supervision while torchrun runs: step heartbeats from the workers
(:mod:`elastic.agent.heartbeat`: hang detection), the node heartbeat published to
etcd for the leader (:mod:`elastic.control.leader`: stragglers, lemon nodes), the
run's epoch, this node's exclusion record and the run's stop key.

torchrun itself runs with ``--max-restarts 0``: this agent owns the restart
decision so that it can classify the failure (:mod:`elastic.agent.classify`) and
act on it (:class:`~elastic.agent.config.FailurePolicy`).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from elastic.control.admission import Admission, Refused, join_fingerprint
from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.checkpoint.config import MemoryCacheConfig
from elastic.checkpoint.publish import read_latest
from elastic.agent.classify import UNCOUNTED, FailureKind, classify
from elastic.common.config import ConfigError, to_dict
from elastic.common.events import EventLog
from elastic.agent.heartbeat import HeartbeatMonitor, Silence
from elastic.control.leader import ClusterPolicy, LeaderLoop
from elastic.agent.metrics import AgentMetrics, MeteredEventLog
from elastic.checkpoint.memstate import MemStateServer
from elastic.control.keys import BACKEND_NAME, run_prefix
from elastic.common.procs import child_preexec, descendants, set_parent_death_signal, terminate_tree
from elastic.control.store import EtcdStore, LeaseKeeper, StoreAuthError, StoreError, StoreTLSError
from elastic.replicas.config import ReplicaConfig
from elastic.replicas.runtime import LighthouseUnavailable, ReplicaRuntime
from elastic.worker.channel import SKIP_STEPS_ENV

EXIT_SUCCESS = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_EXCLUDED = 93  # "do not requeue": the node is bad, rescheduling it here is pointless
EXIT_INTERRUPTED = 130


__all__ = ["NodeAgent", "NodeSpec", "Exclusions", "FailureKind", "AgentState", "EXIT_EXCLUDED"]


class AgentState(str, Enum):
    INIT = "INIT"
    SCREENING = "SCREENING"
    REGISTERED = "REGISTERED"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    SUCCEEDED = "SUCCEEDED"
    STOPPED = "STOPPED"
    GAVE_UP = "GAVE_UP"
    EXCLUDED = "EXCLUDED"


@dataclass
class NodeSpec:
    run_id: str
    node_id: str
    endpoint: str
    run_dir: Path
    nnodes: str  # "N" or "MIN:MAX"
    nproc_per_node: int
    entrypoint: list[str]  # e.g. ["-m", "trainer.train", "--config", ..., "--run-dir", ...]
    local_addr: str = "127.0.0.1"  # torchrun --local-addr: where peers reach this node's workers


@dataclass
class Attempt:
    """What happened to one torchrun attempt."""

    outcome: str  # succeeded | failed | stopped | peer_restart | excluded | run_stopped
    rc: int | None = None
    kind: FailureKind | None = None  # set when the agent itself decided the failure (hang)
    detail: str = ""
    numerics_step: int | None = None
    attempt_dir: Path | None = None


class Exclusions:
    """The run's exclusion list in etcd: ``<run>/excluded/<node>`` -> JSON {reason, until, by}."""

    def __init__(self, store: EtcdStore, prefix: str) -> None:
        self.store = store
        self.prefix = f"{prefix}/excluded/"

    def add(self, node_id: str, reason: str, ttl_s: float | None = None, by: str = "") -> None:
        until = time.time() + ttl_s if ttl_s else None
        self.store.put(self.prefix + node_id, json.dumps({"reason": reason, "until": until, "by": by, "ts": time.time()}))

    def get(self, node_id: str) -> dict | None:
        """The active exclusion record of a node, or None (expired records count as absent)."""
        kv = self.store.get(self.prefix + node_id)
        if kv is None:
            return None
        try:
            record = json.loads(kv.value)
        except json.JSONDecodeError:
            return {"reason": "unreadable exclusion record", "until": None}
        until = record.get("until")
        if until is not None and until < time.time():
            return None
        return record

    def clear(self, node_id: str) -> None:
        self.store.delete(self.prefix + node_id)

    def all(self) -> dict[str, dict]:
        out = {}
        for kv in self.store.get_prefix(self.prefix):
            node = kv.key[len(self.prefix):]
            record = self.get(node)
            if record is not None:
                out[node] = record
        return out


class NodeAgent:
    def __init__(self, spec: NodeSpec, config: AgentConfig, rdzv: RendezvousConfig,
                 admission: Admission | None = None, memory: MemoryCacheConfig | None = None,
                 replicas: ReplicaConfig | None = None) -> None:
        self.spec = spec
        self.admission = admission
        self.config = config
        self.rdzv = rdzv
        self.store = EtcdStore(spec.endpoint)
        self.prefix = run_prefix(rdzv.key_prefix, spec.run_id)
        self.exclusions = Exclusions(self.store, self.prefix)
        self.metrics = AgentMetrics(spec.node_id, spec.run_dir)
        self.events: EventLog = MeteredEventLog(spec.run_dir / "events" / f"agent-{spec.node_id}.jsonl",
                                                f"agent/{spec.node_id}", self.metrics)
        self.state = AgentState.INIT
        self.failures = 0
        self.attempt = 0
        self.restarts_since_progress = 0
        self.last_commit = -1
        self._stop = threading.Event()
        self._stop_signal: int | None = None
        self._lease: LeaseKeeper | None = None
        self._leader: LeaderLoop | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._known_pids: set[int] = set()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.monitor = HeartbeatMonitor(config.heartbeat)
        self.metrics.watch_silence(lambda: self.monitor.silent_for() if self.state == AgentState.RUNNING else 0.0)
        # Replica-group mode (torchft): this node is one group that restarts alone.
        self.replicas = (ReplicaRuntime(replicas, self.store, self.prefix, spec.node_id, spec.run_id, spec.run_dir,
                                        self.events) if replicas is not None and replicas.enabled else None)
        # The node's in-memory copy of its workers' newest checkpoint state (elastic.checkpoint.memstate):
        # it outlives the workers, so a restart on this node loads from RAM.
        self.memstate = (MemStateServer(memory.max_mib << 20, self.events, memory.timeout_s)
                         if memory is not None and memory.enabled else None)

    # -- keys -------------------------------------------------------------------
    @property
    def epoch_key(self) -> str:
        return f"{self.prefix}/epoch"

    @property
    def node_key(self) -> str:
        return f"{self.prefix}/nodes/{self.spec.node_id}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # -- bookkeeping ------------------------------------------------------------
    def _set_state(self, state: AgentState, **fields) -> None:
        self.state = state
        self.events.emit("agent.state", state=state.value, **fields)
        if self._lease is not None:
            self._publish_node()

    def _publish_node(self) -> None:
        record = {"node": self.spec.node_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "state": self.state.value, "failures": self.failures, "ts": time.time(),
                  "metrics": self.metrics.address}
        self._put_quietly(self.node_key, record, "publish_node", lease=True)

    def _publish_heartbeat(self, epoch: int) -> None:
        record = {"node": self.spec.node_id, "epoch": epoch, "state": self.state.value, "ts": time.time(),
                  **self.monitor.summary()}
        self._put_quietly(self._key(f"heartbeat/{self.spec.node_id}"), record, "heartbeat", lease=True)

    def _put_quietly(self, key: str, record: dict, op: str, lease: bool = False) -> None:
        try:
            self.store.put(key, json.dumps(record), lease=self._lease.lease_id if lease and self._lease else None)
        except StoreError as exc:
            self.events.emit("agent.store_error", op=op, error=str(exc))

    def _get_json(self, name: str) -> dict | None:
        kv = self.store.get(self._key(name))
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except json.JSONDecodeError:
            return {}

    def read_epoch(self) -> int:
        kv = self.store.get(self.epoch_key)
        return int(kv.value) if kv else 0

    def bump_epoch(self, seen: int) -> int:
        """Move the run to epoch seen+1 unless someone already moved it; returns the current epoch."""
        if self.replicas is not None:
            return seen  # replica groups restart alone: nothing run-wide to re-form
        kv = self.store.get(self.epoch_key)
        current = int(kv.value) if kv else 0
        if current != seen:
            return current
        expected = kv.mod_revision if kv else 0
        ok, now = self.store.compare_and_swap(self.epoch_key, str(seen + 1), expected)
        if ok:
            self.events.emit("agent.epoch_bump", epoch=seen + 1)
            return seen + 1
        return int(now.value) if now else 0

    def _bump_quietly(self, epoch: int) -> None:
        try:
            self.bump_epoch(epoch)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="bump_epoch", error=str(exc))

    # -- signals ------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        self._stop_signal = signum
        self._stop.set()
        # Cleanup (lease revoke, leader resign) is best effort once we are told to stop: with the
        # launcher gone etcd is usually gone too, and retrying for the full deadline per call
        # would keep this agent (an orphan by then) alive for most of a minute.
        self.store.stop_retrying()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.request_stop(signum))

    # -- main loop ----------------------------------------------------------------
    def run(self) -> int:
        self.events.emit("agent.start", run_id=self.spec.run_id, endpoint=self.spec.endpoint,
                         nnodes=self.spec.nnodes, max_restarts=self.config.max_restarts)
        self._serve_metrics()
        try:
            return self._run()
        finally:
            self.metrics.close()
            self._stop_workers("agent exit")
            if self.replicas is not None:
                self.replicas.close(drain=self.state == AgentState.SUCCEEDED)
            if self._leader is not None:
                self._leader.close()
            if self._lease is not None:
                self._lease.close(revoke=True)
            if self.memstate is not None:
                self.memstate.close()
            self.events.emit("agent.exit", state=self.state.value, failures=self.failures)
            self.events.close()

    def _serve_metrics(self) -> None:
        try:
            address = self.metrics.serve(self.config.metrics)
        except OSError as exc:  # e.g. a fixed port already taken: run without the endpoint
            self.events.emit("agent.metrics_failed", error=str(exc), port=self.config.metrics.port)
            print(f"elastic-agent: node {self.spec.node_id}: metrics endpoint not started: {exc}", file=sys.stderr)
            return
        if address is not None:
            self.events.emit("agent.metrics_started", address=address)

    def _run(self) -> int:
        if self.admission is not None:
            try:
                self.admission.check(self.store, self.prefix, self.events)
            except Refused as exc:
                self.events.emit("agent.refused", reason=str(exc), rc=exc.code)
                print(f"elastic-agent: node {self.spec.node_id} refused: {exc}", file=sys.stderr)
                return exc.code
        excluded = self.exclusions.get(self.spec.node_id)
        screened = False
        if excluded is not None:
            # A node excluded by a failed screen may come back by passing one (repaired); an
            # exclusion by the leader's policy or an operator only expires or is cleared.
            if not (self.config.preflight.enabled and excluded.get("by") in ("preflight", "rescreen")):
                return self._leave_excluded(excluded.get("reason"), excluded.get("until"))
            passed, reason = self.screen("re-screen of an excluded node")
            if not passed:
                return self._exclude_self(reason, self.config.preflight.exclusion_ttl_s, by="preflight", epoch=None)
            self.exclusions.clear(self.spec.node_id)
            self.events.emit("agent.exclusion_cleared", previous_reason=excluded.get("reason"))
            screened = True
        if self.config.preflight.enabled and not screened:
            passed, reason = self.screen("pre-flight")
            if not passed:
                return self._exclude_self(reason, self.config.preflight.exclusion_ttl_s, by="preflight", epoch=None)
        self._lease = LeaseKeeper(self.store, self.config.lease_ttl_s,
                                  on_lost=lambda: self.events.emit("agent.lease_lost"))
        self._set_state(AgentState.REGISTERED)
        self._leader = LeaderLoop(self.store, self.prefix, self.spec.node_id, self.config.leader,
                                  ClusterPolicy(self.config.leader, self._exclude_other, self.events), self.events,
                                  is_excluded=lambda node: self.exclusions.get(node) is not None,
                                  on_tick=self._replicas_tick if self.replicas else None)
        self._leader.start()
        self._join_running_run()
        while not self._stop.is_set():
            epoch = self.read_epoch()
            result = self._run_once(epoch)
            if result.outcome == "stopped":
                self._set_state(AgentState.STOPPED, signal=self._stop_signal)
                return EXIT_INTERRUPTED
            if result.outcome == "succeeded":
                self._set_state(AgentState.SUCCEEDED, epoch=epoch)
                self._put_quietly(self._key("done"), {"by": self.spec.node_id, "ts": time.time()}, "done")
                return EXIT_SUCCESS
            if result.outcome == "run_stopped":
                record = self._get_json("stop") or {}
                self._set_state(AgentState.GAVE_UP, reason=f"run stopped by {record.get('by')}: {record.get('reason')}")
                print(f"elastic-agent: node {self.spec.node_id}: run stopped by {record.get('by')}: "
                      f"{record.get('reason')}", file=sys.stderr)
                return EXIT_FAILURE
            if result.outcome == "excluded":
                record = self.exclusions.get(self.spec.node_id) or {}
                return self._leave_excluded(record.get("reason"), record.get("until"))
            code = self._after_failure(result, epoch)
            if code is not None:
                return code
        self._set_state(AgentState.STOPPED, signal=self._stop_signal)
        return EXIT_INTERRUPTED

    def _replicas_tick(self, is_leader: bool) -> None:
        # The Lighthouse address is bound to this node's lease: it goes when this agent does.
        self.replicas.tick(is_leader, self._lease.lease_id if self._lease else None)

    def _after_failure(self, result: Attempt, epoch: int) -> int | None:
        """Classify, act, and either return an exit code or None to go round again."""
        self.restarts_since_progress += 1
        if result.outcome == "peer_restart":
            self.events.emit("agent.restart", reason="peer", epoch=epoch, counted=False)
            return self._no_progress_guard()
        kind, detail = (result.kind, result.detail) if result.kind else self._classify(result)
        counted = kind not in UNCOUNTED
        action = self.config.failure.action(kind.value)
        if action == "rollback":
            verdict, why = self._rollback(result.numerics_step, detail, epoch)
            if verdict == "stop":
                self._set_state(AgentState.FAILED, rc=result.rc, failure_kind=kind.value, detail=detail,
                                failures=self.failures, epoch=epoch, action="stop")
                return self._stop_run(why, epoch)
            if verdict == "duplicate":
                counted = False  # one NaN, reported by every node: count it once
        if counted:
            self.failures += 1
            self._put_quietly(self._key(f"failures/{self.spec.node_id}/{int(time.time() * 1000)}"),
                              {"ts": time.time(), "kind": kind.value, "epoch": epoch}, "record_failure")
        self._set_state(AgentState.FAILED, rc=result.rc, failure_kind=kind.value, detail=detail,
                        failures=self.failures, epoch=epoch, action=action)
        if action == "stop":
            return self._stop_run(f"{kind.value}: {detail}", epoch)
        if action == "exclude":
            return self._exclude_self(f"{kind.value}: {detail}", self.config.failure.exclusion_ttl_s,
                                      by="policy", epoch=epoch)
        if action == "rescreen" and self.config.preflight.enabled:
            passed, reason = self.screen(f"after {kind.value}")
            if not passed:
                return self._exclude_self(reason, self.config.preflight.exclusion_ttl_s, by="rescreen", epoch=epoch)
        new_epoch = self.bump_epoch(epoch)
        if self.failures > self.config.max_restarts:
            self._set_state(AgentState.GAVE_UP, failures=self.failures, max_restarts=self.config.max_restarts)
            print(f"elastic-agent: node {self.spec.node_id} gave up after {self.failures} failures "
                  f"(max_restarts={self.config.max_restarts})", file=sys.stderr)
            return EXIT_FAILURE
        self.events.emit("agent.restart", reason=kind.value, epoch=new_epoch, counted=counted,
                         failures=self.failures, action=action)
        return self._no_progress_guard()

    def _no_progress_guard(self) -> int | None:
        try:
            latest = read_latest(self.store, self.prefix)
        except (StoreError, ValueError):
            latest = None
        if latest and int(latest.get("step", -1)) > self.last_commit:
            self.last_commit = int(latest["step"])
            self.restarts_since_progress = 1  # progress since the last restart: only this one counts
        limit = self.config.failure.no_progress_restarts
        if limit and self.restarts_since_progress > limit:
            return self._stop_run(f"no progress: {self.restarts_since_progress - 1} restarts without a new "
                                  f"committed checkpoint (no_progress_restarts={limit})", self.read_epoch())
        return None

    def _stop_run(self, reason: str, epoch: int) -> int:
        """Stop the whole run: every agent sees the stop key and leaves."""
        self._put_quietly(self._key("stop"), {"reason": reason, "by": self.spec.node_id, "ts": time.time()}, "stop")
        self._set_state(AgentState.GAVE_UP, reason=reason)
        print(f"elastic-agent: node {self.spec.node_id} stops the run: {reason}", file=sys.stderr)
        return EXIT_FAILURE

    def _leave_excluded(self, reason: str | None, until: float | None) -> int:
        self._set_state(AgentState.EXCLUDED, reason=reason, until=until)
        print(f"elastic-agent: node {self.spec.node_id} is excluded from run {self.spec.run_id}: {reason}",
              file=sys.stderr)
        return EXIT_EXCLUDED

    def _exclude_self(self, reason: str, ttl_s: float, by: str, epoch: int | None) -> int:
        self.exclusions.add(self.spec.node_id, reason, ttl_s=ttl_s, by=by)
        self.events.emit("agent.excluded_self", reason=reason, by=by, ttl_s=ttl_s)
        if epoch is not None:
            self.bump_epoch(epoch)
        return self._leave_excluded(reason, time.time() + ttl_s)

    def _exclude_other(self, node: str, reason: str, ttl_s: float) -> None:
        """Leader policy: exclude another node (it notices and leaves)."""
        try:
            self.exclusions.add(node, reason, ttl_s=ttl_s, by=f"leader/{self.spec.node_id}")
            self.events.emit("leader.exclude", node=node, reason=reason, ttl_s=ttl_s)
        except StoreError as exc:
            self.events.emit("leader.store_error", error=str(exc))

    def _join_running_run(self) -> None:
        """A node (re)joining a run that trains without it triggers a re-form, so the run grows."""
        if self._get_json("done") is not None:
            return
        epoch = self.read_epoch()
        fresh = time.time() - 3 * self.config.heartbeat.publish_interval_s
        for kv in self.store.get_prefix(self._key("heartbeat/")):
            try:
                hb = json.loads(kv.value)
            except json.JSONDecodeError:
                continue
            if hb.get("node") != self.spec.node_id and hb.get("epoch") == epoch and hb.get("ts", 0) > fresh \
                    and hb.get("step", 0) > 0:
                self.events.emit("agent.join_running", epoch=epoch, seen=hb.get("node"))
                self.bump_epoch(epoch)
                return

    # -- rollback after bad numerics ----------------------------------------------------
    def _rollback(self, bad_step: int | None, detail: str, epoch: int) -> tuple[str, str]:
        """Record the bad step range to skip; the restart then resumes from the last commit.

        Returns ("rollback" | "duplicate" | "stop", reason).  Every rank of a synchronous job
        sees the same NaN, so several agents report one failure: the range is written with a
        compare-and-swap, and an agent finding its step already recorded *for this epoch* is
        looking at the same failure.  The same step failing in a later epoch is a repeat.
        """
        if bad_step is None:
            return "stop", f"numerics failure without a step ({detail})"
        key = self._key("numerics")
        while True:
            kv = self.store.get(key)
            record = json.loads(kv.value) if kv else {"ranges": [], "rollbacks": 0}
            for r in record["ranges"]:
                if r["lo"] <= bad_step <= r["hi"]:
                    if r["epoch"] == epoch:
                        return "duplicate", f"step {bad_step} already rolled back by {r['by']}"
                    return "stop", f"numerics failure repeats at step {bad_step} after skipping it"
            if record["rollbacks"] >= self.config.failure.max_rollbacks:
                return "stop", (f"numerics: {record['rollbacks']} rollbacks already "
                                f"(max_rollbacks={self.config.failure.max_rollbacks})")
            lo = max(1, bad_step - self.config.failure.skip_before)
            record["ranges"].append({"lo": lo, "hi": bad_step, "epoch": epoch, "by": self.spec.node_id})
            record["rollbacks"] += 1
            ok, _ = self.store.compare_and_swap(key, json.dumps(record), kv.mod_revision if kv else 0)
            if ok:
                skip = [[r["lo"], r["hi"]] for r in record["ranges"]]
                self.events.emit("agent.rollback", bad_step=bad_step, skip=skip, rollbacks=record["rollbacks"],
                                 detail=detail)
                return "rollback", ""

    def _skip_steps_env(self) -> str:
        record = self._get_json("numerics") or {}
        return ",".join(f"{r['lo']}-{r['hi']}" for r in record.get("ranges", []))

    # -- pre-flight screen ----------------------------------------------------------------
    def screen(self, why: str) -> tuple[bool, str]:
        """Run ``diag burnin`` in a child process; (passed, reason)."""
        cfg = self.config.preflight
        self._set_state(AgentState.SCREENING, why=why)
        report_path = self.spec.run_dir / "diag" / f"{self.spec.node_id}-{int(time.time() * 1000)}.json"
        report_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "diagnostics.cli", "burnin", f"--{cfg.mode}", "--json", str(report_path),
               "--etcd-endpoint", self.spec.endpoint, "--ckpt-dir", str(self.spec.run_dir)]
        if cfg.checks:
            cmd += ["--checks", ",".join(cfg.checks)]
        if cfg.thresholds:
            cmd += ["--config", cfg.thresholds]
        inject = self.spec.run_dir / "faults" / f"diag-{self.spec.node_id}.yaml"
        if inject.exists():
            cmd += ["--inject", str(inject)]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s,
                                  preexec_fn=child_preexec(signal.SIGKILL))
            rc, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            rc, tail = None, [f"screen did not finish within {cfg.timeout_s:g}s"]
        failures: list[str] = []
        try:
            checks = json.loads(report_path.read_text()).get("checks", [])
            failures = [f"{c['name']}: {c['reason']}" for c in checks if c.get("verdict") == "fail"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            pass
        passed = rc == 0
        reason = "; ".join(failures) or (tail[0] if tail else f"diag exited {rc}")
        self.events.emit("agent.screen", why=why, passed=passed, rc=rc, reason=reason if not passed else "",
                         report=str(report_path), duration_s=round(time.monotonic() - started, 3))
        try:
            self.store.put(self._key(f"diag/{self.spec.node_id}"),
                           json.dumps({"passed": passed, "rc": rc, "reason": reason, "ts": time.time(), "why": why}))
        except StoreError:
            pass
        return passed, (f"pre-flight screen failed: {reason}" if not passed else "")

    # -- one torchrun attempt -------------------------------------------------------------
    def attempt_dir(self, epoch: int) -> Path:
        return self.spec.run_dir / "torchrun" / self.spec.node_id / f"e{epoch}-a{self.attempt}"

    def _torchrun_cmd(self, epoch: int) -> list[str]:
        nnodes, rdzv_id = self.spec.nnodes, f"{self.spec.run_id}-e{epoch}"
        if self.replicas is not None:
            nnodes, rdzv_id = "1", self.replicas.rdzv_id(self.attempt)
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={self.spec.nproc_per_node}",
            f"--rdzv-backend={BACKEND_NAME}",
            f"--rdzv-endpoint={self.spec.endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf={','.join([self.rdzv.torchrun_conf(), *self.store.security.rdzv_conf()])}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            f"--local-addr={self.spec.local_addr}",
            f"--log-dir={self.attempt_dir(epoch)}",
            *self.spec.entrypoint,
        ]

    def _torchrun_env(self, epoch: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            # Restarted gloo workers cannot reuse the agent-shared TCPStore (measured: they read
            # the previous attempt's addresses); a fresh MASTER_PORT per attempt works.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "ELASTIC_AGENT_ADDR": "127.0.0.1:%d" % self._sock.getsockname()[1],
            "ELASTIC_NODE_ID": self.spec.node_id,
            "ELASTIC_RUN_ID": self.spec.run_id,
            # Workers publish checkpoint commits to etcd themselves (elastic.checkpoint.manager).
            "ELASTIC_ETCD_ENDPOINT": self.spec.endpoint,
            "ELASTIC_RUN_PREFIX": self.prefix,
            "ELASTIC_EPOCH": str(epoch),
            "ELASTIC_PG_TIMEOUT": str(self.config.pg_timeout_s),
            SKIP_STEPS_ENV: self._skip_steps_env(),
        })
        if self.memstate is not None:
            env.update(self.memstate.worker_env())
        return env

    def _run_once(self, epoch: int) -> Attempt:
        self.attempt += 1
        attempt_dir = self.attempt_dir(epoch)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        self.monitor = HeartbeatMonitor(self.config.heartbeat)
        env = self._torchrun_env(epoch)
        if self.replicas is not None:
            if self._get_json("done") is not None:
                # Another group finished the run: a group (re)starting now would train alone from scratch.
                self.events.emit("replicas.run_done_by_peers", attempt=self.attempt)
                return Attempt("succeeded", 0)
            try:
                env.update(self.replicas.worker_env(self.replicas.lighthouse_address(self._stop.is_set)))
            except LighthouseUnavailable as exc:
                if self._stop.is_set():
                    return Attempt("stopped")
                return Attempt("failed", None, kind=FailureKind.RENDEZVOUS_TIMEOUT, detail=str(exc))
        started = time.monotonic()
        with open(attempt_dir / "torchrun.log", "ab") as log:
            self._proc = subprocess.Popen(self._torchrun_cmd(epoch), env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=child_preexec(signal.SIGTERM))
        self._known_pids = {self._proc.pid}
        self._set_state(AgentState.RUNNING, epoch=epoch, attempt=self.attempt, torchrun_pid=self._proc.pid)
        numerics_step: int | None = None
        next_poll = next_beat = time.monotonic()
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self.events.emit("agent.torchrun_exit", rc=rc, epoch=epoch, attempt=self.attempt,
                                 runtime_s=time.monotonic() - started)
                # Workers in their own sessions may outlive torchrun: reap them.
                terminate_tree(None, self._known_pids, self.config.term_grace_s)
                self.metrics.tick()  # the attempt's last checkpoint events (the final commit)
                self._proc = None
                if rc == 0:
                    return Attempt("succeeded", rc)
                return Attempt("failed", rc, numerics_step=numerics_step, attempt_dir=attempt_dir)
            if self._stop.is_set():
                self._stop_workers(f"signal {self._stop_signal}")
                return Attempt("stopped")
            self._known_pids.update(descendants(self._proc.pid))
            for report in self._drain_reports():
                self.metrics.observe_report(report)
                numerics_step = self._on_report(report, epoch, started, numerics_step)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.config.epoch_poll_s
                outcome = self._poll_run(epoch)
                if outcome is not None:
                    return outcome
            if now >= next_beat:
                next_beat = now + self.config.heartbeat.publish_interval_s
                self._publish_heartbeat(epoch)
                self.metrics.tick()
            verdict, detail = self.monitor.check()
            if verdict != Silence.NONE and numerics_step is None:
                kind = {Silence.CULPRIT: FailureKind.HANG, Silence.VICTIM: FailureKind.STALL,
                        Silence.INIT: FailureKind.INIT_TIMEOUT}[verdict]
                self.events.emit("agent.hang_detected", verdict=verdict.value, detail=detail, epoch=epoch,
                                 silent_s=round(self.monitor.silent_for(), 3))
                # Tell the peers first: they are blocked behind this hang and should not each
                # wait out their own stall timeout while this node tears its workers down.
                self._bump_quietly(epoch)
                self._stop_workers(f"{kind.value}: {detail}")
                return Attempt("failed", None, kind=kind, detail=detail, attempt_dir=attempt_dir)
            self._wait_for_reports(self.config.monitor_interval_s)

    def _on_report(self, report: dict, epoch: int, started: float, numerics_step: int | None) -> int | None:
        kind = report.get("type")
        if kind == "step":
            first = self.monitor.first_step_at is None
            self.monitor.observe(report)
            if first:
                self.events.emit("agent.first_step", step=report.get("step"), epoch=epoch,
                                 attempt=self.attempt, since_start_s=time.monotonic() - started)
        elif kind == "done":
            self.monitor.observe(report)
        elif kind == "commit":
            step = int(report.get("step", -1))
            if step > self.last_commit:
                self.last_commit = step
                self.restarts_since_progress = 0
        elif kind == "numerics":
            self.events.emit("agent.numerics_report", step=report.get("step"), rank=report.get("rank"),
                             reason=report.get("reason"))
            if numerics_step is None:
                return int(report.get("step", 0))
        return numerics_step

    def _poll_run(self, epoch: int) -> Attempt | None:
        """Run-wide signals in etcd: a new epoch, this node's exclusion, a stop of the run."""
        try:
            current = self.read_epoch()
            excluded = self.exclusions.get(self.spec.node_id)
            stop = self.store.get(self._key("stop"))
        except StoreError as exc:
            # etcd unreachable: keep training; the workers do not need etcd between rendezvous.
            self.events.emit("agent.store_error", op="poll", error=str(exc))
            return None
        if stop is not None:
            self._stop_workers("run stopped")
            return Attempt("run_stopped")
        if excluded is not None:
            self.events.emit("agent.excluded_seen", reason=excluded.get("reason"), by=excluded.get("by"))
            self._bump_quietly(epoch)  # the others re-form without this node right away
            self._stop_workers("excluded")
            return Attempt("excluded")
        if current > epoch:
            self.events.emit("agent.epoch_seen", epoch=current, previous=epoch)
            self._stop_workers(f"epoch {current}")
            return Attempt("peer_restart")
        return None

    def _wait_for_reports(self, timeout: float) -> None:
        # Sleeping in select() on the report socket: wakes early when a worker reports.
        try:
            select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)

    def _drain_reports(self) -> list[dict]:
        reports = []
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, OSError):
                return reports
            try:
                reports.append(json.loads(data))
            except json.JSONDecodeError:
                continue

    def _stop_workers(self, reason: str) -> None:
        if self._proc is None:
            return
        self._known_pids.update(descendants(self._proc.pid))
        self.events.emit("agent.stop_workers", reason=reason, pids=sorted(self._known_pids))
        terminate_tree(self._proc.pid, self._known_pids, self.config.term_grace_s)
        try:
            self._proc.wait(timeout=self.config.term_grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._proc = None

    def _classify(self, result: Attempt) -> tuple[FailureKind, str]:
        assert result.attempt_dir is not None
        try:
            log = (result.attempt_dir / "torchrun.log").read_text(errors="replace")
        except OSError:
            log = ""
        return classify(result.attempt_dir, result.rc, log, numerics_reported=result.numerics_step is not None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elastic.agent", description="per-node elastic agent")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--etcd-endpoint", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True, help="resolved run config (YAML)")
    p.add_argument("--local-addr", default="127.0.0.1", help="where peers reach this node (torchrun --local-addr)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from launch.config import load_config  # launch owns the run-config schema

    args = parse_args(argv)
    # If the launcher dies without cleaning up, the kernel tells us; we then stop our workers.
    set_parent_death_signal(signal.SIGTERM)
    try:
        cfg = load_config(args.config)
        # Children (torchrun, workers, diag) inherit the etcd credentials through the environment.
        if cfg.etcd.enabled:
            os.environ.update(cfg.etcd.resolve().env())
        token = cfg.security.token()
    except ConfigError as exc:
        print(f"elastic-agent: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(args.run_dir)
    spec = NodeSpec(
        run_id=args.run_id, node_id=args.node_id, endpoint=args.etcd_endpoint, run_dir=run_dir,
        nnodes=cfg.launch.nodes, nproc_per_node=cfg.launch.nproc_per_node,
        entrypoint=[*cfg.launch.entrypoint, "--config", args.config, "--run-dir", str(run_dir)],
        local_addr=args.local_addr,
    )
    admission = Admission(run_id=args.run_id, node_id=args.node_id, token=token,
                          fingerprint=join_fingerprint(to_dict(cfg)), join_check=cfg.security.join_check)
    agent = NodeAgent(spec, cfg.agent, cfg.rendezvous, admission, memory=cfg.checkpoint.memory,
                      replicas=cfg.replicas)
    agent.install_signal_handlers()
    try:
        return agent.run()
    except (StoreAuthError, StoreTLSError) as exc:
        print(f"elastic-agent: node {args.node_id}: etcd error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
