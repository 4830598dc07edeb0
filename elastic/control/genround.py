"""One node's part in a generation round (:mod:`elastic.control.generations`): join, learn the plan.

Every node joins with one transaction and watches the round's control keys (``lost/*``, ``plan``,
``store``) over one stream.  Roles follow from the records every node sees alike, so handing a role
over needs no message of its own:

* the **coordinator**, the first node of generation g (key order) not lost: reads the round once,
  then watches all of it (joins included), probes the nodes that have not joined every ``poll_s``,
  declares the gone ones lost, and closes the round with one compare-and-swap;
* the **deputy**, the next node in that order: probes the coordinator alone; when the coordinator
  is lost it declares it so, which makes the deputy the coordinator;
* the **reserves**, the next two nodes: after ``takeover_s`` without a plan (coordinator and
  deputy both gone, a double fault) they probe the two themselves, so a round does not hang on them;
* every other node waits for the plan: it reads nothing and probes no one.  (When every node took
  over after ``takeover_s``, a round slowed by a loaded host turned into every agent reading every
  node record: ~1 M records at 1,024 nodes, and etcd timed out; benchmarks/control_plane.py.)
  Given ``notes`` (the agent's signal watch follows the run's round note), such a member opens no
  watch of its own either: the coordinator's close and the new rank 0's store put also put the round
  note, and the member takes both from there.  One that has no plan ``note_watch_after_s`` into the
  round watches the round after all (from its join's revision: nothing is missed), so a round
  whose four leaders were all lost still finds a coordinator.  (1,024 simulated nodes on 2 cores: a
  watch stream per member and round was ~1,000 HTTP streams and reader threads opened at once.)

The probe is the agent's (``probe(nodes) -> {node: reason}``, "" while a node may only be slow),
so this module stays free of sockets and is tested on the in-memory store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic.control.generations import GenerationFailed, Generations, Plan, RoundState, Roster, plan_next
from elastic.control.keys import RunKeys
from elastic.control.store import WatchEvent

Probe = Callable[[list[str]], dict[str, str]]
Emit = Callable[..., Any]


class _Stream(Protocol):
    def get(self, timeout: float) -> list[WatchEvent] | None: ...
    def close(self) -> None: ...


class Notes(Protocol):
    """The round notes an agent's signal watch hands on (:class:`~elastic.agent.roundnotes.RoundNotes`)."""

    def plan(self, gen: int, wait_s: float, stopped: Callable[[], bool]) -> Plan | None: ...
    def noted_store(self, gen: int, wait_s: float) -> str | None: ...


