"""``chaos``: inject faults into a local elastic run and check that it survives.

    chaos suite --config examples/tiny.yaml --nodes 2 --quick
    chaos soak --config examples/tiny.yaml --nodes 4 --duration 10m --mtbf 60s
    chaos inject --etcd-endpoint HOST:PORT --run-id ID --node node1 kill_worker
    chaos inject sdc --etcd-endpoint HOST:PORT --run-id ID --node node1 --step 40
    chaos run plan.yaml -- elastic-launch examples/tiny.yaml --nodes 3
    chaos list

``suite`` runs a fault-free baseline of the job plus one scenario per fault kind, each as
separate nodes against one etcd with faults delivered through etcd to the nodes' agents, and
checks invariants; ``soak`` fires seeded random faults at one long run and reports goodput
(excluding startup too) and recovery times (p50, p95); both write a JSON report and a
self-contained ``report.html`` and exit 1 unless every invariant held (for the soak: no run
hung and the weights equal a fault-free replay's).  ``inject`` delivers one fault to a running
run's node (signed with the run token); ``run`` fires a plan's faults into one local launch by
signals.  Errors print one line naming the field or flag and exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from elastic.common.cli_errors import OneLineArgumentParser
from elastic.common.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one launch under a fault plan: chaos run PLAN -- elastic-launch ...")
    run.add_argument("plan", help="fault plan YAML")
    run.add_argument("--baseline-checksum", help="final checksum of a fault-free run: compare weights bitwise")
    run.add_argument("--expect-excluded", default="", help="comma-separated nodes that must end up excluded")
    run.add_argument("--timeout-s", type=float, default=600.0, help="SIGTERM the launch after this long")
    suite = sub.add_parser("suite", help="baseline + one scenario per fault kind against a job, with invariants")
    _job_flags(suite, "runs/chaos-suite")
    suite.add_argument("--quick", action="store_true", help="only kill_worker and corrupt_checkpoint")
    suite.add_argument("--only", default="", help="comma-separated scenario names")
    suite.add_argument("--timeout-s", type=float, default=300.0, help="per-scenario run timeout")
    suite.add_argument("--jobs", type=int, default=1, help="scenario runs at a time (each its own nodes)")
    netns = suite.add_mutually_exclusive_group()
    netns.add_argument("--netns", action="store_true", default=None,
                       help="run the partition scenario (nodes in network namespaces; needs root and ip)")
    netns.add_argument("--no-netns", dest="netns", action="store_false", help="skip the partition scenario")
    soak = sub.add_parser("soak", help="seeded random faults at one long run; goodput per fault kind")
    _job_flags(soak, "runs/chaos-soak")
    soak.add_argument("--duration", default="10m", help="how long faults are fired (e.g. 90s, 10m)")
    soak.add_argument("--mtbf", default="60s", help="mean time between faults (exponential inter-arrival)")
    soak.add_argument("--seed", type=int, default=7)
    soak.add_argument("--faults", default="", help="comma-separated fault kinds (default: the soak catalogue)")
    soak.add_argument("--timeout-s", type=float, default=0.0,
                      help="a run still going after this long is a hang (0: 3x duration + 300 s)")
    soak.add_argument("--standby", type=int, default=1,
                      help="warm standby nodes beside the job's (elastic-launch --standby); 0: a lost node's "
                           "own relaunch rejoins")
    inject = sub.add_parser("inject", help="deliver one fault to a node of a running run, through etcd")
    inject.add_argument("fault", help="fault kind (chaos list)")
    inject.add_argument("--etcd-endpoint", required=True)
    inject.add_argument("--run-id", required=True)
    inject.add_argument("--node", required=True, help="the node whose agent executes it")
    inject.add_argument("--config", help="the job's config (its security section names the run token)")
    inject.add_argument("--key-prefix", default="/elastic")
    inject.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="fault parameter")
    inject.add_argument("--at-step", type=int, help="fire on the node's first step report at or after this step")
    inject.add_argument("--step", type=int,
                        help="the step a step fault hits (nan, ckpt_write_error, sdc); same as --param step=S")
    inject.add_argument("--no-token", action="store_true", help="send it unsigned (to see it refused)")
    inject.add_argument("--wait-s", type=float, default=30.0, help="wait this long for the agent's answer")
    sub.add_parser("list", help="the registered faults and their parameters")
    return p


def _job_flags(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--config", help="the job's run config YAML (default: a built-in small MLP job)")
    p.add_argument("--nodes", type=int, help="nodes per run (default: the job's launch.nodes)")
    p.add_argument("--steps", type=int, help="training steps (default: the job's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job field for every run, e.g. --set trainer.fp8.enabled=true")
    p.add_argument("--etcd-endpoint", help="an etcd to run against (cluster mode); default: one chaos starts")
    p.add_argument("--out", default=out, help="output directory (one run dir per scenario)")


def _check_timeout(value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError("--timeout-s", f"must be a positive number of seconds, got {value!r}")


def _cmd_run(args: argparse.Namespace, launch_cmd: list[str]) -> int:
    from chaos.analysis import Expectation, check_run
    from chaos.injectors import EtcdOutage
    from chaos.plan import check_targets, load_plan
    from chaos.report import format_table, plot_timeline, write_json
    from chaos.runner import CHAOS_DIR, ChaosRunner, resolve_launch
    from chaos.suite import child_env

    _check_timeout(args.timeout_s)
    plan = load_plan(args.plan)
    try:
        launch = resolve_launch(launch_cmd)
    except ValueError as exc:
        raise ConfigError("--", str(exc)) from None
    check_targets(plan.faults, launch.nodes, launch.world_size)  # a typo is found now, not after the run
    faults = plan.schedule(launch.nodes)
    for f in faults:
        print(f"chaos: planned {f.describe()}", file=sys.stderr)
    runner = ChaosRunner(launch, faults, env=child_env(), timeout_s=args.timeout_s)
    outcome = runner.run()
    extra = {i.respawned_pid for i in runner.injectors if isinstance(i, EtcdOutage) and i.respawned_pid}
    excluded = {n for n in args.expect_excluded.split(",") if n}
    expect = Expectation(steps=launch.steps, bitwise=args.baseline_checksum is not None, excluded=excluded,
                         launcher_rc=None if excluded else 0, note="no baseline checksum given")
    result = check_run(launch.run_dir, expect, args.baseline_checksum, outcome.rc, extra_pids=extra)
    entry = {"name": Path(args.plan).stem, "run_dir": str(launch.run_dir), "plan": [f.describe() for f in faults],
             "result": result}
    out = launch.run_dir / CHAOS_DIR
    write_json(entry, out / "report.json")
    plot_timeline([entry], out / "timeline.png")
    print(format_table([entry]))
    for inv in result["invariants"]:
        print(f"  [{'ok' if inv['ok'] else 'FAIL'}] {inv['name']}: {inv['detail']}")
    print(f"report: {out / 'report.json'}  timeline: {out / 'timeline.png'}")
    return 0 if result["ok"] else 1


def _check_job_flags(args: argparse.Namespace) -> None:
    if args.nodes is not None and args.nodes < 2:
        raise ConfigError("--nodes", "needs at least 2 nodes")
    if args.steps is not None and args.steps < 1:
        raise ConfigError("--steps", "must be >= 1")
    if args.config and not Path(args.config).is_file():
        raise ConfigError("--config", f"no such file: {args.config}")
    if args.etcd_endpoint:
        from elastic.control.store import parse_endpoint

        try:
            parse_endpoint(args.etcd_endpoint)
        except ValueError as exc:
            raise ConfigError("--etcd-endpoint", str(exc)) from None


def _cmd_suite(args: argparse.Namespace) -> int:
    from chaos.suite import SuiteConfig, run_suite

    _check_job_flags(args)
    only = tuple(n for n in args.only.split(",") if n)
    if args.jobs < 1:
        raise ConfigError("--jobs", "must be >= 1")
    _check_timeout(args.timeout_s)
    cfg = SuiteConfig(Path(args.out).resolve(), config=Path(args.config).resolve() if args.config else None,
                      num_nodes=args.nodes, steps=args.steps, sets=list(args.set), only=only,
                      timeout_s=args.timeout_s, jobs=args.jobs, etcd_endpoint=args.etcd_endpoint, netns=args.netns)
    try:
        report = run_suite(cfg, quick=args.quick)
    except ValueError as exc:
        raise ConfigError("--only", str(exc)) from None
    return 0 if report["ok"] else 1


def _cmd_soak(args: argparse.Namespace) -> int:
    from chaos.soak import SoakConfig, parse_duration, run_soak

    _check_job_flags(args)
    duration = parse_duration(args.duration, "--duration")
    mtbf = parse_duration(args.mtbf, "--mtbf")
    faults = tuple(n for n in args.faults.split(",") if n)
    from chaos.injectors import REGISTRY

    unknown = [n for n in faults if n not in REGISTRY]
    if unknown:
        raise ConfigError("--faults", f"unknown fault {unknown[0]!r} (known: {', '.join(sorted(REGISTRY))})")
    cfg = SoakConfig(Path(args.out).resolve(), config=Path(args.config).resolve() if args.config else None,
                     num_nodes=args.nodes, steps=args.steps, sets=list(args.set), duration_s=duration, mtbf_s=mtbf,
                     seed=args.seed, faults=faults, etcd_endpoint=args.etcd_endpoint,
                     timeout_s=args.timeout_s or 3 * duration + 300, standby=args.standby)
    if args.standby < 0:
        raise ConfigError("--standby", f"must be >= 0, got {args.standby}")
    report = run_soak(cfg)
    return 0 if report["ok"] else 1


def _cmd_inject(args: argparse.Namespace) -> int:
    from chaos.inject_cmd import inject_once

    return inject_once(args)


def _cmd_list() -> int:
    import dataclasses

    from chaos.injectors import REGISTRY

    for name, cls in sorted(REGISTRY.items()):
        params = ", ".join(f"{f.name}={f.default!r}" if f.default is not dataclasses.MISSING else f.name
                           for f in dataclasses.fields(cls.Params))
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"{name:24} {doc}" + (f"\n{'':24}   params: {params}" if params else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, launch_cmd = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            if not launch_cmd:
                raise ConfigError("--", "give the launch after --, e.g. -- elastic-launch examples/tiny.yaml")
            return _cmd_run(args, launch_cmd)
        if args.command == "suite":
            return _cmd_suite(args)
        if args.command == "soak":
            return _cmd_soak(args)
        if args.command == "inject":
            return _cmd_inject(args)
        return _cmd_list()
    except ConfigError as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
