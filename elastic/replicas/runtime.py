"""Replica-group mode in the agent: the torchft Lighthouse and each group's torchrun settings.

One node agent = one replica group.  The agent holding the leader lease starts the
Lighthouse (torchft's quorum server, a Rust binary inside the ``torchft`` wheel)
as a child process in a session of its own when none runs, and publishes its
address under ``<run>/torchft/lighthouse`` bound to its own node lease: if that
agent dies, the key disappears with the lease and the leader starts a new one.
Every agent reads the address from etcd before each torchrun attempt and hands
it to the workers as ``TORCHFT_LIGHTHOUSE``.

Each group's torchrun rendezvous is its own (``--nnodes=1``, rendezvous id
``<run>-rg-<node>-a<attempt>``: a fresh id per attempt, because torch closes a
rendezvous when its torchrun exits after a failure), so a failed group restarts
alone: the agent does not bump the run-wide epoch in this mode, and the other
groups keep training with a smaller quorum until the restarted one heals from
them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic.control.etcd_server import free_port
from elastic.common.events import EventLog
from elastic.common.procs import child_preexec, terminate_tree
from elastic.replicas.config import ReplicaConfig
from elastic.control.runstate import RunState
from elastic.control.store import StoreError

_TERMINAL = frozenset({"SUCCEEDED", "GAVE_UP", "EXCLUDED", "STOPPED"})
# The Lighthouse lives in torchft's extension module; this launcher loads it without
# importing torch (see lighthouse_main.py for why).
_LIGHTHOUSE_MAIN = Path(__file__).with_name("lighthouse_main.py")


class LighthouseUnavailable(RuntimeError):
    """No Lighthouse address appeared in etcd in time, or the Lighthouse did not come up."""


def lighthouse_cmd(config: ReplicaConfig, port: int) -> list[str]:
    return [sys.executable, str(_LIGHTHOUSE_MAIN),
            "--bind", f"{config.lighthouse_host}:{port}",
            "--min_replicas", str(config.min_replicas),
            "--heartbeat_timeout_ms", str(config.heartbeat_timeout_ms),
            "--join_timeout_ms", str(config.join_timeout_ms),
            "--quorum_tick_ms", str(config.quorum_tick_ms)]


def _wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LighthouseUnavailable(f"lighthouse exited with rc={proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise LighthouseUnavailable(f"lighthouse not listening on {host}:{port} after {timeout:g}s")


_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]"})


class LighthouseHost:
    """The Lighthouse child of the leader agent.

    It binds ``replicas.lighthouse_host``; a wildcard there (``0.0.0.0``, ``::``: every interface,
    as a cluster needs) is advertised as ``advertise_host``, this node's address for its peers."""

    def __init__(self, config: ReplicaConfig, log_path: Path, advertise_host: str = "127.0.0.1") -> None:
        self.config = config
        self.log_path = log_path
        self.advertise_host = config.lighthouse_host if config.lighthouse_host not in _WILDCARDS else advertise_host
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, timeout: float = 15.0) -> str:
        port = self.config.lighthouse_port or free_port(self.config.lighthouse_host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # At info level the Lighthouse logs every quorum tick (~15 KB/s); warnings are what matter.
        env.setdefault("RUST_LOG", "warn")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(lighthouse_cmd(self.config, port), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=child_preexec(signal.SIGKILL))  # noqa: PLW1509 (prctl only)
        try:
            _wait_listening(self.advertise_host, port, self.proc, timeout)  # where peers will connect
        except LighthouseUnavailable:
            self.stop()
            raise
        self.address = f"http://{self.advertise_host}:{port}"
        return self.address

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        terminate_tree(self.proc.pid, grace=2.0)
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


class ReplicaRuntime:
    """What an agent does differently in replica-group mode."""

    def __init__(self, config: ReplicaConfig, state: RunState, node_id: str, run_id: str,
                 run_dir: Path, events: EventLog, local_addr: str = "127.0.0.1") -> None:
        self.config = config
        self.state = state
        self.store = state.store
        self.node_id = node_id
        self.run_id = run_id
        self.events = events
        self.key = state.keys.lighthouse
        self.host = LighthouseHost(config, run_dir / "logs" / f"lighthouse-{node_id}.log", local_addr)
        self._lock = threading.Lock()

    # -- leader side ------------------------------------------------------------
    def tick(self, is_leader: bool, lease_id: int | None) -> None:
        """LeaderLoop callback, every election round (about once a second) on every agent.

        The Lighthouse belongs to the agent that started it, not to the leader lease: under load
        leadership can move every few seconds (measured at a load average of 30), and each move
        would kill the Lighthouse and with it every group's quorum.  So a leader starts one only
        when none is published, the address is bound to the host agent's own node lease, and a
        host stops its Lighthouse only when the published address is no longer its own.
        """
        with self._lock:
            try:
                kv = self.store.get(self.key)
            except StoreError:
                return  # etcd unreachable: change nothing
            owner = self._owner(kv)
            if self.host.running():
                if kv is None and lease_id is not None:
                    self._publish(lease_id)  # our record expired (etcd hiccup): claim it back
                elif owner not in (None, self.node_id):
                    self.host.stop()
                    self.events.emit("replicas.lighthouse_stopped", reason=f"superseded by {owner}'s")
            elif is_leader and kv is None and lease_id is not None:
                self._start(lease_id)

    @staticmethod
    def _owner(kv) -> str | None:
        if kv is None:
            return None
        try:
            return json.loads(kv.value).get("node")
        except (json.JSONDecodeError, AttributeError):
            return ""

    def _start(self, lease_id: int) -> None:
        try:
            address = self.host.start()
        except LighthouseUnavailable as exc:
            self.events.emit("replicas.lighthouse_error", error=str(exc))
            return
        if not self._publish(lease_id):
            self.host.stop()
            return
        self.events.emit("replicas.lighthouse_started", address=address, lighthouse_pid=self.host.proc.pid)

    def _publish(self, lease_id: int) -> bool:
        """Create-only: two agents that both saw no Lighthouse cannot both publish one."""
        record = json.dumps({"address": self.host.address, "node": self.node_id, "pid": self.host.proc.pid,
                             "ts": time.time()})
        try:
            ok, _ = self.store.compare_and_swap(self.key, record, 0, lease=lease_id)
        except StoreError as exc:
            self.events.emit("replicas.lighthouse_error", error=str(exc))
            return False
        return ok

    def close(self, drain: bool) -> None:
        """Stop the Lighthouse; after a success, first let the other groups finish their last steps."""
        if drain and self.host.running():
            self._wait_peers_done(self.config.lighthouse_wait_s)
        with self._lock:
            if self.host.running():
                self.host.stop()
                self.events.emit("replicas.lighthouse_stopped", reason="agent exit")
                try:
                    if self._owner(self.store.get(self.key)) == self.node_id:
                        self.store.delete(self.key)
                except StoreError:
                    pass

    def _wait_peers_done(self, timeout: float) -> None:
        # The other groups' last quorum and commit go through this Lighthouse.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = {node: record.get("state") for node, record in self.state.nodes().items()}
            except StoreError:
                return
            if all(state in _TERMINAL for node, state in states.items() if node != self.node_id):
                return
            time.sleep(0.1)
        self.events.emit("replicas.drain_timeout", timeout_s=timeout)

    # -- every agent --------------------------------------------------------------
    def lighthouse_address(self, should_stop: Callable[[], bool] = lambda: False) -> str:
        deadline = time.monotonic() + self.config.lighthouse_wait_s
        while time.monotonic() < deadline and not should_stop():
            try:
                kv = self.store.get(self.key)
            except StoreError:
                kv = None
            if kv is not None:
                try:
                    return json.loads(kv.value)["address"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass
            time.sleep(0.1)
        raise LighthouseUnavailable(f"no torchft lighthouse address at {self.key} within "
                                    f"replicas.lighthouse_wait_s={self.config.lighthouse_wait_s:g}s")

    def rdzv_id(self, attempt: int) -> str:
        return f"{self.run_id}-rg-{self.node_id}-a{attempt}"

    def worker_env(self, address: str) -> dict[str, str]:
        return {
            "TORCHFT_LIGHTHOUSE": address,
            "REPLICA_GROUP_ID": self.node_id,
            # The trainer reads its Manager timeouts from the run config's replicas section.
            "TORCHFT_USE_OTEL": "false",
        }
