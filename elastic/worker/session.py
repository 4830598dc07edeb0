"""The worker session: the harness every trainer runs inside.

A trainer is ``python -m <module> --config FILE --run-dir DIR`` under torchrun.  It hands its
training function to :func:`run_worker`, which parses those flags, reads the run file
(:func:`~elastic.run.schema.load_run_file`, one line and exit 2 on a bad one), sets up the
process, and calls ``train(session)`` inside a :class:`WorkerSession`:

* the process: device (``cuda:LOCAL_RANK`` when CUDA is present), the default process group
  (``cuda:nccl`` bound to that GPU, or ``cpu:gloo``, with the agent's collective timeout),
  torch's thread count, and ``--deterministic`` (:mod:`elastic.worker.determinism`);
* the event log (``events/trainer-rank<R>.jsonl``), the report channel to the node agent, the
  TensorBoard scalars;
* checkpoints: a :class:`~elastic.checkpoint.manager.CheckpointManager` on a gloo group of its
  own (its collectives must never interleave with the model's), publishing commits to etcd;
* hang attribution: Python stacks on SIGUSR1 and the sync point marked as a collective
  (:mod:`elastic.worker.hangprobe`), read by the agents when the run stalls;
* faults: every in-worker fault comes through one channel, the run's fault files
  (:mod:`elastic.worker.faults`): step hooks, the NaN loss, and checkpoint-write errors through
  the storage wrapper handed to the checkpoint manager;
* the batches to skip after a numerics rollback (decided by the agents);
* teardown in ``finally``: the pending save is finished or abandoned, the scalars flushed and
  the process groups destroyed on every exit path.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from elastic.checkpoint.manager import CheckpointManager, CheckpointMismatch
from elastic.checkpoint.publish import publisher_from_env
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage
from elastic.common.collectives import backend_for, check_device
from elastic.common.config import ConfigError
from elastic.common.env import DISTRUST_ENV, EPOCH_ENV, NODE_ID_ENV, PG_TIMEOUT_ENV
from elastic.common.events import EventLog
from elastic.common.exits import EXIT_SCREEN_FAILED
from elastic.run.schema import RunConfig, load_run_file
from elastic.worker.channel import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NUMERICS, WorkerContext, skip_steps
from elastic.worker.checksum import param_checksum, publish_checksum
from elastic.worker.determinism import set_deterministic
from elastic.worker.faults import FaultHooks
from elastic.worker.faultwatch import PeerAborted, hang_until_torn, wait_unless_torn
from elastic.worker.hangprobe import HangProbe
from elastic.worker.heap import HeapFreeze
from elastic.control.generations import Plan
from elastic.worker.inprocess import EXIT_RECOVERY_FAILED, InProcess, PhaseClock, is_peer_failure, wait_for_agent
from elastic.worker.memwatch import RecoveryPeak
from elastic.worker.scalars import ScalarLog
from elastic.worker.screen import BackgroundScreen



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


class RecoveryFailed(StopTraining):
    """In-process recovery could not continue; the agents restart the epoch from disk."""

    code = EXIT_RECOVERY_FAILED
    label = "in-process recovery failed"


class ScreenFailed(StopTraining):
    """This node failed its screen: it leaves before its first step and its agent excludes it."""

    code = EXIT_SCREEN_FAILED
    label = "node screen failed"


class SavesFailing(StopTraining):
    """Checkpoint saves kept failing and ``checkpoint.on_save_failure`` is stop: the agents stop the run."""

    code = EXIT_CHECKPOINT
    label = "checkpoint.on_save_failure=stop"


class Trainable(Protocol):
    """What a trainer builds for the current world, and the session drives step by step."""

    model: nn.Module
    last_step: int

    def state(self) -> dict[str, Any]:
        """The DCP-stateful objects of a checkpoint (and of a memory snapshot)."""

    def extra(self) -> dict[str, Any]:
        """Per-rank state (RNG) kept beside this rank's shard."""

    def resumed(self, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        """After a load (``extra``: this rank's, when it fits): restore what the state does not; event fields."""

    def step(self, step: int) -> None:
        """One training step (the session saves and snapshots after it)."""

    def done_fields(self) -> dict[str, Any]: ...


def pg_timeout(default_s: float = 600.0) -> timedelta:
    """Collective timeout chosen by the agent (kept above its hang detection)."""
    return timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV) or default_s))


