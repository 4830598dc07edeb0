"""An agent's watch on its ring successor's life: the node-loss detector that needs no collective.

Under gloo a node's death shows at once in every survivor's next collective; under NCCL those
collectives block and nothing raises (``../shared/reference/nccl-faults.md``), so a node loss must
be seen from outside the training.  Each agent holds one silent connection to the memory store of
the next node of the ring (its buddy, which it already replicates snapshots to): the successor's
death closes it, the watcher probes it once (a refused connect is final), pushes the fault and
joins the next round; the round's coordinator probes whoever does not join
(:mod:`elastic.control.genround`).  Every node is watched by exactly one other, so a loss costs one
connection per node and no etcd request; a lease TTL (10 s) stays the backstop for a host that
vanishes without a word and outlives the keepalives (:class:`~elastic.checkpoint.memclient.PeerHold`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic.checkpoint.memclient import PeerHold
from elastic.checkpoint.memstate import MemStateError

Successor = tuple[str, str, str]  # (node, memory store address, token)


class PeerWatch:
    """Keeps a :class:`PeerHold` on the current ring successor; ``on_gone(node, addr, reason)``."""

    RETRY_S = 2.0
    """Least time between two attempts to hold a successor that did not answer."""

    def __init__(self, node_id: str, successor: Callable[[], Successor | None],
                 on_gone: Callable[[str, str, str], None], connect_timeout_s: float) -> None:
        self.node_id = node_id
        self.successor = successor
        self.on_gone = on_gone
        self.connect_timeout_s = connect_timeout_s
        self._held: tuple[Successor, PeerHold] | None = None
        self._next_try = 0.0

    def check(self) -> None:
        """Follow the ring (the supervisor's loop calls this): hold the successor it names now."""
        now = time.monotonic()
        if now < self._next_try:
            return
        target = self.successor()
        if self._held is not None and self._held[0] == target and not self._held[1].lost:
            return
        self.close()
        if target is not None:
            self._hold(target, now)

    def _hold(self, target: Successor, now: float) -> None:
        node, addr, token = target
        try:
            hold = PeerHold(addr, token, lambda reason: self.on_gone(node, addr, reason), self.connect_timeout_s)
        except ConnectionRefusedError:
            self._next_try = now + self.RETRY_S
            self.on_gone(node, addr, "its agent refused the watch's connection")
            return
        except (OSError, MemStateError, ValueError):
            self._next_try = now + self.RETRY_S  # slow or restarting: try again, the lease is the backstop
            return
        self._held = (target, hold)

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[1].close()
