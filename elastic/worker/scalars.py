"""TensorBoard scalars from a trainer: loss, grad norm, throughput, FP8 amax.

Rank 0 only (every rank of a synchronous job sees the same global loss), under
``<run_dir>/<tensorboard.dir>`` (default ``tensorboard/``), one sub-directory
per worker start (``e<epoch>-<pid>``) so a restart's resumed steps do not
overwrite the curve of the attempt before it.  The switch is the run config's
top-level ``tensorboard`` section, outside ``trainer`` on purpose: turning it on
must not change the run's fingerprint (checkpoints of the run stay usable).

Importable without torch (the launcher validates the section).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.common.config import ConfigError
from elastic.common.env import EPOCH_ENV


@dataclass(kw_only=True)
class TensorBoardConfig:
    """The ``tensorboard:`` section: trainer scalars (loss, grad norm, step time, lr, FP8 amax) from rank 0."""

    enabled: bool = False
    """Write TensorBoard event files from rank 0 (needs the ``tensorboard`` package)."""
    dir: str = "tensorboard"
    """Relative to the run directory unless absolute."""
    flush_s: float = 10.0
    """How often the writer flushes to disk."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("dir", "must not be empty")
        if self.flush_s <= 0:
            raise ConfigError("flush_s", "must be > 0")


class ScalarLog:
    """Rank 0's scalar writer; a no-op on other ranks or when disabled."""

    def __init__(self, config: TensorBoardConfig, run_dir: Path, rank: int) -> None:
        self._writer = None
        if not config.enabled or rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        root = Path(config.dir) if Path(config.dir).is_absolute() else run_dir / config.dir
        log_dir = root / f"e{os.environ.get(EPOCH_ENV) or '0'}-{os.getpid()}"
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=int(max(config.flush_s, 1)))
        self.log_dir = log_dir

    def step(self, step: int, loss: float, step_time: float, grad_norm: float | None = None,
             tokens_per_s: float | None = None, lr: float | None = None, fp8: dict[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        w = self._writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("perf/step_time_s", step_time, step)
        if step_time > 0:
            w.add_scalar("perf/steps_per_s", 1.0 / step_time, step)
        if tokens_per_s is not None:
            w.add_scalar("perf/tokens_per_s", tokens_per_s, step)
        if grad_norm is not None:
            w.add_scalar("train/grad_norm", grad_norm, step)
        if lr is not None:
            w.add_scalar("train/lr", lr, step)
        for key, value in (fp8 or {}).items():
            # amax min/max per tensor kind and saturation counts, from trainer.fp8.fp8_stats
            if key != "layers" and isinstance(value, (int, float)):
                w.add_scalar(f"fp8/{key}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
