"""Start the agents of a run: N simulated nodes locally, or this node in a cluster.

Local mode (no etcd endpoint): an embedded etcd on a free loopback port and
one agent process per simulated node (``node0`` ... ``node{N-1}``), all on
this host.  Cluster mode: one agent for this node against the given etcd.

Teardown is the launcher's job and happens on every exit path: agents get
SIGTERM (they stop their torchrun trees), stragglers get SIGKILL after the
grace period, then any process still below the launcher is killed and etcd
is stopped last.  If the launcher itself is SIGKILLed, every agent and etcd
has a parent-death signal and cleans up on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.common.exits import EXIT_EXCLUDED, EXIT_FAILURE, RUN_STOP_CODES
from elastic.control.etcd_cluster import EtcdCluster
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreError
from elastic.common.procs import descendants, terminate_tree
from elastic.run.schema import RESOLVED_NAME, RunConfig, dump_run_file
from launch.agentproc import ForkedProc, agent_argv, start_agent
from launch.summary import EXIT_UNSAVED, format_summary, summarize

__all__ = ["Launcher", "LaunchResult", "format_summary"]

if TYPE_CHECKING:
    from launch.status import LiveStatus


@dataclass
class AgentProc:
    node_id: str
    proc: subprocess.Popen[bytes] | ForkedProc
    log_path: Path
    rc: int | None = None


@dataclass
class LaunchResult:
    exit_code: int
    summary: dict = field(default_factory=dict)


class Launcher:
    def __init__(self, cfg: RunConfig, run_dir: Path, live: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.live = live  # a live status table on the terminal (launch.status.LiveStatus)
        self.etcd: EtcdCluster | None = None
        self.agents: list[AgentProc] = []
        self._stop_signal: int | None = None
        # Opened by run() once the previous launch's files are in history/ (a fresh run dir
        # must not get a history/0 holding only this launch's just-created log).
        self.events = EventLog(None, "launcher")

    def _events_path(self) -> Path:
        # In cluster mode one launcher per host shares the run dir: writers never share a file.
        name = f"launcher-{self.node_ids()[0]}.jsonl" if self.cfg.launch.etcd_endpoint else "launcher.jsonl"
        return self.run_dir / "events" / name

    # -- setup --------------------------------------------------------------
    def _endpoint(self) -> str:
        if self.cfg.launch.etcd_endpoint:
            return self.cfg.launch.etcd_endpoint
        self.etcd = EtcdCluster(self.run_dir / "etcd", members=self.cfg.launch.etcd_members,
                                log_dir=self.run_dir / "logs")
        endpoint = self.etcd.start(parent_death_signal=signal.SIGTERM)
        self.events.emit("launcher.etcd_started", endpoint=endpoint, etcd_pid=self.etcd.pids[0],
                         etcd_pids=self.etcd.pids)
        return endpoint

    def node_ids(self) -> list[str]:
        if self.cfg.launch.etcd_endpoint:
            return [self.cfg.launch.node_id or socket.gethostname()]
        return [f"node{i}" for i in range(self.cfg.launch.max_nodes)]

    def local_addr(self) -> str:
        """Where other nodes reach this node's workers (torchrun --local-addr)."""
        if self.cfg.launch.local_addr:
            return self.cfg.launch.local_addr
        return socket.getfqdn() if self.cfg.launch.etcd_endpoint else "127.0.0.1"

    def _spawn_agent(self, node_id: str, endpoint: str, config_path: Path, fork: bool = True) -> AgentProc:
        """Start one agent; forked from this process while that is safe (launch.agentproc says when)."""
        log_path = self.run_dir / "logs" / f"agent-{node_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = agent_argv(self.cfg.run.id, node_id, endpoint, self.run_dir, config_path, self.local_addr())
        proc, how = start_agent(argv, log_path, fork=fork)
        self.events.emit("launcher.agent_started", node=node_id, agent_pid=proc.pid, start=how)
        return AgentProc(node_id, proc, log_path)

    # -- run ------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def run(self) -> LaunchResult:
        started = time.time()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._archive_previous()
            self.events = EventLog(self._events_path(), "launcher")
            self.cfg.fingerprint = self.cfg.compute_fingerprint()
            config_path = self.run_dir / RESOLVED_NAME
            dump_run_file(self.cfg, config_path)
            if self.cfg.launch.etcd_endpoint:
                # Every host's launcher writes the shared file; its own agent reads a copy of its own,
                # so per-node settings (agent.chaos, agent.metrics, credentials) stay per node.
                config_path = self.run_dir / f"config.resolved-{self.node_ids()[0]}.yaml"
                dump_run_file(self.cfg, config_path)
            endpoint = self._endpoint()
            self.events.emit("launcher.start", run_id=self.cfg.run.id, nodes=self.cfg.launch.nodes,
                             endpoint=endpoint, local=self.etcd is not None)
            for node_id in self.node_ids():
                self.agents.append(self._spawn_agent(node_id, endpoint, config_path))
            self._wait_agents(endpoint, config_path)
        finally:
            self._teardown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._node_lost():
            return self._lost_result()
        summary = summarize(self.cfg, self.run_dir, {a.node_id: a.rc for a in self.agents}, time.time() - started,
                            self._stop_signal)
        summary["loss_png"] = self._loss_plot()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        (self.run_dir / "goodput.json").write_text(json.dumps(summary["goodput"], indent=1))
        code = self._exit_code(summary)
        # A run whose newest steps are in no committed checkpoint is not a clean success.
        return LaunchResult(EXIT_UNSAVED if code == 0 and summary["unsaved_steps"] else code, summary)

    def _node_lost(self) -> bool:
        """Cluster mode: this host's agents were all killed (a signal: the node is being lost, as
        the chaos ``kill_agent`` models it) while the run goes on without it.  Such a launcher
        leaves at once, without summarizing the run: the summary and the loss plot read every
        rank's events (1.5 s of the 5.9 s a lost node cost in a 10-minute soak, before its
        scheduler could relaunch it; at 1,024 nodes, 8,192 event files on a shared file system), and
        the run's are written by the launchers that finish it.  A run that is done, or whose state
        cannot be read, is summarized as before."""
        if not self.cfg.launch.etcd_endpoint or self._stop_signal is not None or not self.agents:
            return False
        if not all(a.rc is not None and a.rc < 0 for a in self.agents):
            return False
        store = EtcdStore(self._endpoint(), retry_deadline=1.0)
        try:
            return not RunState(store, RunKeys.of(self.cfg.rendezvous.key_prefix, self.cfg.run.id)).finished()
        except StoreError:
            return False

    def _lost_result(self) -> LaunchResult:
        nodes = {a.node_id: a.rc for a in self.agents}
        self.events.emit("launcher.node_lost", nodes=nodes)
        summary = {"node_lost": True, "run_id": self.cfg.run.id, "nodes": nodes, "run_dir": str(self.run_dir)}
        return LaunchResult(self._exit_code({}), summary)

    def _loss_plot(self) -> str | None:
        if not self.cfg.run.loss_plot:
            return None
        from launch.report import plot_loss

        try:
            path = plot_loss(self.run_dir)
        except (OSError, ValueError, RuntimeError) as exc:  # the report must never fail a finished run
            self.events.emit("launcher.report_failed", error=str(exc))
            return None
        return str(path) if path is not None else None

    def _archive_previous(self) -> None:
        """A relaunch in the same run dir resumes from its checkpoints but starts fresh logs.

        Event logs and torchrun logs of the previous launch move to history/<n>/ so that
        this launch's summary counts only its own events; a local launch also starts a
        fresh embedded etcd (epochs and leases of a dead launch mean nothing now).
        """
        if self.cfg.launch.etcd_endpoint:
            # Other hosts' launchers write to this run dir right now: moving it would pull their
            # files away; a cluster relaunch appends to the same logs instead.
            return
        outputs = ("events", "torchrun", "logs", "stacks", "summary.json", "goodput.json", "loss.png",
                   "final_checksum.txt")
        old = [self.run_dir / name for name in outputs if (self.run_dir / name).exists()]
        old += sorted(self.run_dir.glob("final_checksum-*.txt"))  # replica groups' checksums
        if old:
            history = self.run_dir / "history"
            history.mkdir(exist_ok=True)
            dest = history / str(len(list(history.iterdir())))
            dest.mkdir()
            for path in old:
                path.rename(dest / path.name)
        shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)

    def _wait_agents(self, endpoint: str, config_path: Path) -> None:
        respawn = self.cfg.launch.respawn_excluded and not self.cfg.launch.etcd_endpoint
        store = EtcdStore(endpoint, retry_deadline=2.0)
        state = RunState(store, RunKeys.of(self.cfg.rendezvous.key_prefix, self.cfg.run.id))
        live = None
        if self.live:
            from launch.status import LiveStatus

            live = LiveStatus(store, state.keys.prefix)
        try:
            self._poll_agents(endpoint, config_path, state, respawn, live)
        finally:
            if live is not None:
                live.close()

    def _poll_agents(self, endpoint: str, config_path: Path, state: RunState, respawn: bool,
                     live: LiveStatus | None) -> None:
        next_check = 0.0
        while True:
            if live is not None:
                live.update()
            if self._stop_signal is not None:
                self.events.emit("launcher.interrupted", signal=self._stop_signal)
                return
            for agent in self.agents:
                if agent.rc is None:
                    agent.rc = agent.proc.poll()
                    if agent.rc is not None:
                        self.events.emit("launcher.agent_exit", node=agent.node_id, rc=agent.rc)
            running = [a for a in self.agents if a.rc is None]
            if not running:
                return
            if respawn and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                try:
                    done = state.finished()
                    for i, agent in enumerate(self.agents):
                        if agent.rc == EXIT_EXCLUDED and not done and state.exclusions.get(agent.node_id) is None:
                            self.events.emit("launcher.agent_respawn", node=agent.node_id)
                            # Exec'd, not forked: this process now holds etcd clients whose sockets a child would share.
                            self.agents[i] = self._spawn_agent(agent.node_id, endpoint, config_path, fork=False)
                except StoreError as exc:
                    self.events.emit("launcher.store_error", error=str(exc))
            time.sleep(0.1)

    def _teardown(self) -> None:
        grace = self.cfg.agent.term_grace_s
        known: set[int] = set()
        for agent in self.agents:
            known.update(descendants(agent.proc.pid))
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace * 2 + 5
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            if agent.rc is None:
                agent.rc = agent.proc.poll()
        for agent in self.agents:
            terminate_tree(agent.proc.pid if agent.proc.poll() is None else None, known, grace=2.0)
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait()
            agent.rc = agent.proc.returncode if agent.rc is None else agent.rc
        # Anything else still below us (should be nothing) goes too.
        terminate_tree(None, descendants(os.getpid()) if self.etcd is None else
                       [p for p in descendants(os.getpid()) if p not in self.etcd.pids], grace=2.0)
        if self.etcd is not None:
            self.etcd.close()
            self.events.emit("launcher.etcd_stopped")

    def _exit_code(self, summary: dict) -> int:
        if self._stop_signal is not None:
            return 128 + self._stop_signal
        codes = [a.rc for a in self.agents]
        # The run finished if any node finished training; nodes that were excluded or lost
        # on the way are reported in the summary, not as a failed run.
        if any(c == 0 for c in codes) and all(c in (0, EXIT_EXCLUDED) or (c or 0) < 0 for c in codes):
            return 0
        nonzero = [c for c in codes if c not in (0, None)]
        code = nonzero[0] if nonzero else EXIT_FAILURE
        # Every node leaves a stopped run with EXIT_FAILURE; what stopped it may say more (failing saves: 88).
        return (_stop_code(summary) or code) if code == EXIT_FAILURE else code


def _stop_code(summary: dict) -> int | None:
    """The code of the failure that stopped the run (the first stop decision), when it has its own."""
    stops = [f for f in summary.get("failures", []) if f.get("action") == "stop"]
    return RUN_STOP_CODES.get(stops[0].get("failure_kind")) if stops else None
