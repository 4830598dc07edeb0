"""An agent's part in replay verification (``sdc.replay_every``; :mod:`elastic.sdc.replay`).

Two roles, by the reports its workers send:

* ``replay_sum``: a local rank was checked; its gradient's checksums go to etcd
  (``sdc/sums/<rank>``, one key per rank holding its last ``KEEP`` checks: one put per node per
  check);
* ``replay``: a local rank captured the inputs of another node's checked rank; this agent's warm
  spare replays them (a line on its stdin) and leaves its checksums beside the input.  The agent
  then compares them with the checked rank's from etcd and says what it found: ``sdc.verified``,
  or ``sdc.suspect`` naming the checked rank's node, the rank, the step, both sets of checksums
  and the units (FSDP-wrapped modules) whose gradients differ.

A check is compared only within one world (the ``tag``: epoch and generation) and one step: a
rank's record from another world or a later step means this check can no longer be compared
(``sdc.replay_skipped``), as does a spare that is absent, failed, slower than ``timeout_s``,
or already has ``queue`` checks waiting.  Nothing here blocks the agent's loop: one stat per pending check per loop, and an
etcd read only once the spare has answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.common.events import EventLog
from elastic.control.runstate import RunState
from elastic.control.store import StoreError
from elastic.sdc.results import read_result, result_path


@dataclass
class _Pending:
    path: Path
    step: int
    rank: int
    tag: str
    asked_at: float
    spare: int
    result: dict[str, Any] | None = None
    next_read: float = 0.0


class ReplayChecks:
    """This node's checks in flight; fed the workers' reports, polled each loop."""

    KEEP = 4
    """Checks of a rank kept in its etcd record: a replay may answer after the rank's next checks."""

    def __init__(self, node_id: str, state: RunState, events: EventLog, timeout_s: float = 120.0,
                 queue: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self.queue = queue
        """Checks a spare may have waiting (it reads them in order): one being replayed, one behind it.
        More means the spare cannot keep up; the newest are dropped rather than queued without end."""
        self.state = state
        self.events = events
        self.timeout_s = timeout_s
        self.clock = clock
        self.pending: dict[Path, _Pending] = {}
        self._published: dict[int, dict[str, Any]] = {}  # rank -> its record in etcd (this agent's ranks)
        self.ask: Callable[[dict[str, Any]], tuple[int | None, str]] = _no_spare
        """Hands a request line to this node's warm spare: (its pid, "") or (None, why it cannot)."""
        self.on_suspect: Callable[[dict[str, Any]], None] = lambda suspect: None
        """What the agent does about a mismatch (roll the run back: :meth:`Supervisor.sdc_rollback`)."""
        self.spare: Callable[[], int | None] = lambda: None
        """The pid of this node's warm spare now (it changes when the spare takes a worker's slot)."""
        self.spare_state: Callable[[], str] = lambda: "none"
        """``none``, ``importing`` or ``ready``: a check that comes while the spare imports is held."""
        self.held: _Pending | None = None
        """The newest check that came while the spare was still importing (one: each is a model's weights)."""

    def attach(self, workers: Any) -> None:
        """The attempt's in-process workers (their spare replays), or None: no spare to ask.  The
        checks of the attempt before are dropped: their spare has gone with it."""
        for check in [*self.pending.values(), *([self.held] if self.held else [])]:
            self._skip(check, "its attempt ended before the spare answered")
        self.held = None
        self.ask = workers.ask_spare if workers is not None else _no_spare
        self.spare = workers.spare_pid if workers is not None else (lambda: None)
        self.spare_state = workers.spare_state if workers is not None else (lambda: "none")

    def observe(self, report: dict[str, Any]) -> None:
        kind = report.get("type")
        if kind == "replay_sum":
            self._publish(report)
        elif kind == "replay":
            self._request(report)

    def _publish(self, report: dict[str, Any]) -> None:
        rank, tag = int(report["rank"]), str(report.get("tag"))
        record = self._published.get(rank)
        if record is None or record["tag"] != tag:
            record = self._published[rank] = {"tag": tag, "node": self.node_id, "checks": {}}
        checks = record["checks"]
        checks[str(report.get("step"))] = report.get("checksums") or {}
        for old in sorted(checks, key=int)[:-self.KEEP]:
            del checks[old]
        try:
            self.state.put_replay_sum(rank, record)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="replay_sum", error=str(exc))

    def _request(self, report: dict[str, Any]) -> None:
        path = Path(str(report["path"]))
        check = _Pending(path, int(report["step"]), int(report["checked_rank"]), str(report.get("tag")),
                         self.clock(), 0)
        waiting = sum(1 for p in self.pending.values() if p.result is None and not result_path(p.path).exists())
        if waiting >= self.queue:
            return self._skip(check, f"the spare has {waiting} checks to replay before it")
        if self.spare_state() == "importing":
            return self._hold(check)
        return self._send(check)

    def _hold(self, check: _Pending) -> None:
        """Until the spare has imported: a line sent now would wait behind seconds of imports, and
        the checks under way meanwhile would pile up (each a model's weights on disk)."""
        if self.held is not None:
            self._skip(self.held, "a newer check came while the spare was importing")
        self.held = check

    def _send(self, check: _Pending) -> None:
        spare, why = self.ask({"verify": str(check.path)})
        if spare is None:
            return self._skip(check, why)
        check.spare, check.asked_at = spare, self.clock()
        self.pending[check.path] = check
        return None

    def poll(self) -> None:
        if self.held is not None and self.spare_state() != "importing":
            held, self.held = self.held, None
            self._send(held)
        now = self.clock()
        for check in list(self.pending.values()):
            if check.result is None:
                check.result = read_result(check.path)
            if check.result is not None and now >= check.next_read:
                check.next_read = now + 0.5
                self._compare(check)
            if check.path not in self.pending or check.result is not None:
                continue
            if self.spare() != check.spare:
                self._skip(check, "the spare took a worker's slot before it answered")
            elif now - check.asked_at > self.timeout_s:
                self._skip(check, f"no verdict within {self.timeout_s:g}s")

    def _compare(self, check: _Pending) -> None:
        assert check.result is not None
        if "error" in check.result:
            return self._skip(check, f"the replay failed: {check.result['error']}")
        try:
            theirs = self.state.replay_sum(check.rank)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="replay_sum", error=str(exc))
            return None
        checks = (theirs or {}).get("checks", {}) if (theirs or {}).get("tag") == check.tag else {}
        if str(check.step) in checks:
            self._verdict(check, theirs or {}, checks[str(check.step)])
        elif theirs is not None and theirs.get("tag") != check.tag:
            self._skip(check, f"rank {check.rank} is in another world ({theirs.get('tag')}, this check's: {check.tag})")
        elif checks and min(int(s) for s in checks) > check.step:
            self._skip(check, f"rank {check.rank}'s checksums of step {check.step} were replaced by newer checks")
        return None  # else its agent has not published them yet

    def _verdict(self, check: _Pending, theirs: dict[str, Any], sums: dict[str, Any]) -> None:
        assert check.result is not None
        mine = {str(k): int(v) for k, v in check.result["checksums"].items()}
        rank_sums = {str(k): int(v) for k, v in sums.items()}
        fields = {"step": check.step, "rank": check.rank, "node": theirs.get("node"), "verifier": self.node_id,
                  "replay_s": check.result.get("replay_s")}
        if mine == rank_sums:
            self.events.emit("sdc.verified", units=len(mine), **fields)
        else:
            differ = sorted(u for u in set(mine) | set(rank_sums) if mine.get(u) != rank_sums.get(u))
            suspect = {"source_check": "replay", "units": differ, "checksums": rank_sums, "replayed": mine, **fields}
            self.events.emit("sdc.suspect", **suspect)
            self.on_suspect(suspect)
        self._done(check)

    def _skip(self, check: _Pending, reason: str) -> None:
        self.events.emit("sdc.replay_skipped", step=check.step, rank=check.rank, verifier=self.node_id,
                         reason=reason)
        self._done(check)

    def _done(self, check: _Pending) -> None:
        self.pending.pop(check.path, None)
        for path in (check.path, result_path(check.path)):
            path.unlink(missing_ok=True)  # the weights of one step: not kept once judged


def _no_spare(request: dict[str, Any]) -> tuple[int | None, str]:
    return None, "no in-process workers: no warm spare"
