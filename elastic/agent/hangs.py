"""Hang attribution: on a stall, find the ranks that are not where the others wait.

When this node's ranks have been silent past ``heartbeat.step_timeout_s`` and none of them is
stopped or spinning (:mod:`elastic.agent.heartbeat`), every agent of the run probes its own
ranks once: SIGUSR1 makes each worker dump its Python stacks into the run directory
(:mod:`elastic.worker.hangprobe`), and each worker's marker file says which collective it last
entered.  A rank *waits in a collective* when its main thread's innermost frame is in
``torch/distributed`` or its marker says it is inside one.  The agent publishes its ranks'
positions under ``hangs/<epoch>/<node>`` and, once every node of the epoch has published (or
``wait_s`` has passed), reads them all: when some ranks wait in a collective and others are not
in any, those others are the culprits.  Every agent reaches the same verdict; only the agent of
a culprit acts (a counted ``hang`` failure naming the rank and its stack file), the others stay
victims and rejoin when it moves the run to the next epoch.  A culprit that hangs again is
excluded by the lemon-node policy, so an elastic run shrinks around it.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic.common.events import EventLog
from elastic.control.runstate import RunState
from elastic.control.store import StoreError
from elastic.worker.hangprobe import PROBE_SIGNAL, find_stack_file, where_file

_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FRAME_RE = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')
_COLLECTIVE_PATH = "/torch/distributed/"


@dataclass(frozen=True)
class RankPosition:
    rank: int
    node: str
    waiting: bool
    """In a collective: innermost frame in torch.distributed, or the marker says ``in``."""
    where: str
    """The innermost frame of the main thread (``file:line func``) or ``unknown``."""
    marker: str
    """The worker's last collective mark (``in sync 12`` / ``out sync 11``), or ``""``."""
    stack_file: str


@dataclass(frozen=True)
class Blame:
    rank: int
    node: str
    detail: str
    stack_file: str


def parse_threads(text: str) -> list[list[tuple[str, int, str]]]:
    """A faulthandler dump -> threads, each a list of (file, line, function), innermost first."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if _THREAD_RE.match(line):
            threads.append([])
        elif threads and (m := _FRAME_RE.match(line)):
            threads[-1].append((m.group(1), int(m.group(2)), m.group(3)))
    return threads


def main_thread(threads: list[list[tuple[str, int, str]]]) -> list[tuple[str, int, str]]:
    """The thread that runs the program (outermost frame ``<module>`` or runpy's), else the first."""
    for frames in threads:
        if frames and frames[-1][2] in ("<module>", "_run_module_as_main"):
            return frames
    return threads[0] if threads else []


def position(rank: int, node: str, dump: str, marker: str, stack_path: str) -> RankPosition:
    frames = main_thread(parse_threads(dump))
    innermost = frames[0] if frames else None
    in_torch = innermost is not None and _COLLECTIVE_PATH in innermost[0].replace(os.sep, "/")
    where = f"{Path(innermost[0]).name}:{innermost[1]} {innermost[2]}" if innermost else "unknown"
    return RankPosition(rank, node, in_torch or marker.startswith("in "), where, marker, stack_path)


def attribute(positions: list[RankPosition]) -> tuple[list[RankPosition], str]:
    """(culprits, what the others wait in): ranks not in a collective while others wait in one."""
    known = [p for p in positions if p.where != "unknown"]
    waiting = [p for p in known if p.waiting]
    outside = [p for p in known if not p.waiting]
    if not waiting or not outside:
        return [], ""
    marks = Counter(p.marker.removeprefix("in ") for p in waiting if p.marker.startswith("in "))
    label = marks.most_common(1)[0][0] if marks else Counter(p.where for p in waiting).most_common(1)[0][0]
    return outside, label


class HangAttribution:
    """One node's part: probe the local ranks once per stall, then read everyone's verdict."""

    def __init__(self, node_id: str, run_dir: Path, state: RunState, events: EventLog, wait_s: float) -> None:
        self.node_id = node_id
        self.run_dir = run_dir
        self.state = state
        self.events = events
        self.wait_s = wait_s
        self.reset()

    def reset(self) -> None:
        """A new attempt, or the ranks reported again: the next stall is a new one."""
        self._probed_at: float | None = None
        self._next_look = 0.0
        self._decided = False

    def step(self, epoch: int, ranks: dict[int, int]) -> Blame | None:
        """Called while the local ranks are silent: probe once, then a local culprit when one is found."""
        now = time.monotonic()
        if self._decided or now < self._next_look:
            return None
        try:
            if self._probed_at is None:
                self._probed_at = now
                self._publish(epoch, self.probe(epoch, ranks))
            self._next_look = now + 0.5
            return self._verdict(epoch, now - self._probed_at >= self.wait_s)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="hang_attribution", error=str(exc))
            return None

    def probe(self, epoch: int, ranks: dict[int, int], timeout_s: float = 2.0) -> list[RankPosition]:
        """SIGUSR1 every local rank and read back its stacks and marker (the new part of each dump)."""
        paths = {r: path for r, pid in ranks.items() if (path := find_stack_file(self.run_dir, epoch, pid))}
        before = {r: _size(p) for r, p in paths.items()}
        for pid in ranks.values():
            try:
                os.kill(pid, PROBE_SIGNAL)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_size(p) <= before[r] for r, p in paths.items()):
            time.sleep(0.05)
        time.sleep(0.05)  # let a dump that just started finish
        return [position(r, self.node_id, _read_from(paths[r], before[r]), _read_marker(paths[r]),
                         str(paths[r].relative_to(self.run_dir))) for r in sorted(paths)]

    def _publish(self, epoch: int, positions: list[RankPosition]) -> None:
        record = {"node": self.node_id, "ts": time.time(), "ranks": [asdict(p) for p in positions]}
        self.state.put_hang(epoch, self.node_id, record)
        self.events.emit("agent.hang_probe", epoch=epoch, ranks=record["ranks"])

    def _verdict(self, epoch: int, timed_out: bool) -> Blame | None:
        reports = self.state.hangs(epoch)
        expected = set(self.state.heartbeats(epoch=epoch)) | {self.node_id}
        if not timed_out and not expected <= set(reports):
            return None
        positions = [RankPosition(**p) for r in reports.values() for p in r.get("ranks", [])]
        culprits, label = attribute(positions)
        self._decided = True
        waiting = sorted(p.rank for p in positions if p.waiting)
        self.events.emit("agent.hang_attribution", epoch=epoch, culprits=[asdict(c) for c in culprits],
                         waiting_in=label, waiting_ranks=waiting, nodes=sorted(reports))
        mine = [c for c in culprits if c.node == self.node_id]
        if not mine:
            return None
        c = mine[0]
        detail = (f"rank {c.rank} on {c.node} is not in a collective (at {c.where}, last mark "
                  f"{c.marker.strip() or 'none'!r}) while ranks {waiting} wait in {label}; stacks: {c.stack_file}")
        return Blame(c.rank, c.node, detail, c.stack_file)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _read_marker(stacks: Path) -> str:
    try:
        return where_file(stacks).read_text().strip()
    except OSError:
        return ""
