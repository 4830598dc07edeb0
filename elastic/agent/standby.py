"""A warm standby node (``elastic-launch --standby``): takes the slot of a node a fixed-size run lost.

Why: a node lost from a fixed-size world is the costliest fault the soak has (5.6-6.0 s in three
10-minute soaks, `docs/chaos.md`): its survivors wait while the scheduler relaunches the node and
its fresh worker imports torch (2.25 s), imports ``torch._dynamo`` and forms the world (1.4 s more).
A standby has done all of that before any fault: its agent process starts its warm spares at once
(one per local rank: imported, ``torch._dynamo`` imported, heap frozen) and then only watches the
run's newest generation plan.  When a plan says a node is gone and the world is short of the nodes
the run needs (its survivors hold the next generation open for it,
``agent.inprocess.rejoin_wait_s``), the standby claims that node's slot (:mod:`elastic.agent.slots`)
and becomes that node: the agent is built with the node's id and rejoins as the node's own relaunch
would (its snapshots copied back from the buddy that holds them, the generation-0 ranks of the
slot), but its slots go to the warm spares it already has.  A node lost from a run whose world may
shrink (``--nodes MIN:MAX`` above MIN) is not taken: the run goes on without it.

Cost while waiting: the spares' memory, and one watch of the epoch's generations (long-polled for
up to a second) plus four reads (the epoch, the next three plan keys) each time it wakes: ~5
requests/s while nothing happens, at most ~50/s during a round (it wakes on the round's writes, and
reads again at most every ``poll_s``).  Polling the reads every 0.1 s instead was ~40 requests/s per
standby for as long as the run trains.  Not taken: a node that is
excluded (its slot is a bad host's, and the exclusion is the policy's word); a node whose slot its
own relaunch claimed first.  The standby leaves with 0 when the run is done, with the run's stop
code when it was stopped.
"""

from __future__ import annotations

import threading
import time

from elastic.agent.inprocess import WarmSpare
from elastic.agent.slots import SlotClaims
from elastic.common.events import EventLog
from elastic.control.generations import Generations, Plan
from elastic.control.runstate import RunState
from elastic.control.store import StoreError

EXIT_INTERRUPTED = 130
RUN_CHECK_S = 1.0
"""How often a waiting standby reads whether the run is over (two reads)."""


class Standby:
    def __init__(self, state: RunState, claims: SlotClaims, events: EventLog, stop: threading.Event,
                 needed_nodes: int, poll_s: float = 0.1) -> None:
        self.state, self.claims, self.events, self.stop = state, claims, events, stop
        self.needed = needed_nodes
        self.poll_s = poll_s
        self.epoch = -1
        self.revision = 0  # the store's, at the epoch read: the watch starts after it
        self.gen = 0
        self.plan: Plan | None = None

    def wait(self, spares: list[WarmSpare]) -> str | int:
        """Block until a lost node's slot is claimed: its node id; or the exit code once the run is
        over (0 done, its stop code) or this process was told to stop."""
        self.events.emit("standby.waiting", needed_nodes=self.needed, spares=[p.pid for p, _ in spares])
        next_check = 0.0
        while not self.stop.is_set():
            try:
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + RUN_CHECK_S
                    code = self._run_over()
                    if code is not None:
                        return code
                node = self._claim()
                if node is not None:
                    return node
                self._until_change(RUN_CHECK_S)
            except StoreError as exc:  # etcd away for a moment: a standby can wait it out
                self.events.emit("standby.store_error", error=str(exc)[:300])
            self.stop.wait(self.poll_s)
        return EXIT_INTERRUPTED

    def _until_change(self, timeout: float) -> None:
        """Until a key of the epoch's generations changes after the last read, or ``timeout``."""
        self.state.store.watch_once(self.state.keys.generations(self.epoch), self.revision + 1, timeout,
                                    prefix=True)

    def _run_over(self) -> int | None:
        if self.state.done_record() is not None:
            self.events.emit("standby.released", why="the run is done")
            return 0
        stop = self.state.stop_record()
        if stop is not None:
            self.events.emit("standby.released", why=f"the run was stopped: {stop.get('reason')}")
            return int(stop.get("code", 1))
        return None

    def _claim(self) -> str | None:
        plan = self._newest()
        if plan is None or not plan.gone or plan.nodes >= self.needed:
            return None
        for node in sorted(plan.gone):
            if self.state.exclusions.get(node) is not None:
                continue
            if self.claims.try_claim(node, self.epoch, plan):
                self.events.emit("standby.claimed", node=node, epoch=self.epoch, gen=plan.gen, nodes=plan.nodes,
                                 needed=self.needed)
                return node
        return None

    def _newest(self) -> Plan | None:
        """The epoch's newest plan, reading on from the last one seen (a new epoch starts over)."""
        kv, self.revision = self.state.store.read(self.state.keys.epoch)
        epoch = int(kv.value) if kv else 0
        if epoch != self.epoch:
            self.epoch, self.gen, self.plan = epoch, 0, None
        gens = Generations(self.state.store, self.state.keys, epoch)
        missed = 0
        while missed < 3:  # a failed round writes no plan: passed over, as Generations.newest_plan does
            plan = gens.plan(self.gen + missed + 1)
            if plan is None:
                missed += 1
                continue
            self.plan, self.gen, missed = plan, plan.gen, 0
        return self.plan
