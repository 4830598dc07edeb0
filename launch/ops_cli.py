"""``elastic``: operate a running run.

    elastic status --etcd 10.0.0.5:2379 --run-id dit64        # table of nodes, exclusions, newest checkpoint
    elastic status --etcd 10.0.0.5:2379 --json                # the only run under /elastic, as JSON

Exit codes: 0 shown, 1 etcd unreachable or no such run, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from elastic.control.keys import DEFAULT_KEY_PREFIX
from elastic.control.store import EtcdStore, StoreError, parse_endpoints
from launch.status import format_plain, list_runs, read_status, resolve_prefix


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 from main()
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elastic", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True
    st = sub.add_parser("status", help="nodes, exclusions and newest checkpoint of a run, from etcd")
    st.add_argument("--etcd", "--etcd-endpoint", dest="etcd", required=True, metavar="HOST:PORT",
                    help="the run's etcd (launch.etcd_endpoint)")
    which = st.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="run id (run.id); default: the only run under --key-prefix")
    which.add_argument("--prefix", help="full key prefix of the run, e.g. /elastic/runs/dit64")
    st.add_argument("--key-prefix", default=DEFAULT_KEY_PREFIX, help="rendezvous.key_prefix (default /elastic)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for etcd (default 3)")
    return parser


def status(args: argparse.Namespace) -> int:
    try:
        parse_endpoints(args.etcd)
    except ValueError as exc:
        raise _UsageError(f"--etcd: {exc}") from None
    store = EtcdStore(args.etcd, request_timeout=args.timeout, retry_deadline=args.timeout)
    try:
        prefix = resolve_prefix(args.key_prefix, args.run_id, args.prefix)
        if prefix is None:
            runs = list_runs(store, args.key_prefix)
            if len(runs) != 1:
                found = ", ".join(runs) if runs else "none"
                print(f"elastic: status: pass --run-id (runs under {args.key_prefix}: {found})", file=sys.stderr)
                return 1
            prefix = resolve_prefix(args.key_prefix, runs[0], None)
        assert prefix is not None
        result = read_status(store, prefix)
    except StoreError as exc:
        print(f"elastic: status: etcd at {args.etcd} unreachable ({type(exc).__name__})", file=sys.stderr)
        return 1
    if not result["nodes"] and not result["excluded"] and result["checkpoint"] is None and not result["epoch"]:
        print(f"elastic: status: no run at {prefix}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else format_plain(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return status(args)
    except _UsageError as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
