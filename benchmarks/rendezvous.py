"""Rendezvous at scale: the etcd3 barrier handler vs the etcd3-state backend vs torch's c10d, one run.

    python benchmarks/rendezvous.py [--sizes 64,256,1024] [--repeats 3] [--procs 4] [--timeout 300]
                                    [--reform-size 256] [--etcd-members 1] [--json PATH]

A "lightweight participant" only runs the rendezvous: a torchrun handler created through
torchrun's handler registry (``etcd3`` = elastic.rendezvous.barrier, ``etcd3-state`` = torch's
DynamicRendezvousHandler over one etcd key, ``c10d`` = torch's TCPStore backend), calling
``next_rendezvous()``.  ``--procs`` OS processes each host ``size / procs`` handler threads.
Per (backend, size, repeat) the parent starts the processes, sends one start time, and
collects per participant join start / return time, round, rank and world size.

``formation_s`` = last return - first join start.  A repeat counts only if every participant
returned the same round, world size = size and ranks exactly 0..size-1.  Each repeat uses a
fresh run id.  A backend that fails at a size is not tried again at that size or above.

``reform``: ``--reform-size`` participants form with nnodes ``size-1:size``; then one leaves
(etcd3: its lease is revoked, as when its agent exits; c10d: its keep-alives stop, as when its
agent dies) and the others call ``next_rendezvous()`` at once, as torchrun does when a peer's
workers fail.  ``reform_s`` = from the leave until the last of the others returns in a new
round of size-1.

``requests_per_s``: requests the etcd3 handlers sent to etcd during the formation (unary
requests and watch streams opened) over its duration; ``requests_per_participant`` alongside.

Servers on 127.0.0.1, outside the participant processes: an embedded etcd (``--etcd-members``
1 or 3) and a TCPStore hosted by the parent (c10d participants get ``is_host=False``).  All
backends use torch's default timings (join 600 s, last call 30 s, keep-alive 5 s x 3).
Participants run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as under the node agent.
Prints one JSON object (``--json PATH`` also writes it); ``ratio_vs_c10d`` maps each size to the
etcd3 median over c10d's.  ``BENCH_CHILD_STDERR=1`` shows the participants' stderr and reports
each failed participant as it fails.
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

BACKENDS = ("etcd3", "etcd3-state", "c10d")
TORCH_TIMINGS = {"join_timeout": "600", "last_call_timeout": "30", "close_timeout": "30",
                 "heartbeat_timeout": "30", "keep_alive_interval": "5"}


# -- participant process ------------------------------------------------------------
def _round_of(handler) -> int:
    return handler.round if hasattr(handler, "round") else handler._state_holder.state.round


def _requests_of(handler) -> int:
    store = getattr(handler, "_store", None)
    if hasattr(store, "requests_sent"):
        return store.requests_sent
    backend = getattr(getattr(handler, "_state_holder", None), "_backend", None)
    return getattr(getattr(backend, "_store", None), "requests_sent", 0)


def _leave(handler) -> None:
    """Leave as a dying agent does: etcd3 revokes its lease at exit, torch's handlers go silent."""
    if hasattr(handler, "_release"):
        handler._release()
    else:
        handler._stop_heartbeats()


