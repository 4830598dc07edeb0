"""Names shared by the launcher, the agents and the rendezvous backend (no heavy imports)."""

from __future__ import annotations

BACKEND_NAME = "etcd3"
"""The ``--rdzv-backend`` name of this project's torchrun rendezvous handler."""
DEFAULT_KEY_PREFIX = "/elastic"


def run_prefix(key_prefix: str, run_id: str) -> str:
    """Root of every key a run owns in etcd."""
    return f"{key_prefix.rstrip('/')}/runs/{run_id}"
