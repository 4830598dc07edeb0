import json
import urllib.request

from elastic.control.etcd_server import EmbeddedEtcd, find_etcd_binary


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
