"""Simulated nodes for ``benchmarks/control_plane.py``: the real agent and worker code, no training.

One process hosts a slice of a run's nodes.  A node is its agent -- a real
:class:`~elastic.agent.supervise.Supervisor` with real :class:`~elastic.agent.inprocess.InProcessWorkers`,
fed the reports its workers would send -- and its ranks, each the real worker-side
:class:`~elastic.worker.generation.GenerationClient` (what ``InProcess.reform`` calls for the round;
no torch, so a host can run many of these processes: 1,024 concurrent joins took 6.5 s from 8
processes of threads and 2.7 s from 32, measured).  What is simulated:

* the processes: no torch process group, no training, no restore;
* how a surviving rank learns its peer is gone.  A worker loss takes NCCL's path: nothing raises,
  the dead worker's agent pushes the fault (``InProcessWorkers.push_fault``, as its ``_death``
  does) and every other agent hears it over its one signal watch, as do its workers, which then
  report the fault.  A node loss takes gloo's: every surviving rank's collective raises at the
  fault's time, so every agent starts its round at once (no push is awaited);
* the warm spare: a new ``GenerationClient`` that joins the next generation for the dead slot;
* the agent's snapshot store: a listening socket per node that the probes connect to, closed when
  the node is lost;
* the local channel between an agent and its workers: a rank's wait on its agent's RoundBoard is a
  call into the agent's objects, not a loopback TCP message (it costs etcd nothing).
  ``--rank-threads node`` runs a node's ranks one after the other in one thread, to spare a 2-core
  host thousands of threads; ranks do no etcd I/O but the new rank 0's one put, so etcd sees the
  same requests.

The new rank 0 publishes its (fake) c10d store address, as it does.  Every store of a node shares
one :class:`~elastic.control.store.StoreMeter`: figures are per node.

Driven over stdin by the parent (``python benchmarks/cp_sim.py --child ...``)::

    ROUND worker_loss <t0> <node index> <local rank>   ->  RESULTS {...}
    ROUND node_loss <t0> <node index>                  ->  RESULTS {...}
    IDLE <t0> <warm-up s> <seconds>                    ->  RESULTS {...}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.agent.attempt import NodeSpec  # noqa: E402
from elastic.agent.config import AgentConfig, InProcessConfig  # noqa: E402
from elastic.agent.inprocess import InProcessWorkers  # noqa: E402
from elastic.agent.records import NodeRecords  # noqa: E402
from elastic.agent.scopes import RunScope  # noqa: E402
from elastic.agent.supervise import Supervisor  # noqa: E402
from elastic.checkpoint.memstate import MemStateRejected, RoundBoard, SnapMeta  # noqa: E402
from elastic.common.env import WorkerEnv  # noqa: E402
from elastic.common.events import EventLog  # noqa: E402
from elastic.control.generations import Plan  # noqa: E402
from elastic.control.keys import RunKeys  # noqa: E402
from elastic.control.runstate import RunState  # noqa: E402
from elastic.control.store import EtcdStore, StoreMeter  # noqa: E402
from elastic.worker.generation import GenerationClient  # noqa: E402

STEP = 10
"""The step every rank stands at when a fault hits (snapshots of STEP-1 and STEP are held)."""


SWITCH_INTERVAL_WHY = """A real agent is a process of its own, with a few threads; here one process
hosts 32 agents and their ranks (~140 threads at 1,024 nodes).  When a fault wakes them all at once,
every thread that waits for the GIL wakes each switch interval (Python's default: 5 ms) to ask for
it: 1,000+ runnable threads on the 2 cores, the simulation's own CPU growing with them, and at 1,024
nodes the round did not finish in 60-120 s (load average 600-1,000).  At 0.05 s it finished in
2.96 s, at 0.2 s in 2.10 s, at 1.0 s in 1.53-2.10 s (one run each, 32 processes; 64 processes at
0.05 s: 4.11 s).  Threads still hand the GIL over at once when they block on I/O or a lock, which is
what this simulation's threads do; a longer interval only stops the convoy of waiters, which a
process per agent would not have."""


def node_name(index: int) -> str:
    return f"n{index:04d}"


class LocalChannel:
    """Stand-in for a worker's memory-store client: its agent's RoundBoard and snapshot list, called
    directly (the loopback hop left out: it costs etcd nothing)."""

    def __init__(self, board: RoundBoard, metas: list[SnapMeta]) -> None:
        self.board = board
        self.metas = metas

    def round_wait(self, epoch: int, gen: int, name: str, timeout_s: float) -> Any:
        reply = self.board.wait(epoch, gen, name, timeout_s)
        if not reply.get("ok"):
            raise MemStateRejected(str(reply.get("error")))
        return reply.get("value")

    def snap_list(self) -> list[SnapMeta]:
        return list(self.metas)


class RoundEvents(EventLog):
    """An agent's events, kept only as the times of its round's milestones (joined, plan, closed)."""

    KINDS = {"round.joined": "joined", "agent.round_plan": "plan_agent", "round.closed": "closed",
             "round.noted": "noted", "agent.fault_heard": "heard"}

    def __init__(self, source: str) -> None:
        super().__init__(None, source)
        self.times: dict[str, float] = {}

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = super().emit(kind, **fields)
        if kind in self.KINDS:
            self.times[self.KINDS[kind]] = event["ts"]
            if kind == "round.joined":  # since_s: the join transaction's own time
                self.times["round_started"] = event["ts"] - float(fields.get("since_s", 0.0))
            elif kind == "round.noted":  # wait_s: how long the round waited for the note
                self.times["round_started"] = event["ts"] - float(fields.get("wait_s", 0.0))
        return event


class Listeners:
    """One listening socket per hosted node (where its agent's snapshot store would be): a probe's
    connect succeeds while the node lives and is refused once :meth:`close` took the socket away.
    One thread accepts and drops every connection."""

    def __init__(self, count: int) -> None:
        self._selector = selectors.DefaultSelector()
        self.socks: list[socket.socket | None] = []
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(4096)
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
            self.socks.append(sock)
        self.addrs = [f"127.0.0.1:{s.getsockname()[1]}" for s in self.socks if s is not None]
        threading.Thread(target=self._accept, name="listeners", daemon=True).start()

    def _accept(self) -> None:
        while True:
            for key, _ in self._selector.select(timeout=0.5):
                try:
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    conn.close()
                except OSError:
                    continue

    def close(self, index: int) -> None:
        sock = self.socks[index]
        if sock is not None:
            self._selector.unregister(sock)
            sock.close()
            self.socks[index] = None


class SimNode:
    """One node: its agent (supervisor and in-process workers) and its ranks."""

    def __init__(self, index: int, args: argparse.Namespace, addr: str, run_dir: Path) -> None:
        self.index = index
        self.node_id = node_name(index)
        self.rpn = args.rpn
        self.args = args
        self.meter = StoreMeter()
        self.keys = RunKeys(args.prefix)
        self.events = RoundEvents(f"agent-{self.node_id}")
        self.state = RunState(self._store(), self.keys)
        self.addr = addr
        spec = NodeSpec("bench", self.node_id, args.endpoint, run_dir, str(args.total), args.rpn, ["-c", "pass"])
        # A simulated loss shrinks the run: no round holds for the lost node to come back (rejoin_wait_s).
        config = InProcessConfig(join_timeout_s=args.join_timeout, spare=False, rejoin_wait_s=0)
        self.workers = InProcessWorkers(spec, config, self.state, self.events, None, 0)
        self.sup = Supervisor(self.node_id, AgentConfig(), self.state, self.events,
                              SimpleNamespace(run_dir=run_dir), None, RunScope(spec, self.state, self.events),  # type: ignore[arg-type]
                              NodeRecords(self.state, self.node_id, self.events, lambda: None), None,  # type: ignore[arg-type]
                              threading.Event(), lambda: "running")
        self.sup.workers = self.workers
        self.ranks: dict[int, GenerationClient] = {local: self._rank(local) for local in range(args.rpn)}
        self.rank_of: dict[int, int] = {local: index * args.rpn + local for local in range(args.rpn)}
        self.alive = True
        self._pid = 1_000_000 + index * 1000

    def _store(self) -> EtcdStore:
        store = EtcdStore(self.args.endpoint, request_timeout=5.0, retry_deadline=30.0)
        store.meter = self.meter
        return store

    def _rank(self, local: int, join_gen: int | None = None) -> GenerationClient:
        env = WorkerEnv(node_id=self.node_id, run_id="bench", etcd_endpoint=self.args.endpoint,
                        run_prefix=self.args.prefix, epoch="0", inprocess=f"{self.args.join_timeout:g}",
                        snapshots="1", join_gen=str(join_gen) if join_gen is not None else "")
        client = GenerationClient(env, local, LocalChannel(self.workers.board, self._metas()))
        client.gens.store.meter = self.meter
        return client

    # -- set-up: the run as torchrun formed it ---------------------------------------------------
    def setup(self) -> None:
        self.state.put_node(self.node_id, {"node": self.node_id, "memstate": {"addr": self.addr, "token": "t"}})
        self.state.set_member(self.node_id, "joined")
        for local in self.ranks:
            self.workers.observe({"type": "step", "local_rank": local, "pid": self._next_pid(),
                                  "rank": self.rank_of[local], "step": STEP, "gen": 0,
                                  "world": self.args.total * self.rpn})
        self.workers.detached = True  # torchrun retired: the agent supervises its workers
        self.workers.register()
        self.sup._poll_run(None, 0)  # type: ignore[arg-type]  # the attempt's signal watch, open from the start

    def _next_pid(self) -> int:
        self._pid += 1
        return self._pid

    # -- a fault ---------------------------------------------------------------------------------
    def fault(self, t0: float, dead_local: int | None, results: list[dict],
              kind: str = "worker_loss", victim: int = -1) -> list[threading.Thread]:
        """The threads of this node's part in a re-formation: a spare for ``dead_local`` (a worker
        of this node died), every surviving rank, and the agent fed its workers' fault reports."""
        gen = self.workers.gen
        self.events.times.clear()
        survivors = [local for local in self.ranks if local != dead_local]
        # Pushed (NCCL's way): the dead worker's agent, or the lost node's ring predecessor (its hold
        # on its successor broke: InProcessWorkers._peer_gone), pushes the fault; the others report
        # once they heard it.
        pusher = dead_local is not None if kind == "worker_loss" else self.index == (victim - 1) % self.args.total
        push = (pusher, not pusher) if self.args.pushed else (False, False)
        lost = node_name(victim) if kind == "node_loss" else None
        threads = [threading.Thread(target=self._agent, args=(t0, gen, survivors, *push, lost), daemon=True)]
        if dead_local is not None:
            self.ranks[dead_local] = self._rank(dead_local, join_gen=gen + 1)
            self.workers.pids[dead_local] = self._next_pid()  # the spare holds the slot (InProcessWorkers._replace)
            self.workers.replaced_in_place(gen + 1)  # as InProcessWorkers._replace: the node closes it in place
        if self.args.rank_threads == "node":  # the node's ranks in one thread (see _reform_node)
            ranks = [self.ranks[local] for local in sorted(self.ranks)]
            threads.append(threading.Thread(target=self._reform_node, args=(t0, ranks, results), daemon=True))
        else:
            threads += [threading.Thread(target=self._reform, args=(t0, self.ranks[local], results), daemon=True)
                        for local in self.ranks]
        for thread in threads:
            thread.start()
        return threads

    def _agent(self, t0: float, gen: int, survivors: list[int], push: bool, pushed: bool, lost: str | None) -> None:
        """What the agent's supervisor loop does with its workers' fault reports (``Supervisor._drain``).
        ``push``: this node's worker died, and its agent pushes the fault first (``_death``; the
        slot is the spare's already), or this node's ring successor ``lost`` is gone and its agent
        pushes that (``_peer_gone``, after its probe's verdict); ``pushed``: the workers report once
        the pushed fault reached them (their fault monitor's wait on the agent's board, which the
        agent's signal watch posts to)."""
        _sleep_until(t0)
        if push and lost is not None:
            self.workers._gone[lost] = "its store refused connections (simulated)"
            self.workers.push_fault(lost, "node_lost", f"node {lost}: hold broke (simulated)", gen=gen)
        elif push:
            self.workers.push_fault(self.node_id, "worker_died", "a worker died (simulated)", gen=gen, in_place=True)
        if pushed:
            self.workers.board.wait_fault(self.workers.epoch, gen, self.args.join_timeout)
        for local in survivors:
            report = {"type": "fault", "gen": gen, "step": STEP, "local_rank": local,
                      "pid": self.workers.pids[local], "rank": self.rank_of[local], "error": "peer lost"}
            self.sup._on_report(report, None, 0)  # type: ignore[arg-type]
        self.workers.join_wanted()  # what the supervisor loop's poll() does once every slot lives

    def _reform(self, t0: float, rank: GenerationClient, results: list[dict]) -> None:
        """What ``InProcess.reform`` does with the control plane: the plan from the agent, then the new
        rank 0 publishes its c10d store's address and every other rank hears it from its agent."""
        _sleep_until(t0)
        held = self._plan(rank, results)
        if held is not None:
            self._store_of(rank, *held, results)

    def _reform_node(self, t0: float, ranks: list[GenerationClient], results: list[dict]) -> None:
        """``_reform`` for every rank of the node in one thread: each rank takes its plan, then each
        its store.  Real ranks do this at once, so no rank's plan waits for another rank's store (in
        turn, rank by rank, ranks 1-7 would have "held the plan" only after rank 0 had its store)."""
        _sleep_until(t0)
        held = [(rank, self._plan(rank, results)) for rank in ranks]
        for rank, plan_held in held:
            if plan_held is not None:
                self._store_of(rank, *plan_held, results)

    def _plan(self, rank: GenerationClient, results: list[dict]) -> tuple[Plan, float] | None:
        try:
            return rank.next_plan(), time.time()
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the round
            results.append({"error": f"{self.node_id}/{rank.slot.local_rank}: {type(exc).__name__}: {exc}"[:300]})
            return None

    def _store_of(self, rank: GenerationClient, plan: Plan, held: float, results: list[dict]) -> None:
        try:
            new_rank = rank.rank_in(plan)
            if new_rank == 0:
                rank.publish_store(plan.gen, "127.0.0.1:1")
            else:
                rank.store_address(plan.gen)
            rank.adopt(plan)
            self.rank_of[rank.slot.local_rank] = new_rank
            results.append({"plan": held, "store": time.time()})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the round
            results.append({"error": f"{self.node_id}/{rank.slot.local_rank}: {type(exc).__name__}: {exc}"[:300]})

    def _metas(self) -> list[SnapMeta]:
        """What this agent's store holds at the fault: its slots' snapshots of the last two steps and
        its ring predecessor's (it is that node's buddy)."""
        before = node_name((self.index - 1) % self.args.total)
        nodes = [(self.node_id, self.index), (before, (self.index - 1) % self.args.total)]
        return [SnapMeta(node=node, slot=local, rank=i * self.rpn + local, world_size=self.args.total * self.rpn,
                         epoch=0, gen=0, step=step, checksum="", nbytes=0)
                for node, i in nodes for local in range(self.rpn) for step in (STEP - 1, STEP)]

    def after_round(self) -> None:
        self.workers.observe({"type": "recovered", "gen": max(r.gen for r in self.ranks.values())})

    # -- steady state ----------------------------------------------------------------------------
    def idle(self, until: float) -> None:
        """The agent's loop in steady state, its run-wide signal checks only (``Supervisor.watch``)."""
        poll_s = self.sup.config.epoch_poll_s
        next_poll = time.monotonic() + poll_s * (self.index % 16) / 16  # agents are not in lockstep
        while time.time() < until:
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + poll_s
                self.sup._poll_run(None, 0)  # type: ignore[arg-type]
            time.sleep(max(0.0, min(next_poll - time.monotonic(), until - time.time())))


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


class Host:
    """This process's slice of the run's nodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(tempfile.mkdtemp(prefix="cp-sim-", dir=args.run_root))
        indexes = list(range(args.first, args.first + args.count))
        self.listeners = Listeners(len(indexes))
        self.nodes = [SimNode(i, args, self.listeners.addrs[k], self.run_dir) for k, i in enumerate(indexes)]

    def setup(self) -> dict[str, Any]:
        t0 = time.time()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda n: n.setup(), self.nodes))
        return {"setup_s": round(time.time() - t0, 3), "meter": self._totals()}

    def _totals(self) -> dict[str, int]:
        total = {"requests": 0, "writes": 0, "watches": 0, "bytes_read": 0}
        for node in self.nodes:
            for key, value in node.meter.totals().items():
                total[key] += value
        return total

    def _per_node(self) -> list[dict[str, int]]:
        return [node.meter.totals() for node in self.nodes]

    def round(self, kind: str, t0: float, victim: int, local: int | None) -> dict[str, Any]:
        before = self._per_node()
        streams0 = self._signal_streams()
        results: list[dict] = []
        threads: list[threading.Thread] = []
        for k, node in enumerate(self.nodes):
            if node.index == victim and kind == "node_loss":
                self._lose(k, t0)
                continue
            if node.alive:
                threads += node.fault(t0, local if node.index == victim else None, results, kind, victim)
        deadline = time.monotonic() + self.args.join_timeout + 30
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._wait_probes(deadline)
        for node in self.nodes:
            if node.alive:
                node.after_round()
        return {"results": results, "per_node": _deltas(before, self._per_node()),
                "signal_streams": self._signal_streams(),
                "signal_streams_in_round": {k: v - streams0[k] for k, v in self._signal_streams().items()},
                "milestones": [dict(n.events.times) for n in self.nodes if n.alive],
                "hung_threads": sum(t.is_alive() for t in threads)}

    def _signal_streams(self) -> dict[str, int]:
        """The agents' signal streams: connects dropped for a missing ``created`` answer so far
        (``WatchStream.incomplete_creates``: a reconnect, ``create_timeout_s`` or more late) and
        streams opened anew (``SignalWatch.restarts``)."""
        out = {"incomplete_creates": 0, "restarts": 0}
        for node in self.nodes:
            signals = node.sup.signals
            stream = getattr(signals, "_stream", None)
            out["incomplete_creates"] += getattr(stream, "incomplete_creates", 0)
            out["restarts"] += getattr(signals, "restarts", 0)
        return out

    def _lose(self, k: int, t0: float) -> None:
        _sleep_until(t0)
        self.listeners.close(k)
        self.nodes[k].alive = False

    @staticmethod
    def _wait_probes(deadline: float) -> None:
        """The agents' lost-node probes run until the generation has its plan: their reads count."""
        for thread in threading.enumerate():
            if thread.name.startswith("probe-g") or thread.name.startswith("round-g"):
                thread.join(max(0.0, deadline - time.monotonic()))

    def idle(self, t0: float, warm_s: float, seconds: float) -> dict[str, Any]:
        end = t0 + warm_s + seconds
        threads = [threading.Thread(target=n.idle, args=(end,), daemon=True) for n in self.nodes if n.alive]
        _sleep_until(t0)
        for thread in threads:
            thread.start()
        _sleep_until(t0 + warm_s)
        start = self._totals()
        _sleep_until(end)
        stop = self._totals()
        for thread in threads:
            thread.join(10)
        return {"meter": {k: stop[k] - start[k] for k in start}, "agents": len(threads)}


class Sampler:
    """``CP_SIM_PROFILE=1``: where this process's threads stand, sampled every 10 ms during a round
    (the innermost frame of this repository's code or of the library it called): what a round costs
    the simulation itself, printed to stderr."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()

    def __enter__(self) -> Sampler:
        threading.Thread(target=self._run, name="sampler", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:25]
        print("SAMPLES " + json.dumps(top), file=sys.stderr, flush=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(0.01):
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[_where(frame)] = self.counts.get(_where(frame), 0) + 1


def _where(frame: Any) -> str:
    f = frame
    while f is not None:
        code = f.f_code
        if "/elastic/" in code.co_filename or "/benchmarks/" in code.co_filename:
            return f"{Path(code.co_filename).name}:{f.f_lineno} {code.co_name} <- {frame.f_code.co_name}"
        f = f.f_back
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"


def _deltas(before: list[dict[str, int]], after: list[dict[str, int]]) -> list[dict[str, int]]:
    return [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]


def child_main(args: argparse.Namespace) -> int:
    import threading as _threading

    _threading.stack_size(512 << 10)  # thousands of rank threads: 8 MiB stacks would be mostly waste
    sys.setswitchinterval(args.switch_interval)
    host = Host(args)
    print("READY " + json.dumps(host.setup()), flush=True)
    for line in sys.stdin:
        verb, *rest = line.split()
        if verb == "ROUND":
            kind, t0, victim, *local = rest
            profile = Sampler() if os.environ.get("CP_SIM_PROFILE") else contextlib.nullcontext()
            with profile:
                out = host.round(kind, float(t0), int(victim), int(local[0]) if local else None)
        elif verb == "IDLE":
            out = host.idle(*(float(x) for x in rest))
        else:
            continue
        print("RESULTS " + json.dumps(out), flush=True)
    os._exit(0)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/cp_sim.py")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--total", type=int, required=True, help="nodes in the run")
    parser.add_argument("--first", type=int, required=True, help="index of this process's first node")
    parser.add_argument("--count", type=int, required=True, help="nodes this process hosts")
    parser.add_argument("--rpn", type=int, default=8, help="ranks per node")
    parser.add_argument("--switch-interval", type=float, default=0.2,
                        help="this process's sys.setswitchinterval (see SWITCH_INTERVAL_WHY)")
    parser.add_argument("--run-root", default=None,
                        help="where this process's run directory goes (the parent removes it: a killed child cannot)")
    parser.add_argument("--join-timeout", type=float, default=300.0)
    parser.add_argument("--pushed", type=int, default=1,
                        help="1: a worker's or a node's loss reaches the other nodes as a pushed fault (NCCL); "
                             "0: every surviving rank's collective raises at the fault's time (gloo)")
    parser.add_argument("--rank-threads", choices=("rank", "node"), default="rank",
                        help="a thread per rank (faithful), or one per node running its ranks' code in turn "
                             "(a node's ranks do no etcd I/O: this only saves the simulation's own CPU)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(child_main(parse()))
