"""The agent's run-wide signals (epoch, exclusion, stop) over one watch stream, not a poll: on the
in-memory store, and on a real etcd that is killed and restarted under the stream."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.control.keys import RunKeys
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import RunSignals, RunState
from elastic.control.signals import SignalWatch
from elastic.control.store import EtcdStore, StoreMeter

KEYS = RunKeys.of("/elastic", "sig")


class CountingStore(MemoryStore):
    """Counts the reads :class:`SignalWatch` makes (a transaction each)."""

    def __init__(self, clock=time.monotonic) -> None:
        super().__init__(clock)
        self.reads = 0

    def txn(self, txn):
        self.reads += 1
        return super().txn(txn)


def test_the_watch_follows_epoch_exclusion_and_stop_after_one_read():
    clock = FakeClock()
    store = CountingStore()
    state = RunState(store, KEYS, clock=clock)
    watch = SignalWatch(state, "n1", clock=clock)
    assert watch.current() == RunSignals(0, None, None) and store.reads == 1
    state.bump_epoch(0)
    state.exclusions.add("n2", "other node")  # not this node's record: no effect
    assert watch.current() == RunSignals(1, None, None)
    state.exclusions.add("n1", "slow", ttl_s=60, by="leader")
    assert watch.current().excluded["reason"] == "slow"
    clock.advance(61)
    assert watch.current().excluded is None  # expired: judged at every look, no new event needed
    state.request_stop("operator", by="cli")
    assert watch.current().stop["reason"] == "operator"
    assert store.reads == 1  # every change came over the stream


class BrokenStream:
    def get(self, timeout):
        raise RuntimeError("stream gone for good")

    def close(self):
        pass


def test_a_stream_that_fails_for_good_falls_back_to_a_read_and_a_new_stream():
    clock = FakeClock()
    store = CountingStore()
    state = RunState(store, KEYS, clock=clock)
    watch = SignalWatch(state, "n1", retry_s=0.25, clock=clock)
    watch.current()
    watch._stream = BrokenStream()
    state.bump_epoch(0)
    clock.advance(1)
    assert watch.current().epoch == 1  # read again, and a new stream opened
    assert store.reads == 2 and watch.restarts == 1
    state.bump_epoch(1)
    assert watch.current().epoch == 2 and store.reads == 2


def test_an_unreachable_store_is_read_at_most_once_per_retry_interval():
    clock = FakeClock()
    store = CountingStore()
    state = RunState(store, KEYS, clock=clock)
    watch = SignalWatch(state, "n1", retry_s=0.25, clock=clock)
    watch._next_start = clock() + 0.25  # a start just failed
    assert watch.current() == RunSignals(0, None, None) and store.reads == 0  # last known, no read
    clock.advance(0.3)
    watch.current()
    assert store.reads == 1


def _until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def test_one_stream_over_three_keys_costs_nothing_idle_and_survives_an_etcd_restart(etcd_server):
    """etcd3gw's own watches die silently with their server (shared/reference/etcd-probe.md); the
    signal watch is re-established and the epoch bumped while etcd was down is still seen."""
    store = EtcdStore(etcd_server.endpoint, request_timeout=2.0, retry_deadline=5.0)
    store.meter = StoreMeter()
    state = RunState(store, KEYS)
    writer = RunState(EtcdStore(etcd_server.endpoint, request_timeout=2.0, retry_deadline=10.0), KEYS)
    with SignalWatch(state, "n1") as watch:
        assert watch.current() == RunSignals(0, None, None)
        writer.exclusions.add("n1", "slow")
        assert _until(lambda: watch.current().excluded)["reason"] == "slow"
        writer.exclusions.clear("n1")
        writer.bump_epoch(0)
        assert _until(lambda: watch.current().epoch == 1 and watch.current().excluded is None)
        before = store.meter.totals()["requests"]
        for _ in range(20):
            watch.current()
            time.sleep(0.05)
        assert store.meter.totals()["requests"] == before  # idle: no request at all
        etcd_server.kill()
        time.sleep(0.5)
        etcd_server.start()
        writer.bump_epoch(1)
        writer.request_stop("operator", by="test")
        assert _until(lambda: watch.current().epoch == 2 and watch.current().stop is not None, timeout=20)
        assert watch.restarts == 0  # the stream resumed from its revision: nothing re-read


@pytest.mark.slow
@pytest.mark.parametrize("member", [0])
def test_the_watch_moves_to_another_member_and_resumes(tmp_path, member):
    """Three members: the one the stream reads from is killed; the stream moves on, losing nothing."""
    from elastic.control.etcd_cluster import EtcdCluster

    cluster = EtcdCluster(tmp_path / "etcd", members=3)
    cluster.start()
    try:
        state = RunState(EtcdStore(cluster.endpoints, request_timeout=1.0, retry_deadline=10.0), KEYS)
        writer = RunState(EtcdStore(cluster.endpoints, request_timeout=1.0, retry_deadline=20.0), KEYS)
        with SignalWatch(state, "n1") as watch:
            assert watch.current().epoch == 0
            cluster.kill(member)
            writer.bump_epoch(0)
            assert _until(lambda: watch.current().epoch == 1, timeout=20)
            assert watch.restarts == 0
    finally:
        cluster.close()


@pytest.mark.parametrize("node", ["node0", "node3"])
def test_an_arbitration_asked_of_this_node_arrives_over_the_same_stream(etcd_server, node):
    """Replay verification: another node's agent puts a check in ``sdc/arbitrate/<node>``; this
    node's signal watch hands it over with its revision, next to the pushed fault."""
    store = EtcdStore(etcd_server.endpoint, request_timeout=2.0, retry_deadline=5.0)
    writer = RunState(EtcdStore(etcd_server.endpoint, request_timeout=2.0, retry_deadline=5.0), KEYS)
    with SignalWatch(RunState(store, KEYS), node, on_fault=lambda fault: None, arbitration=True) as watch:
        watch.current()
        assert watch.arbitration_request() is None
        writer.put_arbitration("node9", {"id": "other node's"})
        writer.put_arbitration(node, {"id": "0.0/110/2", "path": "/run/sdc/x.pt"})
        deadline = time.monotonic() + 5
        while watch.arbitration_request() is None and time.monotonic() < deadline:
            watch.current()
            time.sleep(0.02)
        revision, record = watch.arbitration_request()
        assert record["id"] == "0.0/110/2" and revision > 0


