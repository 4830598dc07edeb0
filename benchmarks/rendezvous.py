"""Rendezvous formation time at scale: this project's etcd3 backend vs torch's c10d backend, one run.

    python benchmarks/rendezvous.py [--sizes 64,256] [--repeats 3] [--procs 4] [--timeout 300]

A "lightweight agent" is a participant that only runs the rendezvous: a
torch ``DynamicRendezvousHandler`` created through torchrun's handler
registry (``etcd3`` = :mod:`elastic.rendezvous.backend`, ``c10d`` = torch's
TCPStore backend), calling ``next_rendezvous()`` once.  ``--procs`` OS
processes each host ``size / procs`` handler threads, so 256 participants fit
on a small host.  Per (backend, size, repeat) the parent

1. starts the processes, which build their handlers and report ready;
2. sends one start time to all of them; every thread sleeps until it, then joins;
3. collects, per participant, join start / return time, round, rank and world size.

``formation_s`` = last return - first join start (wall clock, one host).  A
repeat counts only if every participant returned the same round, world size
= size, and the ranks are exactly 0..size-1.  Each repeat uses a fresh run id.

Servers, both on 127.0.0.1 and both outside the participant processes: an
:class:`~elastic.control.etcd_server.EmbeddedEtcd` (etcd3) and a ``TCPStore`` hosted by
the parent (c10d, participants get ``is_host=False``).  Both backends use
the same rendezvous timings (``--timings``: torch's handler defaults, or this
project's ``RendezvousConfig`` defaults that elastic-launch passes to torchrun)
and min = max = size, so a round closes as soon as the last participant joins.  The participants run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as under the node agent.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BACKENDS = ("etcd3", "c10d")


def _timings(profile: str) -> dict[str, str]:
    """Rendezvous settings for both backends: ``project`` = what elastic-launch passes to torchrun
    (``RendezvousConfig`` defaults: 1 s keep-alive, 5 s heartbeat timeout, tuned for small local runs);
    ``torch`` = torch's own DynamicRendezvousHandler defaults (5 s keep-alive, 30 s heartbeat timeout);
    ``large`` = torch's defaults with the keep-alive stretched to 30 s and the heartbeat timeout to
    120 s: every keep-alive is a write of the one shared state key, so fewer of them leave room
    for the joins at a few hundred participants."""
    from elastic.agent.config import RendezvousConfig

    if profile == "project":
        return dict(item.split("=", 1) for item in RendezvousConfig().torchrun_conf().split(","))
    torch_defaults = {"join_timeout": "600", "last_call_timeout": "30", "close_timeout": "30",
                      "heartbeat_timeout": "30", "keep_alive_interval": "5"}
    if profile == "large":
        return {**torch_defaults, "heartbeat_timeout": "120", "keep_alive_interval": "30"}
    return torch_defaults


# -- participant process ------------------------------------------------------------
def _child(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    conf = _timings(args.timings)
    if args.backend == "c10d":
        conf = {**conf, "is_host": "false", "read_timeout": "300"}
    handlers = []
    for _ in range(args.threads):
        params = RendezvousParameters(backend=args.backend, endpoint=args.endpoint, run_id=args.run_id,
                                      min_nodes=args.size, max_nodes=args.size, local_addr="127.0.0.1", **conf)
        handlers.append(get_rendezvous_handler(params))
    print("READY", flush=True)
    start_at = float(sys.stdin.readline().split()[1])
    results: list[dict] = []
    lock = threading.Lock()

    def join(handler) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        try:
            info = handler.next_rendezvous()
            out = {"start": t0, "end": time.time(), "rank": info.rank, "world": info.world_size,
                   "round": handler._state_holder.state.round}  # no public accessor for the round
        except (RendezvousError, RuntimeError, OSError, ValueError) as exc:  # the parent fails the repeat
            out = {"start": t0, "end": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}
        with lock:
            results.append(out)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULTS " + json.dumps(results), flush=True)
    # Exit without closing the rendezvous: a close by one participant would end it for the rest.
    os._exit(0)


# -- parent -------------------------------------------------------------------------------
def _one_round(backend: str, size: int, procs: int, endpoint: str, timeout: float, timings: str) -> dict:
    run_id = f"bench-{backend}-{size}-{uuid.uuid4().hex[:8]}"
    per = [size // procs + (1 if i < size % procs else 0) for i in range(procs)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    children = [
        subprocess.Popen([sys.executable, __file__, "--child", "--backend", backend, "--endpoint", endpoint,
                          "--run-id", run_id, "--size", str(size), "--threads", str(n), "--timings", timings],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        for n in per if n
    ]
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            line = _readline(child, deadline)
            if line.strip() != "READY":
                return {"ok": False, "error": f"participant process not ready: {line.strip()[:200]!r}"}
        start_at = time.time() + 0.5
        for child in children:
            child.stdin.write(f"GO {start_at}\n")
            child.stdin.flush()
        results: list[dict] = []
        for child in children:
            line = _readline(child, deadline)
            if not line.startswith("RESULTS "):
                return {"ok": False, "error": f"no results: {line.strip()[:200]!r}"}
            results += json.loads(line[len("RESULTS "):])
    except TimeoutError:
        return {"ok": False, "error": f"not formed within {timeout:g}s"}
    finally:
        for child in children:
            child.kill()
            child.wait()
    return _judge(results, size)


def _readline(child: subprocess.Popen, deadline: float) -> str:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([child.stdout], [], [], left)
        if ready:
            line = child.stdout.readline()
            if line == "" or line.strip() in ("READY",) or line.startswith("RESULTS "):
                return line
            # anything else on stdout (library chatter) is skipped


def _judge(results: list[dict], size: int) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"ok": False, "error": f"{len(errors)} participants failed, e.g. {errors[0]}"}
    rounds = {r["round"] for r in results}
    worlds = {r["world"] for r in results}
    ranks = sorted(r["rank"] for r in results)
    ok = len(results) == size and len(rounds) == 1 and worlds == {size} and ranks == list(range(size))
    first, last = min(r["start"] for r in results), max(r["end"] for r in results)
    per_join = sorted(r["end"] - r["start"] for r in results)
    return {"ok": ok, "formation_s": round(last - first, 3), "round": sorted(rounds), "world": sorted(worlds),
            "join_s_p50": round(per_join[len(per_join) // 2], 3), "join_s_max": round(per_join[-1], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/rendezvous.py")
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=4, help="participant processes per rendezvous")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per rendezvous")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--timings", choices=("torch", "project", "large"), default="torch",
                        help="rendezvous keep-alive/heartbeat settings used by both backends (see _timings)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)

    from torch.distributed import TCPStore

    from elastic.control.etcd_server import EmbeddedEtcd, free_port

    sizes = [int(s) for s in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    work = Path(tempfile.mkdtemp(prefix="bench-rdzv-"))
    etcd = EmbeddedEtcd(data_dir=work / "etcd", log_path=work / "etcd.log")
    etcd.start(parent_death_signal=signal.SIGKILL)
    # SIGTERM/SIGINT unwind through the finally below, which stops etcd and the participants.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    c10d_port = free_port()
    store = TCPStore("127.0.0.1", c10d_port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=600),
                     wait_for_workers=False)
    endpoints = {"etcd3": etcd.endpoint, "c10d": f"127.0.0.1:{c10d_port}"}
    report: dict = {"timings": _timings(args.timings), "procs": args.procs, "repeats": args.repeats, "loadavg_1m_start": round(os.getloadavg()[0], 2),
                    "cpus": os.cpu_count(), "results": {}}
    try:
        for size in sizes:
            for backend in backends:
                runs = [_one_round(backend, size, args.procs, endpoints[backend], args.timeout, args.timings)
                        for _ in range(args.repeats)]
                good = [r["formation_s"] for r in runs if r.get("ok")]
                report["results"][f"{backend}/{size}"] = {
                    "formation_s_median": round(statistics.median(good), 3) if good else None,
                    "ok_repeats": len(good), "runs": runs,
                }
                print(f"# {backend}/{size}: {good}", file=sys.stderr, flush=True)
    finally:
        del store
        etcd.close()
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=1))
    return 0 if all(v["ok_repeats"] for v in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
