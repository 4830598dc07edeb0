"""Workloads: the trainers the runtime can run, registered by name through entry points.

The runtime never imports a trainer.  A package declares its workloads in the entry-point group
``elastic.workloads``; each entry point names a :class:`Workload` object (the module it lives
in must import without torch: it is read by the launcher).  ``launch.workload: <name>`` in the
run config picks one; ``launch.entrypoint`` still runs any other program (a user's own trainer),
whose ``trainer`` section the runtime then passes through unread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from elastic.common.config import ConfigError

GROUP = "elastic.workloads"

REPLICAS = "replicas"
"""Capability: the workload has a torchft replica-group entry point."""
INPROCESS = "inprocess"
"""Capability: the trainer runs in a WorkerSession loop that can re-form its world in-process."""
SDC_AGREEMENT = "sdc_agreement"
"""Capability: its replica entry point runs the cross-replica agreement check (``sdc.check_every``)."""
SDC_REPLAY = "sdc_replay"
"""Capability: its trainer takes part in replay verification (``sdc.replay_every``) and its module
can replay one rank's gradient on a spare (``replay_gradients``)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    entry: str
    """Module torchrun runs (``python -m <entry> --config FILE --run-dir DIR``)."""
    config_class: type
    """Dataclass of the run config's ``trainer`` section.  It may name, in a class attribute
    ``checkpoint_neutral_fields`` (frozenset of dotted paths), the fields that do not change the
    meaning of saved state (run length, pacing, logging); they stay out of the checkpoint
    fingerprint (:meth:`elastic.run.schema.RunConfig.fingerprint_basis`)."""
    replica_entry: str = ""
    """Module that speaks torchft, run instead of ``entry`` when ``replicas.enabled``."""
    inprocess: bool = False
    """Its trainer drives its steps through ``WorkerSession.train`` (in-process recovery works)."""
    sdc_agreement: bool = False
    """Its replica entry point compares the groups' parameter checksums (``sdc.check_every``)."""
    sdc_replay: bool = False
    """Its trainer runs replay verification (``sdc.replay_every``)."""
    check_world: Callable[[Any, int], None] | None = None
    """Raises ConfigError (path relative to ``trainer``) for a world size the config cannot use."""
    check_replicas: Callable[[Any, int, int], None] | None = None
    """Replica-group mode's check instead: (trainer config, ranks per group, most groups)."""
    description: str = ""

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(name for name, on in ((REPLICAS, bool(self.replica_entry)), (INPROCESS, self.inprocess),
                                               (SDC_AGREEMENT, self.sdc_agreement), (SDC_REPLAY, self.sdc_replay))
                         if on)

    def argv(self, replicas: bool) -> list[str]:
        return ["-m", self.replica_entry if replicas else self.entry]


@cache
def available() -> dict[str, Workload]:
    """Every registered workload by name (entry points are read once per process)."""
    found: dict[str, Workload] = {}
    for ep in entry_points(group=GROUP):
        workload = ep.load()
        if not isinstance(workload, Workload) or workload.name != ep.name:
            raise RuntimeError(f"entry point {ep.name} = {ep.value} is not a Workload named {ep.name!r}")
        found[ep.name] = workload
    return found


def get(name: str) -> Workload:
    workloads = available()
    if name not in workloads:
        known = ", ".join(sorted(workloads)) or "none installed"
        raise ConfigError("launch.workload", f"unknown workload {name!r} (known: {known})")
    return workloads[name]


def for_entrypoint(argv: list[str]) -> Workload | None:
    """The registered workload whose module ``argv`` runs (``-m <module>``), if any."""
    if len(argv) != 2 or argv[0] != "-m":
        return None
    return next((w for w in available().values() if argv[1] in (w.entry, w.replica_entry)), None)
