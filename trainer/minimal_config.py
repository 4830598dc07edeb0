"""Config of the minimal MLP trainer, importable without torch (the launcher validates it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class MLPTrainerConfig:
    checkpoint_neutral_fields: ClassVar[frozenset[str]] = frozenset({"steps", "step_sleep"})
    """Run length and pacing: a finished run relaunched with more steps resumes its checkpoints."""

    steps: int = 40
    """Optimizer steps to train in total (across restarts)."""
    seed: int = 0
    """Seeds the model init and every batch (a batch is made from seed, step and rank alone)."""
    batch_size: int = 16
    """Per-rank batch size."""
    dim: int = 32
    """Width of every layer (input, hidden and output)."""
    depth: int = 3
    """Linear layers (GELU between them)."""
    lr: float = 1e-2
    """AdamW learning rate."""
    step_sleep: float = 0.0
    """Extra seconds per step, so that faults can land mid-run in tests and demos."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "dim", "depth"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.lr <= 0:
            raise ConfigError("lr", "must be > 0")
        if self.step_sleep < 0:
            raise ConfigError("step_sleep", "must be >= 0")
