"""The run config: one YAML file, one typed dataclass per component.

Precedence (lowest to highest): dataclass defaults, the YAML file, CLI flags
(``elastic-launch --nodes ...``, ``--set section.key=value``).  Unknown keys
and bad values are rejected with a one-line :class:`ConfigError` naming the
dotted field path.

    run:        {id, dir}
    launch:     {nodes: "N" | "MIN:MAX", nproc_per_node, etcd_endpoint, entrypoint}
    agent:      elastic.agent.node.AgentConfig
    rendezvous: elastic.agent.node.RendezvousConfig
    checkpoint: elastic.checkpoint.manager.CheckpointConfig
    etcd:       elastic.control.etcd_security.EtcdClientConfig (TLS client cert, user; password by reference)
    security:   elastic.control.admission.SecurityConfig (run token by reference, join check)
    trainer:    the trainer's own section (trainer.train.MLPTrainerConfig)
    replicas:   elastic.replicas.config.ReplicaConfig (torchft replica-group mode, off by default)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from elastic.control.admission import SecurityConfig
from elastic.agent.config import AgentConfig, RendezvousConfig
from elastic.checkpoint.config import CheckpointConfig
from elastic.common.config import ConfigError, from_dict, to_dict
from elastic.control.etcd_security import EtcdClientConfig
from elastic.common.fingerprint import config_hash
from elastic.replicas.config import ReplicaConfig, check_replica_launch
from trainer.dit_config import DiTTrainerConfig
from trainer.minimal_config import MLPTrainerConfig
from trainer.tensorboard import TensorBoardConfig

DIT_ENTRYPOINT = ["-m", "trainer.dit_train"]

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
    nodes: str = "1"
    """Number of nodes, "N" or elastic "MIN:MAX"."""
    nproc_per_node: int = 1
    etcd_endpoint: str | None = None
    """host:port of the run's etcd; empty -> local mode with an embedded etcd."""
    node_id: str | None = None
    """This node's id in cluster mode (default: the hostname)."""
    local_addr: str | None = None
    """Address other nodes reach this node's workers at (torchrun --local-addr); default
    127.0.0.1 in local mode, the host's FQDN in cluster mode."""
    entrypoint: list[str] = field(default_factory=lambda: ["-m", "trainer.train"])
    """What torchrun runs; the agent appends --config and --run-dir."""
    respawn_excluded: bool = False
    """Local mode: restart a simulated node's agent once its exclusion expires or is cleared
    (a repaired node coming back), so an elastic run grows again."""

    def __post_init__(self) -> None:
        try:
            parse_nodes(self.nodes)
        except ValueError as exc:
            raise ConfigError("nodes", str(exc)) from None
        if self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", "must be >= 1")
        if not self.entrypoint:
            raise ConfigError("entrypoint", "must not be empty")

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
    trainer: MLPTrainerConfig = field(default_factory=MLPTrainerConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """Trainer scalars for TensorBoard (rank 0); outside ``trainer`` so it is not in the fingerprint."""
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    fingerprint: str = ""
    """Set by the launcher: hash of what defines the training state (checkpoints from other configs are foreign)."""

    def __post_init__(self) -> None:
        check_replica_launch(self.replicas, self.launch.entrypoint, self.launch.max_nodes)

    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.id}")

    def compute_fingerprint(self) -> str:
        # Only what changes the meaning of saved state: the trainer section and world layout.
        # Restart budgets, timeouts and paths may change between restarts of the same run.
        return config_hash({"trainer": to_dict(self.trainer), "nproc_per_node": self.launch.nproc_per_node})


@dataclass(kw_only=True)
class DiTRunConfig(RunConfig):
    """A run of the reference DiT trainer: the trainer section is its config."""

    launch: LaunchConfig = field(default_factory=lambda: LaunchConfig(entrypoint=list(DIT_ENTRYPOINT)))
    trainer: DiTTrainerConfig = field(default_factory=DiTTrainerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Every world size the elastic range allows must split the global batch and the cp axis.
        lo, hi = self.launch.min_nodes, self.launch.max_nodes
        for nodes in range(lo, hi + 1):
            try:
                self.trainer.check_world(nodes * self.launch.nproc_per_node)
            except ConfigError as exc:
                raise ConfigError(f"trainer.{exc.path}" if exc.path else "trainer",
                                  f"{exc.message} (at {nodes} nodes of launch.nodes={self.launch.nodes})") from None


def config_class(data: dict) -> type[RunConfig]:
    """The trainer section's schema follows the entrypoint torchrun runs."""
    launch = data.get("launch") if isinstance(data, dict) else None
    entry = launch.get("entrypoint") if isinstance(launch, dict) else None
    return DiTRunConfig if entry == DIT_ENTRYPOINT else RunConfig


def load_config(path: str | os.PathLike[str] | None) -> RunConfig:
    """YAML file -> RunConfig; ConfigError (one line, names the field) on any problem."""
    if path is None:
        return RunConfig()
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
    data = data or {}
    return from_dict(config_class(data), data)


def dump_config(cfg: RunConfig, path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
