"""Worker liveness as the node agent sees it: step reports in, hang verdicts out.

Every local rank reports each step over the agent's UDP socket
(:mod:`elastic.worker.channel`).  :class:`HeartbeatMonitor` keeps the newest report
per rank and answers one question each monitor tick: has any rank been
silent past its timeout (``init_timeout_s`` before the first step,
``step_timeout_s`` after)?

Silence alone does not say *who* is hung: in synchronous training every
healthy rank blocks in the next collective behind the hung one, so all of
them go quiet together.  The agent therefore looks at its own workers in
``/proc``: a worker that is stopped (SIGSTOP, a debugger) or burning CPU
without reporting is the culprit; workers asleep in a blocking call are
victims waiting on a peer elsewhere.  The culprit's agent acts at
``step_timeout_s``; a victim's agent only at ``stall_factor`` times that, so
the blame normally lands on the hung node while a node that vanished
entirely still cannot stall the run forever.  In between (``SUSPECT``: silent,
every local rank asleep) the agent attributes the hang from what every rank
is doing (:mod:`elastic.agent.hangs`): a rank asleep in I/O or on a lock is
asleep too, but it is not in the collective the others wait in.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from elastic.agent.config import HeartbeatConfig

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Silence(str, Enum):
    NONE = "none"
    CULPRIT = "culprit"   # a local worker is stopped or spinning without reporting
    VICTIM = "victim"     # local workers are blocked, waiting on someone else
    SUSPECT = "suspect"   # silent past step_timeout_s, all asleep: attribute before calling it a stall
    INIT = "init"         # no first step within init_timeout_s


@dataclass
class ProcSample:
    state: str  # one-letter /proc state: R, S, D, T, t, Z, ...
    cpu_s: float


def sample_proc(pid: int) -> ProcSample | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3, utime/stime are fields 14 and 15.
    return ProcSample(state=fields[0], cpu_s=(int(fields[11]) + int(fields[12])) / _CLK_TCK)


@dataclass
class RankView:
    pid: int
    last_step: int = 0
    last_seen: float = 0.0
    step_times: deque = field(default_factory=lambda: deque(maxlen=20))
    busy_times: deque = field(default_factory=lambda: deque(maxlen=20))
    loss: float | None = None


class HeartbeatMonitor:
    """Tracks one torchrun attempt's local ranks; reset for each attempt."""

    def __init__(self, config: HeartbeatConfig, clock=time.monotonic, recovery_grace_s: float = 0.0) -> None:
        self.config = config
        self.clock = clock
        self.recovery_grace_s = recovery_grace_s
        self.recovering_until = 0.0  # in-process re-formation under way: silence is expected
        self.started = clock()
        self.ranks: dict[int, RankView] = {}
        self.first_step_at: float | None = None
        self.finished = False  # the trainer said it is done: silence from here on is shutdown
        self._cpu_at_silence: dict[int, float] = {}
        self.culprit_pid: int | None = None  # the process the last CULPRIT verdict named

    def recovering(self) -> None:
        """A peer was lost and the world re-forms in-process: no verdict for ``recovery_grace_s``."""
        self.recovering_until = self.clock() + self.recovery_grace_s

    def observe(self, report: dict) -> None:
        if report.get("type") == "done":
            self.finished = True
        if report.get("type") == "fault":
            self.recovering()
        if report.get("type") == "recovered":
            # The world has re-formed and trains again: silence counts from now.  Counting it from the
            # last step before the fault judged a slow recovery (a cold spare joining, 5.4 s under a
            # CPU hog) a stall the moment it ended: the run restarted from disk for nothing.
            self.recovering_until = 0.0
            now = self.clock()
            for view in self.ranks.values():
                view.last_seen = max(view.last_seen, now)
            self._cpu_at_silence.clear()
        if report.get("type") != "step":
            return
        # Keyed by local rank: the global rank of a slot may change when the world re-forms in-process.
        rank = int(report.get("local_rank", report.get("rank", -1)))
        view = self.ranks.get(rank)
        if view is None or view.pid != report.get("pid"):
            view = self.ranks[rank] = RankView(pid=int(report.get("pid", 0)))
            view.step_times = deque(maxlen=self.config.window)
            view.busy_times = deque(maxlen=self.config.window)
        now = self.clock()
        view.last_step = int(report.get("step", 0))
        view.last_seen = now
        view.loss = report.get("loss")
        if report.get("step_time") is not None:
            view.step_times.append(float(report["step_time"]))
            view.busy_times.append(float(report.get("busy_time", report["step_time"])))
        if self.first_step_at is None:
            self.first_step_at = now
        self._cpu_at_silence.pop(rank, None)

    # -- verdicts ---------------------------------------------------------------
    def silent_for(self) -> float:
        """Seconds since the quietest local rank last reported (or since start, before any step)."""
        now = self.clock()
        if not self.ranks:
            return now - self.started
        return now - min(v.last_seen for v in self.ranks.values())

    def check(self) -> tuple[Silence, str]:
        if self.finished or self.clock() < self.recovering_until:
            return Silence.NONE, ""
        silent = self.silent_for()
        if self.first_step_at is None:
            if silent > self.config.init_timeout_s:
                return Silence.INIT, f"no step within init_timeout_s={self.config.init_timeout_s:g}"
            return Silence.NONE, ""
        if silent <= self.config.step_timeout_s:
            return Silence.NONE, ""
        culprit = self._local_culprit()
        if culprit:
            return Silence.CULPRIT, f"{culprit}; silent {silent:.1f}s > step_timeout_s={self.config.step_timeout_s:g}"
        if silent > self.config.step_timeout_s * self.config.stall_factor:
            return Silence.VICTIM, (f"all local ranks blocked {silent:.1f}s "
                                    f"(> {self.config.stall_factor:g} x step_timeout_s); a peer is hung or gone")
        return Silence.SUSPECT, f"all local ranks blocked {silent:.1f}s > step_timeout_s={self.config.step_timeout_s:g}"

    def _local_culprit(self) -> str:
        """Why a local rank is the hang's culprit ("" when none is); :attr:`culprit_pid` names it."""
        self.culprit_pid = None
        for rank, view in sorted(self.ranks.items()):
            sample = sample_proc(view.pid)
            if sample is None:
                continue
            if sample.state in ("T", "t"):
                self.culprit_pid = view.pid
                return f"rank {rank} (pid {view.pid}) is stopped"
            # A rank that keeps burning CPU while silent is spinning, not waiting.
            before = self._cpu_at_silence.setdefault(rank, sample.cpu_s)
            if sample.state == "R" and sample.cpu_s - before > 0.5 * self.config.step_timeout_s:
                self.culprit_pid = view.pid
                return f"rank {rank} (pid {view.pid}) is running without progress"
        return ""

    # -- statistics for the node heartbeat ------------------------------------------
    def summary(self) -> dict:
        if not self.ranks:
            return {"step": 0}
        steps = [t for v in self.ranks.values() for t in v.step_times]
        busy = [t for v in self.ranks.values() for t in v.busy_times]
        return {
            "step": max(v.last_step for v in self.ranks.values()),
            "step_time": statistics.median(steps) if steps else None,
            "busy_time": max(statistics.median(v.busy_times) for v in self.ranks.values() if v.busy_times)
            if busy else None,
            "samples": min(len(v.busy_times) for v in self.ranks.values()),
            "loss": next(iter(self.ranks.values())).loss,
        }
