"""Per-step snapshots at real sizes: simulated ranks pushing packed shards through a real agent store
and on to a real buddy store, on loopback (issue 28).

    python benchmarks/snapshot_pipeline.py --shard-mib 16,47,512 --ranks-per-node 8 --json out.json

Three processes per shard size: the **buddy** (a :class:`~elastic.checkpoint.memstate.MemStateServer`),
the **agent** (another, replicating every snapshot of its workers to the buddy as the agent's
``BuddyLink`` does: :class:`~elastic.checkpoint.memclient.ClientPool`), and this one, which runs the
``--ranks-per-node`` ranks as threads, each with the worker's real snapshot code: a
:class:`~elastic.checkpoint.snapshot.SnapshotRing` of packed buffers, a
:class:`~elastic.checkpoint.snapshot.SnapshotPusher` (capture deferred to its thread, checksum,
push on a kept connection).  A rank's step is paced by ``--compute-ms`` of sleep (the device's
work), with the trainer's two sync points in it: ``sync_point`` (the deferred copy must be taken)
after ``--sync-frac`` of it and ``commit_point`` (the previous push must be stored at the agent and
the buddy) at its end.

Reported per size:

* ``node_push_gbps``: the bytes of every rank's snapshot of a step over the time from the first
  rank's capture to the last rank's push stored at the buddy (median over steps): the node's
  sustained rate through the agent and on to the buddy;
* ``train_thread_wait_ms``: how long the pipeline held the training thread per step at the two
  sync points: from each call to the moment the pusher had done what it waits for (median, p90 and
  max over ranks and steps), after the first ``WARMUP_STEPS`` (whose fresh buffers are first
  touched: their largest wait is ``warmup_wait_ms_max``); ``train_thread_wait_wall_ms``: the same
  calls' wall time, which adds the OS's latency to run the woken thread again (on this host's 2
  cores shared by every rank thread and both stores; a real node has a core per rank);
* ``checksum_gbps``: the chosen checksum (XXH3-128) and sha256 on one shard, on this thread;
* ``agent_peak_rss_mib`` / ``buddy_peak_rss_mib``: the stores' peak resident memory.

``baseline`` (the 47 MiB size): the same pipeline with sha256 and one kept buddy connection per
agent, as before issue 28.  The stores hold two steps of every shard of the node (and the buddy the
node's); when this host has not the memory for ``--ranks-per-node`` ranks of a size, that size runs
with fewer ranks and says so (``ranks``, ``ranks_reduced``).  Top-level ``node_push_gbps`` is the
47 MiB figure.  One JSON object on stdout (and in ``--json``), with the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 1 << 20

WARMUP_STEPS = 4
"""Steps whose waits are reported apart (``warmup_wait_ms_max``), not in ``train_thread_wait_ms``.

