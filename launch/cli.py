"""``elastic-launch``: run a training job under elastic agents.

    elastic-launch --nodes 4 examples/tiny.yaml          # local: embedded etcd, 4 simulated nodes
    elastic-launch --nodes 2:4 --etcd-endpoint 10.0.0.5:2379 --node-id $(hostname) job.yaml

Flags override the YAML file; ``--set section.key=value`` overrides any
field (value parsed as YAML).  Config errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from elastic.common.cli_errors import OneLineArgumentParser
from elastic.common.config import ConfigError, override
from elastic.control.store import StoreError
from elastic.run.schema import RunConfig, load_run_file
from launch.security import SECURITY_FLAGS, add_security_flags, apply_security_flags, prepare_etcd_access


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="elastic-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="run config YAML (defaults apply without one)")
    p.add_argument("--nodes", help='number of nodes, "N" or "MIN:MAX" (launch.nodes)')
    p.add_argument("--nproc-per-node", type=int, help="workers per node (launch.nproc_per_node)")
    p.add_argument("--etcd-endpoint", help="host:port of etcd; omit for local mode (launch.etcd_endpoint)")
    p.add_argument("--node-id", help="this node's id in cluster mode (launch.node_id)")
    p.add_argument("--local-addr", help="address peers reach this node at, cluster mode (launch.local_addr)")
    p.add_argument("--run-id", help="run id (run.id)")
    p.add_argument("--run-dir", help="run directory (run.dir)")
    p.add_argument("--max-restarts", type=int, help="per-node restart budget (agent.max_restarts)")
    p.add_argument("--steps", type=int, help="training steps (trainer.steps)")
    p.add_argument("--allow-chaos", action="store_true",
                   help="execute chaos faults delivered to this node through etcd (agent.chaos.enabled; off by default)")
    p.add_argument("--standby", action="store_true",
                   help="cluster mode: a warm standby that takes the slot of a node the run loses (launch.standby)")
    p.add_argument("--fresh", action="store_true",
                   help="start from step 0: move the run dir's checkpoints aside (checkpoints.old-N), never delete")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set checkpoint.interval_steps=5")
    add_security_flags(p)
    return p


_FLAG_FIELDS = {
    "nodes": "launch.nodes",
    "nproc_per_node": "launch.nproc_per_node",
    "etcd_endpoint": "launch.etcd_endpoint",
    "node_id": "launch.node_id",
    "local_addr": "launch.local_addr",
    "run_id": "run.id",
    "run_dir": "run.dir",
    "max_restarts": "agent.max_restarts",
    "steps": "trainer.steps",
}
_ALLOW_CHAOS_FIELD = "agent.chaos.enabled"
_STANDBY_FIELD = "launch.standby"


def field_flags() -> dict[str, str]:
    """Dotted config field -> the flag that sets it (the config reference, launch/config_docs.py, lists them)."""
    flags = {dotted: f"--{attr.replace('_', '-')}" for attr, dotted in _FLAG_FIELDS.items()}
    flags.update({dotted: flag for flag, dotted in SECURITY_FLAGS.items()})
    flags[_ALLOW_CHAOS_FIELD] = "--allow-chaos"
    flags[_STANDBY_FIELD] = "--standby"
    return flags


def resolve_config(args: argparse.Namespace) -> RunConfig:
    cfg = load_run_file(args.config)
    for attr, dotted in _FLAG_FIELDS.items():
        value = getattr(args, attr)
        if value is not None:
            try:
                cfg = override(cfg, dotted, value)
            except ConfigError as exc:
                raise ConfigError(f"--{attr.replace('_', '-')}", exc.message) from None
    cfg = apply_security_flags(cfg, args)
    if args.allow_chaos:
        cfg = override(cfg, _ALLOW_CHAOS_FIELD, True)
    if args.standby:
        cfg = override(cfg, _STANDBY_FIELD, True)
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}", f"cannot parse value {raw!r}") from None
        cfg = override(cfg, key.strip(), value)
    cfg.check_launch()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        if cfg.launch.etcd_endpoint:
            from elastic.control.store import parse_endpoints

            try:
                parse_endpoints(cfg.launch.etcd_endpoint)
            except ValueError as exc:
                raise ConfigError("launch.etcd_endpoint", str(exc)) from None
        prepare_etcd_access(cfg)
    except ConfigError as exc:
        print(f"elastic-launch: config error: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:  # credentials refused (auth / TLS): retrying cannot help
        print(f"elastic-launch: etcd error: {exc}", file=sys.stderr)
        return 2
    return _launch(cfg, args.fresh)


def _launch(cfg: RunConfig, fresh: bool) -> int:
    from elastic.control.etcd_server import EtcdServerError
    from launch.checkpoints import CheckpointConflict, check_checkpoints
    from launch.local import Launcher, format_summary
    from launch.rundir import RunDirError, os_error_line, prepare_run_dir

    run_dir = Path(cfg.run_dir()).resolve()
    try:
        prepare_run_dir(run_dir, embedded_etcd=not cfg.launch.etcd_endpoint)
        check_checkpoints(cfg, run_dir, fresh, lambda line: print(f"elastic-launch: {line}", file=sys.stderr))
        result = Launcher(cfg, run_dir, live=sys.stdout.isatty()).run()
    except RunDirError as exc:
        print(f"elastic-launch: run dir error: {exc}", file=sys.stderr)
        return 2
    except CheckpointConflict as exc:
        print(f"elastic-launch: checkpoint mismatch: {exc}", file=sys.stderr)
        return 2
    except EtcdServerError as exc:
        print(f"elastic-launch: etcd error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the run dir failed under the running launch (e.g. the disk filled up)
        print(f"elastic-launch: run dir error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    print(format_summary(result.summary), flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
