"""Checkpoint settings, importable without torch (the launcher validates them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class MemoryCacheConfig:
    """The in-memory fast path (:mod:`elastic.checkpoint.memstate`): the node agent keeps each local rank's
    newest checkpointed state in RAM, so a worker restarted on a surviving node loads from there."""

    enabled: bool = False
    """Push every saved state to the agent's cache and try it first on load (disk stays the source of truth)."""
    max_mib: int = 16384
    """Most memory the agent's cache may hold for all its local ranks together; a bigger push is refused."""
    timeout_s: float = 60.0
    """Socket timeout for one push or fetch between a worker and its agent."""

    def __post_init__(self) -> None:
        if self.max_mib < 1:
            raise ConfigError("max_mib", "must be >= 1")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", "must be > 0")


@dataclass(kw_only=True)
class CheckpointConfig:
    """The ``checkpoint:`` section: committed DCP checkpoints on disk and what to do when saves fail."""

    dir: str = "checkpoints"
    """Checkpoint root; relative paths are resolved against the run directory."""
    interval_steps: int = 10
    """Save every N optimizer steps.  0: no periodic saves, only the final checkpoint at the last
    step (a failure before it restarts the run from step 0)."""
    keep_last: int = 3
    """Committed checkpoints to retain; the newest is never deleted."""
    verify_on_load: bool = True
    """Verify per-file sha256 before loading."""
    async_save: bool = True
    """Persist in a background thread (training blocks only for staging); False: write inline."""
    writer_nice: int = 10
    """Niceness added to the background writer thread (0-19), so persisting yields CPU to training
    (measured: step time during persist 2.2-2.9x baseline at 0, 1.3x at 10; bench_checkpoint.py).
    On a host shared with unrelated work a high value makes saves slower; 0 disables it."""
    memory: MemoryCacheConfig = field(default_factory=MemoryCacheConfig)
    """In-memory copy of the newest checkpoint held by the node agent (fast restart on a surviving node)."""
    max_consecutive_failures: int = 3
    """Saves that may fail in a row (no commit in between) before ``on_save_failure`` applies; 0 never."""
    on_save_failure: Literal["stop", "warn"] = "stop"
    """stop: within a step of the save that ends the streak failing (not at the next save), the
    trainers stop (exit 88), the agents stop the run with the reason, keeping the last committed
    checkpoint, and ``elastic-launch`` exits 88; warn: a ``checkpoint.failing`` event and a warning
    line at the next save, training goes on.  Either way the launcher's summary lists the failed
    saves and the unsaved steps."""

    def __post_init__(self) -> None:
        if self.interval_steps < 0:
            raise ConfigError("interval_steps", "must be >= 0")
        if self.keep_last < 1:
            raise ConfigError("keep_last", "must be >= 1")
        if self.max_consecutive_failures < 0:
            raise ConfigError("max_consecutive_failures", "must be >= 0 (0: never act on failed saves)")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError("writer_nice", "must be in 0..19")

    def root(self, run_dir: str | Path) -> Path:
        """The checkpoint root of a run: ``dir``, relative to the run directory unless absolute."""
        path = Path(self.dir)
        return path if path.is_absolute() else Path(run_dir) / path
