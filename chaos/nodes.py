"""The nodes of a chaos scenario: one ``elastic-launch --etcd-endpoint ... --node-id ...`` per node.

Each node is its own launcher process, exactly as on a cluster (one per host, all against one
etcd); here they all run on this machine, on loopback or each in its own network namespace
(:mod:`chaos.netns`).  The set can relaunch a node whose launcher died while the run goes on
(``requeue``: what a scheduler does with a lost node), and stops every launcher at the end
(SIGTERM, then SIGKILL after a grace period); each launcher stops its own agent tree.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.netns import NODE_IFNAME, NetLab
from elastic.common.exits import EXIT_EXCLUDED
from elastic.control.admission import EXIT_FINGERPRINT, EXIT_WRONG_TOKEN

REFUSED = (EXIT_EXCLUDED, EXIT_WRONG_TOKEN, EXIT_FINGERPRINT)
"""Launcher exits a requeue cannot change: the run turned the node away (excluded, another run's
token, other code or config).  Soak seed 3 (2026-12-05) relaunched a node refused for its code 127
times in five minutes (its code changed on disk mid-run) while the other three waited for it."""


@dataclass
class NodeLaunch:
    """How to start the nodes of one run."""

    config: Path
    run_id: str
    run_dir: Path
    nodes: list[str]
    node_range: str
    """``--nodes``: "N", or "MIN:MAX" for the scenarios where the world may shrink."""
    endpoint: str
    """The etcd endpoint the nodes use (the proxy's when there is one)."""
    log_dir: Path
    env: dict[str, str]
    overrides: list[str] = field(default_factory=list)
    """``--set KEY=VALUE`` items, applied to every node."""
    steps: int | None = None
    allow_chaos: set[str] | None = None
    """Nodes started with ``--allow-chaos`` (None: all of them)."""
    lab: NetLab | None = None
    standby: set[str] = field(default_factory=set)
    """Nodes started with ``--standby`` (a warm standby that takes a lost node's slot)."""


@dataclass
class Node:
    name: str
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    launches: int = 1
    rc: int | None = None


class NodeSet:
    def __init__(self, launch: NodeLaunch) -> None:
        self.launch = launch
        self.nodes: dict[str, Node] = {}
        self.pids: set[int] = set()

    def argv(self, index: int) -> list[str]:
        spec, name = self.launch, self.launch.nodes[index]
        addr = spec.lab.address(index) if spec.lab else "127.0.0.1"
        argv = [sys.executable, "-m", "launch", str(spec.config), "--etcd-endpoint", spec.endpoint,
                "--node-id", name, "--run-id", spec.run_id, "--run-dir", str(spec.run_dir),
                "--nodes", spec.node_range, "--local-addr", addr]
        if spec.allow_chaos is None or name in spec.allow_chaos:
            argv.append("--allow-chaos")
        if name in spec.standby:
            argv.append("--standby")
        if spec.steps is not None:
            argv += ["--steps", str(spec.steps)]
        for item in spec.overrides:
            argv += ["--set", item]
        return spec.lab.wrap(index, argv) if spec.lab else argv

    def _env(self) -> dict[str, str]:
        env = dict(self.launch.env)
        if self.launch.lab is not None:
            # gloo binds to the interface that reaches the peers; in a namespace that is eth0.
            env["GLOO_SOCKET_IFNAME"] = NODE_IFNAME
        return env

    def start_node(self, index: int) -> Node:
        name = self.launch.nodes[index]
        self.launch.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.launch.log_dir / f"launch-{name}.log", "ab") as log:
            proc = subprocess.Popen(self.argv(index), stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                    start_new_session=True)
        self.pids.add(proc.pid)
        previous = self.nodes.get(name)
        node = Node(name, index, proc, time.monotonic(), launches=previous.launches + 1 if previous else 1)
        self.nodes[name] = node
        return node

    def start(self) -> None:
        for index in range(len(self.launch.nodes)):
            self.start_node(index)

    def poll(self) -> dict[str, int | None]:
        for node in self.nodes.values():
            if node.rc is None:
                node.rc = node.proc.poll()
        return {name: node.rc for name, node in self.nodes.items()}

    def running(self) -> list[str]:
        return [name for name, rc in self.poll().items() if rc is None]

    def lost(self) -> list[str]:
        """Nodes whose launcher died (not finished, not refused): candidates for a requeue."""
        return [name for name, rc in self.poll().items() if rc not in (None, 0, *REFUSED)]

    def refused(self) -> dict[str, int]:
        """Nodes the run turned away, and why (their exit codes): never requeued."""
        return {name: rc for name, rc in self.poll().items() if rc in REFUSED and rc != EXIT_EXCLUDED}

    def stop(self, grace_s: float = 20.0) -> None:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        self.poll()

    def exit_code(self) -> int:
        """The run's verdict from its launchers, as ``elastic-launch`` gives it in local mode."""
        codes = [n.rc for n in self.nodes.values()]
        if any(c == 0 for c in codes) and all(c in (0, EXIT_EXCLUDED) or (c or 0) < 0 for c in codes):
            return 0
        nonzero = [c for c in codes if c not in (0, None)]
        return nonzero[0] if nonzero else 1
