"""Faults chaos executes itself in cluster mode: on etcd and on the network, never inside a node.

* ``etcd_outage``: etcd stops answering for ``duration_s`` (the etcd chaos started is paused with
  SIGSTOP; an operator's etcd is blackholed at the proxy, for the nodes behind it);
* ``etcd_latency``: ``latency_s`` added to every etcd exchange, optionally with dropped
  connections, for ``duration_s`` (the proxy);
* ``partition``: one node cut from its peers and from etcd for ``duration_s`` (its namespace's
  link down, :mod:`chaos.netns`).

Each has a start and an end (the heal); the runner calls :meth:`NetFault.end` when the duration
is over, and always once more at teardown so nothing is left broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chaos.etcd_proxy import EtcdProxy
from chaos.follow import parse_target
from chaos.injection import InjectionContext, InjectionRecord, Injector, TargetNotFound, register
from chaos.netns import NetLab
from elastic.common.config import ConfigError
from elastic.control.etcd_server import EmbeddedEtcd


class InfraMissing(RuntimeError):
    """The scenario lacks what the fault needs (a proxy, namespaces, an etcd of its own)."""


@dataclass
class Infra:
    """What chaos runs around the nodes of one scenario."""

    endpoint: str
    """etcd as chaos itself reaches it (never through the proxy)."""
    etcd: EmbeddedEtcd | None = None
    proxy: EtcdProxy | None = None
    lab: NetLab | None = None
    nodes: tuple[str, ...] = ()


@dataclass(kw_only=True)
class LatencyParams:
    latency_s: float = 0.3
    """Added to each chunk in each direction (a request/response pays it twice)."""
    drop_rate: float = 0.0
    """Probability that a connection (or a forwarded chunk) is reset."""
    duration_s: float = 10.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not 0 <= self.drop_rate <= 1 or self.duration_s <= 0:
            raise ConfigError("latency_s", "need latency_s >= 0, 0 <= drop_rate <= 1, duration_s > 0")


@dataclass(kw_only=True)
class PartitionParams:
    duration_s: float = 8.0
    """How long the node stays cut off before the link comes back."""

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ConfigError("duration_s", "must be > 0")


class _ClusterOnly(Injector):
    needs_run = True
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        raise TargetNotFound(f"{self.name} runs in `chaos suite` / `chaos soak` (nodes behind a proxy or in "
                             f"namespaces), not under `chaos run`")


@register("etcd_latency")
class EtcdLatency(_ClusterOnly):
    """Slow (and optionally drop) every node's etcd traffic at the interposed proxy for ``duration_s``."""

    Params = LatencyParams


@register("partition")
class Partition(_ClusterOnly):
    """Cut one node (in its own network namespace) from its peers and etcd for ``duration_s``."""

    Params = PartitionParams


class NetFault:
    """One chaos-side fault in a scenario: ``begin`` it, ``end`` it (idempotent)."""

    def __init__(self, fault: str, target: str, params: Any, infra: Infra) -> None:
        self.fault, self.target, self.params, self.infra = fault, target, params, infra
        self.active = False
        self.index: int | None = None

    @property
    def duration_s(self) -> float:
        return float(self.params.duration_s)

    def begin(self) -> dict[str, Any]:
        detail = getattr(self, f"_begin_{self.fault}")()
        self.active = True
        return detail

    def end(self) -> None:
        if self.active:
            self.active = False
            getattr(self, f"_end_{self.fault}")()

    def _proxy(self) -> EtcdProxy:
        if self.infra.proxy is None:
            raise InfraMissing(f"{self.fault} needs the nodes behind chaos's etcd proxy")
        return self.infra.proxy

    def _begin_etcd_outage(self) -> dict[str, Any]:
        if self.infra.etcd is not None:
            self.infra.etcd.pause()
            return {"mode": "sigstop", "etcd_pid": self.infra.etcd.pid, "duration_s": self.duration_s}
        self._proxy().set(blackhole=True)
        return {"mode": "proxy_blackhole", "duration_s": self.duration_s}

    def _end_etcd_outage(self) -> None:
        if self.infra.etcd is not None:
            self.infra.etcd.resume()
        else:
            self._proxy().set(blackhole=False)

    def _begin_etcd_latency(self) -> dict[str, Any]:
        self._proxy().set(latency_s=self.params.latency_s, drop_rate=self.params.drop_rate)
        return {"latency_s": self.params.latency_s, "drop_rate": self.params.drop_rate, "duration_s": self.duration_s}

    def _end_etcd_latency(self) -> None:
        self._proxy().set(latency_s=0.0, drop_rate=0.0)

    def _node_index(self) -> int:
        node, _ = parse_target(self.target)
        if node not in self.infra.nodes:
            raise InfraMissing(f"partition needs a node target, got {self.target!r}")
        return self.infra.nodes.index(node)

    def _begin_partition(self) -> dict[str, Any]:
        if self.infra.lab is None:
            raise InfraMissing("partition needs the nodes in network namespaces (chaos suite --netns)")
        self.infra.lab.partition(self._node_index())
        return {"node": self.target, "duration_s": self.duration_s, "link": f"v{self._node_index()}"}

    def _end_partition(self) -> None:
        assert self.infra.lab is not None
        self.infra.lab.heal(self._node_index())


NET_FAULTS = frozenset({"etcd_outage", "etcd_latency", "partition"})
