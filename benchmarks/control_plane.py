"""The control plane at scale: a recovery round and an idle run, at up to 1,024 nodes x 8 ranks.

    python benchmarks/control_plane.py --nodes 64,256,1024 --ranks-per-node 8 --json out.json
        [--procs 32] [--rank-threads rank|node] [--faults worker_loss,node_loss] [--round-timeout 300]
        [--fault-path push|error]
        [--idle-s 5] [--rendezvous-size 2048] [--rendezvous-repeats 3] [--baseline before.json]

Simulated nodes (``benchmarks/cp_sim.py``: the real Supervisor, InProcessWorkers and InProcess code,
no training, ``--procs`` processes of threads) against a real 3-member etcd on loopback (the
cluster behind ``launch.etcd_members: 3``).  Per size, on one run:

``worker_loss``  a worker of a middle node dies; its node's spare takes the slot (generation 0 -> 1)
                 and its agent closes the round in place; the others hear of it by the pushed fault
                 and take the plan from the round note (``--fault-path push``: NCCL's way), or their
                 ranks' collectives raise at once and each node joins (``error``: gloo's)
``node_loss``    a whole node (agent and workers) is lost; the rest re-form without it (1 -> 2): its
                 ring predecessor pushes the loss with the plan without it, the others take it from
                 the round note (``push``), or every node joins and the coordinator probes (``error``)
``idle``         every agent's steady-state check of the run-wide signals (epoch, exclusion, stop)

Per round: ``round_s`` (the fault -> every surviving rank holds the next generation's plan; its
``phases`` from the agents' events: the last node joined, the coordinator closed, every agent held it),
``store_s`` (-> every rank knows where the new generation's c10d store listens, once rank 0 said),
``restore_lookup_s`` (-> every rank has also looked up, as its restore does, which nodes were lost),
etcd requests, raft writes (client-side: puts, deletes, lease grants/revokes and every transaction
holding a write) and response bytes, in total and per node (mean and max; every store of a node
shares one meter), from the fault until the agents' round work (probes included) ended; and etcd's
own count of raft proposals committed (leader's ``etcd_server_proposals_committed_total``).
Idle: requests per second of all agents over ``--idle-s`` after a warm-up (1 s per 128 agents), measured (a 2-core
host may not keep up with a polling rate), beside what polling every ``epoch_poll_s`` asks for and
the watch's reconnect bound (one per agent per ``watch_idle_s``; an ``--idle-s`` past it measures them).

Top level: ``round_s``, ``requests_per_node_per_round`` and ``idle_requests_per_s`` per size (the
worker loss for the first two), ``bytes_ratio_256_to_1024`` (linear growth is 4x), the rendezvous
benchmark (``benchmarks/rendezvous.py``, etcd3 barrier handler, 3 members) at ``--rendezvous-size``
participants (the median of ``--rendezvous-repeats`` formations, each run listed), the load average, and ``baseline``: this host's sequential etcd latencies, plus
``--baseline``'s report (an earlier run, e.g. before a change) when given.  A size whose round did
not finish within ``--round-timeout`` is reported as such, and larger sizes are not tried.
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
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIM = Path(__file__).with_name("cp_sim.py")
ETCD_PIDS: list[int] = []  # the members' processes, for the rounds' CPU accounting


class Sim:
    """The simulated nodes of one run, spread over ``procs`` processes."""

    def __init__(self, nodes: int, rpn: int, procs: int, endpoint: str, timeout: float, rank_threads: str,
                 pushed: bool = True) -> None:
        self.nodes, self.rpn, self.timeout = nodes, rpn, timeout
        prefix = f"/bench/runs/cp-{nodes}-{uuid.uuid4().hex[:8]}"
        self._root = tempfile.TemporaryDirectory(prefix="cp-sim-")  # the children's run directories
        counts = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
        firsts = [sum(counts[:i]) for i in range(procs)]
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.children = [
            subprocess.Popen([sys.executable, str(SIM), "--child", "--endpoint", endpoint, "--prefix", prefix,
                              "--total", str(nodes), "--first", str(first), "--count", str(count),
                              "--rpn", str(rpn), "--join-timeout", str(timeout), "--rank-threads", rank_threads,
                              "--pushed", str(int(pushed)), "--run-root", self._root.name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                             stderr=None if os.environ.get("BENCH_CHILD_STDERR") else subprocess.DEVNULL)
            for first, count in zip(firsts, counts) if count
        ]
        t0 = time.monotonic()
        ready = [self._read(child, "READY ", time.monotonic() + 3600) for child in self.children]
        self.setup = {"setup_s": round(time.monotonic() - t0, 2),
                      "setup_requests": sum(r["meter"]["requests"] for r in ready)}

    def command(self, line: str, deadline: float) -> list[dict[str, Any]]:
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(line + "\n")
            child.stdin.flush()
        return [self._read(child, "RESULTS ", deadline) for child in self.children]

    @staticmethod
    def _read(child: subprocess.Popen, tag: str, deadline: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([child.stdout], [], [], left)
            if not ready:
                continue
            line = child.stdout.readline()  # type: ignore[union-attr]
            if line == "":
                raise RuntimeError(f"simulation process exited (rc {child.poll()})")
            if line.startswith(tag):
                return json.loads(line[len(tag):])

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()
        self._root.cleanup()


def _server_metrics(endpoints: str) -> dict[str, float]:
    """etcd's own counters, summed or maxed over the members (proposals: the leader's count)."""
    proposals, sent = 0.0, 0.0
    for endpoint in endpoints.split(","):
        try:
            with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("etcd_server_proposals_committed_total "):
                proposals = max(proposals, float(line.split()[1]))
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total "):
                sent += float(line.split()[1])
    return {"proposals_committed": proposals, "grpc_sent_bytes": sent}


def _cpu_s(pids: list[int], which: tuple[int, ...] = (11, 12)) -> float:
    """CPU seconds (user + system, every thread; ``which``: (11,) user only, (12,) system only) the
    processes ``pids`` used so far (/proc)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(fields[i]) for i in which)  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _cpu(sim: Sim) -> dict[str, float]:
    children = [c.pid for c in sim.children]
    return {"etcd": _cpu_s(ETCD_PIDS), "simulation": _cpu_s(children),
            "simulation_system": _cpu_s(children, (12,))}


