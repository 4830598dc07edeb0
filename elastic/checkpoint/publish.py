"""Announce committed checkpoints in etcd.

After a commit, rank 0 hands ``(step, path)`` to :class:`LatestPublisher`, whose own thread
calls ``publisher(step, path)`` (newest first, never on the save path).
:class:`EtcdCheckpointPublisher` writes ``<run_prefix>/checkpoint/latest`` as
versionless JSON ``{"step", "path", "ts", "world_size"}`` so agents and tools
can see the newest resumable point without listing the checkpoint directory.
The key is a hint, not the source of truth: a loader still verifies the
directory's COMMIT marker and checksums.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
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


class LatestPublisher:
    """Publishes on a thread of its own, newest first, so that a slow or unreachable etcd never
    holds up the next save.  Why: the commit thread used to publish inline, and each save first
    waits for the one before it.  In a 10-minute chaos soak (seed 1), a 3 s etcd outage held
    rank 0's publish for 5.9 s (the store's retry deadline), the next save waited 4.5 s for it,
    every rank stopped in the next collective, and the agents' 6 s hang timeout restarted the run
    from disk: 39 s lost to a fault that the workers need not even see (they use etcd only between
    generations).  A record that cannot be written is retried every ``retry_s`` until a newer
    commit replaces it, never queued behind it: the key names only the newest checkpoint."""

    def __init__(self, publish: Callable[[int, str], None], emit: Callable[..., None],
                 error_fields: Callable[[BaseException], dict[str, Any]], retry_s: float = 1.0) -> None:
        self._publish, self._emit, self._error_fields = publish, emit, error_fields
        self.retry_s = retry_s
        self._cond = threading.Condition()
        self._pending: tuple[int, str] | None = None
        self._busy = False
        self._closed = False
        self._failed_step: int | None = None  # said once per record, not once per retry
        self._thread = threading.Thread(target=self._run, name="ckpt-publish", daemon=True)
        self._thread.start()

    def __call__(self, step: int, path: str) -> None:
        with self._cond:
            self._pending = (step, path)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Until the newest record is written, at most ``timeout_s``: whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._pending is not None or self._busy) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return self._pending is None and not self._busy

    def close(self, timeout_s: float) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self) -> tuple[int, str] | None:
        with self._cond:
            while self._pending is None and not self._closed:
                self._cond.wait()
            item, self._pending = self._pending, None
            self._busy = item is not None
            return item

    def _run(self) -> None:
        while (item := self._take()) is not None:
            written = self._once(*item)
            with self._cond:
                if not written and self._pending is None:
                    self._pending = item  # retried, unless a newer commit replaced it meanwhile
                self._busy = False
                self._cond.notify_all()
                if not written:
                    self._cond.wait(self.retry_s)  # a newer record or close() wakes it early

    def _once(self, step: int, path: str) -> bool:
        try:
            self._publish(step, path)
        except Exception as exc:  # noqa: BLE001 -- any failure is an event, never the training's
            if self._failed_step != step:
                self._failed_step = step
                self._emit("checkpoint.publish_failed", step=step, **self._error_fields(exc))
            return False
        self._emit("checkpoint.published", step=step)
        return True


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
