"""An agent's lease that etcd says is gone is renewed at once, not at its keeper's next refresh.

After a 10 s stop of the etcd leader member (chaos soak, seed 3), an agent learned from its
heartbeat's put that its lease had expired but renewed it 4.8 s later; the run's leader had called
the node lost by then and every node restarted from disk.  Real lease keeper and node records; the
in-memory store stands in for etcd (its puts on a revoked lease fail as etcd's do).
"""

from __future__ import annotations

import pytest

from elastic.agent.records import NodeRecords
from elastic.common.events import EventLog, read_events
from elastic.control.keys import RunKeys
from elastic.control.lease import LeaseKeeper
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState

pytestmark = pytest.mark.timeout(30)


def test_a_lease_etcd_says_is_gone_is_renewed_by_the_same_heartbeat(tmp_path):
    store = MemoryStore()
    state = RunState(store, RunKeys.of("/t", "run"))
    events = EventLog(tmp_path / "agent.jsonl", "agent/n0")
    lost: list[int] = []
    records = NodeRecords(state, "n0", events, lambda: None)
    records.lease = LeaseKeeper(store, 30, on_lost=lambda: lost.append(1))  # its own refresh is 10 s away
    try:
        records.publish_node("RUNNING", 0)
        old = records.lease_id
        store.revoke_lease(old)  # expired behind the agent's back: its records are gone
        assert "n0" not in state.nodes()
        records.heartbeat(0, "RUNNING", {})
        assert records.lease_id != old and not records.lease.lost.is_set() and lost == [1]
        assert "n0" in state.nodes() and "n0" in state.heartbeats()  # back, on the new lease
        kinds = [e["kind"] for e in read_events([tmp_path / "agent.jsonl"])]
        assert kinds.count("agent.lease_renewed") == 1
    finally:
        records.lease.close()
        events.close()


def test_a_lost_lease_is_reported_once_whoever_notices_it():
    store = MemoryStore()
    lost: list[int] = []
    keeper = LeaseKeeper(store, 30, on_lost=lambda: lost.append(1))
    keeper.mark_lost()
    keeper.mark_lost()
    assert keeper.lost.is_set() and lost == [1]
    keeper.close()


def test_a_failed_refresh_is_retried_soon_then_less_often_and_success_restores_the_interval():
    from elastic.control.lease import next_wait

    assert next_wait(3.3, 0) == 3.3
    assert [next_wait(3.3, n) for n in range(1, 6)] == [0.25, 0.5, 1.0, 2.0, 3.3]


def test_the_keeper_goes_on_refreshing_after_failed_refreshes():
    import threading

    from elastic.control.store import StoreError

    class Flaky(MemoryStore):
        """Fails the first two refreshes (its member stalled), then answers."""

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.answered = threading.Event()

        def refresh_lease(self, lease_id: int, timeout: float | None = None) -> None:
            self.calls += 1
            if self.calls <= 2:
                raise StoreError("member stalled")
            super().refresh_lease(lease_id)
            self.answered.set()

    store = Flaky()
    keeper = LeaseKeeper(store, 3)  # refreshes every 1 s; retries after 0.25 s, then 0.5 s
    try:
        assert store.answered.wait(10)
        assert not keeper.lost.is_set() and store.calls == 3
    finally:
        keeper.close()