def test_after_a_broken_stream_pushed_faults_still_arrive_without_a_look_and_old_events_are_ignored():
    """A stream that failed for good used to close the whole watch: the fault pump ended with it,
    and pushed faults then waited for the supervisor's next look."""
    store = MemoryStore()
    state = RunState(store, KEYS)
    heard: list[dict] = []
    watch = SignalWatch(state, "n1", on_fault=heard.append, retry_s=0.0)
    watch.current()
    watch._stream.close()
    watch._stream = BrokenStream()
    watch.current()  # the broken stream is replaced: a read, a new stream
    assert watch.restarts == 1
    state.push_fault({"node": "n2", "gen": 3})
    deadline = time.monotonic() + 3
    while not heard and time.monotonic() < deadline:
        time.sleep(0.02)
    assert heard and heard[0]["gen"] == 3
    # An event older than what the restart read (from the old stream) changes nothing.
    state.bump_epoch(0)
    assert watch.current().epoch == 1
    from elastic.control.store import WatchEvent
    watch._apply(WatchEvent(KEYS.epoch, b"0", 1))
    assert watch.current().epoch == 1
    watch.close()


def test_a_pushed_fault_is_applied_on_the_streams_reader_thread_and_a_failing_consumer_restarts_it(etcd_server):
    """No thread of the watch's own polls the stream (it was a second wake-up per event for every
    agent): the reader thread hands each batch on.  A consumer that raises is reported by the next
    ``current()``, which opens a new stream; the faults after it still arrive."""
    state = RunState(EtcdStore(etcd_server.endpoint, request_timeout=2.0, retry_deadline=5.0), KEYS)
    heard: list[dict] = []
    threads: set[str] = set()

    def on_fault(record: dict) -> None:
        threads.add(threading.current_thread().name)
        if record.get("boom"):
            raise RuntimeError("the consumer failed")
        heard.append(record)

    with SignalWatch(state, "n1", on_fault=on_fault, retry_s=0.0) as watch:
        watch.current()
        state.push_fault({"node": "n2", "gen": 1})
        assert _until(lambda: heard)  # no current() since: the reader thread applied it
        assert threads and all(name.startswith("watch-") for name in threads)
        state.push_fault({"node": "n2", "gen": 2, "boom": True})
        assert _until(lambda: (watch.current(), watch.restarts)[1] == 1)
        state.push_fault({"node": "n3", "gen": 3})
        assert _until(lambda: heard[-1]["gen"] == 3) and [r["gen"] for r in heard] == [1, 3]
