"""The ``sdc:`` section: silent-data-corruption checks (importable without torch; the launcher validates it)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class SdcConfig:
    """The ``sdc:`` section: catch a replica group whose weights silently went wrong."""

    check_every: int = 0
    """Replica-group mode: every this many committed steps, the groups of the quorum compare a CRC32
    of each rank's parameter shard (8 bytes per group, in one torchft allreduce); a group in the
    minority is named in an ``sdc.suspect`` event and heals from the others.  0 (default) is off.
    Cost per check: one CRC32 pass over the rank's parameter shard (measured 2 GB/s on one core of
    the test host, plus a device-to-host copy on a GPU) and two small collectives; nothing between
    checks.  Needs replicas.enabled and at least 3 groups for a majority (with 2 a mismatch is
    reported, not healed)."""

    def __post_init__(self) -> None:
        if self.check_every < 0:
            raise ConfigError("check_every", f"must be >= 0 (0: off), got {self.check_every}")

    @property
    def agreement(self) -> bool:
        """Whether the cross-replica agreement check runs."""
        return self.check_every > 0