A rank's ring allocates its three shared buffers (two kept, one being filled) in its first three
captures, and the stores their receive buffers in the first pushes: the first touch of that fresh
memory is page faults over every byte.  Measured at 512 MiB x 3 ranks on a quiet host (load 1.1):
captures 0.6, 2.8, 2.9 s, then 75-112 ms; the training thread waited 1.2 s at step 3's sync point
and 4.3 s at steps 3-4's commit point, then 0.0-0.1 ms from step 5 on.  A run pays this once, in its
first steps (and again after a re-formation changes its shard shapes)."""


# -- the stores (child processes) -----------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    """One store: print its address, serve until stdin closes, then print its peak RSS."""
    from elastic.checkpoint.memclient import ClientPool, MemStateClient
    from elastic.checkpoint.memstate import MemStateServer

    server = MemStateServer(max_bytes=args.cap_mib * MIB)
    if args.buddy:
        addr, token = args.buddy.split(",")
        if args.legacy:  # before issue 28: one kept connection, its lock shared by every forwarding thread
            client = MemStateClient(addr, token, 60.0, peer=True, keep_alive=True)
            server.replicate = lambda meta, data: client.snap_put(meta, data, replica=True)
        else:
            server.replicate = ClientPool(addr, token, 60.0).replicate
    print(json.dumps({"addr": server.addr, "token": server.token}), flush=True)
    sys.stdin.read()
    print(json.dumps({"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}),
          flush=True)
    server.close()
    return 0


class _Store:
    def __init__(self, cap_mib: int, buddy: _Store | None = None, legacy: bool = False) -> None:
        cmd = [sys.executable, __file__, "--serve", "--cap-mib", str(cap_mib)]
        if buddy is not None:
            cmd += ["--buddy", f"{buddy.addr},{buddy.token}"] + (["--legacy"] if legacy else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.addr, self.token = hello["addr"], hello["token"]

    def close(self) -> float:
        """Stop it; its peak RSS in MiB."""
        out, _ = self.proc.communicate("", timeout=60)
        return float(json.loads(out.strip().splitlines()[-1])["peak_rss_mib"])


# -- the ranks (threads of this process) ---------------------------------------------------------
class _Rank:
    """One simulated rank: the worker's ring and pusher, paced steps, its waits and push times."""

    def __init__(self, slot: int, ranks: int, source: Any, agent: _Store, algorithm: str, legacy: bool) -> None:
        from elastic.checkpoint.memclient import MemStateClient
        from elastic.checkpoint.snapshot import SnapshotPusher, SnapshotRing
        from elastic.common.events import EventLog

        self.slot, self.ranks, self.state = slot, ranks, {"w": source}
        self.ring = SnapshotRing(shared=not legacy)  # legacy: bytes over loopback TCP to the agent
        client = MemStateClient(agent.addr, agent.token, 60.0, keep_alive=True)
        self.pusher = SnapshotPusher(client, "n0", slot, 0, EventLog(None, "bench"), checksum=algorithm)
        self.waits: list[float] = []
        self.held: list[float] = []
        self.started: dict[int, float] = {}
        self.captured: dict[int, float] = {}

    def take(self, step: int) -> Any:
        from elastic.checkpoint.snapshot import capture

        self.started[step] = time.monotonic()
        snap = capture(self.state, step, 0, self.slot, self.ranks, ring=self.ring)
        self.ring.add(snap)
        self.captured[step] = time.monotonic()
        return snap

    def _held(self, job: int, t_sync: float, t_commit: float) -> float:
        """How long the pipeline held this step's training thread: from each sync point's call to
        the moment the pusher finished what it waits for (the previous step's capture; its push
        stored), 0 where that was done before the call.  The wall time of the calls (``waits``)
        adds the OS's latency to run a woken thread again, which on 2 cores shared by 16 rank
        threads and two stores is the spikes of a few ms seen at steps the pipeline was idle."""
        if job < 1:
            return 0.0
        done = self.pusher.done_at[job - 1]
        return max(0.0, self.captured[job] - t_sync) + max(0.0, done - t_commit)

    def run(self, steps: int, compute_s: float, sync_frac: float, collective: threading.Barrier) -> None:
        for step in range(1, steps + 1):
            collective.wait()  # the step's collectives keep the ranks in step, as in training
            time.sleep(compute_s * sync_frac)
            t_sync = time.monotonic()
            self.pusher.wait_captured()  # the trainer's sync_point
            wait = time.monotonic() - t_sync
            time.sleep(compute_s * (1 - sync_frac))
            t_commit = time.monotonic()
            self.pusher.wait()  # the trainer's commit_point
            self.waits.append(wait + time.monotonic() - t_commit)
            self.held.append(self._held(step - 1, t_sync, t_commit))
            self.pusher.submit(lambda step=step: self.take(step))
        self.pusher.wait()
        self.pusher.client.close()


def _windows(ranks: list[_Rank], steps: int) -> list[float]:
    """Per step: the first rank's capture to the last rank's push stored (at the agent and the buddy)."""
    ends = [{s: r.started[s] + c + p for s, c, p in zip(range(1, steps + 1), r.pusher.capture_s, r.pusher.push_s)}
            for r in ranks]
    return [max(e[s] for e in ends) - min(r.started[s] for r in ranks) for s in range(1, steps + 1)]


