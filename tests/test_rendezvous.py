"""The etcd3-state backend (torch's backend contract), the entry points, and plain torchrun on both handlers."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from elastic.rendezvous.backend import Etcd3RendezvousBackend, create_etcd3_handler
from elastic.control.store import EtcdStore

WORKER = Path(__file__).parent / "workers" / "allreduce.py"


@pytest.fixture
def backend(etcd_endpoint) -> Etcd3RendezvousBackend:
    return Etcd3RendezvousBackend(EtcdStore(etcd_endpoint), "run-a")


def test_absent_state_is_none(backend):
    assert backend.name == "etcd3-state"
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


def test_handler_registered_through_entry_point():
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names.get("etcd3") == "elastic.rendezvous.plugin:handler_factory"
    assert names.get("etcd3-state") == "elastic.rendezvous.plugin:state_handler_factory"


def test_handler_reports_bad_endpoint():
    params = RendezvousParameters(backend="etcd3-state", endpoint="127.0.0.1:notaport", run_id="r", min_nodes=1,
                                  max_nodes=1)
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        create_etcd3_handler(params)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd3", "etcd3-state"])
def test_plain_torchrun_two_nodes(etcd_endpoint, tmp_path, subprocess_env, backend):
    """Two torchrun agents (one per 'node') meet through the backend and all-reduce; the agents
    share their store with the workers (torch's default), so rank 0's agent hosts it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           f"--rdzv-backend={backend}", f"--rdzv-endpoint={etcd_endpoint}", "--rdzv-id=plain",
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
