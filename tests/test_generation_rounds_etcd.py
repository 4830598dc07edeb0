"""A generation round on a real 3-member etcd: 16 simulated nodes x 8 ranks, the coordinator's etcd
member killed mid-round.

Each node is the real agent side (InProcessWorkers: its round thread, probe, memory store and the
RoundBoard behind it) and eight real worker-side GenerationClients (what InProcess.reform calls)
that learn the plan, then the new c10d store's address, over the local channel (a TCP request to
their agent's memory store); no process groups, no training.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from elastic.agent.attempt import NodeSpec
from elastic.agent.config import InProcessConfig
from elastic.agent.inprocess import InProcessWorkers
from elastic.checkpoint.memstate import MemStateServer
from elastic.common.env import WorkerEnv
from elastic.common.events import EventLog
from elastic.control.etcd_cluster import EtcdCluster
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore
from elastic.checkpoint.memclient import MemStateClient
from elastic.worker.generation import GenerationClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NODES, RPN = 16, 8
PREFIX = "/elastic/runs/round16"
LOST = "n09"


class Events(EventLog):
    """An agent's events, kept in memory (the test waits for the coordinator to take its role)."""

    def __init__(self, source: str) -> None:
        super().__init__(None, source)
        self.seen: list[dict] = []
        self.changed = threading.Condition()

    def emit(self, kind: str, **fields):
        event = super().emit(kind, **fields)
        with self.changed:
            self.seen.append(event)
            self.changed.notify_all()
        return event

    def wait_for(self, kind: str, timeout: float, **match) -> dict:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for event in self.seen:
                    if event["kind"] == kind and all(event.get(k) == v for k, v in match.items()):
                        return event
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind} {match}: {[e['kind'] for e in self.seen]}"
                self.changed.wait(left)


def _refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections are refused


class Node:
    def __init__(self, index: int, endpoints: str, tmp: Path) -> None:
        self.node_id = f"n{index:02d}"
        self.events = Events(f"agent/{self.node_id}")
        self.state = RunState(EtcdStore(endpoints, request_timeout=1.0, retry_deadline=20.0), RunKeys(PREFIX))
        self.memstate = MemStateServer(1 << 20, self.events) if self.node_id != LOST else None
        spec = NodeSpec("round16", self.node_id, endpoints, tmp, str(NODES), RPN, ["-c", "pass"])
        self.workers = InProcessWorkers(spec, InProcessConfig(join_timeout_s=60, probe_timeout_s=0.5, spare=False),
                                        self.state, self.events, self.memstate, epoch=0)
        self.workers.ranks = {local: index * RPN + local for local in range(RPN)}
        self.workers.pids = {local: 10_000 * (index + 1) + local for local in range(RPN)}
        self.workers.detached = True
        addr = self.memstate.addr if self.memstate else f"127.0.0.1:{_refused_port()}"
        self.state.put_node(self.node_id, {"memstate": {"addr": addr, "token": "t"}})
        self.state.set_member(self.node_id, "joined")
        self.workers.register()
        self.ranks = [self._rank(endpoints, local) for local in range(RPN)] if self.memstate else []

    def _rank(self, endpoints: str, local: int) -> GenerationClient:
        assert self.memstate is not None
        env = WorkerEnv(node_id=self.node_id, run_id="round16", etcd_endpoint=endpoints, run_prefix=PREFIX,
                        epoch="0", inprocess="60", snapshots="1")
        return GenerationClient(env, local, MemStateClient(self.memstate.addr, self.memstate.token, 30.0))

    def fault(self, results: list) -> list[threading.Thread]:
        """The workers' collectives failed: they report it and wait for the plan; the agent joins."""
        threads = [threading.Thread(target=self._reform, args=(rank, results)) for rank in self.ranks]
        for thread in threads:
            thread.start()
        for local in range(RPN):
            self.workers.observe({"type": "fault", "gen": 0, "step": 7, "local_rank": local,
                                  "pid": self.workers.pids[local]})
        self.workers.join_wanted()
        return threads

    @staticmethod
    def _reform(client: GenerationClient, results: list) -> None:
        try:
            plan = client.next_plan()
            rank = client.rank_in(plan)
            if rank == 0:  # as InProcess._store: the new rank 0 says where the generation's c10d store is
                client.publish_store(plan.gen, "127.0.0.1:29999")
            else:
                assert client.store_address(plan.gen) == "127.0.0.1:29999"
            results.append((client.slot, plan, rank))
        except Exception as exc:  # noqa: BLE001 - the test reports every failed rank
            results.append((client.slot, exc, None))

    def close(self) -> None:
        if self.memstate is not None:
            self.memstate.close()


def test_sixteen_nodes_re_form_while_the_coordinators_etcd_member_is_killed(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd", members=3)
    cluster.start()
    nodes: list[Node] = []
    try:
        nodes = [Node(i, cluster.endpoints, tmp_path) for i in range(NODES)]
        coordinator = nodes[0]
        results: list = []
        threads = []
        t0 = time.monotonic()
        for node in nodes[:8]:  # half the run notices the fault first
            threads += node.fault(results)
        coordinator.events.wait_for("round.role", timeout=30, role="coordinator")
        assert coordinator.state.store.endpoint_index() == 0  # the member it reads from
        cluster.kill(0)  # mid-round: the coordinator has read the round and watches it on member 0
        for node in nodes[8:]:
            if node.node_id != LOST:
                threads += node.fault(results)
        for thread in threads:
            thread.join(90)
        elapsed = time.monotonic() - t0

        failures = [(slot.key(), repr(plan)) for slot, plan, _ in results if not hasattr(plan, "world")]
        assert not failures, failures[:5]
        plans = {plan for _, plan, _ in results}
        assert len(results) == (NODES - 1) * RPN and len(plans) == 1
        plan = plans.pop()
        assert plan.lost == (LOST,) and plan.world == (NODES - 1) * RPN and plan.nodes == NODES - 1
        assert plan.by == coordinator.node_id  # the coordinator lived through its member's loss
        assert sorted(rank for _, _, rank in results) == list(range(plan.world))
        assert coordinator.state.store.endpoint_index() != 0  # it moved to a live member
        lost = coordinator.events.wait_for("agent.node_lost", timeout=5, node=LOST)
        assert lost["gen"] == 1
        assert elapsed < 60, elapsed
    finally:
        for node in nodes:
            node.close()
        cluster.close()
