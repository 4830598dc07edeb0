"""The ``sdc:`` section: silent-data-corruption checks (importable without torch; the launcher validates it)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.common.config import ConfigError


@dataclass(kw_only=True)
class SdcConfig:
    """The ``sdc:`` section: catch a node that silently computes wrong."""

    check_every: int = 0
    """Replica-group mode: every this many committed steps, the groups of the quorum compare a CRC32
    of each rank's parameter shard (8 bytes per group, in one torchft allreduce); a group in the
    minority is named in an ``sdc.suspect`` event and heals from the others.  0 (default) is off.
    Cost per check: one CRC32 pass over the rank's parameter shard (measured 2 GB/s on one core of
    the test host, plus a device-to-host copy on a GPU) and two small collectives; nothing between
    checks.  Needs replicas.enabled and at least 3 groups for a majority (with 2 a mismatch is
    reported, not healed)."""

    replay_every: int = 0
    """Replay verification: every this many steps, on every node (or ``replay_nodes`` of them) one
    local rank's gradient (the same local index on each node: round robin, then seeded random) is
    recomputed by another node's
    warm spare from the step's weights and batch, and the checksums compared
    (:mod:`elastic.sdc.replay`); a mismatch emits ``sdc.suspect`` naming the node, rank and step.
    0 (default) is off.  Cost per check: on the checked rank, a copy and a CRC32 of its local
    gradient (off the training thread); on the capturing rank, a host copy of the step's unsharded
    weights written to the run directory (off the training thread); on the spare, one rank's forward
    and backward; in etcd, one put per checked node.  Needs the in-process path with its warm spare
    (agent.inprocess.enabled and spare), FSDP over more than one rank, and cp 1."""

    replay_nodes: int = 0
    """How many nodes have a rank checked at each check step (0, the default: every node).  Fewer
    divides replay verification's compute and etcd writes per check by ``nodes / replay_nodes``: the
    checks cycle through the nodes (index order in the first cycle, then each cycle shuffled by the
    seed), so every node is checked once in each cycle of ``ceil(nodes / replay_nodes)`` checks
    (two checks of a node lie at most two cycles apart), and a checkpoint is verified only once
    every node's newest check has reached it.  The price: a
    one-off flip on a node that is not checked at its step is not seen (a persistent fault is, on
    the node's next check).  On a host where the spares share the ranks' cores (the 2-core CPU test
    host), every node's replay per check costs about 1/``replay_every`` of the ranks' compute."""

    replay_ab_block: int = 0
    """For measuring replay verification's cost within one run (``benchmarks/sdc.py``): check only
    in alternate blocks of this many steps (steps 1..N checked, the next N not, ...), so both sides
    of the comparison share the host's load.  A fault in a block without checks goes unseen.  0: off."""

    def __post_init__(self) -> None:
        if self.replay_ab_block < 0:
            raise ConfigError("replay_ab_block", f"must be >= 0 (0: off), got {self.replay_ab_block}")
        if self.check_every < 0:
            raise ConfigError("check_every", f"must be >= 0 (0: off), got {self.check_every}")
        if self.replay_nodes < 0:
            raise ConfigError("replay_nodes", f"must be >= 0 (0: every node), got {self.replay_nodes}")
        if self.replay_every < 0:
            raise ConfigError("replay_every", f"must be >= 0 (0: off), got {self.replay_every}")

    @property
    def replay(self) -> bool:
        """Whether replay verification runs."""
        return self.replay_every > 0

    def node_cycle(self, nodes: int) -> int:
        """Checks it takes to check every one of ``nodes`` nodes once (1 when every check covers all)."""
        per = self.replay_nodes
        return 1 if per <= 0 or per >= nodes else -(-nodes // per)

    @property
    def agreement(self) -> bool:
        """Whether the cross-replica agreement check runs."""
        return self.check_every > 0
