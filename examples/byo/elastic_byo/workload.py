"""The ``byo`` workload, named by this package's entry point in the ``elastic.workloads`` group.

Read by the launcher before any worker starts: it imports the config class, never torch."""

from __future__ import annotations

from elastic.run.workloads import Workload
from elastic_byo.config import ByoConfig


def _check_world(cfg: ByoConfig, world_size: int) -> None:
    cfg.check_world(world_size)


BYO = Workload(
    name="byo", entry="elastic_byo.train", config_class=ByoConfig, check_world=_check_world, inprocess=True,
    description="bring your own loop: a plain FSDP2 residual MLP trained through elastic.api (examples/byo)",
)
