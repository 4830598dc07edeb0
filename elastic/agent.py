"""The per-node agent: registers the node, runs torchrun, restarts it on failure.

One agent runs per node (``python -m elastic.agent ...``; ``elastic-launch``
starts them).  Its life::

    INIT -> REGISTERED -> RUNNING -> SUCCEEDED
                 |           |-> FAILED -> (budget left) RUNNING
                 |           |-> FAILED -> (budget spent) GAVE_UP
                 |           '-> STOPPED (SIGTERM/SIGINT forwarded)
                 '-> EXCLUDED (node on the run's exclusion list; never starts)

Restart coordination uses a run-wide **epoch** in etcd.  Every torchrun is
started with rendezvous id ``<run>-e<epoch>``, so each recovery gets a fresh
rendezvous: no stale participants to wait out, and torch closing the old
round on exit cannot block the new one.  An agent whose torchrun fails bumps
the epoch (compare-and-swap, so concurrent failures bump it once); every
other agent sees the bump within ``epoch_poll_s``, stops its healthy workers
(SIGTERM, grace, SIGKILL) and rejoins under the new epoch.  Only a node's own
failures consume its restart budget: a restart caused by a peer is a
membership change, not a failure of this node.

torchrun itself runs with ``--max-restarts 0``: this agent owns the restart
decision so that it can classify the failure and record it.
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

from elastic.config import ConfigError
from elastic.events import EventLog
from elastic.procs import child_preexec, descendants, set_parent_death_signal, terminate_tree
from elastic.agent_config import AgentConfig, RendezvousConfig
from elastic.naming import BACKEND_NAME, run_prefix
from elastic.store import EtcdStore, LeaseKeeper, StoreError

EXIT_SUCCESS = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_EXCLUDED = 93  # "do not requeue": the node is bad, rescheduling it here is pointless
EXIT_INTERRUPTED = 130

# Messages in a worker's error file that mean "a peer went away", not "this node broke".
_PEER_LOST_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh failed",
    "Connection refused",
)


class AgentState(str, Enum):
    INIT = "INIT"
    REGISTERED = "REGISTERED"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    SUCCEEDED = "SUCCEEDED"
    STOPPED = "STOPPED"
    GAVE_UP = "GAVE_UP"
    EXCLUDED = "EXCLUDED"


class FailureKind(str, Enum):
    WORKER_SIGNAL = "worker_signal"    # a worker died from a signal (SIGKILL, SIGSEGV, OOM killer)
    WORKER_ERROR = "worker_error"      # a worker raised (error file present)
    PEER_LOST = "peer_lost"            # collective failed because another node went away
    TORCHRUN = "torchrun"              # torchrun itself died or failed before workers ran


@dataclass
class NodeSpec:
    run_id: str
    node_id: str
    endpoint: str
    run_dir: Path
    nnodes: str  # "N" or "MIN:MAX"
    nproc_per_node: int
    entrypoint: list[str]  # e.g. ["-m", "trainer.train", "--config", ..., "--run-dir", ...]


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
    def __init__(self, spec: NodeSpec, config: AgentConfig, rdzv: RendezvousConfig) -> None:
        self.spec = spec
        self.config = config
        self.rdzv = rdzv
        self.store = EtcdStore(spec.endpoint)
        self.prefix = run_prefix(rdzv.key_prefix, spec.run_id)
        self.exclusions = Exclusions(self.store, self.prefix)
        self.events = EventLog(spec.run_dir / "events" / f"agent-{spec.node_id}.jsonl", f"agent/{spec.node_id}")
        self.state = AgentState.INIT
        self.failures = 0
        self.attempt = 0
        self._stop = threading.Event()
        self._stop_signal: int | None = None
        self._lease: LeaseKeeper | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._known_pids: set[int] = set()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)
        self.last_report: dict[int, dict] = {}

    # -- bookkeeping ------------------------------------------------------------
    @property
    def epoch_key(self) -> str:
        return f"{self.prefix}/epoch"

    @property
    def node_key(self) -> str:
        return f"{self.prefix}/nodes/{self.spec.node_id}"

    def _set_state(self, state: AgentState, **fields) -> None:
        self.state = state
        self.events.emit("agent.state", state=state.value, **fields)
        if self._lease is not None:
            self._publish_node()

    def _publish_node(self) -> None:
        record = {"node": self.spec.node_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "state": self.state.value, "failures": self.failures, "ts": time.time()}
        try:
            self.store.put(self.node_key, json.dumps(record), lease=self._lease.lease_id if self._lease else None)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="publish_node", error=str(exc))

    def read_epoch(self) -> int:
        kv = self.store.get(self.epoch_key)
        return int(kv.value) if kv else 0

    def bump_epoch(self, seen: int) -> int:
        """Move the run to epoch seen+1 unless someone already moved it; returns the current epoch."""
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

    # -- signals ------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        self._stop_signal = signum
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.request_stop(signum))

    # -- main loop ----------------------------------------------------------------
    def run(self) -> int:
        self.events.emit("agent.start", run_id=self.spec.run_id, endpoint=self.spec.endpoint,
                         nnodes=self.spec.nnodes, max_restarts=self.config.max_restarts)
        try:
            return self._run()
        finally:
            self._stop_workers("agent exit")
            if self._lease is not None:
                self._lease.close(revoke=True)
            self.events.emit("agent.exit", state=self.state.value, failures=self.failures)
            self.events.close()

    def _run(self) -> int:
        excluded = self.exclusions.get(self.spec.node_id)
        if excluded is not None:
            self._set_state(AgentState.EXCLUDED, reason=excluded.get("reason"), until=excluded.get("until"))
            print(f"elastic-agent: node {self.spec.node_id} is excluded from run {self.spec.run_id}: "
                  f"{excluded.get('reason')}", file=sys.stderr)
            return EXIT_EXCLUDED
        self._lease = LeaseKeeper(self.store, self.config.lease_ttl_s,
                                  on_lost=lambda: self.events.emit("agent.lease_lost"))
        self._set_state(AgentState.REGISTERED)
        while not self._stop.is_set():
            epoch = self.read_epoch()
            outcome, rc = self._run_once(epoch)
            if outcome == "stopped":
                self._set_state(AgentState.STOPPED, signal=self._stop_signal)
                return EXIT_INTERRUPTED
            if outcome == "succeeded":
                self._set_state(AgentState.SUCCEEDED, epoch=epoch)
                return EXIT_SUCCESS
            if outcome == "peer_restart":
                self.events.emit("agent.restart", reason="peer", epoch=epoch, counted=False)
                continue
            kind = self._classify(rc, epoch)
            counted = kind != FailureKind.PEER_LOST
            if counted:
                self.failures += 1
            self._set_state(AgentState.FAILED, rc=rc, failure_kind=kind.value, failures=self.failures, epoch=epoch)
            new_epoch = self.bump_epoch(epoch)
            if self.failures > self.config.max_restarts:
                self._set_state(AgentState.GAVE_UP, failures=self.failures, max_restarts=self.config.max_restarts)
                print(f"elastic-agent: node {self.spec.node_id} gave up after {self.failures} failures "
                      f"(max_restarts={self.config.max_restarts})", file=sys.stderr)
                return EXIT_FAILURE
            self.events.emit("agent.restart", reason=kind.value, epoch=new_epoch, counted=counted,
                             failures=self.failures)
        self._set_state(AgentState.STOPPED, signal=self._stop_signal)
        return EXIT_INTERRUPTED

    def _torchrun_cmd(self, epoch: int) -> list[str]:
        log_dir = self.spec.run_dir / "torchrun" / self.spec.node_id / f"e{epoch}-a{self.attempt}"
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.spec.nnodes}",
            f"--nproc-per-node={self.spec.nproc_per_node}",
            f"--rdzv-backend={BACKEND_NAME}",
            f"--rdzv-endpoint={self.spec.endpoint}",
            f"--rdzv-id={self.spec.run_id}-e{epoch}",
            f"--rdzv-conf={self.rdzv.torchrun_conf()}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
            f"--log-dir={log_dir}",
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
            # Workers publish checkpoint commits to etcd themselves (elastic.checkpoint).
            "ELASTIC_ETCD_ENDPOINT": self.spec.endpoint,
            "ELASTIC_RUN_PREFIX": self.prefix,
            "ELASTIC_EPOCH": str(epoch),
            "ELASTIC_PG_TIMEOUT": str(self.config.pg_timeout_s),
        })
        return env

    def _run_once(self, epoch: int) -> tuple[str, int | None]:
        self.attempt += 1
        cmd = self._torchrun_cmd(epoch)
        started = time.monotonic()
        self._proc = subprocess.Popen(cmd, env=self._torchrun_env(epoch), start_new_session=True,
                                      preexec_fn=child_preexec(signal.SIGTERM))
        self._known_pids = {self._proc.pid}
        self._set_state(AgentState.RUNNING, epoch=epoch, attempt=self.attempt, torchrun_pid=self._proc.pid)
        first_step_seen = False
        next_epoch_check = time.monotonic() + self.config.epoch_poll_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self.events.emit("agent.torchrun_exit", rc=rc, epoch=epoch, attempt=self.attempt,
                                 runtime_s=time.monotonic() - started)
                # Workers in their own sessions may outlive torchrun: reap them.
                terminate_tree(None, self._known_pids, self.config.term_grace_s)
                self._proc = None
                return ("succeeded" if rc == 0 else "failed"), rc
            if self._stop.is_set():
                self._stop_workers(f"signal {self._stop_signal}")
                return "stopped", None
            self._known_pids.update(descendants(self._proc.pid))
            for report in self._drain_reports():
                if report.get("type") == "step" and not first_step_seen:
                    first_step_seen = True
                    self.events.emit("agent.first_step", step=report.get("step"), epoch=epoch,
                                     attempt=self.attempt, since_start_s=time.monotonic() - started)
            if time.monotonic() >= next_epoch_check:
                next_epoch_check = time.monotonic() + self.config.epoch_poll_s
                try:
                    current = self.read_epoch()
                except StoreError as exc:
                    self.events.emit("agent.store_error", op="read_epoch", error=str(exc))
                    current = epoch
                if current > epoch:
                    self.events.emit("agent.epoch_seen", epoch=current, previous=epoch)
                    self._stop_workers(f"epoch {current}")
                    return "peer_restart", None
            self._wait_for_reports(self.config.monitor_interval_s)

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
                report = json.loads(data)
            except json.JSONDecodeError:
                continue
            self.last_report[int(report.get("rank", -1))] = report
            reports.append(report)

    def _stop_workers(self, reason: str) -> None:
        if self._proc is None:
            return
        self.events.emit("agent.stop_workers", reason=reason, pids=sorted(self._known_pids))
        self._known_pids.update(descendants(self._proc.pid))
        terminate_tree(self._proc.pid, self._known_pids, self.config.term_grace_s)
        try:
            self._proc.wait(timeout=self.config.term_grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._proc = None

    def _classify(self, rc: int | None, epoch: int) -> FailureKind:
        log_dir = self.spec.run_dir / "torchrun" / self.spec.node_id / f"e{epoch}-a{self.attempt}"
        messages = []
        for err in log_dir.glob("**/error.json"):
            try:
                messages.append(err.read_text(errors="replace"))
            except OSError:
                continue
        if messages:
            if all(any(m in text for m in _PEER_LOST_MARKERS) for text in messages):
                return FailureKind.PEER_LOST
            return FailureKind.WORKER_ERROR
        if rc is not None and rc < 0:
            return FailureKind.TORCHRUN
        return FailureKind.WORKER_SIGNAL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elastic.agent", description="per-node elastic agent")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--etcd-endpoint", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True, help="resolved run config (YAML)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from launch.config import load_config  # launch owns the run-config schema

    args = parse_args(argv)
    # If the launcher dies without cleaning up, the kernel tells us; we then stop our workers.
    set_parent_death_signal(signal.SIGTERM)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"elastic-agent: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(args.run_dir)
    spec = NodeSpec(
        run_id=args.run_id, node_id=args.node_id, endpoint=args.etcd_endpoint, run_dir=run_dir,
        nnodes=cfg.launch.nodes, nproc_per_node=cfg.launch.nproc_per_node,
        entrypoint=[*cfg.launch.entrypoint, "--config", args.config, "--run-dir", str(run_dir)],
    )
    agent = NodeAgent(spec, cfg.agent, cfg.rendezvous)
    agent.install_signal_handlers()
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
