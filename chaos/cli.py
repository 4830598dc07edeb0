"""``chaos``: inject faults into a local elastic run and check that it survives.

    chaos run plan.yaml -- elastic-launch examples/tiny.yaml --nodes 3
    chaos suite --nodes 3 --quick
    chaos list

``run`` fires a plan's faults into one launch and writes
``<run_dir>/chaos/report.json`` and ``timeline.png``; ``suite`` runs a
fault-free baseline plus one scenario per fault kind and checks invariants
(exit 1 if a scenario that is not pending fails).  Plan errors print one line
naming the field and exit 2.
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
    suite = sub.add_parser("suite", help="baseline + one scenario per fault kind, with invariants")
    suite.add_argument("--nodes", type=int, default=3, help="local nodes (>= 2; 3 adds the shrink scenarios)")
    suite.add_argument("--quick", action="store_true", help="only kill_worker and corrupt_checkpoint")
    suite.add_argument("--only", default="", help="comma-separated scenario names")
    suite.add_argument("--steps", type=int, default=20)
    suite.add_argument("--out", default="runs/chaos-suite", help="output directory (one run dir per scenario)")
    suite.add_argument("--timeout-s", type=float, default=300.0, help="per-scenario launch timeout")
    suite.add_argument("--jobs", type=int, default=1, help="scenario launches at a time (each its own cluster)")
    sub.add_parser("list", help="the registered faults and their parameters")
    return p


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


def _cmd_suite(args: argparse.Namespace) -> int:
    from chaos.suite import SuiteConfig, run_suite

    if args.nodes < 2:
        raise ConfigError("--nodes", "the suite needs at least 2 nodes")
    only = tuple(n for n in args.only.split(",") if n)
    if args.jobs < 1:
        raise ConfigError("--jobs", "must be >= 1")
    if args.steps < 1:
        raise ConfigError("--steps", "must be >= 1")
    _check_timeout(args.timeout_s)
    cfg = SuiteConfig(Path(args.out).resolve(), num_nodes=args.nodes, steps=args.steps, only=only,
                      timeout_s=args.timeout_s, jobs=args.jobs)
    try:
        report = run_suite(cfg, quick=args.quick)
    except ValueError as exc:
        raise ConfigError("--only", str(exc)) from None
    return 0 if report["ok"] else 1


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
        return _cmd_list()
    except ConfigError as exc:
        print(f"chaos: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
