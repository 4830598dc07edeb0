"""Announce committed checkpoints in etcd.

After a commit, rank 0's background thread calls ``publisher(step, path)``.
:class:`EtcdCheckpointPublisher` writes ``<run_prefix>/checkpoint/latest`` as
versionless JSON ``{"step", "path", "ts", "world_size"}`` so agents and tools
can see the newest resumable point without listing the checkpoint directory.
The key is a hint, not the source of truth: a loader still verifies the
directory's COMMIT marker and checksums.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

from elastic.common.env import ETCD_ENDPOINT_ENV, RUN_PREFIX_ENV
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, KVStore


class CheckpointPublisher(Protocol):
    def __call__(self, step: int, path: str) -> None: ...


class EtcdCheckpointPublisher:
    """Writes the newest committed checkpoint of a run to etcd."""

    def __init__(self, store: KVStore, run_prefix: str, world_size: int | None = None) -> None:
        self.state = RunState(store, RunKeys(run_prefix))
        self.world_size = world_size

    def _world_size(self) -> int:
        if self.world_size is not None:
            return self.world_size
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def __call__(self, step: int, path: str) -> None:
        record = {"step": step, "path": str(path), "ts": time.time(), "world_size": self._world_size()}
        self.state.publish_checkpoint(record)


def read_latest(store: KVStore, run_prefix: str) -> dict[str, Any] | None:
    """The record last published for ``run_prefix``, or None."""
    return RunState(store, RunKeys(run_prefix)).latest_checkpoint()


def publisher_from_env(environ: Mapping[str, str] | None = None) -> EtcdCheckpointPublisher | None:
    """A publisher for the run the agent started this worker in, or None outside an agent.

    Uses ``ELASTIC_ETCD_ENDPOINT`` and ``ELASTIC_RUN_PREFIX``.  Timeouts are short:
    publishing happens on the checkpoint thread, and a slow etcd must not hold
    up the next save for long (failures become ``checkpoint.publish_failed``).
    """
    env = os.environ if environ is None else environ
    endpoint = env.get(ETCD_ENDPOINT_ENV, "").strip()
    prefix = env.get(RUN_PREFIX_ENV, "").strip()
    if not endpoint or not prefix:
        return None
    return EtcdCheckpointPublisher(EtcdStore(endpoint, request_timeout=2.0, retry_deadline=5.0), prefix)
