"""``diag``: node burn-in screening.

::

    diag burnin [--quick|--full] [--json report.json] [--config thresholds.yaml]
                [--inject readings.yaml] [--etcd-endpoint HOST:PORT] [--ckpt-dir DIR]
    diag list
    diag <check> [same options]      # gpu, gemm, membw, nvlink, ib, collective (nccl), disk, etcd

Exit codes: 0 the screen passed (warnings included), 1 a check failed, 2 the
screen could not run (bad arguments, unreadable or invalid config / injection
file); errors are one line naming the flag or field, never a traceback.
``--inject`` defaults to ``$ELASTIC_DIAG_INJECT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diagnostics import checks as registry
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


def build_parser() -> _Parser:
    parser = _Parser(prog="diag", description="Node burn-in screening.")
    sub = parser.add_subparsers(dest="command", metavar="{burnin,list,<check>}", parser_class=_Parser)
    sub.required = True
    burnin = sub.add_parser("burnin", help="run every check")
    _add_options(burnin)
    burnin.add_argument("--checks", metavar="A,B", help="run only these checks (comma-separated names)")
    sub.add_parser("list", help="list the checks")
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
        )
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


if __name__ == "__main__":
    sys.exit(main())
