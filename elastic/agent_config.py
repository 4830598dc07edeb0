"""Agent and rendezvous settings, importable without torch (the launcher validates them)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config import ConfigError
from elastic.naming import DEFAULT_KEY_PREFIX


@dataclass(kw_only=True)
class AgentConfig:
    max_restarts: int = 3
    """torchrun relaunches after failures of this node before the agent gives up."""
    term_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    monitor_interval_s: float = 0.1
    epoch_poll_s: float = 0.25
    """How often the run's restart epoch is read from etcd."""
    lease_ttl_s: int = 10
    """TTL of the node record; the agent refreshes it at a third of this."""
    pg_timeout_s: float = 60.0
    """Collective timeout handed to the trainer (gloo/NCCL), far below NCCL's 30 min default."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", "must be >= 0")
        for name in ("term_grace_s", "monitor_interval_s", "epoch_poll_s", "pg_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be > 0")
        if self.lease_ttl_s < 2:
            raise ConfigError("lease_ttl_s", "must be >= 2")


@dataclass(kw_only=True)
class RendezvousConfig:
    key_prefix: str = DEFAULT_KEY_PREFIX
    join_timeout_s: int = 300
    last_call_timeout_s: int = 1
    close_timeout_s: int = 10
    heartbeat_timeout_s: int = 5
    keep_alive_interval_s: int = 1

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
