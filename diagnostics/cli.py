"""``diag``: node burn-in screening.

::

    diag burnin [--quick|--full] [--json report.json] [--config thresholds.yaml]
                [--inject readings.yaml] [--etcd-endpoint HOST:PORT] [--ckpt-dir DIR]
                [--calibration calibration.json]
    diag calibrate [--quick|--full] [--repeats 5] [--checks gemm,membw,collective] --output FILE
    diag list
    diag <check> [same options]      # gpu, gemm, membw, nvlink, ib, collective (nccl), disk, etcd

Exit codes: 0 the screen passed (warnings included), 1 a check failed, 2 the
screen could not run (bad arguments, unreadable or invalid config / injection
file); errors are one line naming the flag or field, never a traceback.
``--inject`` defaults to ``$ELASTIC_DIAG_INJECT``.

``diag calibrate`` runs the benchmark checks ``--repeats`` times on a node known to be good
and writes the median and spread per check, size and dtype (:mod:`diagnostics.calibration`);
``--calibration FILE`` (or ``calibration: FILE`` in the thresholds) makes a screen judge
against those medians instead of datasheet fractions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diagnostics import checks as registry
from diagnostics.calibration import CHECKS as CALIBRATED_CHECKS
from diagnostics.calibration import CalibrationError
from diagnostics.readers import INJECT_ENV, InjectionError
from diagnostics.thresholds import load_thresholds
from elastic.common.config import ConfigError
from elastic.control.store import parse_endpoints

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 via main()
        raise _UsageError(message)


def _add_options(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="seconds-long screen (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="minutes-long burn-in")
    p.set_defaults(mode="quick")
    p.add_argument("--json", metavar="PATH", help="write the JSON report here ('-' for stdout)")
    p.add_argument("--config", metavar="YAML", help="thresholds file (see examples/diag-thresholds.yaml)")
    p.add_argument("--inject", metavar="YAML", help=f"reading overrides (default: ${INJECT_ENV})")
    p.add_argument("--etcd-endpoint", metavar="HOST:PORT", help="etcd to probe (etcd check)")
    p.add_argument("--ckpt-dir", metavar="DIR", help="checkpoint directory to test (disk check)")
    p.add_argument("--calibration", metavar="JSON", help="medians from `diag calibrate` (default: thresholds')")


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure known-good nodes: median and spread per check, size, dtype")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="quick-screen sizes (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="full burn-in sizes")
    p.set_defaults(mode="quick")
    p.add_argument("--output", metavar="PATH", required=True, help="calibration file to write (JSON)")
    p.add_argument("--repeats", type=int, default=5, help="screens per check (default 5)")
    p.add_argument("--checks", metavar="A,B", default="gemm,membw,collective", help="checks to calibrate")
    p.add_argument("--config", metavar="YAML", help="thresholds file (sizes, durations)")


def build_parser() -> _Parser:
    parser = _Parser(prog="diag", description="Node burn-in screening.")
    sub = parser.add_subparsers(dest="command", metavar="{burnin,list,<check>}", parser_class=_Parser)
    sub.required = True
    burnin = sub.add_parser("burnin", help="run every check")
    _add_options(burnin)
    burnin.add_argument("--checks", metavar="A,B", help="run only these checks (comma-separated names)")
    sub.add_parser("list", help="list the checks")
    _add_calibrate(sub)
    for name in registry.all_names() + sorted(registry.ALIASES):
        cls = registry.REGISTRY[registry.resolve(name)]
        _add_options(sub.add_parser(name, help=cls.description))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        print(f"diag: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.command == "list":
        for name in registry.all_names():
            aliases = [a for a, n in registry.ALIASES.items() if n == name]
            alias = f" (alias: {', '.join(aliases)})" if aliases else ""
            print(f"{name:<11} {registry.REGISTRY[name].description}{alias}")
        return EXIT_PASS
    if args.command == "calibrate":
        return _calibrate(args)
    from diagnostics.preflight import run_screen

    only = None if args.command == "burnin" else [args.command]
    if args.command == "burnin" and args.checks:
        only = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = [c for c in only if c not in registry.REGISTRY and c not in registry.ALIASES]
        if unknown:
            print(f"diag: error: --checks: unknown check {unknown[0]!r} (see `diag list`)", file=sys.stderr)
            return EXIT_ERROR
    if args.config and not Path(args.config).is_file():
        print(f"diag: error: --config: no such file {args.config}", file=sys.stderr)
        return EXIT_ERROR
    if args.inject and not Path(args.inject).is_file():
        print(f"diag: error: --inject: no such file {args.inject}", file=sys.stderr)
        return EXIT_ERROR
    if args.etcd_endpoint:
        try:
            parse_endpoints(args.etcd_endpoint)
        except ValueError as exc:
            print(f"diag: error: --etcd-endpoint: {exc}", file=sys.stderr)
            return EXIT_ERROR
    try:
        thresholds = load_thresholds(args.config)
    except ConfigError as exc:
        print(f"diag: error: --config {args.config}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        report = run_screen(
            mode=args.mode,
            config=thresholds,
            inject=args.inject,
            etcd_endpoint=args.etcd_endpoint,
            ckpt_dir=args.ckpt_dir,
            checks=only,
            calibration=args.calibration,
        )
    except CalibrationError as exc:
        print(f"diag: error: --calibration: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except InjectionError as exc:
        source = "--inject" if args.inject else f"${INJECT_ENV}"
        print(f"diag: error: {source}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # With --json - the JSON owns stdout and the table goes to stderr.
    print(report.table(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = report.to_json()
        if args.json == "-":
            print(text)
        else:
            try:
                Path(args.json).write_text(text + "\n")
            except OSError as exc:
                print(f"diag: error: --json: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
                return EXIT_ERROR
    return EXIT_FAIL if report.verdict == "fail" else EXIT_PASS


def _calibrate(args: argparse.Namespace) -> int:
    from diagnostics.preflight import run_calibration

    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CALIBRATED_CHECKS]
    if unknown or not checks:
        print(f"diag: error: --checks: {unknown[0] if unknown else '(none)'!r} does not calibrate "
              f"(calibrating checks: {', '.join(CALIBRATED_CHECKS)})", file=sys.stderr)
        return EXIT_ERROR
    if args.repeats < 2:
        print("diag: error: --repeats: must be >= 2 (a spread needs several runs)", file=sys.stderr)
        return EXIT_ERROR
    try:
        thresholds = load_thresholds(args.config)
        calibration = run_calibration(args.mode, checks, args.repeats, config=thresholds)
        calibration.write(args.output)
    except ConfigError as exc:
        print(f"diag: error: --config {args.config}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except CalibrationError as exc:
        print(f"diag: calibration failed: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:
        print(f"diag: error: --output: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    for check, entries in calibration.checks.items():
        for key, entry in entries.items():
            print(f"{check:<11} {key:<28} median {entry.median:.4g} {entry.unit}  spread {entry.spread:.3g}")
    print(f"calibration for {calibration.device} written to {args.output}")
    return EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