class NodeRound:
    """``run()``: the plan of generation ``gen`` for ``node``; ``wait_store()``: its c10d store address."""

    def __init__(self, gens: Generations, node: str, gen: int, slots: dict[int, int], previous: Plan | None,
                 probe: Probe, timeout_s: float, on_lost: Callable[[str, str], None] = lambda node, why: None,
                 emit: Emit = lambda kind, **fields: None, poll_s: float = 0.2, takeover_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, stopped: Callable[[], bool] = lambda: False,
                 notice: tuple[str, str] | None = None, reprobe_s: float = 1.0, min_nodes: int = 0,
                 rejoin_wait_s: float = 0.0, notes: Notes | None = None, note_watch_after_s: float = 10.0) -> None:
        self.gens, self.node, self.gen, self.slots = gens, node, gen, slots
        self.previous = previous
        self.probe, self.on_lost, self.emit = probe, on_lost, emit
        self.timeout_s, self.poll_s, self.takeover_s, self.clock = timeout_s, poll_s, takeover_s, clock
        self.stopped = stopped  # the attempt ended (workers stopped, run over): the round is moot
        self.notice = notice  # the run's note of the fault, written with the join (Generations.join_node)
        # A node that has not joined is probed at the first poll (a lost node refuses at once), then
        # once a reprobe_s: probing every node every poll made the coordinator connect to ~1,000
        # slow-but-alive agents five times a second while they joined.
        self.reprobe_s = reprobe_s
        # A fixed-size run's coordinator holds a round short of min_nodes while a node lost before it
        # may come back (_holding): the returning node joins it and is re-admitted (plan_next).
        self.min_nodes, self.rejoin_wait_s = min_nodes, rejoin_wait_s
        self._held = False
        self.gone = set(previous.gone) if previous else set()
        self.state = RoundState(0)
        self.head: list[str] = []
        self._head_limit = 0
        self._stream: _Stream | None = None
        self._base = gens.keys.generation(gens.epoch, gen)
        self._roster: Roster | None = None  # the coordinator's: generation 0, read once
        self._next_probe: dict[str, float] = {}  # the coordinator's: when to probe a node not joined again
        self._started = 0.0
        self.role = ""
        self.notes, self.note_watch_after_s = notes, note_watch_after_s
        self._by_note = False  # a member taking the plan and store from the round note (no watch)
        self._joined_at = 0  # the join's revision: a member's late watch starts after it

    # -- the round --------------------------------------------------------------------------
    def run(self) -> Plan:
        self._started = self.clock()
        deadline = self._started + self.timeout_s
        self._join()
        while self.state.plan is None:
            self._check_self()
            self._act()
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise GenerationFailed(self._timeout_text())
            if self.stopped():
                raise GenerationFailed(f"generation {self.gen}: this node's attempt ended during the round")
            self._receive(min(self._wait_s(), remaining))
        self._check_self()
        return self.state.plan

    def _wait_s(self) -> float:
        """How long to wait for the round's next event: a poll for those that probe; the others have
        nothing to do until an event comes (a lost record, the plan), so they only look up now and
        then whether their attempt ended.  (1,024 round threads of a simulation waking five times a
        second kept a 2-core host's run queue long: benchmarks/control_plane.py.)"""
        if self.role in ("coordinator", "deputy", "reserve"):
            return self.poll_s
        leaders = [n for n in self.head if n not in self.gone and n not in self.state.lost][:4]
        if self.node in leaders[2:]:  # a reserve: its turn comes at takeover_s
            return max(self.poll_s, self._started + self.takeover_s - self.clock())
        return max(self.poll_s, 1.0)

    def wait_store(self, timeout_s: float) -> str:
        """Where the new generation's c10d store listens, once its rank 0 published it."""
        deadline = self.clock() + timeout_s
        while self.state.store is None:
            remaining = deadline - self.clock()
            if self.stopped():
                raise GenerationFailed(f"generation {self.gen}: this node's attempt ended during the round")
            if remaining <= 0:
                raise GenerationFailed(f"generation {self.gen}: its rank 0 published no store within {timeout_s:g}s")
            self._receive(min(1.0, remaining))
        return self.state.store

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _join(self) -> None:
        self._head_limit = len(self.gone) + 4  # coordinator, deputy and two reserves past the gone ones
        view = self.gens.join_node(self.gen, self.node, self.slots, self._head_limit, self.notice)
        self.emit("round.joined", gen=self.gen, since_s=round(self.clock() - self._started, 3))
        if not view.head:
            raise GenerationFailed(f"generation {self.gen}: no node registered generation 0 of epoch {self.gens.epoch}")
        self.state = RoundState(view.revision, {}, set(view.lost), view.plan, view.store)
        self.head = view.head
        self._joined_at = view.revision
        if self.notes is not None and self.node not in self._leaders():
            self._by_note = True
            return
        self._watch_round()

    def _watch_round(self) -> None:
        """The round's control keys (lost, plan, store), from the join's revision on."""
        start, end = self.gens.keys.gen_control(self.gens.epoch, self.gen)
        self._stream = self.gens.store.watch(start, self._joined_at + 1, range_end=end)  # type: ignore[attr-defined]

    def _receive(self, timeout: float) -> None:
        if self._by_note:
            self._receive_note(timeout)
            return
        assert self._stream is not None
        for event in self._stream.get(timeout) or []:
            self.gens.apply(self.state, RunKeys.tail(event.key, self._base), event.value)

    def _receive_note(self, timeout: float) -> None:
        """A member's wait on the round note (see the module docstring), or its own watch after all."""
        assert self.notes is not None
        if self.clock() - self._started >= self.note_watch_after_s:
            self._by_note = False
            self.emit("round.note_fallback", gen=self.gen, after_s=round(self.clock() - self._started, 3),
                      plan=self.state.plan is not None)
            self._watch_round()
            return
        if self.state.plan is None:
            self.state.plan = self.notes.plan(self.gen, timeout, self.stopped)
        elif self.state.store is None:
            self.state.store = self.notes.noted_store(self.gen, timeout)

    def _check_self(self) -> None:
        if self.node in self.state.lost:
            raise GenerationFailed(f"generation {self.gen}: this node ({self.node}) was declared lost")
        plan = self.state.plan
        if plan is not None and (self.node in plan.lost or self.node in plan.gone):
            # gone: a node back from a loss that joined a round which closed without it (its wait
            # ran out); the run restarts from disk, and this node with it.
            raise GenerationFailed(f"generation {self.gen} formed without this node ({self.node})")

    # -- roles ------------------------------------------------------------------------------
    def _act(self) -> None:
        leaders = self._leaders()
        if not leaders:
            return
        if leaders[0] == self.node:
            self._coordinate()
        elif len(leaders) > 1 and leaders[1] == self.node:
            self._set_role("deputy")
            self._probe_each([leaders[0]])
        elif self.node in leaders[2:] and self.clock() - self._started >= self.takeover_s:
            self._set_role("reserve")
            self._probe_each(leaders[:2])

    def _leaders(self) -> list[str]:
        """Coordinator, deputy and the two reserves: the first nodes of the roster not gone or lost."""
        out = [n for n in self.head if n not in self.gone and n not in self.state.lost]
        if len(out) < 4 and len(self.head) >= self._head_limit:
            self._head_limit *= 2  # the head read ran out of live nodes: read further
            self.head = self.gens.head(self._head_limit)
            out = [n for n in self.head if n not in self.gone and n not in self.state.lost]
        return out[:4]

    def _set_role(self, role: str) -> None:
        if role != self.role:
            self.role = role
            self.emit("round.role", gen=self.gen, role=role, since_s=round(self.clock() - self._started, 3))

    def _probe_each(self, nodes: list[str]) -> None:
        nodes = [n for n in nodes if n not in self.state.lost and n != self.node]
        for node, reason in sorted(self.probe(nodes).items()) if nodes else []:
            if reason:
                self._declare_lost(node, reason)

    def _declare_lost(self, node: str, reason: str) -> None:
        if self.gens.mark_lost(self.gen, node, self.node, reason):
            self.on_lost(node, reason)
        self.state.lost.add(node)

    # -- the coordinator ------------------------------------------------------------------------
    def _coordinate(self) -> None:
        if self.role != "coordinator":
            self._set_role("coordinator")
            self._read_round()
        # Live nodes join within a fraction of a second of the fault: probing before one poll passed
        # would connect to nearly every node of the run for nothing.
        now = self.clock()
        if now - self._started >= self.poll_s:
            suspects = sorted(n for n in self._expected() - set(self.state.joined) - self.state.lost - {self.node}
                              if self._next_probe.get(n, 0.0) <= now)
            self._next_probe.update(dict.fromkeys(suspects, now + self.reprobe_s))
            self._probe_each(suspects)
        self._try_close()

    def _read_round(self) -> None:
        """Become the coordinator: the roster and the round so far, then a watch on all of the round."""
        self._roster = self.gens.roster()
        read = self.gens.round_state(self.gen)
        read.lost |= self.state.lost
        self.state = read
        self.close()
        self._stream = self.gens.store.watch(self._base, read.revision + 1, prefix=True)  # type: ignore[attr-defined]

    def _expected(self) -> set[str]:
        assert self._roster is not None
        return set(self._roster) - self.gone

    def _try_close(self) -> None:
        assert self._roster is not None
        self.state.joined.setdefault(self.node, self.slots)  # our own join, read or not yet seen
        plan = plan_next(self.gen, self._roster, self.previous, self.state.joined, self.state.lost, by=self.node)
        if plan is None or self._holding(plan):
            return
        self.state.plan = self.gens.close(plan, note=True)  # the members take it from the note
        self.emit("round.closed", gen=self.gen, world=self.state.plan.world, nodes=self.state.plan.nodes,
                  lost=list(self.state.plan.lost), by=self.state.plan.by,
                  close_s=round(self.clock() - self._started, 3))

    def _holding(self, plan: Plan) -> bool:
        """Whether to keep ``plan`` unwritten: it has fewer nodes than the run needs, a node lost in an
        earlier generation is still away, and ``rejoin_wait_s`` has not passed.  A node lost in this
        very round cannot rejoin it (declared lost here): that round closes at once, short, and the
        workers, told so, ask for the next one, which holds."""
        away = sorted(set(self.previous.gone if self.previous else ()) - set(plan.returned))
        if plan.nodes >= self.min_nodes or not away or self.clock() - self._started >= self.rejoin_wait_s:
            return False
        if not self._held:
            self._held = True
            self.emit("round.rejoin_wait", gen=self.gen, nodes=plan.nodes, needed=self.min_nodes, away=away[:20],
                      wait_s=self.rejoin_wait_s)
        return True

    def _timeout_text(self) -> str:
        if self.role == "coordinator" and self._roster is not None:
            missing = sorted(self._expected() - set(self.state.joined) - self.state.lost)
            return (f"generation {self.gen}: nodes {missing[:20]} neither joined nor were declared lost "
                    f"within {self.timeout_s:g}s")
        return f"generation {self.gen}: no plan within {self.timeout_s:g}s (role {self.role or 'member'})"
