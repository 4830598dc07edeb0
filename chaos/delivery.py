"""Deliver a fault to a node's agent through etcd, and read back what the agent did.

This is how chaos reaches another host: a signed request under the run's ``chaos/requests/<node>``
keys, executed by that node's agent (:mod:`elastic.agent.remote_faults`), answered under
``chaos/results/<node>``.  The run token signs requests (HMAC, :mod:`elastic.control.faultauth`);
it is read from the job's ``security`` section like every other process of the run reads it,
and never written anywhere.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from elastic.control.faultauth import sign
from elastic.control.runstate import RunState
from elastic.control.store import StoreError


def params_dict(params: Any) -> dict[str, Any]:
    """A fault's parameters as the agent reads them (a Params dataclass or a mapping)."""
    if params is None:
        return {}
    if dataclasses.is_dataclass(params):
        return {k: v for k, v in dataclasses.asdict(params).items() if v is not None and v != ""}
    return dict(params)


@dataclass
class Posted:
    node: str
    request_id: str
    fault: str
    posted_ts: float


class AgentDelivery:
    """Posts requests for one run; ids are unique per delivery (``<prefix>-NNNN``), in posting order."""

    def __init__(self, state: RunState, run_id: str, token: str | None, id_prefix: str = "") -> None:
        self.state = state
        self.run_id = run_id
        self._token = token
        # Time first (ids sort in posting order across deliveries), then randomness: two tools
        # posting in the same millisecond must never overwrite each other's request.
        self.id_prefix = id_prefix or f"c{int(time.time() * 1000):x}{os.urandom(3).hex()}"
        self._count = 0

    def next_id(self) -> str:
        self._count += 1
        return f"{self.id_prefix}-{self._count:04d}"

    def post(self, node: str, fault: str, params: Any = None, at_step: int | None = None, after: str = "",
             wait_s: float = 300.0, request_id: str | None = None) -> Posted:
        request_id = request_id or self.next_id()
        request: dict[str, Any] = {"id": request_id, "fault": fault, "params": params_dict(params), "node": node,
                                   "run_id": self.run_id, "ts": time.time(), "wait_s": wait_s,
                                   "by": f"chaos@{socket.gethostname()}"}
        if at_step is not None:
            request["at_step"] = at_step
        if after:
            request["after"] = after
        self.state.post_fault(node, request_id, sign(request, self._token))
        return Posted(node, request_id, fault, request["ts"])

    def result(self, posted: Posted) -> dict[str, Any] | None:
        try:
            return self.state.fault_results(posted.node).get(posted.request_id)
        except StoreError:
            return None

    def wait(self, posted: Posted, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.result(posted)
            if found is not None:
                return found
            time.sleep(poll_s)
        return None