def _round(sim: Sim, kind: str, victim: int, local: int | None, endpoints: str) -> dict[str, Any]:
    t0 = time.time() + 1.0
    server0 = _server_metrics(endpoints)
    cpu0 = _cpu(sim)
    line = f"ROUND {kind} {t0} {victim}" + (f" {local}" if local is not None else "")
    load = os.getloadavg()[0]
    try:
        parts = sim.command(line, time.monotonic() + sim.timeout + 60)
    except TimeoutError:
        return {"ok": False, "error": f"not finished within {sim.timeout:g}s", "loadavg_1m": round(load, 2)}
    server1 = _server_metrics(endpoints)
    results = [r for p in parts for r in p["results"]]
    per_node = [n for p in parts for n in p["per_node"]]
    cpu1 = _cpu(sim)
    out = _round_report(kind, t0, results, per_node, server0, server1, sim, load)
    out["phases"] = _phases(t0, [m for p in parts for m in p.get("milestones", [])])
    # Where the host's 2 cores went during the round (set-up to report, agents' tail included):
    # etcd's three members, and the simulated agents and ranks.
    out["cpu_s"] = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
    for name in ("signal_streams", "signal_streams_in_round"):
        streams = [p[name] for p in parts if name in p]
        if streams:  # the agents' signal streams (since set-up; in the round): reconnects delay what they carry
            out[name] = {k: sum(s[k] for s in streams) for k in streams[0]}
    return out


