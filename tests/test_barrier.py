"""The etcd3 barrier rendezvous handler against a real etcd: forming, growing, leaving, closing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic.control.keys import RunKeys
from elastic.control.store import EtcdStore
from elastic.rendezvous.barrier import BarrierRendezvousHandler, BarrierSettings
from elastic.rendezvous.c10d_store import EtcdC10dStore


def handlers(endpoint: str, n: int, run_id: str = "rb", min_nodes: int | None = None, max_nodes: int | None = None,
             **conf: str) -> list[BarrierRendezvousHandler]:
    params = dict(backend="etcd3", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes or n,
                  max_nodes=max_nodes or n, local_addr="127.0.0.1")
    made = [get_rendezvous_handler(RendezvousParameters(**params, **conf)) for _ in range(n)]
    _CREATED.extend(made)
    return made


_CREATED: list = []


@pytest.fixture(autouse=True)
def release_handlers():
    """Every handler a test made gives up its lease afterwards: a lease keeper left running would
    refresh against an etcd that the test's fixture has stopped, for the rest of the session."""
    yield
    while _CREATED:
        handler = _CREATED.pop()
        handler._stop_waiting()
        handler._release()


def join_all(hs, timeout: float = 30.0) -> dict[int, tuple]:
    """next_rendezvous() on every handler at once: index -> (rank, world, round) or the exception."""
    out: dict[int, tuple] = {}

    def one(i, h):
        try:
            info = h.next_rendezvous()
            out[i] = (info.rank, info.world_size, h.round, info.bootstrap_store_info.master_port)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[i] = (exc,)

    threads = [threading.Thread(target=one, args=(i, h), daemon=True) for i, h in hs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


def test_round_forms_with_sorted_ranks_and_one_master(etcd_endpoint):
    hs = handlers(etcd_endpoint, 5)
    out = join_all(dict(enumerate(hs)))
    assert sorted(v[0] for v in out.values()) == [0, 1, 2, 3, 4]
    assert {v[1] for v in out.values()} == {5} and {v[2] for v in out.values()} == {0}
    assert len({v[3] for v in out.values()}) == 1  # every node was told the same master port
    # Deterministic order: by (addr, pid, local id), i.e. creation order within one process.
    assert [out[i][0] for i in range(5)] == sorted(out[i][0] for i in range(5))
    assert hs[0].get_backend() == "etcd3" and not hs[0].use_agent_store


def test_late_node_is_seen_waiting_and_the_run_grows(etcd_endpoint):
    hs = handlers(etcd_endpoint, 3, min_nodes=2, max_nodes=3, last_call_timeout="1")
    first = join_all({0: hs[0], 1: hs[1]})
    assert {v[1] for v in first.values()} == {2}
    assert hs[0].num_nodes_waiting() == 0
    late = threading.Thread(target=lambda: join_all({2: hs[2]}), daemon=True)
    late.start()
    deadline = time.monotonic() + 10
    while hs[0].num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hs[0].num_nodes_waiting() == 1 and hs[1].num_nodes_waiting() == 1
    # The members restart (torchrun does so when nodes wait): everyone of the old round is back,
    # so the new round closes at once, without another last call.
    grown = join_all({0: hs[0], 1: hs[1]})
    late.join(10)
    assert {v[1] for v in grown.values()} == {3} and {v[2] for v in grown.values()} == {1}


def test_restart_after_one_node_leaves_does_not_wait_for_last_call(etcd_endpoint):
    # A last call of 120 s and a join timeout of 20 s: the re-formed round must close because every
    # live node of the previous round is back, not because the last call passed.
    hs = handlers(etcd_endpoint, 4, min_nodes=3, max_nodes=4, last_call_timeout="120", join_timeout="20")
    assert {v[1] for v in join_all(dict(enumerate(hs))).values()} == {4}
    hs[3]._release()  # what an agent exiting on a signal does: its lease and join records go at once
    again = join_all({i: hs[i] for i in range(3)})
    assert sorted(v[0] for v in again.values()) == [0, 1, 2], again
    assert {v[1] for v in again.values()} == {3} and {v[2] for v in again.values()} == {1}


def test_set_closed_wakes_waiters_and_refuses_joins(etcd_endpoint):
    hs = handlers(etcd_endpoint, 3)
    waiting = threading.Thread(target=lambda: results.update(join_all({0: hs[0]})), daemon=True)
    results: dict = {}
    waiting.start()
    time.sleep(0.5)
    assert not hs[1].is_closed()
    hs[1].set_closed()
    waiting.join(10)
    assert isinstance(results[0][0], RendezvousClosedError)
    assert hs[2].is_closed()
    with pytest.raises(RendezvousClosedError):
        hs[2].next_rendezvous()


def test_join_timeout_withdraws_the_join_record(etcd_endpoint):
    (h,) = handlers(etcd_endpoint, 1, min_nodes=2, max_nodes=2, join_timeout="1")
    with pytest.raises(RendezvousTimeoutError):
        h.next_rendezvous()
    assert EtcdStore(etcd_endpoint).get_prefix(RunKeys.of("/elastic", "rb").rdzv_joins(0)) == []


@pytest.mark.slow
def test_dead_coordinator_is_replaced(etcd_endpoint, subprocess_env):
    """The first joiner (the round's coordinator) is SIGKILLed; when its lease expires a waiter takes
    the role over and closes the round on last call (nobody else would: max_nodes is not reached)."""
    conf = dict(last_call_timeout="1", keep_alive_interval="1", keep_alive_max_attempt="2", join_timeout="30")
    code = ("from torch.distributed.elastic.rendezvous import RendezvousParameters as P;"
            "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler as g;"
            f"g(P('etcd3', {etcd_endpoint!r}, 'rb', 2, 4, local_addr='127.0.0.1', **{conf!r})).next_rendezvous()")
    first = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env)
    keys, store = RunKeys.of("/elastic", "rb"), EtcdStore(etcd_endpoint)
    deadline = time.monotonic() + 60
    while store.get(keys.rdzv_ctl(0, "coord")) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    hs = handlers(etcd_endpoint, 2, min_nodes=2, max_nodes=4, **conf)
    results = join_all(dict(enumerate(hs)), timeout=40)
    assert sorted(v[:2] for v in results.values()) == [(0, 2), (1, 2)], results
    mine = {f"127.0.0.1_{os.getpid()}_{h._local_id}" for h in hs}
    assert store.get(keys.rdzv_ctl(0, "coord")).value.decode() in mine


