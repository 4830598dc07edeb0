"""``python -m elastic.agent``: read the run file, build this node's agent, run it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from elastic.agent.attempt import NodeSpec, base_env
from elastic.agent.inprocess import WarmSpare, spawn_spare
from elastic.agent.node import NodeAgent
from elastic.agent.screener import Screener
from elastic.agent.slots import Claimant, SlotClaims
from elastic.agent.standby import Standby
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_CONFIG, EXIT_EXCLUDED
from elastic.common.config import ConfigError, to_dict
from elastic.common.procs import set_parent_death_signal
from elastic.control.admission import Admission, Refused, join_fingerprint
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreAuthError, StoreTLSError
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


def worker_entrypoint(cfg: RunConfig, args: argparse.Namespace) -> list[str]:
    return [*cfg.entrypoint(), "--config", args.config, "--run-dir", args.run_dir]


def build_agent(cfg: RunConfig, args: argparse.Namespace, token: str | None, node_id: str | None = None,
                spares: list[WarmSpare] | None = None) -> NodeAgent:
    """The agent of ``node_id`` (default ``--node-id``; a standby's: the node whose slot it took)."""
    run_dir = Path(args.run_dir)
    node_id = node_id or args.node_id
    spec = NodeSpec(
        run_id=args.run_id, node_id=node_id, endpoint=args.etcd_endpoint, run_dir=run_dir,
        nnodes=cfg.launch.nodes, nproc_per_node=cfg.launch.nproc_per_node,
        entrypoint=worker_entrypoint(cfg, args), local_addr=args.local_addr,
    )
    return NodeAgent(spec, cfg.agent, cfg.rendezvous, admission(cfg, args, token, node_id),
                     memory=cfg.checkpoint.memory, replicas=cfg.replicas, inprocess=cfg.inprocess_recovery(),
                     checkpoint_root=cfg.checkpoint.root(run_dir), sdc_replay=cfg.sdc.replay,
                     claimant=Claimant.this_process(args.node_id), spares=spares, screened=bool(spares))


def admission(cfg: RunConfig, args: argparse.Namespace, token: str | None, node_id: str) -> Admission:
    return Admission(run_id=args.run_id, node_id=node_id, token=token,
                     fingerprint=join_fingerprint(to_dict(cfg)), join_check=cfg.security.join_check)


def wait_as_standby(cfg: RunConfig, args: argparse.Namespace, token: str | None
                    ) -> tuple[str, list[WarmSpare]] | int:
    """Start the warm spares, then wait for a lost node's slot (elastic.agent.standby): the node id
    and the spares, or the exit code once the run is over or this process is stopped.  Admitted
    first: a standby the run would refuse (token, code, config) must not claim a slot it cannot take."""
    keys = RunKeys.of(cfg.rendezvous.key_prefix, args.run_id)
    state = RunState(EtcdStore(args.etcd_endpoint, retry_deadline=min(15.0, cfg.agent.etcd_wait_s)), keys)
    events = EventLog(Path(args.run_dir) / "events" / f"standby-{args.node_id}.jsonl", f"standby/{args.node_id}")
    try:
        admission(cfg, args, token, args.node_id).check(state.store, keys, events)
    except Refused as exc:
        print(f"elastic-agent: standby {args.node_id}: refused: {exc}", file=sys.stderr)
        return exc.code
    spares = _start_spares(cfg, args)
    got = _screen_standby(cfg, args, state, events)
    if got is None:
        needed = int(str(cfg.launch.nodes).partition(":")[0])
        claims = SlotClaims(state, Claimant.this_process(args.node_id))
        got = Standby(state, claims, events, _stop_on_signal(), needed).wait(spares)
    events.close()
    if isinstance(got, str):
        return got, spares
    for proc, _ in spares:
        proc.kill()
        proc.wait()
    return got


def _screen_standby(cfg: RunConfig, args: argparse.Namespace, state: RunState, events: EventLog) -> int | None:
    """A standby is screened while it waits (``diag burnin``, as a pre-flight screen), not in the first
    worker of the slot it takes: that worker's screen ran beside the survivors' recovery (0.39 s of
    CPU in a soak; on a GPU, GEMM and bandwidth checks its first step would wait for).  None when it
    passed, else the exit code after excluding itself (93: do not requeue)."""
    preflight = cfg.agent.preflight
    excluded = state.exclusions.get(args.node_id)
    # As an agent judges its own exclusion: one by a failed screen is lifted by passing one.
    if excluded is not None and not (preflight.enabled and excluded.get("by") in ("preflight", "rescreen")):
        events.emit("standby.excluded", reason=excluded.get("reason"), until=excluded.get("until"))
        return EXIT_EXCLUDED
    if not preflight.enabled:
        return None
    result = Screener(preflight, args.node_id, Path(args.run_dir), args.etcd_endpoint, state, events).screen(
        "standby pre-flight")
    if result.passed:
        if excluded is not None:
            state.exclusions.clear(args.node_id)
        return None
    state.exclusions.add(args.node_id, result.reason, ttl_s=cfg.agent.preflight.exclusion_ttl_s, by="preflight")
    events.emit("standby.excluded", reason=result.reason)
    return EXIT_EXCLUDED


def _start_spares(cfg: RunConfig, args: argparse.Namespace) -> list[WarmSpare]:
    """One warm spare per local rank, with only the base environment: the node comes with the slot."""
    log_dir = Path(args.run_dir) / "torchrun" / args.node_id / "standby"
    return [spawn_spare(worker_entrypoint(cfg, args), base_env(inprocess=True), log_dir)
            for _ in range(cfg.launch.nproc_per_node)]


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


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
    try:
        return _run(cfg, args, token)
    except (StoreAuthError, StoreTLSError) as exc:
        print(f"elastic-agent: node {args.node_id}: etcd error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def _run(cfg: RunConfig, args: argparse.Namespace, token: str | None) -> int:
    """Run as ``--node-id``, or first wait as a standby (``launch.standby``) for the node whose
    slot it takes; a node whose slot a standby took meanwhile waits as a standby too."""
    standby = cfg.launch.standby
    while True:
        node_id, spares = args.node_id, []
        if standby:
            got = wait_as_standby(cfg, args, token)
            if isinstance(got, int):
                return got
            node_id, spares = got
        agent = build_agent(cfg, args, token, node_id, spares)
        agent.install_signal_handlers()
        code = agent.run()
        if not agent.slot_taken:
            return code
        standby = True
