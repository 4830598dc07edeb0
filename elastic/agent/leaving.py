"""How a node leaves a run, and the one line it leaves with.

The agent's state machine decides *that* the node leaves; :class:`Leaving` carries it out:
stopping the whole run (the stop key every agent watches), leaving because the node is on the
exclusion list, and excluding itself by policy.  Every way
out prints one line on stderr naming this node and the reason, and records the reason in the
node's final ``agent.state`` event, which the launcher's summary prints for every node.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from elastic.agent.attempt import NodeSpec
from elastic.agent.records import NodeRecords
from elastic.agent.scopes import RestartScope
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_EXCLUDED, EXIT_FAILURE, RUN_STOP_CODES
from elastic.control.runstate import RunState


class Leaving:
    def __init__(self, spec: NodeSpec, state: RunState, records: NodeRecords, scope: RestartScope,
                 events: EventLog, set_state: Callable[..., None]) -> None:
        self.spec = spec
        self.state = state
        self.records = records
        self.scope = scope
        self.events = events
        self.set_state = set_state  # the agent's _set_state(state, **fields)

    def say(self, message: str) -> None:
        print(f"elastic-agent: node {self.spec.node_id} {message}", file=sys.stderr, flush=True)

    def give_up(self, reason: str, code: int = EXIT_FAILURE, **fields) -> int:
        """Leave alone (the run may go on without this node); ``code``: the stopped run's own."""
        self.set_state("GAVE_UP", reason=reason, **fields)
        self.say(f"gave up: {reason}")
        return code

    def stop_run(self, reason: str, kind: str = "") -> int:
        """Stop the whole run: every agent sees the stop key and leaves, with the code of ``kind``
        (a failure class) when it has one (failing saves: 88), else EXIT_FAILURE."""
        code = RUN_STOP_CODES.get(kind, EXIT_FAILURE)
        self.records.quietly("stop", lambda: self.state.request_stop(reason, self.spec.node_id, code))
        self.set_state("GAVE_UP", reason=reason)
        self.say(f"stops the run: {reason}")
        return code

    def excluded(self, reason: str | None, until: float | None) -> int:
        self.set_state("EXCLUDED", reason=reason, until=until)
        self.say(f"is excluded from run {self.spec.run_id}: {reason}")
        return EXIT_EXCLUDED

    def exclude_self(self, reason: str, ttl_s: float, by: str, epoch: int | None) -> int:
        self.state.exclusions.add(self.spec.node_id, reason, ttl_s=ttl_s, by=by)
        self.events.emit("agent.excluded_self", reason=reason, by=by, ttl_s=ttl_s)
        if epoch is not None:
            self.scope.bump(epoch)
        return self.excluded(reason, time.time() + ttl_s)