def _phases(t0: float, milestones: list[dict[str, float]]) -> dict[str, float]:
    """Where a round's time went, from the agents' events: the last node's join, the coordinator's
    close, the last agent holding the plan (each from the fault)."""
    out = {}
    for name, key in (("last_heard_s", "heard"), ("last_round_start_s", "round_started"), ("last_join_s", "joined"),
                      ("closed_s", "closed"), ("agents_hold_plan_s", "plan_agent")):
        times = [m[key] for m in milestones if key in m]
        if times:
            out[name] = round(max(times) - t0, 3)
    heard = sorted(m["heard"] - t0 for m in milestones if "heard" in m)
    if heard:  # the pushed fault on the other agents' signal watches
        out["heard_s_p50"], out["heard_s_p90"] = round(heard[len(heard) // 2], 3), round(heard[len(heard) * 9 // 10], 3)
    joins = sorted(m["joined"] - m["round_started"] for m in milestones if "joined" in m and "round_started" in m)
    if joins:  # one join transaction, from the agent's round thread
        out["join_txn_s_p50"], out["join_txn_s_max"] = round(joins[len(joins) // 2], 3), round(joins[-1], 3)
    return out


def _round_report(kind: str, t0: float, results: list[dict], per_node: list[dict], server0: dict, server1: dict,
                  sim: Sim, load: float) -> dict[str, Any]:
    errors = [r["error"] for r in results if "error" in r]
    expected = sim.nodes * sim.rpn - (sim.rpn if kind == "node_loss" else 0)
    ok = not errors and len(results) == expected
    out: dict[str, Any] = {"ok": ok, "ranks": len(results), "expected_ranks": expected}
    if errors:
        out["errors"] = len(errors)
        out["error"] = errors[0]
    good = [r for r in results if "error" not in r]
    if good:
        out["round_s"] = round(max(r["plan"] for r in good) - t0, 3)
        out["round_s_p50"] = round(statistics.median(r["plan"] for r in good) - t0, 3)
        if all("store" in r for r in good):  # the c10d store's address reached every rank (its agent)
            out["store_s"] = round(max(r["store"] for r in good) - t0, 3)
        if all("restore" in r for r in good):  # the restore's lost-node lookups (they read etcd before)
            out["restore_lookup_s"] = round(max(r["restore"] for r in good) - t0, 3)
    totals = {k: sum(n[k] for n in per_node) for k in ("requests", "writes", "watches", "bytes_read")}
    out.update(totals)
    out["per_node_mean"] = {k: round(v / sim.nodes, 2) for k, v in totals.items()}
    out["per_node_max"] = {k: max(n[k] for n in per_node) for k in totals}
    out["server_proposals"] = int(server1["proposals_committed"] - server0["proposals_committed"])
    out["server_grpc_sent_bytes"] = int(server1["grpc_sent_bytes"] - server0["grpc_sent_bytes"])
    out["loadavg_1m"] = round(load, 2)
    return out


def _idle(sim: Sim, seconds: float) -> dict[str, Any]:
    from elastic.agent.config import AgentConfig

    t0 = time.time() + 0.5
    warm = max(1.0, sim.nodes / 128)  # every agent has read its signals and opened its stream by then
    parts = sim.command(f"IDLE {t0} {warm} {seconds}", time.monotonic() + warm + seconds + 120)
    requests = sum(p["meter"]["requests"] for p in parts)
    agents = sum(p["agents"] for p in parts)
    config = AgentConfig()
    return {"requests_per_s": round(requests / seconds, 1), "agents": agents, "seconds": seconds,
            # What a read of the signals every epoch_poll_s asks for (the agents' old polling; on 2
            # cores the measured rate falls short of it), and the bound of a watch that is silent:
            # one reconnect per agent per watch_idle_s (an --idle-s longer than it includes them).
            "polling_requests_per_s": round(agents / config.epoch_poll_s, 1),
            "watch_reconnects_per_s": round(agents / getattr(config, "watch_idle_s", float("inf")), 1),
            "bytes_per_s": round(sum(p["meter"]["bytes_read"] for p in parts) / seconds, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def _size(nodes: int, args: argparse.Namespace, endpoints: str, faults: list[str]) -> dict[str, Any]:
    print(f"# {nodes} nodes x {args.ranks_per_node}: setting up", file=sys.stderr, flush=True)
    try:
        sim = Sim(nodes, args.ranks_per_node, min(args.procs, nodes), endpoints, args.round_timeout,
                  args.rank_threads, args.fault_path == "push")
    except (TimeoutError, RuntimeError) as exc:
        return {"ok": False, "error": f"set-up: {exc}"}
    try:
        out: dict[str, Any] = dict(sim.setup)
        for fault in faults:
            victim, local = (nodes // 2, args.ranks_per_node // 2) if fault == "worker_loss" else (nodes // 3, None)
            out[fault] = entry = _round(sim, fault, victim, local, endpoints)
            print(f"# {nodes}: {fault} {entry.get('round_s', entry.get('error'))}", file=sys.stderr, flush=True)
            if not entry["ok"]:
                break  # the run is in no state for another round
        if all(out.get(f, {}).get("ok") for f in faults):
            out["idle"] = _idle(sim, args.idle_s)
            print(f"# {nodes}: idle {out['idle']['requests_per_s']}/s", file=sys.stderr, flush=True)
        else:  # a round that timed out may still answer: its late results would be read as the idle run's
            out["idle"] = {"skipped": "a round failed"}
        out["ok"] = all(out.get(f, {}).get("ok") for f in faults)
        return out
    finally:
        sim.close()


def _latency_baseline(endpoints: str, n: int = 200) -> dict[str, float]:
    """Sequential get / put / compare-and-swap on this cluster: the host's unit of etcd cost."""
    from elastic.control.store import EtcdStore

    store = EtcdStore(endpoints)
    key = f"/bench/latency/{uuid.uuid4().hex[:8]}"
    timings: dict[str, list[float]] = {"put": [], "get": [], "cas": []}
    for _ in range(n):
        t = time.perf_counter()
        rev = store.put(key, "x")
        timings["put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        store.get(key)
        timings["get"].append(time.perf_counter() - t)
        t = time.perf_counter()
        store.compare_and_swap(key, "y", rev)
        timings["cas"].append(time.perf_counter() - t)
    return {f"{op}_ms_p50": round(statistics.median(v) * 1000, 3) for op, v in timings.items()}


def _rendezvous(size: int, timeout: float, repeats: int) -> dict[str, Any]:
    """``benchmarks/rendezvous.py`` at ``size`` participants: the etcd3 barrier handler, 3 members.

    ``formation_s`` is the median of ``repeats`` (each with fresh participant processes): single
    runs of one commit at 2,048 ranged 7.8-10.6 s here."""
    out_path = Path(tempfile.mkdtemp(prefix="cp-rdzv-")) / "rdzv.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "rendezvous.py"), "--sizes", str(size), "--backends", "etcd3",
           "--repeats", str(repeats), "--reform-size", "0", "--etcd-members", "3", "--timeout", str(timeout),
           "--json", str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=(timeout + 100) * repeats + 200)
    try:
        report = json.loads(out_path.read_text())
    except (OSError, ValueError):
        return {"ok": False, "error": f"rc {proc.returncode}: {proc.stderr[-500:]}"}
    finally:
        shutil.rmtree(out_path.parent, ignore_errors=True)
    entry = report["results"].get(f"etcd3/{size}", {})
    runs = entry.get("runs", [])
    out = {"participants": size, "formation_s": entry.get("formation_s_median"),
           "requests_per_participant": next((r.get("requests_per_participant") for r in runs if r.get("ok")), None),
           "formation_s_runs": [r.get("formation_s") for r in runs],
           "first_return_s_runs": [r.get("first_return_s") for r in runs],
           "ok": bool(entry.get("ok_repeats")), "command": " ".join(["benchmarks/rendezvous.py", *cmd[2:-2]]),
           "loadavg_1m_start": report.get("loadavg_1m_start")}
    if runs and not runs[0].get("ok"):
        out["error"] = runs[0].get("error") or {k: v for k, v in runs[0].items() if k != "ok"}
    return out


def _summary(report: dict[str, Any]) -> None:
    sizes = report["sizes"]
    wl = {s: report["details"][s].get("worker_loss", {}) for s in sizes}
    report["round_s"] = {s: wl[s].get("round_s") if wl[s].get("ok") else None for s in sizes}
    report["node_loss_round_s"] = {s: report["details"][s].get("node_loss", {}).get("round_s") for s in sizes}
    report["requests_per_node_per_round"] = {s: wl[s].get("per_node_mean", {}).get("requests") for s in sizes}
    report["idle_requests_per_s"] = {s: report["details"][s].get("idle", {}).get("requests_per_s") for s in sizes}
    b256, b1024 = wl.get("256", {}).get("bytes_read"), wl.get("1024", {}).get("bytes_read")
    report["bytes_ratio_256_to_1024"] = round(b1024 / b256, 2) if b256 and b1024 else None


def _baseline_summary(prev: dict[str, Any]) -> dict[str, Any]:
    """An earlier report's headline figures and per-round totals (not its whole text)."""
    keys = ("command", "round_s", "node_loss_round_s", "requests_per_node_per_round", "idle_requests_per_s",
            "bytes_ratio_256_to_1024", "loadavg_1m_start")
    rounds = {size: {fault: {k: entry.get(fault, {}).get(k) for k in
                             ("ok", "errors", "round_s", "restore_lookup_s", "requests", "writes", "bytes_read",
                              "server_proposals")}
                     for fault in ("worker_loss", "node_loss") if fault in entry}
              for size, entry in prev.get("details", {}).items()}
    return {**{k: prev.get(k) for k in keys}, "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/control_plane.py")
    parser.add_argument("--nodes", default="64,256,1024")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--procs", type=int, default=32,
                        help="simulation processes (no torch in them; more processes, fewer threads each: "
                             "1,024 concurrent joins took 6.5 s from 8 and 2.7 s from 32 on 2 cores)")
    parser.add_argument("--round-timeout", type=float, default=300.0, help="seconds allowed per round")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--faults", default="worker_loss,node_loss",
                        help="rounds per size, in order (each re-forms the previous round's generation)")
    parser.add_argument("--rendezvous-size", type=int, default=2048, help="0 skips the rendezvous benchmark")
    parser.add_argument("--rendezvous-repeats", type=int, default=3, help="its formations (the median is reported)")
    parser.add_argument("--rank-threads", choices=("rank", "node"), default="rank",
                        help="simulated ranks: a thread each, or a thread per node (see benchmarks/cp_sim.py)")
    parser.add_argument("--fault-path", choices=("push", "error"), default="push",
                        help="how a worker's or a node's loss reaches the other nodes: a pushed fault (the "
                             "dead worker's agent, the lost node's ring predecessor), which they hear over their "
                             "signal watch (NCCL: nothing raises), or every surviving rank's collective error at "
                             "once (gloo); see benchmarks/cp_sim.py")
    parser.add_argument("--baseline", help="an earlier report of this benchmark, embedded for comparison")
    parser.add_argument("--json", help="also write the JSON report here")
    args = parser.parse_args()

    from elastic.control.etcd_cluster import EtcdCluster

    work = Path(tempfile.mkdtemp(prefix="bench-cp-"))
    etcd = EtcdCluster(work / "etcd", members=3)
    endpoints = etcd.start(parent_death_signal=signal.SIGKILL)
    ETCD_PIDS.extend(pid for pid in etcd.pids if pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report: dict[str, Any] = {"command": " ".join(["benchmarks/control_plane.py", *sys.argv[1:]]),
                              "ranks_per_node": args.ranks_per_node, "procs": args.procs, "etcd_members": 3,
                              "rank_threads": args.rank_threads, "fault_path": args.fault_path,
                              "cpus": os.cpu_count(), "loadavg_1m_start": round(os.getloadavg()[0], 2),
                              "sizes": [], "details": {}}
    try:
        report["baseline"] = {"etcd_latency": _latency_baseline(endpoints)}
        faults = [f for f in args.faults.split(",") if f]
        for nodes in [int(s) for s in args.nodes.split(",") if s]:
            report["sizes"].append(str(nodes))
            report["details"][str(nodes)] = entry = _size(nodes, args, endpoints, faults)
            if not entry.get("ok") and faults:
                faults = []  # a round that failed is not worth a larger one: idle runs only from here
                entry["note"] = "a round failed: larger sizes measure only the idle run"
    finally:
        etcd.close()
        shutil.rmtree(work, ignore_errors=True)
    _summary(report)
    if args.rendezvous_size:
        report["rendezvous"] = _rendezvous(args.rendezvous_size, args.round_timeout, args.rendezvous_repeats)
    if args.baseline:
        report["baseline"]["report"] = _baseline_summary(json.loads(Path(args.baseline).read_text()))
    report["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if all(report["details"][size].get("ok") for size in report["sizes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
