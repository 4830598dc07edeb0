"""The etcd3 rendezvous backend: torch's backend contract, the c10d store, and plain torchrun."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastic.rendezvous.backend import Etcd3RendezvousBackend, EtcdC10dStore, create_etcd3_handler
from elastic.control.store import EtcdStore

WORKER = Path(__file__).parent / "workers" / "allreduce.py"


@pytest.fixture
def backend(etcd_endpoint) -> Etcd3RendezvousBackend:
    return Etcd3RendezvousBackend(EtcdStore(etcd_endpoint), "run-a")


def test_absent_state_is_none(backend):
    assert backend.name == "etcd3"
    assert backend.get_state() is None


def test_create_then_update_with_token(backend):
    state, token, ok = backend.set_state(b"s1")  # token None: create only
    assert (state, ok) == (b"s1", True)
    assert backend.get_state() == (b"s1", token)
    state2, token2, ok2 = backend.set_state(b"s2", token)
    assert ok2 and state2 == b"s2" and token2 != token
    assert backend.get_state() == (b"s2", token2)


def test_create_only_when_state_exists_returns_current(backend):
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"second") == (b"first", token, False)


def test_stale_token_returns_current_and_false(backend):
    _, old, _ = backend.set_state(b"s1")
    _, new, _ = backend.set_state(b"s2", old)
    assert backend.set_state(b"s3", old) == (b"s2", new, False)


@pytest.mark.parametrize("bad_token", ["not-a-number", object(), -1])
def test_invalid_token_returns_current_and_false(backend, bad_token):
    _, token, _ = backend.set_state(b"s1")
    assert backend.set_state(b"s2", bad_token) == (b"s1", token, False)


def test_invalid_token_on_absent_state_is_none(backend):
    assert backend.set_state(b"x", "garbage") is None
    assert backend.set_state(b"x", 12345) is None


def test_corrupt_state_raises_state_error(backend, etcd_endpoint):
    EtcdStore(etcd_endpoint).put(backend.key, b"definitely not rendezvous state")
    with pytest.raises(RendezvousStateError):
        backend.get_state()
    EtcdStore(etcd_endpoint).put(backend.key, b"ERDZV1:***not base64***")
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_runs_are_isolated(etcd_endpoint):
    store = EtcdStore(etcd_endpoint)
    a = Etcd3RendezvousBackend(store, "run-a")
    b = Etcd3RendezvousBackend(store, "run-b")
    a.set_state(b"A")
    assert b.get_state() is None


def test_c10d_store_ops(etcd_endpoint):
    store = EtcdC10dStore(EtcdStore(etcd_endpoint), "/test/c10d", timeout=timedelta(seconds=5))
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.set("bytes", b"\x00\x01")
    assert store.get("bytes") == b"\x00\x01"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["k", "n"]) and not store.check(["k", "missing"])
    assert store.num_keys() == 3
    assert store.delete_key("k") and not store.check(["k"])
    # get blocks until another party sets the key (c10d contract).
    threading.Timer(0.3, lambda: store.set("late", "here")).start()
    assert store.get("late") == b"here"
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.5))


def test_handler_registered_through_entry_point():
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names.get("etcd3") == "elastic.rendezvous.plugin:handler_factory"


def test_handler_reports_bad_endpoint():
    params = RendezvousParameters(backend="etcd3", endpoint="127.0.0.1:notaport", run_id="r", min_nodes=1, max_nodes=1)
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        create_etcd3_handler(params)


@pytest.mark.slow
def test_plain_torchrun_two_nodes(etcd_endpoint, tmp_path, subprocess_env):
    """Two torchrun agents (one per 'node') meet through the etcd3 backend and all-reduce."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=etcd3", f"--rdzv-endpoint={etcd_endpoint}", "--rdzv-id=plain",
           "--rdzv-conf=last_call_timeout=1", "--local-addr=127.0.0.1", "--max-restarts=0",
           str(WORKER), str(tmp_path)]
    procs = [subprocess.Popen(cmd, env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    results = sorted(p.read_text().split() for p in tmp_path.glob("rank*.txt"))
    assert results == [["2", "3.0"], ["2", "3.0"]]
    # The rendezvous round really lives in this etcd.
    assert EtcdStore(etcd_endpoint).get_prefix("/elastic/runs/plain/rdzv/")
