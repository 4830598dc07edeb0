"""What the run's round note told this agent: plans closed in place and new c10d store addresses.

A worker lost on a node whose warm spare takes its slot changes nothing else: that node closes
the next generation in place (:func:`~elastic.control.generations.plan_in_place`).  Every other node
used to join that round all the same (one raft write each) and open a watch of its own for the
round's keys (a new HTTP stream and reader thread each): ~2 requests per node per round, ~2,000
at 1,024 nodes, for a plan that was already written.  Now the plan's own compare-and-swap also puts
it on the run's round note (:attr:`~elastic.control.keys.RunKeys.round_note`), which every agent's one
signal watch already follows, and the new rank 0's put of its c10d store address does the same.  A
node whose round follows a pushed fault that said "in place" waits here for the note instead of
joining: the round costs it no request at all.

Nothing depends on the note arriving.  A node that hears no "in place" joins at once, as before
(under gloo its workers' own errors may come before the push: they join and read the plan back);
one whose note does not come within ``wait_s`` (the closing node died, a watch stream reconnecting)
joins then, and its join reads whatever plan the round has.  A store address not noted within a
second is read from etcd, once a second, until it comes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.control.generations import GenerationFailed, Plan

_KEEP = 8
"""Generations of notes kept: a round looks only at its own; older ones are dropped as newer arrive."""


class RoundNotes:
    """The round notes and in-place faults of one epoch, as the signal watch delivers them."""

    def __init__(self, epoch: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch = epoch
        self.clock = clock
        self._cond = threading.Condition()
        self._in_place: set[int] = set()  # generations a pushed fault said would be closed in place
        self._plans: dict[int, Plan] = {}
        self._stores: dict[int, str] = {}

    def heard_fault(self, record: dict[str, Any]) -> None:
        """A pushed fault of generation g whose pusher closes g+1 with it (its node's spare took the
        slot: ``in_place``; or the plan without a lost node went in the push: ``closed``)."""
        if self._ours(record) and (record.get("in_place") or record.get("closed")):
            with self._cond:
                self._in_place.add(int(record["gen"]) + 1)
                self._prune(int(record["gen"]) + 1)

    def heard(self, note: dict[str, Any]) -> None:
        """One round note: ``kind`` ``plan`` (a plan closed in place) or ``store`` (an address)."""
        if not self._ours(note):
            return
        gen = int(note["gen"])
        with self._cond:
            if note.get("kind") == "plan" and isinstance(note.get("plan"), dict):
                self._plans[gen] = Plan.from_record(note["plan"])
            elif note.get("kind") == "store" and note.get("addr"):
                self._stores[gen] = str(note["addr"])
            self._prune(gen)
            self._cond.notify_all()

    def expects(self, gen: int) -> bool:
        """Whether a pushed fault said generation ``gen`` closes in place."""
        with self._cond:
            return gen in self._in_place

    def plan(self, gen: int, wait_s: float, stopped: Callable[[], bool]) -> Plan | None:
        """Generation ``gen``'s plan from a note, waiting up to ``wait_s`` (None: not noted)."""
        deadline = self.clock() + wait_s
        with self._cond:
            while gen not in self._plans and not stopped() and (remaining := deadline - self.clock()) > 0:
                self._cond.wait(min(remaining, 0.5))
            return self._plans.get(gen)

    def store(self, gen: int, timeout_s: float, stopped: Callable[[], bool], read: Callable[[], str | None]) -> str:
        """Generation ``gen``'s c10d store address: from a note, else read once a second (``read``)."""
        deadline = self.clock() + timeout_s
        next_read = self.clock() + 1.0
        while (addr := self._noted_store(gen, min(1.0, max(0.0, deadline - self.clock())))) is None:
            if stopped():
                raise GenerationFailed(f"generation {gen}: this node's attempt ended during the round")
            if self.clock() >= next_read:
                next_read = self.clock() + 1.0
                if (addr := read()) is not None:
                    return addr
            if self.clock() >= deadline:
                raise GenerationFailed(f"generation {gen}: its rank 0 published no store within {timeout_s:g}s")
        return addr

    def noted_store(self, gen: int, wait_s: float) -> str | None:
        """Generation ``gen``'s store address if noted, waiting up to ``wait_s`` for it (no read)."""
        return self._noted_store(gen, wait_s)

    def _noted_store(self, gen: int, wait_s: float) -> str | None:
        with self._cond:
            if gen not in self._stores and wait_s > 0:
                self._cond.wait(wait_s)
            return self._stores.get(gen)

    def _ours(self, record: dict[str, Any]) -> bool:
        try:
            return int(record.get("epoch", -1)) == self.epoch and int(record.get("gen", -1)) >= 0
        except (TypeError, ValueError):
            return False

    def _prune(self, newest: int) -> None:
        oldest = newest - _KEEP
        self._in_place = {g for g in self._in_place if g > oldest}
        self._plans = {g: plan for g, plan in self._plans.items() if g > oldest}
        self._stores = {g: addr for g, addr in self._stores.items() if g > oldest}