def run_size(shard_mib: int, ranks: int, steps: int, compute_s: float, sync_frac: float,
             algorithm: str = "xxh3_128", legacy: bool = False) -> dict[str, Any]:
    import torch

    from elastic.checkpoint.memstate import snapshot_need

    source = torch.randn(shard_mib * MIB // 4)
    cap_mib = snapshot_need(shard_mib * MIB, ranks) // MIB + 8
    buddy = _Store(cap_mib)
    agent = _Store(cap_mib, buddy, legacy)
    sim = [_Rank(slot, ranks, source, agent, algorithm, legacy) for slot in range(ranks)]
    collective = threading.Barrier(ranks)
    threads = [threading.Thread(target=r.run, args=(steps, compute_s, sync_frac, collective)) for r in sim]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    agent_rss, buddy_rss = agent.close(), buddy.close()
    failures = sum(r.pusher.failures for r in sim)
    windows = _windows(sim, steps)[1:]  # the first step's buffers and connections are new: warm-up
    waits = [w * 1000 for r in sim for w in r.held[WARMUP_STEPS:]]
    walls = [w * 1000 for r in sim for w in r.waits[WARMUP_STEPS:]]
    warmup = [w * 1000 for r in sim for w in r.waits[:WARMUP_STEPS]]
    return {"shard_mib": shard_mib, "ranks": ranks, "steps": steps, "compute_ms": round(compute_s * 1000),
            "node_push_gbps": round(ranks * shard_mib * MIB / statistics.median(windows) / 1e9, 3),
            "push_window_ms_median": round(statistics.median(windows) * 1000, 1),
            "train_thread_wait_ms": {"median": round(statistics.median(waits), 3),
                                     "p90": round(sorted(waits)[int(0.9 * (len(waits) - 1))], 3),
                                     "max": round(max(waits), 3)},
            "train_thread_wait_wall_ms": {"median": round(statistics.median(walls), 3),
                                          "p90": round(sorted(walls)[int(0.9 * (len(walls) - 1))], 3),
                                          "max": round(max(walls), 3)},
            "warmup_steps": WARMUP_STEPS, "warmup_wait_ms_max": round(max(warmup), 1),
            "wait_ms_per_step_max": [round(max(r.held[i] for r in sim) * 1000, 1) for i in range(steps)],
            "wait_wall_ms_per_step_max": [round(max(r.waits[i] for r in sim) * 1000, 1) for i in range(steps)],
            "push_window_ms_per_step": [round(w * 1000, 1) for w in _windows(sim, steps)],
            "capture_ms_median": round(statistics.median(c for r in sim for c in r.pusher.capture_s[1:]) * 1000, 1),
            "push_ms_median": round(statistics.median(p for r in sim for p in r.pusher.push_s[1:]) * 1000, 1),
            "push_failures": failures, "agent_cap_mib": cap_mib,
            "agent_peak_rss_mib": agent_rss, "buddy_peak_rss_mib": buddy_rss}


def checksum_gbps(shard_mib: int) -> dict[str, float]:
    import xxhash

    data = os.urandom(MIB) * shard_mib
    rates = {}
    for name, fn in (("xxh3_128", lambda: xxhash.xxh3_128(data).hexdigest()),
                     ("sha256", lambda: hashlib.sha256(data).hexdigest())):
        best = min(_timed(fn) for _ in range(3))
        rates[name] = round(len(data) / best / 1e9, 2)
    rates["ratio"] = round(rates["xxh3_128"] / rates["sha256"], 1)
    return rates


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ranks_for(shard_mib: int, wanted: int) -> int:
    """How many ranks this host's free memory holds: each costs six shards (two ring buffers, two
    steps at the agent, two at the buddy); half of what is available is used."""
    avail = _mem_available()
    return max(1, min(wanted, int(avail * 0.5 // (6 * shard_mib * MIB))))


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snapshot_pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--shard-mib", default="16,47,512", help="shard sizes per rank, MiB, comma-separated")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10,
                        help=f"steps per size (the first {WARMUP_STEPS} are warm-up: WARMUP_STEPS)")
    parser.add_argument("--compute-ms", default="300,500,3000",
                        help="a step's compute time per size (one value: every size), ms")
    parser.add_argument("--sync-frac", type=float, default=0.5,
                        help="where in the step the sync point is (the deferred copy waited for)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the sha256, one-connection baseline")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cap-mib", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--buddy", default="", help=argparse.SUPPRESS)
    parser.add_argument("--legacy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return _serve(args)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    sizes = [int(s) for s in args.shard_mib.split(",")]
    computes = [float(c) / 1000 for c in args.compute_ms.split(",")]
    computes = computes * len(sizes) if len(computes) == 1 else computes
    result: dict[str, Any] = {"load_avg_before": list(os.getloadavg()), "ranks_per_node": args.ranks_per_node,
                              "sizes": []}
    for size, compute_s in zip(sizes, computes):
        ranks = _ranks_for(size, args.ranks_per_node)
        row = run_size(size, ranks, args.steps, compute_s, args.sync_frac)
        row["ranks_reduced"] = ranks < args.ranks_per_node
        row["checksum_gbps"] = checksum_gbps(min(size, 512))
        result["sizes"].append(row)
        if size == 47 and not args.no_baseline:
            result["baseline_47mib"] = run_size(size, ranks, args.steps, compute_s, args.sync_frac,
                                                algorithm="sha256", legacy=True)
    headline = next((r for r in result["sizes"] if r["shard_mib"] == 47), result["sizes"][0])
    result["node_push_gbps"] = headline["node_push_gbps"]
    result["load_avg_after"] = list(os.getloadavg())
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
