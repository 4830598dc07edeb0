import json
import socket
import urllib.request

import pytest

from elastic.control.etcd_server import EmbeddedEtcd, EtcdServerError, find_etcd_binary, free_port


def test_binary_found():
    assert find_etcd_binary()


def test_start_restart_stop(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "d", log_path=tmp_path / "log")
    server.start()
    with urllib.request.urlopen(f"http://{server.endpoint}/version", timeout=2) as resp:
        assert "etcdserver" in json.loads(resp.read())
    server.kill()
    server.start()  # same data dir, same port
    server.close()
    assert server.proc is None


def _occupy(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_free_port_is_below_the_ephemeral_range():
    # An ephemeral port can be taken by any outgoing connection before the server binds it.
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert all(free_port() < low for _ in range(20))


def test_free_port_never_hands_out_a_port_twice_before_it_is_bound(monkeypatch):
    """Each call probes and lets go: with the same probe order (here forced), every call found the
    same free port, and a 3-member cluster's six draws could collide (fresh-clone suite: member 0's
    peer port was another member's client port)."""
    from elastic.control import etcd_server

    monkeypatch.setattr(etcd_server.random, "sample", lambda population, k: list(population)[:k])
    ports = [free_port() for _ in range(6)]
    assert len(set(ports)) == 6


def test_start_moves_to_fresh_ports_when_its_chosen_port_was_taken(tmp_path):
    server = EmbeddedEtcd(data_dir=tmp_path / "d", log_path=tmp_path / "log")
    taken = server.client_port
    with _occupy(taken):
        server.start()
        try:
            assert server.client_port != taken
            with urllib.request.urlopen(f"http://{server.endpoint}/version", timeout=2) as resp:
                assert "etcdserver" in json.loads(resp.read())
        finally:
            server.close()


def test_a_port_the_caller_named_is_never_moved(tmp_path):
    port = free_port()
    server = EmbeddedEtcd(data_dir=tmp_path / "d", log_path=tmp_path / "log", client_port=port)
    with _occupy(port), pytest.raises(EtcdServerError, match="address already in use"):
        server.start()
    server.close()
    assert server.client_port == port
