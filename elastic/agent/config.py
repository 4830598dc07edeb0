"""Agent and rendezvous settings, importable without torch (the launcher validates them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elastic.common.config import ConfigError
from elastic.agent.metrics import MetricsConfig
from elastic.control.leader import LeaderConfig
from elastic.control.keys import DEFAULT_KEY_PREFIX


Action = Literal["restart", "rescreen", "exclude", "stop", "rollback"]

# What the agent does per failure class unless the config says otherwise.  A crash or signal
# may be a transient software fault (restart) or bad hardware (rescreen first); a hang is
# re-screened because a wedged GPU or link is the common cause at scale.
DEFAULT_ACTIONS: dict[str, str] = {
    "worker_signal": "rescreen",
    "worker_error": "restart",
    "oom": "restart",
    "collective_timeout": "restart",
    "hang": "rescreen",
    "init_timeout": "rescreen",
    "numerics": "rollback",
    "torchrun": "restart",
    "rendezvous_timeout": "stop",
    "recovery_failed": "restart",
    "config": "stop",       # the worker cannot run this config: a restart would fail the same way
    "checkpoint": "stop",   # saves kept failing (checkpoint.on_save_failure: stop chose this)
}
_UNCOUNTED = ("peer_lost", "stall", "recovery_failed")


@dataclass(kw_only=True)
class HeartbeatConfig:
    """The agent's hang detection: how long its workers may stay silent (no step report)."""

    init_timeout_s: float = 300.0
    """Silence allowed from torchrun start to the first step report (rendezvous, imports, load)."""
    step_timeout_s: float = 30.0
    """Silence allowed between step reports once training runs; past it the rank is hung."""
    stall_factor: float = 2.0
    """A node whose workers are blocked waiting on peers gives up after stall_factor x step_timeout_s."""
    publish_interval_s: float = 2.0
    """How often the node heartbeat (step, step time) goes to etcd."""
    window: int = 20
    """Step reports kept for the published step-time statistics."""

    def __post_init__(self) -> None:
        for name in ("init_timeout_s", "step_timeout_s", "publish_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        if self.stall_factor < 1:
            raise ConfigError("stall_factor", "must be >= 1")
        if self.window < 1:
            raise ConfigError("window", "must be >= 1")


@dataclass(kw_only=True)
class FailurePolicy:
    """What the agent does per failure class, and the guards that stop a run that does not progress."""

    actions: dict[str, Action] = field(default_factory=dict)
    """Per failure class: restart | rescreen | exclude | stop | rollback.  A class not listed keeps its
    default (``DEFAULT_ACTIONS`` in elastic/agent/config.py; the failure table of docs/operations.md)."""
    max_rollbacks: int = 3
    """NaN / loss-spike rollbacks allowed per run before the agent stops with a report."""
    skip_before: int = 0
    """On rollback, also skip this many data batches before the offending one."""
    no_progress_restarts: int = 4
    """Stop after this many restarts (any cause) without a new committed checkpoint; 0 disables."""
    exclusion_ttl_s: float = 3600.0
    """How long an exclusion by this node's own policy lasts."""

    def __post_init__(self) -> None:
        unknown = set(self.actions) - set(DEFAULT_ACTIONS)
        if unknown:
            raise ConfigError(f"actions.{sorted(unknown)[0]}",
                              f"unknown failure class (known: {', '.join(sorted(DEFAULT_ACTIONS))})")
        for name in ("max_rollbacks", "skip_before", "no_progress_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0")
        if self.exclusion_ttl_s <= 0:
            raise ConfigError("exclusion_ttl_s", "must be > 0")

    def action(self, kind: str) -> str:
        if kind in _UNCOUNTED:
            return "restart"
        return self.actions.get(kind, DEFAULT_ACTIONS.get(kind, "restart"))


@dataclass(kw_only=True)
class InProcessConfig:
    """In-process recovery (elastic.agent.inprocess): healthy workers re-form without restarting."""

    enabled: bool = True
    """Recover from a lost worker or node in-process when the workload supports it (DiT, MLP);
    false: every fault restarts every worker through a new torchrun (the epoch path)."""
    spare: bool = True
    """Keep one warm spare worker per node (torch and the trainer imported) to replace a dead one."""
    spare_fork: bool = True
    """Fork replacement spares from a per-node zygote that has imported torch and the trainer once
    (``elastic.worker.zygote``): a spare replaced in milliseconds instead of the seconds an import
    takes, so a worker lost soon after its node's spare is not left without one.  It costs one more
    process per node (its pages shared with the spares it forks); the node's first spare is started
    as before.  It forks only single-threaded (``OMP_NUM_THREADS`` above 1 lets BLAS start threads
    at import): otherwise it says so (``agent.spare_zygote_failed``) and spares are started."""
    join_timeout_s: float = 60.0
    """How long workers wait for the next generation to form before falling back to a restart."""
    probe_timeout_s: float = 1.0
    """Connect timeout of the probe that tells a lost node (its agent unreachable) from a slow one."""
    in_place_wait_s: float = 2.0
    """A worker lost on a node whose spare takes its slot: that node closes the next generation in
    place and puts the plan on the run's round note.  How long every other node waits for the note
    (its signal watch delivers it, no request) before it joins the round itself (one raft write and
    one watch per node: what a round at 1,024 nodes spent most of its time on).  Waited only when the
    fault's push said "in place"; a note that does not come costs this long, then the round as before."""
    member_note_wait_s: float = 5.0
    """A round every node joins (a node lost, gloo's errors): the nodes other than the round's four
    leaders (coordinator, deputy, two reserves) open no watch of their own and take the plan and the
    new store's address from the run's round note, which their signal watch follows.  How long such a
    node waits for the plan there before it watches the round itself (a round whose four leaders were
    all lost then still finds a coordinator among the others)."""
    snapshots: bool = True
    """Per-step memory snapshots (the first checkpoint tier).  false: none are taken, so an in-process
    re-formation has nothing to restore from memory and falls back to the restart path and the newest
    disk checkpoint; for measuring their cost (``benchmarks/recovery.py``) or a host too short of memory."""
    snapshot_mib: int = 4096
    """Memory the agent may hold for per-step snapshots (its workers' and its buddy node's): two
    steps of every local shard and of the buddy's.  Checked against the model when the workers
    start: when they do not fit, the run stops before training with one line naming this field, the
    size needed and the size allowed (raise it, or set ``snapshots: false``).  The agent's own memory
    for them is at most 1.5x this (a reused receive buffer per buddy shard); its workers' shards it
    maps from their shared memory rather than copying."""
    rejoin_wait_s: float = 30.0
    """A fixed-size run (``launch.nodes: N``) that lost a node cannot shrink: its survivors keep
    their processes and wait this long for the node to come back (its agent restarted with the same
    node id: a requeued job step, a rescheduled pod), which then rejoins the running world in-process
    with its snapshots from its buddy node, instead of every node restarting from disk.  A fixed-size
    run cannot train without the node anyway: the restart would wait for it too.  0: restart from
    disk at once.  Must be below ``join_timeout_s`` (the workers' wait for the next generation)."""
    snapshot_ab_block: int = 0
    """For measuring the snapshots' cost within one run (``benchmarks/recovery.py``): alternate
    blocks of this many steps with and without snapshots, so both halves of the comparison share the
    host's load.  A fault in a block without them loses up to a block of steps.  0: off."""

    def __post_init__(self) -> None:
        for name in ("join_timeout_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        if not 0 < self.member_note_wait_s < self.join_timeout_s:
            raise ConfigError("member_note_wait_s", f"must be > 0 and below join_timeout_s ({self.join_timeout_s:g})")
        if not 0 <= self.in_place_wait_s < self.join_timeout_s:
            raise ConfigError("in_place_wait_s", f"must be >= 0 and below join_timeout_s ({self.join_timeout_s:g})")
        if self.snapshot_mib < 1:
            raise ConfigError("snapshot_mib", "must be >= 1")
        if self.snapshot_ab_block < 0:
            raise ConfigError("snapshot_ab_block", "must be >= 0")
        if not 0 <= self.rejoin_wait_s < self.join_timeout_s:
            raise ConfigError("rejoin_wait_s", f"must be >= 0 and below join_timeout_s ({self.join_timeout_s:g})")

    def snapshots_env(self) -> str:
        """The workers' ``ELASTIC_SNAPSHOTS``: ``1``, ``0``, or ``ab:N`` (:attr:`snapshot_ab_block`)."""
        if not self.snapshots:
            return "0"
        return f"ab:{self.snapshot_ab_block}" if self.snapshot_ab_block else "1"


@dataclass(kw_only=True)
class PreflightConfig:
    """The node's pre-flight screen (``diag burnin``): before it trains, and after a rescreen failure."""

    enabled: bool = True
    """Screen the node with ``diag burnin`` before it joins and after a failure whose action is rescreen."""
    mode: Literal["quick", "full"] = "quick"
    """``diag burnin --quick`` (seconds) or ``--full`` (a minutes-long burn-in)."""
    checks: list[str] = field(default_factory=list)
    """Checks to run (empty: every check of the mode)."""
    thresholds: str = ""
    """Thresholds YAML for ``diag`` (empty: its per-GPU-model defaults)."""
    timeout_s: float = 120.0
    """A screen that does not finish in time counts as failed (a wedged GPU hangs its checks)."""
    exclusion_ttl_s: float = 3600.0
    """Expiry of the exclusion written when the screen fails."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "exclusion_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")


@dataclass(kw_only=True)
class ChaosConfig:
    """Faults delivered through etcd (``chaos`` in cluster mode, :mod:`elastic.agent.remote_faults`)."""

    enabled: bool = False
    """Execute fault requests addressed to this node (``elastic-launch --allow-chaos``); off: refuse them."""
    poll_s: float = 1.0
    """How often the agent looks for new requests in etcd (step-triggered ones then fire on the step)."""
    max_age_s: float = 600.0
    """A request older than this (or this far in the future) is refused as stale or replayed."""

    def __post_init__(self) -> None:
        for name in ("poll_s", "max_age_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")


@dataclass(kw_only=True)
class AgentConfig:
    """The ``agent:`` section: the node agent that supervises its torchrun and workers."""

    max_restarts: int = 3
    """torchrun relaunches after failures of this node before the agent gives up."""
    term_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    monitor_interval_s: float = 0.1
    """Longest sleep of the agent's supervision loop between checks of its workers (exits, silence,
    screen result); a worker's report wakes it at once."""
    epoch_poll_s: float = 0.25
    """The run's signals (epoch, this node's exclusion, stop) are watched, not polled: this is the
    least time between two reads that re-establish their watch after it failed for good."""
    watch_idle_s: float = 30.0
    """A signal watch silent this long reconnects (one request): how long a silently dead connection
    (a member's host gone without a reset) can go unnoticed; 30 s is ~34 requests/s at 1,024 agents."""
    lease_ttl_s: int = 10
    """TTL of the node record; the agent refreshes it at a third of this."""
    etcd_wait_s: float = 60.0
    """How long the agent waits out an unreachable etcd where it cannot go on without one (joining,
    starting an attempt) before it stops with one line naming the endpoint.  A running attempt
    keeps training through an outage; the workers do not need etcd between rendezvous."""
    pg_timeout_s: float = 60.0
    """Collective timeout handed to the trainer (gloo/NCCL), far below NCCL's 30 min default.

    Kept above heartbeat.step_timeout_s on purpose: the agent of the hung rank must see the
    silence (and blame its own worker) before the healthy ranks' collectives time out."""
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    failure: FailurePolicy = field(default_factory=FailurePolicy)
    leader: LeaderConfig = field(default_factory=LeaderConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", "must be >= 0")
        for name in ("term_grace_s", "monitor_interval_s", "epoch_poll_s", "watch_idle_s", "pg_timeout_s",
                     "etcd_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        if self.lease_ttl_s < 2:
            raise ConfigError("lease_ttl_s", "must be >= 2")
        if self.pg_timeout_s <= self.heartbeat.step_timeout_s:
            raise ConfigError("pg_timeout_s", f"must exceed heartbeat.step_timeout_s "
                              f"({self.heartbeat.step_timeout_s}) so a hang is blamed on the hung rank")


@dataclass(kw_only=True)
class RendezvousConfig:
    """The ``rendezvous:`` section: the etcd keys of the run and torchrun's rendezvous timings
    (passed to the ``etcd3`` handler as ``--rdzv-conf``; whole seconds, as torch parses them)."""

    key_prefix: str = DEFAULT_KEY_PREFIX
    """Root of every etcd key of the run (``<key_prefix>/runs/<run.id>/...``); ``elastic status --key-prefix``."""
    join_timeout_s: int = 300
    """A rendezvous that has not formed by then fails (failure class ``rendezvous_timeout``, whose default
    action is stop): the reason names the lost node, its step, the nodes the run needs and this wait."""
    last_call_timeout_s: int = 1
    """Once ``launch.nodes``' minimum has joined, how long the round waits for more before it closes (it
    closes at once when every live node of the previous round is back, or the maximum joined)."""
    close_timeout_s: int = 10
    """torch's ``close_timeout``: accepted for torch's contract; closing a round is one write in ``etcd3``."""
    heartbeat_timeout_s: int = 5
    """torch's ``heartbeat_timeout``: used by the ``etcd3-state`` handler (a participant silent this long
    is dropped); ``etcd3`` accepts it, its liveness is the node's lease (``keep_alive_interval_s``)."""
    keep_alive_interval_s: int = 1
    """How often a node refreshes its rendezvous lease; the lease lasts three intervals, so a dead node
    drops out of the round after about that long."""

    def __post_init__(self) -> None:
        if not self.key_prefix.startswith("/"):
            raise ConfigError("key_prefix", "must start with '/'")
        for name in ("join_timeout_s", "last_call_timeout_s", "close_timeout_s", "heartbeat_timeout_s",
                     "keep_alive_interval_s"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1 (torch parses these as whole seconds)")

    def torchrun_conf(self) -> str:
        return ",".join([
            f"join_timeout={self.join_timeout_s}",
            f"last_call_timeout={self.last_call_timeout_s}",
            f"close_timeout={self.close_timeout_s}",
            f"heartbeat_timeout={self.heartbeat_timeout_s}",
            f"keep_alive_interval={self.keep_alive_interval_s}",
            f"key_prefix={self.key_prefix}",
        ])
