"""The workloads this package registers with the runtime (entry-point group ``elastic.workloads``).

Imported by the launcher to read a run's ``trainer`` section, so it must not import torch:
only the trainers' config modules are imported here, the trainers run under torchrun.
"""

from __future__ import annotations

from elastic.run.workloads import Workload
from trainer.dit_config import DiTTrainerConfig
from trainer.minimal_config import MLPTrainerConfig


def _dit_world(cfg: DiTTrainerConfig, world_size: int) -> None:
    cfg.check_world(world_size)


def _dit_groups(cfg: DiTTrainerConfig, group_size: int, max_groups: int) -> None:
    cfg.check_replica_groups(group_size, max_groups)


MLP = Workload(
    name="mlp", entry="trainer.train", replica_entry="trainer.ft_train", config_class=MLPTrainerConfig, inprocess=True,
    description="small FSDP2 MLP regression; deterministic and bitwise resumable (the runtime's test workload)",
)
DIT = Workload(
    name="dit", entry="trainer.dit_train", replica_entry="trainer.dit_ft_train", config_class=DiTTrainerConfig,
    check_world=_dit_world, check_replicas=_dit_groups, inprocess=True, sdc_agreement=True, sdc_replay=True,
    description="DiT flow matching: FSDP2, Ulysses context parallel, FP8 linears, resumable global sampler",
)