def test_settings_reject_bad_conf():
    params = RendezvousParameters("etcd3", "127.0.0.1:2379", "r", 1, 2, join_timeout="0")
    with pytest.raises(ValueError, match="join_timeout"):
        BarrierSettings.from_params(params)
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        get_rendezvous_handler(RendezvousParameters("etcd3", "127.0.0.1:nope", "r", 1, 1))


# -- the c10d store torchrun's agents use -------------------------------------------------
@pytest.fixture
def c10d(etcd_endpoint) -> EtcdC10dStore:
    return EtcdC10dStore(EtcdStore(etcd_endpoint), "/test/c10d", timeout=timedelta(seconds=5))


def test_c10d_store_ops(c10d):
    c10d.set("k", "v")
    assert c10d.get("k") == b"v"
    c10d.set("bytes", b"\x00\x01")
    assert c10d.get("bytes") == b"\x00\x01"
    assert c10d.add("n", 2) == 2 and c10d.add("n", 1) == 3 and c10d.add("n", -1) == 2
    assert c10d.get("n") == b"2"
    assert c10d.check(["k", "n"]) and not c10d.check(["k", "missing"])
    assert c10d.num_keys() == 3
    assert c10d.delete_key("k") and not c10d.check(["k"])
    c10d.set("n", "10")  # a set replaces a counter's history
    assert c10d.add("n", 1) == 11
    assert c10d.compare_set("cas", "", "a") == b"a"
    assert c10d.compare_set("cas", "x", "b") == b"a"
    assert c10d.compare_set("cas", "a", "b") == b"b"
    # get blocks until another party sets the key (c10d contract).
    threading.Timer(0.3, lambda: c10d.set("late", "here")).start()
    assert c10d.get("late") == b"here"
    with pytest.raises(dist.DistStoreError):
        c10d.wait(["never"], timedelta(seconds=0.5))


def test_c10d_counter_has_no_lost_updates(etcd_endpoint):
    """Concurrent adds from separate clients: every caller gets a distinct value, none is lost."""
    seen: list[int] = []

    def bump():
        local = EtcdC10dStore(EtcdStore(etcd_endpoint), "/test/c10d")
        seen.extend(local.add("ctr", 1) for _ in range(10))

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 41))


def test_c10d_batches_beyond_the_txn_cap(c10d):
    keys = [f"role_info/{i}" for i in range(300)]
    c10d.multi_set(keys, [str(i) for i in range(300)])
    assert c10d.multi_get(keys) == [str(i).encode() for i in range(300)]
    assert c10d.check(keys)


def test_round_record_is_stored_compressed_and_a_plain_json_one_still_decodes():
    import json

    from torch.distributed.elastic.rendezvous import RendezvousStateError

    from elastic.rendezvous.round import RoundRecord

    nodes = [f"10.0.{i // 256}.{i % 256}_4242_0" for i in range(2048)]
    record = RoundRecord(3, nodes, "10.0.0.0", 29500)
    raw = record.encode()
    assert len(raw) * 3 < len(json.dumps(nodes))  # what every waiter's watch event carries
    assert RoundRecord.decode(raw, 7) == RoundRecord(3, nodes, "10.0.0.0", 29500, 7)
    plain = json.dumps({"round": 1, "nodes": ["a", "b"], "master": ["a", 1]}).encode()
    assert RoundRecord.decode(plain, 2).nodes == ["a", "b"]
    with pytest.raises(RendezvousStateError, match="corrupt round record"):
        RoundRecord.decode(raw[:-5], 7)
