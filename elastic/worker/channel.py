"""Worker-side API: how any trainer talks to its node agent.

The channel is one UDP datagram per report to the agent's loopback socket
(address in ``ELASTIC_AGENT_ADDR``).  UDP because a report must never block
or fail a training step: if the agent is gone or slow, the datagram is
dropped and training goes on.  Reports are small JSON objects::

    {"type": "step",   "rank": 0, "step": 12, "loss": 0.41, "step_time": 0.03, "ts": ...}
    {"type": "commit", "rank": 0, "step": 10, "ts": ...}
    {"type": "numerics", "rank": 0, "step": 12, "reason": "nan loss", "ts": ...}

Without ``ELASTIC_AGENT_ADDR`` (plain torchrun, tests) every call is a no-op.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.common.env import AGENT_ADDR_ENV, INPROCESS_ENV, SKIP_STEPS_ENV
from elastic.common.exits import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NUMERICS  # noqa: F401  (re-exported)
from elastic.common.procs import set_parent_death_signal


def skip_steps(text: str | None = None) -> frozenset[int]:
    """Steps whose data batch is skipped after a numerics rollback (``"12-12,30-31"``, set by the agent)."""
    text = os.environ.get(SKIP_STEPS_ENV, "") if text is None else text
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(steps)


@dataclass
class WorkerContext:
    rank: int
    local_rank: int
    world_size: int
    run_dir: Path
    agent_addr: tuple[str, int] | None
    _sock: socket.socket | None = None

    @classmethod
    def from_env(cls, run_dir: str | os.PathLike[str]) -> WorkerContext:
        addr = None
        raw = os.environ.get(AGENT_ADDR_ENV)
        if raw:
            host, _, port = raw.rpartition(":")
            addr = (host, int(port))
        ctx = cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            run_dir=Path(run_dir),
            agent_addr=addr,
        )
        if addr is not None:
            # Under an agent, a worker must not outlive torchrun (node-lost semantics, no orphans).
            # Under an agent a worker must not outlive its parent (node-lost semantics, no orphans); in
            # in-process mode the parent is torchrun, which the agent retires, so the worker watches
            # the agent itself instead (elastic.worker.session).
            if not os.environ.get(INPROCESS_ENV):
                set_parent_death_signal(signal.SIGKILL)
            ctx._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            ctx._sock.setblocking(False)
        return ctx

    def _send(self, payload: dict[str, Any]) -> None:
        if self._sock is None or self.agent_addr is None:
            return
        payload.setdefault("rank", self.rank)
        payload.setdefault("local_rank", self.local_rank)
        payload.setdefault("world", self.world_size)  # torchrun's: generation 0's world (the agent's in-place plan)
        payload["ts"] = time.time()
        payload["pid"] = os.getpid()
        try:
            self._sock.sendto(json.dumps(payload).encode(), self.agent_addr)
        except OSError:
            pass  # agent gone or buffer full: never let reporting hurt training

    def report_step(self, step: int, loss: float, step_time: float, busy_time: float | None = None,
                    gen: int = 0) -> None:
        """``busy_time``: the step's time minus the time spent waiting for peers at its sync point
        (what tells a straggler apart: in synchronous training every rank's step takes as long)."""
        payload = {"type": "step", "step": step, "loss": loss, "step_time": step_time, "gen": gen}
        if busy_time is not None:
            payload["busy_time"] = busy_time
        self._send(payload)

    def report_commit(self, step: int) -> None:
        self._send({"type": "commit", "step": step})

    def report_done(self, step: int) -> None:
        """Training finished: what follows (final barrier, teardown) is not a hang."""
        self._send({"type": "done", "step": step})

    def report_numerics(self, step: int, reason: str) -> None:
        self._send({"type": "numerics", "step": step, "reason": reason})

    def report_fault(self, step: int, gen: int, error: str) -> None:
        """A peer was lost during ``step``: this worker is re-forming in-process (not hung)."""
        self._send({"type": "fault", "step": step, "gen": gen, "error": error[:300]})

    def report_screen(self, verdict: dict[str, Any]) -> None:
        """The node screen's verdict (run by this worker before its first step)."""
        self._send({"type": "screen", **{k: v for k, v in verdict.items() if k in
                                         ("passed", "reason", "duration_s", "wait_s", "report")}})

    def report_replay_sum(self, step: int, tag: str, checksums: dict[str, int], threads: int) -> None:
        """This rank was checked at ``step`` (replay verification): its gradient's checksums per FSDP unit."""
        self._send({"type": "replay_sum", "step": step, "tag": tag, "checksums": checksums, "threads": threads})

    def report_replay(self, step: int, rank: int, path: str, tag: str) -> None:
        """The weights and batch that replay ``rank``'s ``step`` are in ``path``: for this node's spare."""
        self._send({"type": "replay", "step": step, "checked_rank": rank, "path": path, "tag": tag})

    def report_recovered(self, step: int, gen: int, world_size: int, source: str) -> None:
        self._send({"type": "recovered", "step": step, "gen": gen, "world_size": world_size, "source": source})
