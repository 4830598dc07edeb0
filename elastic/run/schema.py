"""The run config: one YAML file, one typed dataclass per component, read by one function.

Precedence (lowest to highest): dataclass defaults, the YAML file, CLI flags
(``elastic-launch --nodes ...``, ``--set section.key=value``).  Unknown keys and bad values
are rejected with a one-line :class:`ConfigError` naming the dotted field path.

    run:         {id, dir, loss_plot}
    launch:      {nodes: "N" | "MIN:MAX", nproc_per_node, etcd_endpoint, node_id, local_addr,
                  workload | entrypoint, respawn_excluded}
    agent:       elastic.agent.config.AgentConfig
    rendezvous:  elastic.agent.config.RendezvousConfig
    checkpoint:  elastic.checkpoint.config.CheckpointConfig
    etcd:        elastic.control.etcd_security.EtcdClientConfig
    security:    elastic.control.admission.SecurityConfig
    trainer:     the workload's own section (its config class, see elastic.run.workloads);
                 passed through unread for a custom launch.entrypoint
    tensorboard: elastic.worker.scalars.TensorBoardConfig
    replicas:    elastic.replicas.config.ReplicaConfig (torchft replica-group mode)
    sdc:         elastic.sdc.config.SdcConfig (silent data corruption checks)

:func:`load_run_file` is the one reader: the launcher, the agents, the trainers, chaos and
the benchmarks all read a run file through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.checkpoint.config import CheckpointConfig
from elastic.common.config import ConfigError, from_dict, to_dict
from elastic.common.fingerprint import config_hash
from elastic.control.admission import SecurityConfig
from elastic.control.etcd_security import EtcdClientConfig
from elastic.replicas.config import ReplicaConfig
from elastic.run import workloads
from elastic.run.workloads import Workload
from elastic.sdc.config import SdcConfig
from elastic.worker.scalars import TensorBoardConfig

DEFAULT_WORKLOAD = "mlp"
RESOLVED_NAME = "config.resolved.yaml"
"""What the launcher writes into the run directory: the run file every process of the run reads."""

_NODES_RE = re.compile(r"^(\d+)(?::(\d+))?$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_nodes(text: str) -> tuple[int, int]:
    """"N" -> (N, N); "MIN:MAX" -> (MIN, MAX); ValueError otherwise."""
    match = _NODES_RE.match(str(text).strip())
    if not match:
        raise ValueError(f"must be N or MIN:MAX, got {text!r}")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) else lo
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


@dataclass(kw_only=True)
class RunSection:
    """The ``run:`` section: which run this is and where its files go."""

    id: str = "local"
    """Run id: names the run's keys in etcd and the rendezvous."""
    dir: str = ""
    """Run directory (events, checkpoints, logs, summary); default runs/<id>."""
    loss_plot: bool = True
    """Draw <dir>/loss.png (rank 0 loss, restarts and faults marked) when the run ends."""

    def __post_init__(self) -> None:
        if not _RUN_ID_RE.match(self.id):
            raise ConfigError("id", f"must match {_RUN_ID_RE.pattern}, got {self.id!r}")


