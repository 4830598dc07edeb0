"""EtcdStore against a real etcd: KV, CAS, leases, watches, outage errors."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.control.lease import LeaseKeeper
from elastic.control.store import EtcdStore, LeaseExpired, StoreUnavailable, parse_endpoint


@pytest.fixture
def store(etcd_endpoint) -> EtcdStore:
    return EtcdStore(etcd_endpoint, request_timeout=2.0, retry_deadline=3.0)


def test_put_get_delete_and_prefix(store):
    assert store.get("/t/a") is None
    rev = store.put("/t/a", b"1")
    store.put("/t/b", "two")
    store.put("/u/c", b"3")
    kv = store.get("/t/a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
    assert [k.key for k in store.get_prefix("/t/")] == ["/t/a", "/t/b"]
    assert store.count_prefix("/t/") == 2
    assert store.delete("/t/a") is True
    assert store.delete("/t/a") is False
    assert store.delete_prefix("/t/") == 1
    assert store.get_prefix("/t/") == []


def test_compare_and_swap_create_only_and_fencing(store):
    ok, kv = store.compare_and_swap("/cas", b"v1", 0)
    assert ok and kv.value == b"v1"
    first_rev = kv.mod_revision
    # Create-only again fails and returns the current value in the same round trip.
    ok, current = store.compare_and_swap("/cas", b"other", 0)
    assert not ok and current.value == b"v1" and current.mod_revision == first_rev
    ok, kv = store.compare_and_swap("/cas", b"v2", first_rev)
    assert ok and kv.mod_revision > first_rev
    # The old revision is now stale: the write is fenced off.
    ok, current = store.compare_and_swap("/cas", b"v3", first_rev)
    assert not ok and current.value == b"v2"
    # CAS on an absent key with a non-zero expected revision: fails, no current value.
    ok, current = store.compare_and_swap("/absent", b"x", 5)
    assert not ok and current is None


def test_lease_expiry_removes_key(store):
    lease = store.grant_lease(1)
    store.put("/leased", b"x", lease=lease)
    assert store.get("/leased").lease == lease
    deadline = time.monotonic() + 6
    while store.get("/leased") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.get("/leased") is None
    with pytest.raises(LeaseExpired):
        store.refresh_lease(lease)


def test_lease_keeper_keeps_key_alive_then_revokes(store):
    keeper = LeaseKeeper(store, ttl=1)
    store.put("/kept", b"x", lease=keeper.lease_id)
    time.sleep(2.5)  # well past the TTL: only the keeper's refreshes keep it
    assert store.get("/kept") is not None and not keeper.lost.is_set()
    keeper.close(revoke=True)
    assert store.get("/kept") is None


def test_watch_once_sees_change_from_revision(store):
    rev = store.revision()
    assert store.watch_once("/w", rev + 1, timeout=0.3) is None
    threading.Timer(0.2, lambda: store.put("/w", b"hello")).start()
    event = store.watch_once("/w", rev + 1, timeout=5)
    assert event is not None and event.key == "/w" and event.value == b"hello"
    # A change made before the watch started is still seen when watching from its revision.
    put_rev = store.put("/w2/x", b"early")
    event = store.watch_once("/w2/", put_rev, timeout=2, prefix=True)
    assert event is not None and event.key == "/w2/x"


def test_outage_raises_store_unavailable(etcd_server):
    store = EtcdStore(etcd_server.endpoint, request_timeout=0.5, retry_deadline=1.0)
    store.put("/x", b"1")
    etcd_server.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.get("/x")
    assert time.monotonic() - started < 10  # bounded by the retry deadline, not hanging
    etcd_server.start()
    assert store.get("/x").value == b"1"  # data survives; the same client reconnects


@pytest.mark.parametrize("text", ["", "host:notaport", ":2379", "host:70000", "host:0"])
def test_parse_endpoint_rejects_bad_input(text):
    with pytest.raises(ValueError):
        parse_endpoint(text)


def test_parse_endpoint_accepts_forms():
    assert parse_endpoint("127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_endpoint("http://127.0.0.1:1234") == ("127.0.0.1", 1234)
    assert parse_endpoint("etcd-0") == ("etcd-0", 2379)  # etcd's default client port


def test_requests_from_short_lived_threads_share_pooled_clients(store):
    """An agent's round runs on a new thread each time: its requests borrow an idle client (its
    session and connection) instead of making one per thread; concurrent ones each get their own."""
    made: list[int] = []
    new_client = store._new_unary
    store._new_unary = lambda index: made.append(index) or new_client(index)
    for k in range(20):
        thread = threading.Thread(target=store.put, args=(f"/pool/{k}", "v"))
        thread.start()
        thread.join()
    assert len(made) == 1
    threads = [threading.Thread(target=store.get_prefix, args=("/pool/",)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 1 <= len(made) <= 9 and len(store.get_prefix("/pool/")) == 20