REFORM_TRIES = 3
"""Re-formations one fault may take: a peer lost while the world re-forms (a kill during recovery)
costs another generation, not a restart from disk."""


class LostPeer:
    """What the training thread knew when a peer was lost: the error, when it unwound, the pushed
    fault behind it (none when a collective raised first, as gloo's do)."""

    def __init__(self, error: str, unwound_at: float, fault: dict[str, Any] | None) -> None:
        self.error, self.unwound_at, self.fault = error, unwound_at, fault

    def fields(self) -> dict[str, Any]:
        """For ``trainer.recovered``: how the fault reached this rank and how long it took."""
        if not self.fault:
            return {"unwound_by": "collective error"}
        pushed = float(self.fault.get("ts", 0.0) or 0.0)
        return {"unwound_by": "pushed fault", "fault_kind": self.fault.get("kind"),
                "fault_to_unwound_s": round(self.unwound_at - pushed, 4) if pushed else None}


def _retryable(err: BaseException) -> bool:
    """A failure of the re-formation that another generation can cure: a peer of the forming world
    died (its collectives, or the new rank 0's c10d store, failed)."""
    return is_peer_failure(err) or isinstance(err, dist.DistNetworkError)


def _final_peer_lost(exc: Exception, step: int) -> Exception:
    """A peer that died during the final collectives (its fault monitor is off by then) is no fault
    of this rank: it leaves as a failed recovery (uncounted; the run restarts from the final
    checkpoint, committed before these collectives, and finishes).  Measured: a rank that crashed
    in the final checksum made its peers exit 1, each counted as its node's own failure, until the
    lemon policy excluded a healthy node and the fixed-size run waited for it."""
    if not is_peer_failure(exc):
        return exc
    return RecoveryFailed(f"a peer went away during the final collectives of step {step}: {exc}"[:500])


def _join_as_spare(inproc: InProcess, device: torch.device) -> Plan:
    """A spare's first generation; a peer lost while it forms (the new rank 0's store gone) makes
    it join the next one, as the survivors do, instead of failing the slot."""
    for attempt in range(1, REFORM_TRIES + 1):
        try:
            return inproc.reform(_backend(device), pg_timeout())
        except Exception as err:  # noqa: BLE001 - judged: another generation, or the spare fails
            if attempt == REFORM_TRIES or not _retryable(err):
                raise
            inproc.events.emit("trainer.reform_retry", step=None, attempt=attempt, gen=inproc.latch.gen,
                               error=f"{type(err).__name__}: {err}"[:300])
    raise AssertionError("unreachable")


def _release_memory(device: torch.device, heap: HeapFreeze | None) -> None:
    """Before re-forming: the failed step's tensors are garbage by now (no frame holds them);
    collect them (what survives is frozen: :meth:`HeapFreeze.rebase`), and hand cached GPU blocks
    back so the new world's buffers fit."""
    if heap is not None:
        heap.rebase()
    else:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def init_process() -> tuple[torch.device, int, int]:
    """This worker's device, the default process group and torch's thread count; (device, rank, world).

    The thread count is set explicitly because a resumed run is only bitwise equal to an
    uninterrupted one with the same number of intra-op threads.
    """
    device = init_device()
    if not dist.is_initialized():
        # On a GPU the group is bound to this rank's device: NCCL then creates its communicator on
        # the right GPU instead of guessing at the first collective.
        dist.init_process_group(_backend(device), timeout=pg_timeout(),
                                device_id=device if device.type == "cuda" else None)
    return device, dist.get_rank(), dist.get_world_size()


def init_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present (made current), else the CPU; torch's thread count."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return device


def _backend(device: torch.device) -> str:
    """Bound to the compute device's type (``cuda:nccl`` / ``cpu:gloo``): a collective over a
    misplaced tensor fails on a CPU host as it does on NCCL (elastic.common.collectives)."""
    return backend_for(device)