@dataclass(kw_only=True)
class LaunchConfig:
    """The ``launch:`` section: how many nodes, where etcd is, what the workers run."""

    nodes: str = "1"
    """Number of nodes, "N" or elastic "MIN:MAX"."""
    nproc_per_node: int = 1
    """Workers per node (torchrun --nproc-per-node); with in-process recovery each node also keeps one
    warm spare (``agent.inprocess.spare``)."""
    etcd_endpoint: str | None = None
    """host:port of the run's etcd (host:port,host:port,... for every member of a cluster);
    empty -> local mode with an embedded etcd."""
    etcd_members: int = 1
    """Local mode: members of the embedded etcd cluster, 1 or 3.  Three survive the loss of one
    member (the raft leader included) without the run noticing."""
    node_id: str | None = None
    """This node's id in cluster mode (default: the hostname)."""
    local_addr: str | None = None
    """Address other nodes reach this node's workers at (torchrun --local-addr); default
    127.0.0.1 in local mode, the host's FQDN in cluster mode."""
    workload: str = ""
    """A registered workload (``mlp``, ``dit``, ...; see elastic.run.workloads); default mlp."""
    entrypoint: list[str] = field(default_factory=list)
    """Instead of a workload, any program torchrun runs (e.g. ``[-m, my.trainer]``); the agent
    appends --config and --run-dir."""
    respawn_excluded: bool = False
    """Local mode: restart a simulated node's agent once its exclusion expires or is cleared
    (a repaired node coming back), so an elastic run grows again."""
    standby: bool = False
    """Cluster mode (``elastic-launch --standby``): this host is a warm standby.  It starts its warm
    spares at once and waits; when a fixed-size run loses a node, it claims that node's slot and
    rejoins as that node, in-process, without the lost node's relaunch and cold start
    (:mod:`elastic.agent.standby`).  ``launch.node_id`` is then the standby's own name.  A node
    relaunched after a standby took its slot waits as a standby itself.  Needs in-process recovery
    (agent.inprocess.enabled, with rejoin_wait_s > 0)."""

    def __post_init__(self) -> None:
        try:
            parse_nodes(self.nodes)
        except ValueError as exc:
            raise ConfigError("nodes", str(exc)) from None
        if self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", "must be >= 1")
        if self.etcd_members not in (1, 3):
            raise ConfigError("etcd_members", f"must be 1 or 3, got {self.etcd_members}")
        if self.standby and not self.etcd_endpoint:
            raise ConfigError("standby", "a standby joins a cluster run: needs launch.etcd_endpoint")
        if self.etcd_members != 1 and self.etcd_endpoint:
            raise ConfigError("etcd_members", "only for local mode (the embedded etcd); etcd_endpoint is set")
        if self.workload and self.entrypoint:
            raise ConfigError("entrypoint", f"give launch.workload or launch.entrypoint, not both "
                                            f"(workload {self.workload!r})")

    @property
    def min_nodes(self) -> int:
        return parse_nodes(self.nodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nodes(self.nodes)[1]


@dataclass(kw_only=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    etcd: EtcdClientConfig = field(default_factory=EtcdClientConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    trainer: Any = field(default_factory=dict)
    """The workload's section: its config class once read (a plain mapping for a custom entrypoint)."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """Trainer scalars for TensorBoard (rank 0); outside ``trainer`` so it is not in the fingerprint."""
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)
    """Silent-data-corruption checks (cross-replica agreement in replica-group mode)."""
    fingerprint: str = ""
    """Set by the launcher: hash of what defines the training state (checkpoints from other configs are foreign)."""

    def __post_init__(self) -> None:
        workload = self.workload()
        if self.trainer is None:
            self.trainer = {}
        if workload is not None and isinstance(self.trainer, dict):
            self.trainer = from_dict(workload.config_class, self.trainer, "trainer")
        elif workload is None and not isinstance(self.trainer, dict):
            self.trainer = to_dict(self.trainer)
        self._check_replicas(workload)
        self._check_sdc(workload)

    def workload(self) -> Workload | None:
        """The registered workload this run trains, or None for a custom entrypoint."""
        if self.launch.entrypoint:
            return workloads.for_entrypoint(self.launch.entrypoint)
        return workloads.get(self.launch.workload or DEFAULT_WORKLOAD)

    def entrypoint(self) -> list[str]:
        """What torchrun runs (before --config and --run-dir)."""
        if self.launch.entrypoint:
            return list(self.launch.entrypoint)
        workload = self.workload()
        assert workload is not None
        return workload.argv(self.replicas.enabled)

    def inprocess_recovery(self) -> bool:
        """Whether faults are recovered in-process: on in the agent config, supported by the workload,
        and not in replica-group mode (torchft recovers a group its own way)."""
        workload = self.workload()
        return (self.agent.inprocess.enabled and not self.replicas.enabled and workload is not None
                and workloads.INPROCESS in workload.capabilities)

    def _check_replicas(self, workload: Workload | None) -> None:
        if not self.replicas.enabled:
            return
        if workload is not None and not self.launch.entrypoint and workloads.REPLICAS not in workload.capabilities:
            raise ConfigError("launch.workload", f"{workload.name!r} has no torchft support; replica-group mode "
                                                 f"(replicas.enabled) needs a workload with a replica entry point")
        if self.replicas.min_replicas > self.launch.max_nodes:
            raise ConfigError("replicas.min_replicas", f"{self.replicas.min_replicas} exceeds the "
                              f"{self.launch.max_nodes} replica groups launch.nodes allows (one group per node)")
        self._check_timeout_ladder()

    def _check_sdc(self, workload: Workload | None) -> None:
        """An SDC check that cannot run is an error, not a silent no-op."""
        self._check_replay(workload)
        if not self.sdc.agreement:
            return
        if not self.replicas.enabled:
            raise ConfigError("sdc.check_every", "compares replica groups: needs replicas.enabled")
        if workload is not None and workloads.SDC_AGREEMENT not in workload.capabilities:
            raise ConfigError("sdc.check_every", f"workload {workload.name!r} has no cross-replica agreement "
                                                 f"check (it is in the dit workload's replica trainer)")

    def _check_replay(self, workload: Workload | None) -> None:
        if not self.sdc.replay:
            return
        if self.replicas.enabled:
            raise ConfigError("sdc.replay_every", "replays a rank of one world; replica-group mode has sdc.check_every")
        inproc = self.agent.inprocess
        if not (inproc.enabled and inproc.spare):
            raise ConfigError("sdc.replay_every", "replays on the node's warm spare: needs agent.inprocess.enabled "
                                                  "and agent.inprocess.spare")
        if workload is not None and workloads.SDC_REPLAY not in workload.capabilities:
            raise ConfigError("sdc.replay_every", f"workload {workload.name!r} cannot replay a rank's step "
                                                  f"(the dit workload can)")

    def _check_timeout_ladder(self) -> None:
        """Replica-group mode's timeouts must rise: Lighthouse heartbeat < quorum < collective < hang.

        A dead group must drop out of the quorum before the survivors' quorum call gives up; a
        group waiting in the cross-group allreduce must outwait a peer still in its quorum; and a
        survivor blocked in that allreduce behind a hung peer must time out and report a step
        before its own agent calls it hung (docs/architecture.md, "Replica groups for the DiT trainer")."""
        rungs = [("replicas.heartbeat_timeout_ms", self.replicas.heartbeat_timeout_ms / 1000.0),
                 ("replicas.quorum_timeout_s", self.replicas.quorum_timeout_s),
                 ("replicas.timeout_s", self.replicas.timeout_s),
                 ("agent.heartbeat.step_timeout_s", self.agent.heartbeat.step_timeout_s)]
        # Beside the ladder: a quorum may also wait join_timeout_ms for a straggler before it forms.
        join = ("replicas.join_timeout_ms", self.replicas.join_timeout_ms / 1000.0)
        pairs = [*zip(rungs, rungs[1:]), (join, rungs[1])]
        for (low, low_s), (high, high_s) in pairs:
            if not low_s < high_s:
                raise ConfigError(low, f"must be below {high} ({low_s:g} s >= {high_s:g} s; replica-group "
                                       f"timeouts must rise: heartbeat < quorum < collective < hang)")

    def check_launch(self) -> None:
        """The launcher's check, after every flag is applied: each world size the elastic range allows
        must suit the trainer (e.g. split its global batch).  Workers started by plain torchrun read
        the same file without it: their world is what torchrun gave them."""
        workload = self.workload()
        if self.launch.standby and not (self.inprocess_recovery() and self.agent.inprocess.rejoin_wait_s > 0):
            raise ConfigError("launch.standby", "a standby takes a lost node's slot in-process: needs "
                                                "agent.inprocess.enabled (a workload that supports it, no "
                                                "replicas) and agent.inprocess.rejoin_wait_s > 0")
        if workload is not None and self.replicas.enabled:
            self._check_replica_groups(workload)
            return
        if workload is None or workload.check_world is None:
            return
        lo, hi = self.launch.min_nodes, self.launch.max_nodes
        for nodes in range(lo, hi + 1):
            try:
                workload.check_world(self.trainer, nodes * self.launch.nproc_per_node)
            except ConfigError as exc:
                raise ConfigError(f"trainer.{exc.path}" if exc.path else "trainer",
                                  f"{exc.message} (at {nodes} nodes of launch.nodes={self.launch.nodes})") from None

    def _check_replica_groups(self, workload: Workload) -> None:
        """One group per node of ``nproc_per_node`` ranks; up to launch's most nodes of them."""
        group, groups = self.launch.nproc_per_node, self.launch.max_nodes
        try:
            if workload.check_replicas is not None:
                workload.check_replicas(self.trainer, group, groups)
            elif workload.check_world is not None:
                workload.check_world(self.trainer, group)
        except ConfigError as exc:
            raise ConfigError(f"trainer.{exc.path}" if exc.path else "trainer",
                              f"{exc.message} (replica groups of launch.nproc_per_node={group}, "
                              f"up to {groups} of them)") from None

    def trainer_steps(self) -> int | None:
        """Steps the trainer runs in total, when its section says (a custom trainer's may not)."""
        steps = self.trainer.get("steps") if isinstance(self.trainer, dict) else getattr(self.trainer, "steps", None)
        return steps if isinstance(steps, int) else None

    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.id}")

    def fingerprint_basis(self) -> dict[str, Any]:
        """What the checkpoint fingerprint hashes: exactly what changes the meaning of saved state.

        The workload and its ``trainer`` section, minus the fields its config class lists in
        ``checkpoint_neutral_fields`` (run length, pacing, logging: a run extended with more
        steps resumes its checkpoints).  Restart budgets, timeouts, paths and the world layout
        are left out too: the loader reshards to any world size.  A custom entrypoint's section
        is opaque, so all of it counts.  Stored in each COMMIT marker, so a loader that rejects
        a checkpoint can name the fields that differ.
        """
        workload = self.workload()
        trainer = to_dict(self.trainer)
        for path in getattr(type(self.trainer), "checkpoint_neutral_fields", ()):
            _drop_path(trainer, path)
        return {"workload": workload.name if workload is not None else list(self.launch.entrypoint),
                "trainer": trainer}

    def compute_fingerprint(self) -> str:
        return config_hash(self.fingerprint_basis())


def _drop_path(tree: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
        if not isinstance(tree, dict):
            return
    tree.pop(leaf, None)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a YAML file; ConfigError (one line) when unreadable or not YAML."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError("", f"{path}: invalid YAML{where}") from None
    return data or {}


def load_run_file(path: str | os.PathLike[str] | None, trainer_class: type | None = None) -> RunConfig:
    """A run config YAML -> RunConfig; ConfigError (one line, names the field) on any problem.

    ``trainer_class``: a trainer reading its own run file names the schema of its section, so a
    run that starts it through a custom ``launch.entrypoint`` still gets its typed config.
    """
    cfg = from_dict(RunConfig, read_yaml(path) if path is not None else {})
    if trainer_class is not None and not isinstance(cfg.trainer, trainer_class):
        cfg.trainer = from_dict(trainer_class, to_dict(cfg.trainer), "trainer")
    return cfg


def dump_run_file(cfg: RunConfig, path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
