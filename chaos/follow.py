"""Follow a run directory's event logs while the run is going on.

The chaos runner polls many times a second, so re-reading every JSONL file
each time would cost more than the training it watches.  :class:`RunFollower`
keeps a byte offset per file and only parses what was appended since the
last poll; a line without its newline yet (the writer is mid-write) is left
for the next poll.  Process discovery (which pid is rank 1's worker now,
which is node2's agent, where etcd is) is answered from the events alone,
the same way the suite's invariants are computed afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.common.procs import alive

Event = dict[str, Any]


@dataclass
class _Tail:
    path: Path
    offset: int = 0


@dataclass
class RunFollower:
    run_dir: Path
    events: list[Event] = field(default_factory=list)
    _tails: dict[str, _Tail] = field(default_factory=dict)

    def poll(self) -> list[Event]:
        """Parse what was appended since the last call; returns the new events (in ts order)."""
        directory = Path(self.run_dir) / "events"
        new: list[Event] = []
        if not directory.is_dir():
            return new
        for path in sorted(directory.glob("*.jsonl")):
            tail = self._tails.setdefault(path.name, _Tail(path))
            try:
                with open(path, "rb") as fh:
                    fh.seek(tail.offset)
                    chunk = fh.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            tail.offset += end + 1
            for line in chunk[: end + 1].splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a writer killed mid-write
        new.sort(key=lambda e: e.get("ts", 0.0))
        self.events.extend(new)
        if new and len(self.events) > len(new) and self.events[-len(new) - 1].get("ts", 0) > new[0].get("ts", 0):
            self.events.sort(key=lambda e: e.get("ts", 0.0))
        return new

    # -- queries -------------------------------------------------------------
    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.get("kind") == kind]

    def max_step(self) -> int:
        return max((e["step"] for e in self.of_kind("trainer.step")), default=0)

    def launcher_start(self) -> Event | None:
        starts = self.of_kind("launcher.start")
        return starts[-1] if starts else None

    def etcd(self) -> tuple[int | None, str | None]:
        started = self.of_kind("launcher.etcd_started")
        if not started:
            return None, None
        return started[-1].get("etcd_pid"), started[-1].get("endpoint")

    def nodes(self) -> list[str]:
        return sorted({e["node"] for e in self.of_kind("launcher.agent_started")}, key=_node_order)

    def agent_pid(self, node: str) -> int | None:
        """The newest agent process running as ``node``: its launcher's, or a standby's that took
        its slot (its ``agent.start`` comes from the node's source)."""
        started = [(e["ts"], int(e["agent_pid"])) for e in self.of_kind("launcher.agent_started") if e.get("node") == node]
        started += [(e["ts"], int(e["pid"])) for e in self.of_kind("agent.start") if e.get("source") == f"agent/{node}"]
        return max(started)[1] if started else None

    def workers(self) -> list[Event]:
        """The newest ``trainer.start`` per rank whose process is still alive."""
        newest: dict[str, Event] = {}
        for e in self.of_kind("trainer.start"):
            newest[e["source"]] = e
        return [e for e in newest.values() if alive(int(e["pid"]))]

    def worker(self, target: str) -> Event | None:
        """The live worker for ``nodeN``, ``rankR`` or ``nodeN/rankR`` (None if there is none now)."""
        node, rank = parse_target(target)
        for e in self.workers():
            if node is not None and e.get("node") != node:
                continue
            if rank is not None and e["source"] != f"trainer/rank{rank}":
                continue
            return e
        return None

    def torchrun(self, node: str) -> Event | None:
        """The newest RUNNING state of ``node``'s agent (carries torchrun_pid and epoch)."""
        for e in reversed(self.of_kind("agent.state")):
            if e.get("source") == f"agent/{node}" and e.get("state") == "RUNNING":
                return e
        return None

    def all_pids(self) -> set[int]:
        """Every process the run reported: launcher, etcd, agents, torchrun, trainers."""
        pids: set[int] = set()
        for e in self.events:
            source = e.get("source", "")
            if source == "chaos":
                continue
            pids.add(int(e.get("pid", 0)))
            for key in ("etcd_pid", "agent_pid", "torchrun_pid"):
                if e.get(key):
                    pids.add(int(e[key]))
        pids.discard(0)
        pids.discard(os.getpid())
        return pids


def parse_target(target: str) -> tuple[str | None, int | None]:
    """``node1`` -> ("node1", None); ``rank2`` -> (None, 2); ``node1/rank0``; ``any`` -> (None, None)."""
    node: str | None = None
    rank: int | None = None
    if target in ("", "any"):
        return None, None
    for part in target.split("/"):
        if part.startswith("rank") and part[4:].isdigit():
            rank = int(part[4:])
        elif part:
            node = part
    return node, rank


def _node_order(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else 0, name)
