"""Who runs as a node id: the claim a standby, or the node itself, makes on a lost node's slot.

In a fixed-size run a node id names a *slot* (its generation-0 ranks, its snapshots held by its
buddy), not a host.  When a node is lost its survivors hold the next generation open for it
(``agent.inprocess.rejoin_wait_s``), and whoever comes back as that node first claims the slot:
``slots/<node>`` -> ``{by, host, pid, epoch, gen}``, written by compare-and-swap on the revision it
read.  Of two claimants (a warm standby, ``elastic-launch --standby``, and the node's own relaunch)
exactly one wins; the other waits as a standby.  One raft write per claim, none while nothing is
lost; a node that is never lost never writes one.

A claim someone else made still holds the slot unless
- the node is in the epoch's newest plan's ``gone`` and that plan is no older than the generation
  the claimant joined: it was lost after it took the slot (and a claimant that has not joined yet
  is never taken for lost);
- it was made in an earlier epoch and the node's record (leased by the agent running as the node)
  does not name the claimant: it is no longer running as the node.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.control.generations import Plan
from elastic.control.runstate import RunState, decode


@dataclass(frozen=True)
class Claimant:
    """This process, as a claim names it."""

    name: str
    """The launcher's node id (a standby's own name, or the node's)."""
    host: str
    pid: int

    @classmethod
    def this_process(cls, name: str) -> Claimant:
        return cls(name, socket.gethostname(), os.getpid())

    def is_holder(self, record: dict[str, Any]) -> bool:
        return record.get("host") == self.host and record.get("pid") == self.pid


def slot_free(record: dict[str, Any] | None, me: Claimant, node: str, epoch: int, plan: Plan | None,
              node_record: dict[str, Any] | None) -> bool:
    """Whether ``me`` may claim ``node``'s slot, given its claim record (None: never claimed)."""
    if record is None or me.is_holder(record):
        return True
    if record.get("epoch") == epoch:
        return plan is not None and node in plan.gone and plan.gen >= int(record.get("gen", 0))
    if node_record is None:
        return True
    return (node_record.get("host"), node_record.get("pid")) != (record.get("host"), record.get("pid"))


class SlotClaims:
    """Reads and claims ``slots/<node>`` through the run's state."""

    def __init__(self, state: RunState, me: Claimant) -> None:
        self.state, self.me = state, me

    def try_claim(self, node: str, epoch: int, plan: Plan | None) -> bool:
        """Claim ``node`` for this process: True when it holds the slot now (it did already, or its
        compare-and-swap won), False when someone else holds it."""
        key = self.state.keys.slot(node)
        kv = self.state.store.get(key)
        record = decode(kv)
        if record is not None and self.me.is_holder(record):
            return True
        if not slot_free(record, self.me, node, epoch, plan, self._node_record(node, record, epoch)):
            return False
        joins = plan.gen + 1 if plan is not None else 0
        claim = {"by": self.me.name, "host": self.me.host, "pid": self.me.pid, "epoch": epoch, "gen": joins,
                 "ts": time.time()}
        won, _ = self.state.store.compare_and_swap(key, json.dumps(claim), kv.mod_revision if kv else 0)
        return won

    def held_by_other(self, node: str, epoch: int, plan: Callable[[], Plan | None]) -> dict[str, Any] | None:
        """The claim by which someone else runs as ``node`` now (None: nobody else does); ``plan``
        reads the epoch's newest plan, called only when there is a claim."""
        record = decode(self.state.store.get(self.state.keys.slot(node)))
        if record is None or self.me.is_holder(record):
            return None
        free = slot_free(record, self.me, node, epoch, plan(), self._node_record(node, record, epoch))
        return None if free else record

    def _node_record(self, node: str, record: dict[str, Any] | None, epoch: int) -> dict[str, Any] | None:
        """The node's record, read only where :func:`slot_free` looks at it (an earlier epoch's claim)."""
        if record is None or record.get("epoch") == epoch:
            return None
        return self.state.node(node)
