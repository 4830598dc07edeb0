"""An agent's part in replay verification (``sdc.replay_every``; :mod:`elastic.sdc.replay`).

Two roles, by the reports its workers send:

* ``replay_sum``: a local rank was checked; its gradient's checksums go to etcd
  (``sdc/sums/<rank>``, one key per rank holding its last ``KEEP`` checks: one put per node per
  check);
* ``replay``: a local rank captured the inputs of another node's checked rank; this agent's warm
  spare replays them (a line on its stdin) and leaves its checksums beside the input.  The agent
  then compares them with the checked rank's from etcd: ``sdc.verified``, or a mismatch.

A mismatch does not yet say who computed wrong: the checked rank's GPU or the verifier's.  The
verifier's agent asks a third node (the next node of the run after it, neither the checked one nor
itself) to **arbitrate**: it puts the check (input path, both checksum sets) in
``sdc/arbitrate/<arbiter>``, a key that agent watches with its run signals (no polling); the
arbiter's spare replays the same input and its agent judges two against one: agreeing with the
verifier, the checked rank's node is the suspect and the run rolls back; agreeing with the rank, the
verifier's node computed wrong (counted against it, the run's training was right: no rollback); with
neither, nobody is named and the run rolls back (``sdc.inconclusive``).  The arbiter writes its
verdict into the same key; the verifier's agent, which reads that key every 0.5 s while it waits,
judges alone (``arbitrated: false``, the reason said) when no third node exists, the arbiter cannot
replay (no spare, the input not readable there: the run directory must be shared across nodes for
arbitration) or says nothing within ``arbitrate_timeout_s``.  The verdict is one ``sdc.suspect``
naming the node, its role (``rank`` or ``verifier``), the rank, the step, every set of checksums
and the units (FSDP-wrapped modules) whose gradients differ.

A rank's last verified step (this agent's view: it verifies one node's checks) goes with a suspect
(``verified_step``): a GPU that computes wrong may have done so since, so the rollback distrusts
every checkpoint after it, not only those from the detected step.

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
    arbitration: dict[str, Any] | None = None
    """The request this replay arbitrates (None: a first replay, of this node's own check)."""

    @property
    def key(self) -> Path:
        return result_path(self.path, arbiter=self.arbitration is not None)


@dataclass
class _Asked:
    """An arbitration this agent asked another node for, until its verdict."""

    id: str
    arbiter: str
    suspect: dict[str, Any]
    path: Path
    deadline: float
    next_read: float = 0.0
    nudge_at: float = 0.0
    nudges: int = 0


class ReplayChecks:
    """This node's checks in flight; fed the workers' reports, polled each loop."""

    KEEP = 4
    """Checks of a rank kept in its etcd record: a replay may answer after the rank's next checks."""
    NUDGE_S = 2.0
    """An arbiter silent this long is asked again (the same request, a new revision: its watch hands
    it over again), twice at most.  Measured (``benchmarks/sdc.py``, 20 runs): the arbiter's watch
    handed the request over 1.1, 3.6 and 5.1 s late three times and never once (its loop and spare
    were idle; ``sdc.arbitrating`` says ``heard_after_s``); the cause was not found.  A second put is
    one raft write; the deadline still ends the wait when the watch stays silent."""

    def __init__(self, node_id: str, state: RunState, events: EventLog, timeout_s: float = 120.0,
                 queue: int = 2, clock: Callable[[], float] = time.monotonic, arbitrate_timeout_s: float = 10.0) -> None:
        self.node_id = node_id
        self.arbitrate_timeout_s = arbitrate_timeout_s
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
        self.nodes: Callable[[], list[str]] = lambda: []
        """The run's nodes now (an arbiter is picked among them); may raise StoreError."""
        self.requests: Callable[[], tuple[int, dict[str, Any]] | None] = lambda: None
        """The newest arbitration asked of this node: (revision, record), from the run signals' watch."""
        self._request_seen = 0
        self._taken: set[str] = set()  # arbitrations this agent took (a nudge repeats one: not replayed twice)
        self.heard: Callable[[], float] = lambda: 0.0
        """When the run signals' watch delivered the newest arbitration (wall clock)."""
        self.asked: dict[str, _Asked] = {}
        self._unverified: set[str] = set()  # epochs in which this agent's checks found a mismatch
        self.verified: dict[int, int] = {}
        """Rank -> the last step whose replay agreed with it (the checks this agent verified)."""

    def attach(self, workers: Any) -> None:
        """The attempt's in-process workers (their spare replays), or None: no spare to ask.  The
        checks of the attempt before are dropped: their spare has gone with it."""
        for check in [*self.pending.values(), *([self.held] if self.held else [])]:
            self._skip(check, "its attempt ended before the spare answered")
        self.held = None
        for asked in list(self.asked.values()):  # the arbiter may have judged (and bumped the epoch) already
            self._await_verdict(asked, self.clock(), final="its attempt ended before the arbiter answered")
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
        waiting = sum(1 for p in self.pending.values() if p.result is None and not p.key.exists())
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
        arbiter = check.arbitration is not None
        spare, why = self.ask({"verify": str(check.path), **({"arbiter": True} if arbiter else {})})
        if spare is None:
            return self._skip(check, why)
        check.spare, check.asked_at = spare, self.clock()
        self.pending[check.key] = check
        return None

    def poll(self) -> None:
        if self.held is not None and self.spare_state() != "importing":
            held, self.held = self.held, None
            self._send(held)
        self._take_request()
        now = self.clock()
        for asked in list(self.asked.values()):
            if now >= asked.next_read:
                asked.next_read = now + 0.5
                self._await_verdict(asked, now)
        for check in list(self.pending.values()):
            if check.result is None:
                check.result = read_result(check.path, arbiter=check.arbitration is not None)
            if check.result is not None and now >= check.next_read:
                check.next_read = now + 0.5
                self._compare(check)
            if check.key not in self.pending or check.result is not None:
                continue
            if self.spare() != check.spare:
                self._skip(check, "the spare took a worker's slot before it answered")
            elif now - check.asked_at > self.timeout_s:
                self._skip(check, f"no verdict within {self.timeout_s:g}s")

    def _compare(self, check: _Pending) -> None:
        assert check.result is not None
        if "error" in check.result:
            return self._skip(check, f"the replay failed: {check.result['error']}")
        if check.arbitration is not None:
            return self._arbitrated(check, check.arbitration)
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
        mine, rank_sums = _sums(check.result["checksums"]), _sums(sums)
        fields = {"step": check.step, "rank": check.rank, "node": theirs.get("node"), "verifier": self.node_id,
                  "replay_s": check.result.get("replay_s")}
        if mine == rank_sums:
            self.verified[check.rank] = max(check.step, self.verified.get(check.rank, -1))
            self.events.emit("sdc.verified", units=len(mine), **fields)
            self._publish_verified(check)
            return self._done(check)
        suspect = {"units": _differ(mine, rank_sums), "checksums": rank_sums, "replayed": mine,
                   "verified_step": self.verified.get(check.rank), **fields}
        self._unverified.add(_epoch(check.tag))
        self._done(check, keep_input=True)  # the arbiter's spare replays the same input
        return self._arbitrate(check, suspect)

    def _publish_verified(self, check: _Pending) -> None:
        """What a checkpoint's COMMIT marker is judged by (the run is verified through the lowest
        of the verifiers' newest checks: :meth:`RunState.sdc_verified_through`).  Not after a
        mismatch in the same epoch: the checks after a corruption replay from the corrupted weights
        and agree (measured: a flip at step 110 found, step 120's check agreed and marked 110's
        checkpoint verified); the next epoch's checks start afresh."""
        if _epoch(check.tag) in self._unverified:
            return
        try:
            self.state.put_sdc_verified(self.node_id, {"step": check.step, "rank": check.rank, "tag": check.tag})
        except StoreError as exc:
            self.events.emit("agent.store_error", op="sdc_verified", error=str(exc))

    # -- the end of the run ------------------------------------------------------------
    def busy(self) -> bool:
        """Checks or arbitrations still waiting for an answer."""
        return bool(self.pending or self.asked or self.held)

    def end_of_run(self) -> None:
        """The run ended: what is still unanswered is said, never dropped in silence."""
        for check in [*self.pending.values(), *([self.held] if self.held else [])]:
            self._skip(check, "the run ended before the replay answered")
        self.held = None
        for asked in list(self.asked.values()):
            self._await_verdict(asked, self.clock(), final=f"the run ended before {asked.arbiter} answered")

    # -- arbitration: the verifier's side ----------------------------------------------
    def _arbitrate(self, check: _Pending, suspect: dict[str, Any]) -> None:
        now = self.clock()
        asked = _Asked(f"{check.tag}/{check.step}/{check.rank}", "", suspect, check.path,
                       now + self.arbitrate_timeout_s, nudge_at=now + self.NUDGE_S)
        try:
            asked.arbiter = self._arbiter(str(suspect["node"])) or ""
            if not asked.arbiter:
                return self._judge_alone(asked, "no third node in the run to arbitrate")
            self.state.put_arbitration(asked.arbiter, {"id": asked.id, "path": str(check.path), "tag": check.tag,
                                                       "asked_ts": time.time(), **suspect})
        except StoreError as exc:
            return self._judge_alone(asked, f"asking for an arbiter: {exc}")
        self.events.emit("sdc.mismatch", arbiter=asked.arbiter, **_brief(suspect))
        self.asked[asked.id] = asked
        return None

    def _arbiter(self, checked: str) -> str | None:
        """The first node after this one (in name order, wrapping) that is neither it nor the checked node."""
        others = sorted(n for n in self.nodes() if n not in (checked, self.node_id))
        return next((n for n in others if n > self.node_id), others[0] if others else None)

    def _await_verdict(self, asked: _Asked, now: float, final: str = "") -> None:
        """Read the arbiter's key: done when it judged; judge alone when it cannot, when another
        request replaced this one, past the deadline, or (``final``: why) when waiting must end now."""
        try:
            record, revision = self.state.arbitration_at(asked.arbiter)
        except StoreError:
            record, revision = {}, 0  # etcd away: wait on, up to the deadline
        verdict = record.get("verdict") if record.get("id") == asked.id else None
        if verdict is None and record.get("id") == asked.id and now >= asked.nudge_at and asked.nudges < 2 \
                and not final and now <= asked.deadline:
            return self._nudge(asked, record, revision, now)
        if verdict is not None and "skipped" not in verdict:
            self.asked.pop(asked.id, None)
            asked.path.unlink(missing_ok=True)  # judged by the arbiter
        elif verdict is not None:
            self._judge_alone(asked, f"{asked.arbiter} could not arbitrate: {verdict['skipped']}")
        elif record and record.get("id") != asked.id:
            self._judge_alone(asked, f"a later check's arbitration replaced this one on {asked.arbiter}")
        elif now > asked.deadline:
            self._judge_alone(asked, f"no verdict from {asked.arbiter} within {self.arbitrate_timeout_s:g}s")
        elif final:
            self._judge_alone(asked, final)

    def _nudge(self, asked: _Asked, record: dict[str, Any], revision: int, now: float) -> None:
        asked.nudges, asked.nudge_at = asked.nudges + 1, now + self.NUDGE_S
        try:  # only over the unanswered request: a verdict written meanwhile stays
            self.state.nudge_arbitration(asked.arbiter, {**record, "nudge": asked.nudges}, revision)
        except StoreError as exc:
            self.events.emit("agent.store_error", op="arbitration", error=str(exc))

    def _judge_alone(self, asked: _Asked, why: str) -> None:
        """No arbiter's verdict: the checked rank is the suspect (a verifier wrong is the rarer case:
        one GPU's replay against a rank's whole step), said to be unarbitrated and why."""
        self.asked.pop(asked.id, None)
        asked.path.unlink(missing_ok=True)
        self._suspect({**asked.suspect, "role": "rank", "rollback": True, "arbitrated": False,
                       "arbiter": asked.arbiter or None, "arbitration": why})

    # -- arbitration: the arbiter's side -----------------------------------------------
    def _take_request(self) -> None:
        request = self.requests()
        if request is None or request[0] <= self._request_seen:
            return
        self._request_seen, record = request
        if "verdict" in record or str(record.get("id")) in self._taken:
            return  # this agent's own answer seen back through the watch, or a nudge of one it took
        self._taken.add(str(record.get("id")))
        check = _Pending(Path(str(record["path"])), int(record["step"]), int(record["rank"]), str(record.get("tag")),
                         self.clock(), 0, arbitration=record)
        self.events.emit("sdc.arbitrating", step=check.step, rank=check.rank, node=record.get("node"),
                         verifier=record.get("verifier"), revision=request[0],
                         since_asked_s=round(time.time() - float(record.get("asked_ts") or time.time()), 3),
                         heard_after_s=round(self.heard() - float(record.get("asked_ts") or 0.0), 3))
        if not check.path.exists():
            return self._skip(check, f"the check's input {check.path} is not readable on {self.node_id} "
                                     "(arbitration needs the run directory shared across nodes)")
        self._send(check)

    def _arbitrated(self, check: _Pending, record: dict[str, Any]) -> None:
        assert check.result is not None
        mine, rank_sums, first = _sums(check.result["checksums"]), _sums(record["checksums"]), _sums(record["replayed"])
        fields = {**record, "arbiter": self.node_id, "arbitrated": True, "arbitrated_sums": mine}
        for name in ("id", "path", "tag", "asked_ts"):
            fields.pop(name, None)
        if mine == first:
            verdict = {**fields, "role": "rank", "rollback": True}
        elif mine == rank_sums:
            verdict = {**fields, "role": "verifier", "node": record["verifier"], "rollback": False,
                       "units": _differ(mine, first)}
        else:
            verdict = {**fields, "role": None, "rollback": True, "count": False}
        self._answer(record, {"suspect": verdict.get("node") if verdict["role"] else None, "role": verdict["role"]})
        self._done(check)
        self._suspect(verdict)

    def _answer(self, record: dict[str, Any], verdict: dict[str, Any]) -> None:
        try:
            self.state.put_arbitration(self.node_id, {**record, "verdict": verdict})
        except StoreError as exc:  # the verifier's agent then judges alone at its deadline
            self.events.emit("agent.store_error", op="arbitration", error=str(exc))

    def _suspect(self, suspect: dict[str, Any]) -> None:
        if suspect.get("role") is None:
            self.events.emit("sdc.inconclusive", **_brief(suspect), arbiter=suspect.get("arbiter"))
        else:
            self.events.emit("sdc.suspect", source_check="replay", **suspect)
        self.on_suspect(suspect)

    def _skip(self, check: _Pending, reason: str) -> None:
        self.events.emit("sdc.replay_skipped", step=check.step, rank=check.rank, verifier=self.node_id,
                         reason=reason, **({"arbitration": True} if check.arbitration is not None else {}))
        if check.arbitration is not None:
            self._answer(check.arbitration, {"skipped": reason})
        self._done(check)

    def _done(self, check: _Pending, keep_input: bool = False) -> None:
        self.pending.pop(check.key, None)
        check.key.unlink(missing_ok=True)
        if not (keep_input or check.arbitration is not None):
            check.path.unlink(missing_ok=True)  # the weights of one step: not kept once judged (the
            # verifier's agent removes an arbitrated input once the verdict is in)


def _epoch(tag: str) -> str:
    """The epoch of a world tag (``epoch.generation``)."""
    return tag.split(".", 1)[0]


def _sums(checksums: dict[str, Any]) -> dict[str, int]:
    return {str(k): int(v) for k, v in checksums.items()}


def _differ(a: dict[str, int], b: dict[str, int]) -> list[str]:
    return sorted(u for u in set(a) | set(b) if a.get(u) != b.get(u))


def _brief(suspect: dict[str, Any]) -> dict[str, Any]:
    return {k: suspect.get(k) for k in ("step", "rank", "node", "verifier", "units")}


def _no_spare(request: dict[str, Any]) -> tuple[int | None, str]:
    return None, "no in-process workers: no warm spare"