def _watch_agent(agent_pid: int) -> None:
    """In in-process mode the worker outlives torchrun but never its agent (no orphans)."""
    if agent_pid <= 0:
        return

    def watch() -> None:
        while wait_for_agent(agent_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


class WorkerSession:
    """One worker's harness (see the module docstring); build it with :meth:`open`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, device: torch.device, rank: int, world: int,
                 group: str | None = None, checkpoints: bool = True, inproc: InProcess | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.device, self.rank, self.world = device, rank, world
        self.group = group
        # A replica group's ranks name their group (``trainer/<group>/rank<R>``): ranks repeat across groups.
        name, source = (f"{group}-rank{rank}", f"trainer/{group}/rank{rank}") if group else (f"rank{rank}", f"trainer/rank{rank}")
        self.events = EventLog(run_dir / "events" / f"trainer-{name}.jsonl", source)
        self.agent = WorkerContext.from_env(run_dir)
        self.agent.rank, self.agent.world_size = rank, world  # this generation's (a spare's come from its plan)
        self.hooks = FaultHooks(run_dir, rank, self.events)
        self.probe = HangProbe(run_dir, self.epoch, name)
        self.scalars = ScalarLog(cfg.tensorboard, run_dir, rank)
        self.skip = skip_steps()
        self.checkpoints = checkpoints
        self.inproc = inproc
        if inproc is not None:
            inproc.events = self.events
            inproc.device = device
            inproc.register(rank)
            if inproc.pusher is not None:
                inproc.pusher.events = self.events
                inproc.pusher.kill_during = lambda step: self.hooks.snapshot_kill(step)
                inproc.pusher.corrupt_during = lambda step: self.hooks.snapshot_corrupt(step)
        # A warm spare's checkpoint group is made in _start, where a peer lost while it forms re-forms
        # the world: made here, that loss (its new_group's store gone) failed the slot (soak seed 3).
        joining = inproc is not None and inproc.joining
        self.ckpt = self._checkpoints() if checkpoints and not joining else None
        # The node screen runs while this worker builds and loads; the first step waits for it.
        self.screen = BackgroundScreen.from_env(int(os.environ.get("LOCAL_RANK", "0")))
        self._sync = _sync_tensor(device)
        self._t0 = 0.0
        self._wait = 0.0
        self._commit_points = False  # the trainer calls commit_point(): snapshot pushes overlap its steps
        self._sync_points = False  # the trainer calls sync_point(): snapshot copies overlap its steps' starts
        self._heap: HeapFreeze | None = None  # train()'s, for the recovery's collection (rebase)
        self._step = 0
        self.memory = RecoveryPeak()  # each step's peak RSS, against a re-formation's (trainer.recovered)

    @classmethod
    @contextmanager
    def open(cls, cfg: RunConfig, run_dir: Path, **kwargs: Any) -> Iterator[WorkerSession]:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        inproc = InProcess.from_env(local_rank, EventLog(None, "inprocess"))
        if inproc is not None and inproc.joining:
            # A warm spare taking a dead worker's slot: no torchrun world to join, the next generation.
            device = inproc.device = init_device()
            plan = _join_as_spare(inproc, device)
            rank, world = inproc.rank, plan.world
        else:
            device, rank, world = init_process()
        if inproc is not None:
            _watch_agent(int(inproc.env.agent_pid or 0))
        session = cls(cfg, run_dir, device, rank, world, inproc=inproc, **kwargs)
        try:
            yield session
        finally:
            session.close()

    def _checkpoints(self) -> CheckpointManager:
        if self.inproc is not None and self.inproc.joining:
            self.hooks.joining()
        root = self.cfg.checkpoint.root(self.run_dir)
        # Checkpoint collectives get their own gloo group, so they can never interleave with
        # FSDP's collectives on the default group (measured crash otherwise).
        group = dist.new_group(backend="gloo")
        storage = FaultInjectingStorage(LocalStorage(), self.hooks.checkpoint_write_fails)
        basis = self.cfg.fingerprint_basis() if self.cfg.fingerprint else None
        # A replica group owns its temporary save directories: groups share the checkpoint root.
        publisher = publisher_from_env()
        manager = CheckpointManager(self.cfg.checkpoint, root, self.cfg.fingerprint, self.events, group,
                                    publisher=publisher, storage=storage, fingerprint_basis=basis,
                                    owner=self.group or "")
        manager.epoch, manager.distrust = self.epoch, distrust_from_env()
        if self.cfg.sdc.replay and publisher is not None:
            manager.sdc_verified = lambda epoch: self._verified_through(publisher.state, epoch)
            # A node's check trails its step by one cycle of checks (every node once: sdc.replay_nodes)
            # and a replay; a checkpoint lands up to an interval after that: further back than twice
            # both, verification has stalled.
            cycle = self.cfg.sdc.node_cycle(self._nodes())
            manager.sdc_verified_within = 2 * (self.cfg.sdc.replay_every * cycle + self.cfg.checkpoint.interval_steps)
        return manager

    def _verified_through(self, state: Any, epoch: int) -> int | None:
        """The step ``epoch``'s replay checks agree through (one verifier per node: the world's node
        count of them must have checked in that epoch)."""
        return state.sdc_verified_through(self._nodes(), epoch)

    def _nodes(self) -> int:
        return max(1, self.world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

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
        self._step = step
        if self.inproc is not None and not self._commit_points:
            self.inproc.before_collectives()
        self.hooks.before_step(step)

    def commit_point(self) -> None:
        """Call before the step's last collectives (the ones every rank passes to finish the step).

        The previous step's snapshot push must be stored off-process before them: then a rank that
        finished step s knows every peer's step s-1 is safe (at most one step lost).  Waiting here
        rather than at the step's start lets the push run beside the forward and backward passes
        (measured on the DiT: the wait was most of a push, 13-16 ms of a 0.2 s step, on 2 cores)."""
        self._commit_points = True
        if self.inproc is not None:
            self.inproc.before_collectives()

    def sync_point(self) -> None:
        """The step's sync point: time spent here is waiting for slower peers, not work (busy time).

        Call it before the step changes any state a snapshot holds (the sampler, the RNG, the
        weights): once a trainer has called it, each step's memory snapshot is copied on a
        background thread while the next step starts, and waited for here."""
        self._sync_points = True
        if self.inproc is not None:
            self.inproc.captured()
        watch = self._watches_saves()
        saving = self._agrees_saves(self._step)
        if watch or saving:
            reached = 1.0 if watch and self.ckpt.streak_reached() else 0.0
            # fill_ per value, not a copy from a host tensor: on a GPU that would wait for the stream.
            for i, value in enumerate((reached, *self.ckpt.sync_contribution(saving))):
                self._sync[i].fill_(value)
        t_sync = time.monotonic()
        with self.probe.collective("sync", self._step):
            self._all_reduce_sync()
        self._wait = time.monotonic() - t_sync
        if not (watch or saving):
            return
        reached, busy, token = self._sync.tolist()  # one read back: on a GPU, a wait for the all-reduce
        self._sync.zero_()  # the sums must not come round again at the next step
        if saving:
            self.ckpt.agreed(self._step, busy, token)
        if watch and reached > 0:
            line = self.ckpt.agree_failing()
            if line is not None:
                raise SavesFailing(line)

    def _all_reduce_sync(self) -> None:
        """The sync point's all-reduce; on the host (gloo) with in-process recovery, waited for in
        slices that leave once the generation is torn down (:func:`wait_unless_torn`)."""
        tensor = check_device(self._sync)
        if self.inproc is None or tensor.device.type != "cpu":
            dist.all_reduce(tensor)
            return
        wait_unless_torn(self.inproc.latch, dist.all_reduce(tensor, async_op=True))

    def _watches_saves(self) -> bool:
        """Whether this step's sync carries rank 0's "saves keep failing" flag to every rank.

        An async save fails on rank 0's finalize thread, mid-step, and every rank must stop at the
        same step: the flag rides on the sync point's all-reduce, the one collective every step has
        already, rather than waiting for the next save's broadcast (a run then trained every step
        up to it).  Reading it back costs one scalar: free on gloo (the collective is synchronous);
        on a GPU a wait for the all-reduce, which the sync point exists to wait for.  Replica
        groups save from one group only and keep the check at the save (:meth:`maybe_save`)."""
        return self.ckpt is not None and not self.group and self.ckpt.stops_on_failures

    def _agrees_saves(self, step: int) -> bool:
        """Whether this step's sync point also agrees on its save's token (:meth:`CheckpointManager.
        sync_contribution`): an interval save of a run without replica groups, whose checkpointer
        spans the same ranks as the sync point.  The last step's save broadcasts as before."""
        return self.ckpt is not None and not self.group and self.ckpt.should_save(step)

    def waited(self, seconds: float) -> None:
        """More of this step spent waiting on peers outside :meth:`sync_point` (a torchft quorum)."""
        self._wait += seconds

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
        gen = self.inproc.gen if self.inproc else 0  # which world trained it: a re-formation's tests read it
        self.events.emit("trainer.step", step=step, loss=loss, step_time=step_time, busy_time=busy, gen=gen,
                         **fields)
        self.agent.report_step(step, loss, step_time, busy, gen=gen)
        self.scalars.step(step, loss, step_time, **(scalars or {}))
        return step_time

    def maybe_save(self, step: int, last: int, state: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Save on the checkpoint interval and at the last step (commits in the background)."""
        if self.ckpt is not None and (self.ckpt.should_save(step) or step == last):
            self.ckpt.save(step, state, extra=extra)
            # Agreed by every rank in save(): all of them stop together.  A failure known by then
            # (a synchronous save's, or one older than the sync point's flag) stops here.
            failing = self.ckpt.failing()
            if failing is not None:
                raise SavesFailing(failing)

    # -- the loop ---------------------------------------------------------------------------
    def train(self, build: Callable[[WorkerSession], Trainable]) -> str:
        """Build the trainer for this world, resume, run every step (saving and snapshotting after
        each), and re-form in-process when a peer is lost; returns the final checksum."""
        step, run = self._start(build)
        if self.inproc is not None and not self.inproc.joining:
            self.inproc.check_fit(run.state())  # a cap too small stops the run here, not a fault later
        self.screen_gate()
        heap = self._heap = HeapFreeze(self.events)
        try:
            while step < run.last_step:
                lost = None
                try:
                    with self._fault_zone():
                        run.step(step + 1)
                        step += 1
                        self._after_step(step, run)
                    self.memory.step_done()
                    heap.after_step(step)
                except Exception as exc:  # only a lost peer is handled here; everything else re-raises
                    lost = self._peer_lost(exc)
                # Out of the except clause: the failed step's traceback, frames and activations are
                # released before the world re-forms (the exception kept them alive inside it).
                if lost is not None:
                    heap.thaw()
                    run = None  # the old model and optimizer go before the new ones are built
                    run, step = self._recover(build, step + 1, lost)
        finally:
            heap.thaw()  # a caller that goes on (a test, a notebook) gets its collector back whole
        return self.finish(run.model, run.last_step, **run.done_fields())

    def screen_gate(self) -> None:
        """Wait for the node screen started with this worker; ScreenFailed when the node failed it."""
        if self.screen is None:
            return
        verdict, self.screen = self.screen.verdict(), None
        self.events.emit("trainer.screen", **verdict)
        self.agent.report_screen(verdict)
        if not verdict["passed"]:
            raise ScreenFailed(verdict["reason"])

    def _start(self, build: Callable[[WorkerSession], Trainable]) -> tuple[int, Trainable]:
        """Build and resume; a spare whose first generation loses a peer while it builds or restores
        (a second fault) re-forms for the next one, as the survivors do, instead of failing its slot.

        The build is inside: a fault pushed while a spare builds the model tears its groups down
        under it (soak seed 2: ``mesh["dp"]`` then raised "Default process group has not been
        initialized", the spare exited 1, and its node fell back to disk with "no warm spare").
        So is a joining spare's checkpoint group (soak seed 3: its ``new_group`` raised
        ``DistNetworkError``, same ending, 15.8 s)."""
        lost = None
        try:
            if self.ckpt is None and self.checkpoints:  # a joining spare's (see __init__)
                self.ckpt = self._checkpoints()
            run = build(self)
            return self._resume(run), run
        except Exception as exc:  # a peer failure is handled below; anything else re-raises
            lost = self._peer_lost(exc) if self.inproc is not None and self.inproc.joining else None
            if lost is None:
                raise
        run = None
        run, step = self._recover(build, 0, lost)
        return step, run

    def _resume(self, run: Trainable) -> int:
        if self.inproc is not None and self.inproc.joining:
            try:
                return self._restore_snapshots(run, time.monotonic(), start_event=True)
            except Exception as err:  # the spare says why too (its peers only hear that it failed)
                if is_peer_failure(err) or self.inproc.latch.torn():
                    raise  # a peer lost while it restored: it re-forms (_start), no failure to report
                self.events.emit("trainer.recovery_failed", step=None, error=f"{type(err).__name__}: {err}"[:500],
                                 snapshot_errors=self.inproc.fetch_errors[-4:])
                raise
        loaded = self.resume(run.state())
        start = loaded[0] if loaded else 0
        self.emit_start(start, resumed=loaded is not None, **run.resumed(start, loaded[1] if loaded else None))
        return start

    def _after_step(self, step: int, run: Trainable) -> None:
        extra = run.extra()
        if self.inproc is not None:
            self.inproc.snapshot(step, run.state(), extra, self.world, deferred=self._sync_points)
        self.maybe_save(step, run.last_step, run.state(), extra=extra or None)

    @contextmanager
    def _fault_zone(self) -> Iterator[None]:
        """A step: where a pushed fault may unwind this thread (elastic.worker.faultwatch)."""
        if self.inproc is None:
            yield
            return
        with self.inproc.latch.armed():
            yield

    def _peer_lost(self, exc: Exception) -> LostPeer:
        """What a step's failure says when a peer was lost; re-raises any other failure.  Under the
        test switch (NCCL's behaviour) a peer-loss error raised outside a patched wait blocks here
        until the pushed fault tears the generation down, as the collective would have."""
        if self.inproc is not None:
            self.inproc.latch.disarm()
        if self.inproc is None or not (is_peer_failure(exc) or self.inproc.latch.torn()):
            raise exc
        if self.inproc.hang_switch and not isinstance(exc, PeerAborted):
            try:
                hang_until_torn(self.inproc.latch, exc)
            except PeerAborted as aborted:
                exc = aborted
        return LostPeer(" ".join(str(exc).split())[:300], time.time(), self.inproc.latch.fault)

    def _recover(self, build: Callable[[WorkerSession], Trainable], step: int, lost: LostPeer
                 ) -> tuple[Trainable, int]:
        """A peer was lost during ``step``: re-form the world in-process and restore from memory.
        A peer lost while re-forming (a second fault) re-forms again, for the next generation, up
        to :data:`REFORM_TRIES` times; any other failure falls back to a restart from disk."""
        assert self.inproc is not None
        t0 = time.monotonic()
        self.memory.recovery_started()  # the failed step's frames are gone by now: not counted
        self.events.emit("trainer.peer_lost", step=step, gen=self.inproc.gen, error=lost.error)
        self.agent.report_fault(step, self.inproc.gen, lost.error)
        # The old world goes first: a save in flight waits in its collectives, and closing the
        # checkpointer while the world stands could wait on peers that wait on this rank.
        clock = PhaseClock()
        self.inproc.leave()
        if self.ckpt is not None:
            self.ckpt.close()  # the save in flight fails with the world; committed ones stay
            self.ckpt = None
        clock.lap("leave_s")
        _release_memory(self.device, self._heap)
        clock.lap("collect_s")
        for attempt in range(1, REFORM_TRIES + 1):
            try:
                return self._reform_once(build, t0, lost, clock.laps)
            except Exception as err:  # noqa: BLE001 - judged below: re-form again or fall back
                if attempt < REFORM_TRIES and (_retryable(err) or self.inproc.latch.torn()):
                    self.events.emit("trainer.reform_retry", step=step, attempt=attempt, gen=self.inproc.latch.gen,
                                     error=f"{type(err).__name__}: {err}"[:300])
                    continue
                self.events.emit("trainer.recovery_failed", step=step, error=f"{type(err).__name__}: {err}"[:500],
                                 snapshot_errors=self.inproc.fetch_errors[-4:])  # e.g. a checksum mismatch
                raise RecoveryFailed(f"{type(err).__name__}: {err}") from err
        raise AssertionError("unreachable")

    def _reform_once(self, build: Callable[[WorkerSession], Trainable], t0: float, lost: LostPeer,
                     before: dict[str, float]) -> tuple[Trainable, int]:
        """One re-formation; ``before``: the phases before it (the old world left, its garbage
        collected: elastic.worker.heap), reported first in ``trainer.recovered``."""
        assert self.inproc is not None
        self.inproc.leave()  # a retry: the half-formed generation goes before its checkpointer
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        plan = self.inproc.reform(_backend(self.device), pg_timeout(), self.cfg.launch.min_nodes)
        self.inproc.phases = {**before, **self.inproc.phases}
        self.rank, self.world, self.hooks.rank = self.inproc.rank, plan.world, self.inproc.rank
        self.agent.rank, self.agent.world_size = self.rank, self.world
        self._sync = _sync_tensor(self.device)
        self.ckpt = self._checkpoints() if self.checkpoints else None
        t_build = time.monotonic()
        run = build(self)
        self.inproc.phases["build_s"] = round(time.monotonic() - t_build, 4)
        return run, self._restore_snapshots(run, t0, lost=lost)

    def _restore_snapshots(self, run: Trainable, t0: float, start_event: bool = False,
                           lost: LostPeer | None = None) -> int:
        assert self.inproc is not None
        t_restore = time.monotonic()
        step, extra, source = self.inproc.restore(run.state())
        self.inproc.phases["restore_s"] = round(time.monotonic() - t_restore, 4)
        fields = run.resumed(step, extra or None)
        if start_event:
            self.emit_start(step, resumed=True, loaded_from=source, gen=self.inproc.gen, **fields)
        bitwise, why = self.inproc.exact
        self.events.emit("trainer.recovered", path="inprocess", gen=self.inproc.gen, step=step, rank=self.rank,
                         world_size=self.world, loaded_from=source, recover_s=round(time.monotonic() - t0, 3),
                         phases=dict(self.inproc.phases), bitwise=bitwise, **self.memory.recovered(),
                         **({"trajectory_changed": why} if not bitwise else {}),
                         **(lost.fields() if lost is not None else {}))
        self.agent.report_recovered(step, self.inproc.gen, self.world, source)
        return step

    # -- end ----------------------------------------------------------------------------
    def finish(self, model: nn.Module, step: int, **fields: Any) -> str:
        """The final commit, the done report and the checksum of the final weights (collective)."""
        if self.inproc is not None and self.inproc.monitor is not None:
            self.inproc.monitor.stop()  # a peer finishing is no fault: the final collectives must run
        if self.ckpt is not None:
            self.ckpt.close()  # the final save must commit before the process group goes away
        self.scalars.close()
        self.agent.report_done(step)
        try:
            checksum = param_checksum(model)
            publish_checksum(self.run_dir, self.rank, checksum)
            if self.inproc is not None:
                fields["snapshot"] = self.inproc.snapshot_costs()
            self.events.emit("trainer.done", step=step, checksum=checksum, **fields)
            dist.barrier()
        except Exception as exc:
            if self.inproc is None:
                raise  # torchrun's error file says "peer lost": the agent's classifier counts nobody
            raise _final_peer_lost(exc, step) from exc
        return checksum

    def close(self) -> None:
        """Teardown on every exit path (idempotent)."""
        if self.inproc is not None:
            self.inproc.before_collectives()  # the last snapshot push finishes (or fails) first
        if self.ckpt is not None:
            self.ckpt.close()
        self.scalars.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.probe.close()
        self.events.close()


def distrust_from_env() -> tuple[int, int] | None:
    """``ELASTIC_DISTRUST`` (``STEP@EPOCH``, set by the agent after replay verification found a
    silent corruption) as (step, epoch), or None."""
    spec = os.environ.get(DISTRUST_ENV, "")
    if not spec:
        return None
    step, _, epoch = spec.partition("@")
    return int(step), int(epoch)


def parse_worker_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help="resolved run config (YAML)")
    parser.add_argument("--run-dir", required=True, help="run directory (events, checkpoints, results)")
    parser.add_argument("--deterministic", action="store_true",
                        help="bitwise reproducible GPU runs (deterministic algorithms, math SDPA); slower")
    args = parser.parse_args(argv)
    if args.deterministic:
        set_deterministic()  # before the process group and any CUDA work (elastic.worker.determinism)
    return args


def read_run_config(path: str, trainer_class: type | None) -> RunConfig | None:
    """The run file, or None after one line on stderr when it is missing or invalid."""
    try:
        return load_run_file(path, trainer_class)
    except ConfigError as exc:
        print(f"trainer: config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return None


def exit_process(code: int) -> None:
    """Leave a finished worker at once.  Everything is written by now (events flush per line, the
    final checkpoint committed, the session closed), and what is left of interpreter exit is C-level
    teardown after every atexit handler: 2.0-2.4 s per worker measured on 2 cores (faulthandler
    shows no Python frame), paid at every run's end and worth nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    except CheckpointMismatch as exc:  # another config's progress: stop, never train over it from 0
        print(f"trainer: checkpoint mismatch: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return 0


_SYNC_DTYPE = torch.float64
"""The sync point's values: whether rank 0's failed saves reached the limit, whether it is busy with
a save, and the next save's token (a 32-bit integer: exact in a float64, summed with zeros)."""


def _sync_tensor(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(3, dtype=_SYNC_DTYPE, device=device)
