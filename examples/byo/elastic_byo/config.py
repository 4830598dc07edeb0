"""The ``trainer`` section of a ``byo`` run; imported by the launcher, so it must not import torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class ByoConfig:
    checkpoint_neutral_fields: ClassVar[frozenset[str]] = frozenset({"steps", "step_sleep"})
    """Run length and pacing: a finished run relaunched with more steps resumes its checkpoints."""

    steps: int = 40
    """Optimizer steps to train in total (across restarts)."""
    seed: int = 0
    """Seeds the model init and the data (a batch is made from the seed and the data position alone)."""
    global_batch_size: int = 16
    """Samples per step over all ranks; every world size the run may use must divide it."""
    dim: int = 32
    """Width of the model's input, output and residual stream."""
    blocks: int = 2
    """Residual MLP blocks (LayerNorm, Linear, GELU, Linear), each sharded on its own."""
    lr: float = 1e-2
    """AdamW learning rate."""
    step_sleep: float = 0.0
    """Extra seconds per step (stands in for device time), so that faults land mid-run."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "dim", "blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.lr <= 0:
            raise ConfigError("lr", "must be > 0")
        if self.step_sleep < 0:
            raise ConfigError("step_sleep", "must be >= 0")

    def check_world(self, world_size: int) -> None:
        if self.global_batch_size % world_size:
            raise ConfigError("global_batch_size", f"{self.global_batch_size} is not divisible by "
                                                   f"a world of {world_size} ranks")
