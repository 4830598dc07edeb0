"""``chaos inject``: deliver one fault to one node of a running run and print the agent's answer.

    chaos inject kill_worker --etcd-endpoint etcd0:2379 --run-id r1 --node node1 --config job.yaml
    chaos inject sdc --etcd-endpoint etcd0:2379 --run-id r1 --node node1 --step 40 --config job.yaml

The request is signed with the run token named by the job's ``security`` section (the same
variable or file the nodes read), unless ``--no-token``.  Exit 0 when the agent executed it,
1 when it refused it (the reason is printed), 3 when no answer came within ``--wait-s``.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from chaos.delivery import AgentDelivery
from elastic.agent.fault_actions import ACTIONS
from elastic.common.config import ConfigError
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreError
from elastic.run.schema import load_run_file

EXIT_NO_ANSWER = 3


def _params(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("--param", f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--param {key}", f"cannot parse value {raw!r}") from None
    return out


def _with_step(params: dict, step: int | None) -> dict:
    if step is None:
        return params
    if step < 0:
        raise ConfigError("--step", f"must be >= 0, got {step}")
    if "step" in params and params["step"] != step:
        raise ConfigError("--step", f"{step} disagrees with --param step={params['step']}")
    return {**params, "step": step}


def inject_once(args: argparse.Namespace) -> int:
    if args.fault not in ACTIONS:
        raise ConfigError("fault", f"unknown fault {args.fault!r} for delivery through etcd "
                                   f"(known: {', '.join(sorted(ACTIONS))})")
    token = None
    prefix = args.key_prefix
    if args.config:
        cfg = load_run_file(args.config)
        token = None if args.no_token else cfg.security.token(path="security")
        prefix = cfg.rendezvous.key_prefix
    state = RunState(EtcdStore(args.etcd_endpoint, retry_deadline=5.0), RunKeys.of(prefix, args.run_id))
    delivery = AgentDelivery(state, args.run_id, token)
    try:
        posted = delivery.post(args.node, args.fault, _with_step(_params(args.param), args.step), at_step=args.at_step,
                               wait_s=max(args.wait_s, 1.0))
    except StoreError as exc:
        print(f"chaos: etcd error: {exc}", file=sys.stderr)
        return 2
    print(f"chaos: posted {args.fault} -> {args.node} as {posted.request_id} "
          f"({'signed' if token else 'unsigned'})", file=sys.stderr)
    result = delivery.wait(posted, args.wait_s)
    if result is None:
        print(f"chaos: no answer from {args.node}'s agent within {args.wait_s:g}s", file=sys.stderr)
        return EXIT_NO_ANSWER
    print(json.dumps(result, default=str))
    return 0 if result.get("executed") else 1
