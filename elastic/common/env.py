"""The environment contract between a node agent and the workers it starts, in one place.

The agent passes these to torchrun, which passes them to every worker; the worker side
(:mod:`elastic.worker`, :mod:`elastic.checkpoint`) reads them.  Without an agent (plain
torchrun, tests) none is set and every worker-side feature that needs one is a no-op.
Credentials for a secured etcd travel separately (:mod:`elastic.control.etcd_security`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

AGENT_ADDR_ENV = "ELASTIC_AGENT_ADDR"
"""host:port of the agent's UDP report socket (:mod:`elastic.worker.channel`)."""
NODE_ID_ENV = "ELASTIC_NODE_ID"
RUN_ID_ENV = "ELASTIC_RUN_ID"
ETCD_ENDPOINT_ENV = "ELASTIC_ETCD_ENDPOINT"
"""Workers publish checkpoint commits to etcd themselves (:mod:`elastic.checkpoint.publish`)."""
RUN_PREFIX_ENV = "ELASTIC_RUN_PREFIX"
EPOCH_ENV = "ELASTIC_EPOCH"
PG_TIMEOUT_ENV = "ELASTIC_PG_TIMEOUT"
"""Collective timeout in seconds, chosen by the agent (kept above its hang detection)."""
SKIP_STEPS_ENV = "ELASTIC_SKIP_STEPS"
"""Steps whose batch is skipped after a numerics rollback (``"12-12,30-31"``)."""
DISTRUST_ENV = "ELASTIC_DISTRUST"
"""``STEP@EPOCH``: a silent corruption was found at STEP in EPOCH; checkpoints of STEP or later
committed in EPOCH or before hold its effect, and a resume skips them (replay verification's rollback)."""
MEMSTATE_ADDR_ENV = "ELASTIC_MEMSTATE_ADDR"
MEMSTATE_TOKEN_ENV = "ELASTIC_MEMSTATE_TOKEN"
INPROCESS_ENV = "ELASTIC_INPROCESS"
"""In-process recovery on: how long (s) a worker waits for the next generation to form."""
SNAPSHOTS_ENV = "ELASTIC_SNAPSHOTS"
"""``0``: in-process recovery without per-step memory snapshots (agent.inprocess.snapshots: false);
``ab:N``: snapshots in alternate blocks of N steps (agent.inprocess.snapshot_ab_block)."""
REJOIN_WAIT_ENV = "ELASTIC_REJOIN_WAIT_S"
"""A fixed-size run's wait for a lost node to come back (agent.inprocess.rejoin_wait_s); ``0``/unset: none."""
JOIN_GEN_ENV = "ELASTIC_JOIN_GEN"
"""Set for a warm spare taking over a dead worker's slot: the generation it joins."""
SCREEN_ENV = "ELASTIC_SCREEN"
"""The node screen's spec (JSON) for local rank 0 to run in-process before its first step."""
LOCAL_ADDR_ENV = "ELASTIC_LOCAL_ADDR"
"""Where peers reach this node (torchrun --local-addr); a new generation's rank 0 serves its store there."""
AGENT_PID_ENV = "ELASTIC_AGENT_PID"
"""In in-process mode workers outlive torchrun; they watch their agent instead (no orphans)."""


ABORT_SAFE_ENV = {
    # The watchdog must neither kill the process (the default, 3, tears it down at the group
    # timeout) nor abort communicators behind the fault monitor's back (torch's
    # _abort_process_group asks for 0): the monitor aborts them, all together.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # The watchdog's own monitor SIGABRTs the process when the watchdog is stuck in a CUDA or NCCL
    # call past its heartbeat timeout, which an abort of a hung communicator can take.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # NVLink SHARP communicators could not be aborted safely (nvidia-resiliency-ext's in-process
    # restart requires NVLS off for the same abort path).
    "NCCL_NVLS_ENABLE": "0",
}
"""What makes a communicator abort safe for in-process recovery: set for its workers unless the
operator set them (elastic.worker.faultwatch; ../shared/reference/nccl-faults.md)."""


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What the agent tells its workers; ``to_env()`` and ``from_env()`` are inverses."""

    agent_addr: str = ""
    node_id: str = ""
    run_id: str = ""
    etcd_endpoint: str = ""
    run_prefix: str = ""
    epoch: str = ""
    pg_timeout: str = ""
    skip_steps: str = ""
    distrust: str = ""
    memstate_addr: str = ""
    memstate_token: str = ""
    inprocess: str = ""
    snapshots: str = ""
    join_gen: str = ""
    rejoin_wait: str = ""
    agent_pid: str = ""
    local_addr: str = ""
    screen: str = ""

    def to_env(self) -> dict[str, str]:
        return {_NAMES[f.name]: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        return cls(**{f.name: env.get(_NAMES[f.name], "") for f in fields(cls)})


_NAMES = {
    "agent_addr": AGENT_ADDR_ENV, "node_id": NODE_ID_ENV, "run_id": RUN_ID_ENV,
    "etcd_endpoint": ETCD_ENDPOINT_ENV, "run_prefix": RUN_PREFIX_ENV, "epoch": EPOCH_ENV,
    "pg_timeout": PG_TIMEOUT_ENV, "skip_steps": SKIP_STEPS_ENV, "distrust": DISTRUST_ENV,
    "memstate_addr": MEMSTATE_ADDR_ENV, "memstate_token": MEMSTATE_TOKEN_ENV,
    "inprocess": INPROCESS_ENV, "snapshots": SNAPSHOTS_ENV, "join_gen": JOIN_GEN_ENV, "rejoin_wait": REJOIN_WAIT_ENV,
    "agent_pid": AGENT_PID_ENV,
    "local_addr": LOCAL_ADDR_ENV, "screen": SCREEN_ENV,
}
