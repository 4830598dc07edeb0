"""Replica-group (torchft) mode settings, importable without torch (the launcher validates them).

In this mode every node agent is one replica group: its torchrun forms the group
alone (``nproc_per_node`` ranks, FSDP inside), and the groups train data-parallel
through a torchft Lighthouse run by the leader agent.  A failed group restarts
alone and heals its weights from a live peer; the others never restart.

The timeouts form a ladder, checked when the run config is read (``RunConfig``):
``heartbeat_timeout_ms`` < ``quorum_timeout_s`` < ``timeout_s`` < ``agent.heartbeat.step_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class ReplicaConfig:
    """The ``replicas:`` section: torchft replica-group mode (one group per node, a Lighthouse)."""

    enabled: bool = False
    """Run each node as a torchft replica group instead of one run-wide torchrun."""
    min_replicas: int = 1
    """Replica groups a step needs to commit (the Lighthouse's --min_replicas)."""
    heartbeat_timeout_ms: int = 1000
    """A group silent this long is dropped from the quorum: it bounds kill -> survivor's next commit
    (measured 5.0-7.1 s at torchft's 5000 ms default, 1.04-1.10 s at 1000 ms)."""
    join_timeout_ms: int = 1000
    """How long the Lighthouse waits for heartbeating stragglers before issuing a quorum."""
    quorum_tick_ms: int = 100
    """How often the Lighthouse re-checks a pending quorum."""
    lighthouse_host: str = "127.0.0.1"
    """Address the Lighthouse binds and advertises (published in etcd for the other agents); a
    wildcard (0.0.0.0, ::) binds every interface and advertises the host agent's launch.local_addr."""
    lighthouse_port: int = 0
    """Lighthouse port; 0 picks a free one."""
    lighthouse_wait_s: float = 60.0
    """How long an agent waits for the Lighthouse address to appear in etcd before it fails."""
    quorum_timeout_s: float = 5.0
    """torchft Manager quorum timeout per step: above heartbeat_timeout_ms, so that a dead group
    drops out of the quorum before the survivors' quorum call gives up.  (A group's first quorum
    may wait longer, up to agent.heartbeat.init_timeout_s, for peers that are still starting.)"""
    timeout_s: float = 10.0
    """torchft process-group timeout: cross-group collectives, commit votes, checkpoint transfer.
    Above quorum_timeout_s (a group in the allreduce waits for a peer still in its quorum) and
    below agent.heartbeat.step_timeout_s (a survivor stuck behind a hung peer leaves the
    collective and reports a step before its own agent calls it hung)."""
    transport: Literal["pg", "http"] = "pg"
    """Live-recovery transport: "pg" sends the state over the torchft process group; "http"
    serves it from an HTTP server that advertises socket.gethostname() (must resolve here)."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError("min_replicas", "must be >= 1")
        for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if not 0 <= self.lighthouse_port <= 65535:
            raise ConfigError("lighthouse_port", "must be 0..65535")
        if not self.lighthouse_host or any(c in self.lighthouse_host for c in " /"):
            raise ConfigError("lighthouse_host", f"must be a host name or address, got {self.lighthouse_host!r}")
        for name in ("lighthouse_wait_s", "quorum_timeout_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
