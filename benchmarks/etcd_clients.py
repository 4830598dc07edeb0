"""Which etcd client for the rendezvous: the JSON gateway (what EtcdStore uses) vs gRPC, one run.

    python benchmarks/etcd_clients.py [--sizes 256,1024] [--procs 4]

Needs ``cslab-etcd3`` (the gRPC client; not a dependency of this project) for the gRPC rows;
without it only the gateway is measured.  Against one embedded etcd on 127.0.0.1:

* ``sequential``: median latency of put, get and a join-like transaction (put + count of a
  prefix), 300 each from one thread, and the client CPU per request; ``gateway`` is a plain
  requests session (what the store sent its requests through before ``UnaryClient``), ``store``
  the runtime's ``EtcdStore`` itself (urllib3, retries and all);
* ``barrier_<n>_s``: the rendezvous pattern at n participants (threads in ``--procs``
  processes): each participant joins (the gateway: one transaction that puts and counts; gRPC:
  a put then a count), the one that sees count == n writes a done key, and everyone else waits
  on a watch of that key.  Time from the common start until the last participant saw it.
  gRPC is measured with one channel per process (a channel per participant timed out here).

Prints JSON with the load average before and after.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class Gateway:
    """What elastic.control.store does, without its retries: one HTTP session per participant."""

    def __init__(self, endpoint: str) -> None:
        self.url, self.session = f"http://{endpoint}/v3", requests.Session()

    def put(self, key: str, value: str) -> None:
        self.session.post(self.url + "/kv/put", json={"key": _b64(key), "value": _b64(value)}).raise_for_status()

    def get(self, key: str) -> None:
        self.session.post(self.url + "/kv/range", json={"key": _b64(key)}).raise_for_status()

    def join(self, prefix: str, key: str) -> int:
        txn = {"compare": [], "success": [
            {"request_put": {"key": _b64(key), "value": _b64("x")}},
            {"request_range": {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True}}]}
        resp = self.session.post(self.url + "/kv/txn", json=txn).json()
        return int(resp["responses"][1]["response_range"].get("count", 0))

    def wait(self, key: str) -> None:
        body = {"create_request": {"key": _b64(key), "start_revision": 1}}
        with self.session.post(self.url + "/watch", json=body, stream=True, timeout=(5, 300)) as resp:
            for chunk in resp.iter_content(chunk_size=None):
                if b'"events"' in chunk:
                    return


_CHANNELS: dict[str, object] = {}


class Grpc:
    """cslab-etcd3 with the settings that avoid its 300 s failed-node lockout; one channel per process."""

    def __init__(self, endpoint: str) -> None:
        import etcd3  # cslab-etcd3

        if endpoint not in _CHANNELS:
            host, port = endpoint.split(":")
            node = etcd3.Endpoint(host, int(port), secure=False, time_retry=0)
            _CHANNELS[endpoint] = etcd3.MultiEndpointEtcd3Client(endpoints=[node], timeout=30)
        self.client = _CHANNELS[endpoint]

    def put(self, key: str, value: str) -> None:
        self.client.put(key, value)

    def get(self, key: str) -> None:
        self.client.get(key)

    def join(self, prefix: str, key: str) -> int:
        self.client.put(key, "x")
        return self.client.get_prefix_response(prefix, keys_only=True, count_only=True).count

    def wait(self, key: str) -> None:
        events, cancel = self.client.watch(key, start_revision=1)
        for _ in events:
            cancel()
            return


class Store:
    """The runtime's own EtcdStore (its requests on urllib3: elastic/control/unary.py), retries included."""

    def __init__(self, endpoint: str) -> None:
        from elastic.control.store import EtcdStore

        self.store = EtcdStore(endpoint)

    def put(self, key: str, value: str) -> None:
        self.store.put(key, value)

    def get(self, key: str) -> None:
        self.store.get(key)

    def join(self, prefix: str, key: str) -> int:
        from elastic.control.txn import Count, Put, Txn

        return self.store.txn(Txn(success=[Put(key, "x"), Count(prefix)])).results[1]

    def wait(self, key: str) -> None:
        with self.store.watch(key, 1) as stream:
            while not stream.get(60.0):
                pass


CLIENTS = {"gateway": Gateway, "store": Store, "grpc": Grpc}


def _sequential(kind: str, endpoint: str, n: int = 300) -> dict:
    client = CLIENTS[kind](endpoint)
    lat: dict[str, list[float]] = {"put": [], "get": [], "join": []}
    cpu0 = time.process_time()
    for i in range(n):
        for op, call in (("put", lambda: client.put(f"/seq/{kind}/{i}", "v")), ("get", lambda: client.get(f"/seq/{kind}/{i}")),
                         ("join", lambda: client.join(f"/seq/{kind}/j/", f"/seq/{kind}/j/{i}"))):
            t0 = time.perf_counter()
            call()
            lat[op].append(time.perf_counter() - t0)
    out = {f"{op}_ms": round(statistics.median(v) * 1e3, 3) for op, v in lat.items()}
    out["client_cpu_ms_per_request"] = round((time.process_time() - cpu0) / (3 * n) * 1e3, 3)
    return out


def _child(kind: str, endpoint: str, prefix: str, threads: int, size: int, start_at: float) -> None:
    done, ends = f"{prefix}done", []

    def one() -> None:
        client = CLIENTS[kind](endpoint)
        time.sleep(max(0.0, start_at - time.time()))
        if client.join(prefix + "j/", f"{prefix}j/{uuid.uuid4().hex}") == size:
            client.put(done, "1")
        else:
            client.wait(done)
        ends.append(time.time())

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(max(ends) - start_at))


def _barrier(kind: str, endpoint: str, size: int, procs: int) -> float:
    prefix, start_at = f"/barrier/{kind}/{size}/", time.time() + 3 + size / 200
    children = [subprocess.Popen([sys.executable, __file__, "--child", kind, endpoint, prefix, str(size // procs),
                                  str(size), str(start_at)], stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    return round(max(json.loads(c.communicate()[0]) for c in children), 3)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, endpoint, prefix, threads, size, start_at = sys.argv[2:8]
        _child(kind, endpoint, prefix, int(threads), int(size), float(start_at))
        return 0
    parser = argparse.ArgumentParser(prog="benchmarks/etcd_clients.py")
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--procs", type=int, default=4)
    args = parser.parse_args()
    from elastic.control.etcd_server import EmbeddedEtcd

    kinds = ["gateway", "store"]
    try:
        import etcd3  # noqa: F401

        kinds.append("grpc")
    except ImportError:
        pass
    report: dict = {"loadavg_1m_start": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    with EmbeddedEtcd() as etcd:
        for kind in kinds:
            report[kind] = _sequential(kind, etcd.endpoint)
            for size in (int(s) for s in args.sizes.split(",")):
                report[kind][f"barrier_{size}_s"] = _barrier(kind, etcd.endpoint, size, args.procs)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