def _join_all(handlers: list, start_at: float, skip: set[int]) -> list[dict]:
    results: list[dict] = []
    lock = threading.Lock()

    def join(index: int, handler) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        try:
            info = handler.next_rendezvous()
            out = {"start": t0, "end": time.time(), "rank": info.rank, "world": info.world_size,
                   "round": _round_of(handler)}
        except Exception as exc:  # noqa: BLE001 - the parent fails the repeat
            out = {"start": t0, "end": time.time(), "error": f"{type(exc).__name__}: {exc}"[:300]}
            if os.environ.get("BENCH_CHILD_STDERR"):
                print(f"participant {index}: {out['error']} after {out['end'] - t0:.1f}s", file=sys.stderr, flush=True)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=join, args=(i, h), daemon=True) for i, h in enumerate(handlers) if i not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _child(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    # Hundreds of participant threads per process: see benchmarks/cp_sim.py's SWITCH_INTERVAL_WHY (the
    # GIL waiters' convoy; a real participant is a process of its own).  Every backend gets the same.
    sys.setswitchinterval(float(os.environ.get("BENCH_SWITCH_INTERVAL", "0.005")))
    conf = dict(TORCH_TIMINGS)
    if args.backend == "c10d":
        conf.update(is_host="false", read_timeout="300")
    handlers = [get_rendezvous_handler(RendezvousParameters(
        backend=args.backend, endpoint=args.endpoint, run_id=args.run_id, min_nodes=args.min_nodes,
        max_nodes=args.size, local_addr="127.0.0.1", **conf)) for _ in range(args.threads)]
    print("READY", flush=True)
    for line in sys.stdin:
        verb, at, *rest = line.split()
        skip: set[int] = set()
        if verb == "LEAVE":
            if rest and rest[0] == "1":  # this process hosts the participant that leaves
                time.sleep(max(0.0, float(at) - time.time()))
                _leave(handlers[0])
                skip = {0}
        before = sum(_requests_of(h) for h in handlers)
        results = _join_all(handlers, float(at), skip)
        print("RESULTS " + json.dumps({"results": results,
                                        "requests": sum(_requests_of(h) for h in handlers) - before}), flush=True)
    # Exit without closing the rendezvous: a close by one participant would end it for the rest.
    os._exit(0)


# -- parent -------------------------------------------------------------------------------
class Participants:
    """The participant processes of one rendezvous (one run id)."""

    def __init__(self, backend: str, size: int, min_nodes: int, procs: int, endpoint: str, deadline: float) -> None:
        run_id = f"bench-{backend}-{size}-{uuid.uuid4().hex[:8]}"
        per = [size // procs + (1 if i < size % procs else 0) for i in range(procs)]
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.deadline = deadline
        self.children = [
            subprocess.Popen([sys.executable, __file__, "--child", "--backend", backend, "--endpoint", endpoint,
                              "--run-id", run_id, "--size", str(size), "--min-nodes", str(min_nodes),
                              "--threads", str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                             stderr=None if os.environ.get("BENCH_CHILD_STDERR") else subprocess.DEVNULL)
            for n in per if n
        ]
        for child in self.children:
            line = _readline(child, deadline)
            if line.strip() != "READY":
                raise RuntimeError(f"participant process not ready: {line.strip()[:200]!r}")

    def command(self, verb: str, at: float, leaver_index: int | None = None) -> tuple[list[dict], int]:
        for i, child in enumerate(self.children):
            flag = " 1" if i == leaver_index else " 0"
            child.stdin.write(f"{verb} {at}{flag}\n")
            child.stdin.flush()
        results: list[dict] = []
        requests = 0
        for child in self.children:
            line = _readline(child, self.deadline)
            if not line.startswith("RESULTS "):
                raise RuntimeError(f"no results: {line.strip()[:200]!r}")
            payload = json.loads(line[len("RESULTS "):])
            results += payload["results"]
            requests += payload["requests"]
        return results, requests

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


def _readline(child: subprocess.Popen, deadline: float) -> str:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([child.stdout], [], [], left)
        if ready:
            line = child.stdout.readline()
            if line == "" or line.strip() == "READY" or line.startswith("RESULTS "):
                return line
            # anything else on stdout (library chatter) is skipped


def _judge(results: list[dict], size: int, since: float | None = None) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"ok": False, "error": f"{len(errors)} participants failed, e.g. {errors[0]}"}
    rounds = {r["round"] for r in results}
    worlds = {r["world"] for r in results}
    ranks = sorted(r["rank"] for r in results)
    ok = len(results) == size and len(rounds) == 1 and worlds == {size} and ranks == list(range(size))
    first = since if since is not None else min(r["start"] for r in results)
    ends = sorted(r["end"] for r in results)
    per_join = sorted(r["end"] - r["start"] for r in results)
    # The first return is about when the round closed; the rest is every waiter hearing it.
    return {"ok": ok, "formation_s": round(ends[-1] - first, 3), "round": sorted(rounds), "world": sorted(worlds),
            "join_s_p50": round(per_join[len(per_join) // 2], 3), "join_s_max": round(per_join[-1], 3),
            "first_return_s": round(ends[0] - first, 3), "returns_p50_s": round(ends[len(ends) // 2] - first, 3)}


def _formation(backend: str, size: int, procs: int, endpoint: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    try:
        group = Participants(backend, size, size, procs, endpoint, deadline)
    except (TimeoutError, RuntimeError) as exc:
        return {"ok": False, "error": f"setup: {exc or 'timed out'}"}
    try:
        results, requests = group.command("GO", time.time() + 0.5)
        out = _judge(results, size)
        if out["ok"] and backend != "c10d":
            out["requests"] = requests
            out["requests_per_s"] = round(requests / max(out["formation_s"], 1e-3), 1)
            out["requests_per_participant"] = round(requests / size, 2)
        return out
    except TimeoutError:
        return {"ok": False, "error": f"not formed within {timeout:g}s"}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)}
    finally:
        group.close()


def _reform(backend: str, size: int, procs: int, endpoint: str, timeout: float) -> dict:
    """Form with nnodes size-1:size, one participant leaves, the rest re-form at once."""
    deadline = time.monotonic() + timeout
    try:
        group = Participants(backend, size, size - 1, procs, endpoint, deadline)
    except (TimeoutError, RuntimeError) as exc:
        return {"ok": False, "error": f"setup: {exc or 'timed out'}"}
    try:
        first = _judge(group.command("GO", time.time() + 0.5)[0], size)
        if not first["ok"]:
            return {"ok": False, "error": f"first formation failed: {first}"}
        leave_at = time.time() + 0.5
        results, _ = group.command("LEAVE", leave_at, leaver_index=0)
        out = _judge(results, size - 1, since=leave_at)
        out["reform_s"] = out.pop("formation_s")
        out["first_formation_s"] = first["formation_s"]
        return out
    except TimeoutError:
        return {"ok": False, "error": f"not re-formed within {timeout:g}s"}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)}
    finally:
        group.close()


def _median(runs: list[dict], key: str) -> float | None:
    good = [r[key] for r in runs if r.get("ok")]
    return round(statistics.median(good), 3) if good else None


def _measure(kind: str, backend: str, size: int, args, endpoint: str) -> dict:
    fn, key = (_formation, "formation_s") if kind == "formation" else (_reform, "reform_s")
    runs = []
    for _ in range(args.repeats):
        runs.append(fn(backend, size, args.procs, endpoint, args.timeout))
        print(f"# {kind} {backend}/{size}: {runs[-1].get(key, runs[-1].get('error'))}", file=sys.stderr, flush=True)
        if not runs[-1].get("ok"):
            break  # a failure (usually a timeout) is not worth repeating
    out = {f"{key}_median": _median(runs, key), "ok_repeats": len([r for r in runs if r.get("ok")]), "runs": runs}
    rates = [r["requests_per_s"] for r in runs if r.get("ok") and "requests_per_s" in r]
    if rates:
        out["requests_per_s_median"] = round(statistics.median(rates), 1)
    return out


def _run_all(args, endpoints: dict[str, str]) -> dict:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    backends = [b for b in args.backends.split(",") if b]
    results: dict = {}
    failed_at: dict[str, int] = {}
    for size in sizes:
        for backend in backends:
            if backend in failed_at:
                results[f"{backend}/{size}"] = {"skipped": f"did not form at {failed_at[backend]}"}
                continue
            results[f"{backend}/{size}"] = entry = _measure("formation", backend, size, args, endpoints[backend])
            if not entry["ok_repeats"]:
                failed_at[backend] = size
    reform = {}
    if args.reform_size:
        for backend in [b for b in args.reform_backends.split(",") if b]:
            reform[backend] = _measure("reform", backend, args.reform_size, args, endpoints[backend])
    return {"results": results, "reform": reform, "sizes": sizes}


def _ratios(report: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for size in report["sizes"]:
        ours = report["results"].get(f"etcd3/{size}", {}).get("formation_s_median")
        base = report["results"].get(f"c10d/{size}", {}).get("formation_s_median")
        out[str(size)] = round(ours / base, 3) if ours and base else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/rendezvous.py")
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=16, help="participant processes per rendezvous")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per rendezvous")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--reform-size", type=int, default=256, help="0 skips the re-form measurement")
    parser.add_argument("--reform-backends", default="etcd3,c10d")
    parser.add_argument("--etcd-members", type=int, choices=(1, 3), default=1)
    parser.add_argument("--json", help="also write the JSON report here")
    parser.add_argument("--switch-interval", type=float, default=0.2,
                        help="the participant processes' sys.setswitchinterval (Python's default: 0.005)")
    for hidden in ("--backend", "--endpoint", "--run-id"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--size", "--min-nodes", "--threads"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    os.environ["BENCH_SWITCH_INTERVAL"] = str(args.switch_interval)  # the participant processes inherit it

    from torch.distributed import TCPStore

    from elastic.control.etcd_cluster import EtcdCluster
    from elastic.control.etcd_server import free_port

    work = Path(tempfile.mkdtemp(prefix="bench-rdzv-"))
    etcd = EtcdCluster(work / "etcd", members=args.etcd_members)
    etcd.start(parent_death_signal=signal.SIGKILL)
    # SIGTERM/SIGINT unwind through the finally below, which stops etcd and the participants.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    c10d_port = free_port()
    store = TCPStore("127.0.0.1", c10d_port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=600),
                     wait_for_workers=False)
    endpoints = {"etcd3": etcd.endpoints, "etcd3-state": etcd.endpoints, "c10d": f"127.0.0.1:{c10d_port}"}
    report: dict = {"timings": TORCH_TIMINGS, "procs": args.procs, "repeats": args.repeats,
                    "switch_interval_s": args.switch_interval,
                    "etcd_members": args.etcd_members, "cpus": os.cpu_count(),
                    "loadavg_1m_start": round(os.getloadavg()[0], 2)}
    try:
        report.update(_run_all(args, endpoints))
    finally:
        del store
        etcd.close()
        shutil.rmtree(work, ignore_errors=True)
    report["ratio_vs_c10d"] = _ratios(report)
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    etcd3_ok = all(v.get("ok_repeats") for k, v in report["results"].items() if k.startswith("etcd3/"))
    return 0 if etcd3_ok else 1


if __name__ == "__main__":
    sys.exit(main())
