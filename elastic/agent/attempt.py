"""One torchrun attempt: its command line, its environment, its process tree, its reports.

:class:`TorchrunAttempt` owns everything about one ``torchrun`` process and the workers below
it: the argv (rendezvous target from the restart scope), the worker environment
(:class:`~elastic.common.env.WorkerEnv`), the Popen, the pids seen below it and the stop of
the whole tree.  :class:`ReportInbox` is the agent's UDP socket that the workers' step,
commit, done and numerics reports arrive on (:mod:`elastic.worker.channel`); it outlives
attempts so that its address stays the same.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from elastic.agent.classify import FailureKind
from elastic.common.env import ABORT_SAFE_ENV, WorkerEnv
from elastic.common.procs import alive, child_preexec, children, descendants, terminate_tree
from elastic.control.keys import BACKEND_NAME


class Outcome(str, Enum):
    """How one attempt ended (the agent's state machine branches on it)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # this agent was told to stop (SIGTERM/SIGINT)
    PEER_RESTART = "peer_restart"  # another node moved the run to a new epoch
    EXCLUDED = "excluded"  # this node is on the exclusion list now
    RUN_STOPPED = "run_stopped"  # the run's stop key is set
    SCREEN_FAILED = "screen_failed"  # the first worker's screen of this node failed (it never trained)


@dataclass
class AttemptResult:
    """What happened to one torchrun attempt."""

    outcome: Outcome
    rc: int | None = None
    kind: FailureKind | None = None  # set when the agent itself decided the failure (hang)
    detail: str = ""
    numerics_step: int | None = None
    attempt_dir: Path | None = None
    decision: Any = None  # set when the failure was already decided and counted (in-process path)
    step: int | None = None  # the newest step a local rank reported (where the fault hit)
    gen: int | None = None  # in-process: the generation that replaces the dead worker (names the fault)


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


class ReportInbox:
    """The loopback UDP socket workers report to; never blocks the agent."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.setblocking(False)

    @property
    def address(self) -> str:
        return "127.0.0.1:%d" % self._sock.getsockname()[1]

    def wait(self, timeout: float, fds: list[int] | None = None) -> None:
        """Sleep in select() on the socket: wakes early when a worker reports, or when one of
        ``fds`` is readable (a worker's pidfd: it exited)."""
        try:
            select.select([self._sock, *(fds or [])], [], [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)

    def drain(self) -> list[dict]:
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

    def close(self) -> None:
        self._sock.close()


def base_env(inprocess: bool) -> dict[str, str]:
    """A worker's environment before its node's and attempt's settings (a standby's spare starts
    with only this: its node comes with the slot it takes)."""
    env = dict(os.environ)
    # Restarted gloo workers cannot reuse the agent-shared TCPStore (measured: they read
    # the previous attempt's addresses); a fresh MASTER_PORT per attempt works.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    if inprocess:
        for name, value in ABORT_SAFE_ENV.items():
            env.setdefault(name, value)
    return env


class TorchrunAttempt:
    """One ``torchrun`` process tree under this agent."""

    def __init__(self, spec: NodeSpec, number: int, attempt_dir: Path, rdzv_conf: str, worker_env: WorkerEnv,
                 target: tuple[str, str], term_grace_s: float, extra_env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.number = number
        self.dir = attempt_dir
        self.rdzv_conf = rdzv_conf
        self.worker_env = worker_env
        self.nnodes, self.rdzv_id = target
        self.term_grace_s = term_grace_s
        self.extra_env = extra_env or {}  # the restart scope's (e.g. torchft's TORCHFT_LIGHTHOUSE)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: set[int] = set()
        self.started = 0.0

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.spec.nproc_per_node}",
            f"--rdzv-backend={BACKEND_NAME}",
            f"--rdzv-endpoint={self.spec.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={self.rdzv_conf}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            f"--local-addr={self.spec.local_addr}",
            f"--log-dir={self.dir}",
            *self.spec.entrypoint,
        ]

    def env(self) -> dict[str, str]:
        env = base_env(bool(self.worker_env.inprocess))
        for name, value in self.worker_env.to_env().items():
            if value:
                env[name] = value
            else:  # never let a value inherited from the agent's own environment through
                env.pop(name, None)
        env.update(self.extra_env)
        return env

    def start(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.dir / "torchrun.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=child_preexec(signal.SIGTERM))
        self.pids = {self.proc.pid}
        return self.proc.pid

    def poll(self) -> int | None:
        """torchrun's exit code once it exited (its stray workers reaped), else None."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is None:
            self.pids.update(descendants(self.proc.pid))
            return None
        # Workers in their own sessions may outlive torchrun: reap them.
        terminate_tree(None, self.pids, self.term_grace_s)
        self.proc = None
        return rc

    @property
    def running(self) -> bool:
        return self.proc is not None

    def in_rendezvous(self) -> bool:
        """torchrun runs but has no worker yet: its rendezvous has not completed."""
        return self.proc is not None and self.proc.poll() is None and not children(self.proc.pid)

    def runtime_s(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> list[int]:
        """SIGTERM the whole tree, SIGKILL after the grace period; returns the pids it stopped."""
        if self.proc is None:
            return []
        self.pids.update(descendants(self.proc.pid))
        pids = sorted(self.pids)
        terminate_tree(self.proc.pid, self.pids, self.term_grace_s)
        try:
            self.proc.wait(timeout=self.term_grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        return pids

    def holds(self, workers: Iterable[int]) -> bool:
        """torchrun still runs and each of ``workers`` is a live (not zombie) descendant of it: the
        only state in which it may be retired.  An agent that stalls (etcd leader lost, seconds)
        reads its first step report late: by then the workers may have trained to the end and
        exited, and adopting them would read a finished run as dead workers (CI: two bogus
        counted faults, then the spares "recovered" at the final step)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        tree = set(descendants(self.proc.pid))
        return all(pid in tree and alive(pid) for pid in workers)

    def retire(self, workers: set[int]) -> None:
        """In-process mode: SIGKILL torchrun, keep its workers (the agent, their subreaper, adopts them)."""
        if self.proc is None:
            return
        self.pids.update(descendants(self.proc.pid))
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.pids = set(workers)

    def log_text(self) -> str:
        try:
            return (self.dir / "torchrun.log").read_text(errors="replace")
        except OSError:
            return ""
