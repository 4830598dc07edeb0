"""The worker session: the harness every trainer runs inside.

A trainer is ``python -m <module> --config FILE --run-dir DIR`` under torchrun.  It hands its
training function to :func:`run_worker`, which parses those flags, reads the run file
(:func:`~elastic.run.schema.load_run_file`, one line and exit 2 on a bad one), sets up the
process, and calls ``train(session)`` inside a :class:`WorkerSession`:

* the process: device (``cuda:LOCAL_RANK`` when CUDA is present), the default process group
  (NCCL or gloo, with the agent's collective timeout), torch's thread count;
* the event log (``events/trainer-rank<R>.jsonl``), the report channel to the node agent, the
  TensorBoard scalars;
* checkpoints: a :class:`~elastic.checkpoint.manager.CheckpointManager` on a gloo group of its
  own (its collectives must never interleave with the model's), publishing commits to etcd;
* faults: every in-worker fault comes through one channel, the run's fault files
  (:mod:`elastic.worker.faults`): step hooks, the NaN loss, and checkpoint-write errors through
  the storage wrapper handed to the checkpoint manager;
* the batches to skip after a numerics rollback (decided by the agents);
* teardown in ``finally``: the pending save is finished or abandoned, the scalars flushed and
  the process groups destroyed on every exit path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.publish import publisher_from_env
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage
from elastic.common.config import ConfigError
from elastic.common.env import EPOCH_ENV, NODE_ID_ENV, PG_TIMEOUT_ENV
from elastic.common.events import EventLog
from elastic.run.schema import RunConfig, load_run_file
from elastic.worker.channel import EXIT_NUMERICS, WorkerContext, skip_steps
from elastic.worker.checksum import param_checksum, publish_checksum
from elastic.worker.faults import FaultHooks
from elastic.worker.scalars import ScalarLog

EXIT_CONFIG = 2


class StopTraining(Exception):
    """Leave training on purpose with an exit code the agent understands (e.g. a numerics rollback)."""

    code = 1
    label = "stopped"


class NumericsRollback(StopTraining):
    """Bad numerics at ``step``: the agent rolls the run back past this batch."""

    code = EXIT_NUMERICS
    label = "numerics rollback"

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"step {step}: {reason}")
        self.step = step
        self.reason = reason


def pg_timeout(default_s: float = 600.0) -> timedelta:
    """Collective timeout chosen by the agent (kept above its hang detection)."""
    return timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV) or default_s))


def init_process() -> tuple[torch.device, int, int]:
    """This worker's device, the default process group and torch's thread count; (device, rank, world).

    The thread count is set explicitly because a resumed run is only bitwise equal to an
    uninterrupted one with the same number of intra-op threads.
    """
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=pg_timeout())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return device, dist.get_rank(), dist.get_world_size()


class WorkerSession:
    """One worker's harness (see the module docstring); build it with :meth:`open`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, device: torch.device, rank: int, world: int,
                 group: str | None = None, checkpoints: bool = True) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.device, self.rank, self.world = device, rank, world
        # A replica group's ranks name their group (``trainer/<group>/rank<R>``): ranks repeat across groups.
        name, source = (f"{group}-rank{rank}", f"trainer/{group}/rank{rank}") if group else (f"rank{rank}", f"trainer/rank{rank}")
        self.events = EventLog(run_dir / "events" / f"trainer-{name}.jsonl", source)
        self.agent = WorkerContext.from_env(run_dir)
        self.hooks = FaultHooks(run_dir, rank, self.events)
        self.scalars = ScalarLog(cfg.tensorboard, run_dir, rank)
        self.skip = skip_steps()
        self.ckpt = self._checkpoints() if checkpoints else None
        self._sync = torch.zeros(1, device=device)
        self._t0 = 0.0
        self._wait = 0.0

    @classmethod
    @contextmanager
    def open(cls, cfg: RunConfig, run_dir: Path, **kwargs: Any) -> Iterator[WorkerSession]:
        device, rank, world = init_process()
        session = cls(cfg, run_dir, device, rank, world, **kwargs)
        try:
            yield session
        finally:
            session.close()

    def _checkpoints(self) -> CheckpointManager:
        root = self.cfg.checkpoint.root(self.run_dir)
        # Checkpoint collectives get their own gloo group, so they can never interleave with
        # FSDP's collectives on the default group (measured crash otherwise).
        group = dist.new_group(backend="gloo")
        storage = FaultInjectingStorage(LocalStorage(), self.hooks.checkpoint_write_fails)
        return CheckpointManager(self.cfg.checkpoint, root, self.cfg.fingerprint, self.events, group,
                                 publisher=publisher_from_env(), storage=storage)

    # -- start ------------------------------------------------------------------
    def resume(self, state: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Load the newest committed checkpoint into ``state``; (step, per-rank extra) or None."""
        return self.ckpt.load_latest(state) if self.ckpt is not None else None

    def emit_start(self, step: int, resumed: bool, **fields: Any) -> None:
        self.events.emit("trainer.start", step=step, world_size=self.world, resumed=resumed,
                         node=os.environ.get(NODE_ID_ENV),
                         restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **fields)

    @property
    def epoch(self) -> int:
        return int(os.environ.get(EPOCH_ENV) or 0)

    # -- each step ------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start timing ``step`` and fire its step faults (straggle, hang, crash)."""
        self._t0 = time.monotonic()
        self.hooks.before_step(step)

    def sync_point(self) -> None:
        """The step's sync point: time spent here is waiting for slower peers, not work (busy time)."""
        t_sync = time.monotonic()
        dist.all_reduce(self._sync)
        self._wait = time.monotonic() - t_sync

    def skip_step(self, step: int) -> bool:
        """True (and an event) when a numerics rollback skips this step's batch."""
        if step not in self.skip:
            return False
        self.events.emit("trainer.step_skipped", step=step, reason="numerics rollback")
        return True

    def loss(self, step: int, value: Any) -> Any:
        """The loss, or NaN where a ``nan_loss`` fault says so."""
        return self.hooks.loss(step, value)

    def step_time(self) -> float:
        return time.monotonic() - self._t0

    def end_step(self, step: int, loss: float, scalars: dict[str, Any] | None = None, **fields: Any) -> float:
        """Record a trained step: event, report to the agent, scalars; returns its duration."""
        step_time = self.step_time()
        busy = step_time - self._wait
        self.events.emit("trainer.step", step=step, loss=loss, step_time=step_time, busy_time=busy, **fields)
        self.agent.report_step(step, loss, step_time, busy)
        self.scalars.step(step, loss, step_time, **(scalars or {}))
        return step_time

    def maybe_save(self, step: int, last: int, state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Save on the checkpoint interval and at the last step (commits in the background)."""
        if self.ckpt is not None and (self.ckpt.should_save(step) or step == last):
            self.ckpt.save(step, state, extra=extra)

    # -- end ----------------------------------------------------------------------------
    def finish(self, model: nn.Module, step: int, **fields: Any) -> str:
        """The final commit, the done report and the checksum of the final weights (collective)."""
        if self.ckpt is not None:
            self.ckpt.close()  # the final save must commit before the process group goes away
        self.scalars.close()
        self.agent.report_done(step)
        checksum = param_checksum(model)
        publish_checksum(self.run_dir, self.rank, checksum)
        self.events.emit("trainer.done", step=step, checksum=checksum, **fields)
        dist.barrier()
        return checksum

    def close(self) -> None:
        """Teardown on every exit path (idempotent)."""
        if self.ckpt is not None:
            self.ckpt.close()
        self.scalars.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.events.close()


def parse_worker_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help="resolved run config (YAML)")
    parser.add_argument("--run-dir", required=True, help="run directory (events, checkpoints, results)")
    return parser.parse_args(argv)


def read_run_config(path: str, trainer_class: type | None) -> RunConfig | None:
    """The run file, or None after one line on stderr when it is missing or invalid."""
    try:
        return load_run_file(path, trainer_class)
    except ConfigError as exc:
        print(f"trainer: config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return None


def run_worker(prog: str, trainer_class: type | None, train: Callable[[WorkerSession], Any],
               argv: list[str] | None = None, **session_kwargs: Any) -> int:
    """A trainer's ``main``: flags, run file, session, ``train(session)``; the process exit code."""
    args = parse_worker_args(prog, argv)
    cfg = read_run_config(args.config, trainer_class)
    if cfg is None:
        return EXIT_CONFIG
    try:
        with WorkerSession.open(cfg, Path(args.run_dir), **session_kwargs) as session:
            train(session)
    except StopTraining as exc:
        print(f"trainer: {exc.label}: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except ConfigError as exc:
        print(f"trainer: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0
