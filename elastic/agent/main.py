"""``python -m elastic.agent``: read the run file, build this node's agent, run it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from elastic.agent.attempt import NodeSpec
from elastic.agent.node import NodeAgent
from elastic.common.exits import EXIT_CONFIG
from elastic.common.config import ConfigError, to_dict
from elastic.common.procs import set_parent_death_signal
from elastic.control.admission import Admission, join_fingerprint
from elastic.control.store import StoreAuthError, StoreTLSError
from elastic.run.schema import RunConfig, load_run_file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elastic.agent", description="per-node elastic agent")
    p.add_argument("--run-id", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--etcd-endpoint", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True, help="resolved run config (YAML)")
    p.add_argument("--local-addr", default="127.0.0.1", help="where peers reach this node (torchrun --local-addr)")
    return p.parse_args(argv)


def build_agent(cfg: RunConfig, args: argparse.Namespace, token: str | None) -> NodeAgent:
    run_dir = Path(args.run_dir)
    spec = NodeSpec(
        run_id=args.run_id, node_id=args.node_id, endpoint=args.etcd_endpoint, run_dir=run_dir,
        nnodes=cfg.launch.nodes, nproc_per_node=cfg.launch.nproc_per_node,
        entrypoint=[*cfg.entrypoint(), "--config", args.config, "--run-dir", str(run_dir)],
        local_addr=args.local_addr,
    )
    admission = Admission(run_id=args.run_id, node_id=args.node_id, token=token,
                          fingerprint=join_fingerprint(to_dict(cfg)), join_check=cfg.security.join_check)
    return NodeAgent(spec, cfg.agent, cfg.rendezvous, admission, memory=cfg.checkpoint.memory, replicas=cfg.replicas,
                     inprocess=cfg.inprocess_recovery(),
                     checkpoint_root=cfg.checkpoint.root(run_dir), sdc_replay=cfg.sdc.replay)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # If the launcher dies without cleaning up, the kernel tells us; we then stop our workers.
    set_parent_death_signal(signal.SIGTERM)
    try:
        cfg = load_run_file(args.config)
        # Children (torchrun, workers, diag) inherit the etcd credentials through the environment.
        if cfg.etcd.enabled:
            os.environ.update(cfg.etcd.resolve().env())
        token = cfg.security.token()
    except ConfigError as exc:
        print(f"elastic-agent: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    agent = build_agent(cfg, args, token)
    agent.install_signal_handlers()
    try:
        return agent.run()
    except (StoreAuthError, StoreTLSError) as exc:
        print(f"elastic-agent: node {args.node_id}: etcd error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
