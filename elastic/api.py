"""The public API for a training loop run by the runtime: what a trainer imports, and all it needs.

The built-in trainers (``trainer.train``, ``trainer.dit_train``) import these names from here and
nothing private; a trainer in another package (``examples/byo``) does the same.  A loop gets, by
going through this module, exactly what they get: in-process recovery, per-step memory snapshots,
checkpoint resume, the NaN guard, hang stacks and every in-worker chaos fault.

The shape of a trainer (``docs/workloads.md`` walks through one)::

    class MyRun(Loop):                      # built for the current world, again after a re-formation
        def __init__(self, session: WorkerSession) -> None:
            self.session = session          # session.cfg.trainer is the run's typed trainer section
            self.model = ...                # sharded for session.world ranks (FSDP2 fully_shard)
            self.optim = ...
            self.train_state = TrainState(self.model, self.optim, data=self.data)
            self.last_step = session.cfg.trainer.steps

        def state(self) -> dict[str, Any]:  # registers model, optimizer, data position
            return {"app": self.train_state}

        def step(self, step: int) -> None:
            session = self.session
            session.begin_step(step)        # timing, step faults
            session.sync_point()            # before the step changes any state a snapshot holds
            if session.skip_step(step):     # a batch skipped after a numerics rollback
                ...                         # advance the data position, train nothing
            loss = session.loss(step, ...)  # the loss (NaN where a nan_loss fault says so)
            nan_guard(session, step, loss)  # non-finite on any rank: every rank rolls back
            session.commit_point()          # before the step's last collectives
            ...                             # backward
            silent_fault(session, step, self.model)  # an sdc chaos fault flips a gradient bit here
            ...                             # optimizer step
            self.train_state.step = step
            session.end_step(step, float(loss))

    def main(argv: list[str] | None = None) -> int:
        return run_worker("python -m my.train", MyConfig, lambda session: session.train(MyRun), argv)

    if __name__ == "__main__":
        exit_process(main())

``run_worker`` parses ``--config FILE --run-dir DIR``, reads the run file into the workload's config
class, opens the :class:`WorkerSession` and maps the typed stops (:class:`StopTraining` and its
subclasses, ``ConfigError``) to the exit codes the agents understand.  ``session.train(build)``
builds the :class:`Trainable`, resumes it (from memory or the newest committed checkpoint), runs its
steps, snapshots and saves after each, and builds it again for the re-formed world after a peer is
lost.  The module that *registers* the workload is read by the launcher and must not import torch,
so it imports ``Workload`` from :mod:`elastic.run.workloads`, not from here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic.checkpoint.statedict import SnapshotStateDict
from elastic.common.collectives import check_device
from elastic.common.config import ConfigError
from elastic.run.schema import RunConfig, dump_run_file, load_run_file
from elastic.worker.sdcreplay import ReplayVerification
from elastic.worker.session import (NumericsRollback, StopTraining, Trainable, WorkerSession, exit_process,
                                    parse_worker_args, run_worker)

__all__ = [
    "ConfigError", "Loop", "NumericsRollback", "ReplayVerification", "RunConfig", "SnapshotStateDict",
    "StopTraining", "Trainable", "TrainState", "WorkerSession", "dump_run_file", "exit_process", "load_run_file",
    "nan_guard", "parse_worker_args", "run_worker", "silent_fault",
]


class Loop:
    """Optional base of a :class:`Trainable`: the hooks most loops leave empty.

    A subclass sets ``model`` and ``last_step`` and writes ``state()`` and ``step()``."""

    model: nn.Module
    last_step: int

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def extra(self) -> dict[str, Any]:
        """Per-rank state beside this rank's shard (RNG); none when every input comes from ``state()``."""
        return {}

    def resumed(self, step: int, extra: dict[str, Any] | None) -> dict[str, Any]:
        """After a load: restore what ``state()`` does not (``extra``); fields for ``trainer.start``."""
        return {}

    def done_fields(self) -> dict[str, Any]:
        """Fields for ``trainer.done``."""
        return {}


class TrainState:
    """Model, optimizer, data position and step as one DCP Stateful (what ``state()`` returns).

    Model and optimizer go through DCP's state-dict helpers, so a checkpoint reshards to another
    world size; a per-step snapshot takes the cheap path (:class:`SnapshotStateDict`).  ``data`` is
    any object with ``state_dict()``/``load_state_dict()`` (a sampler, a stream position): a loop
    that resumes bitwise keeps every input of a step here or in ``extra()``."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, data: Any = None) -> None:
        self.model, self.optim, self.data = model, optim, data
        self.step = 0
        self._snapshot_sd = SnapshotStateDict(model, optim)

    def state_dict(self) -> dict[str, Any]:
        return self._with(*get_state_dict(self.model, self.optim))

    def snapshot_state_dict(self) -> dict[str, Any]:
        """The same tree for a per-step memory snapshot, without DCP's per-call cost."""
        return self._with(*self._snapshot_sd())

    def _with(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
        tree = {"model": model_sd, "optim": optim_sd, "step": self.step}
        if self.data is not None:
            tree["data"] = self.data.state_dict()
        return tree

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.step = int(state_dict["step"])
        if self.data is not None:
            self.data.load_state_dict(state_dict["data"])


def nan_guard(session: WorkerSession, step: int, loss: torch.Tensor) -> None:
    """Collective: raise :class:`NumericsRollback` on every rank when ``loss`` is not finite on any.

    Call it before backward: a NaN never reaches the weights.  The agents roll the run back to the
    last good state and the session skips this step's batch on the way forward (``skip_step``)."""
    bad = (~torch.isfinite(loss.detach())).any().to(torch.float32).reshape(1)
    dist.all_reduce(check_device(bad))  # every rank reaches the same verdict and leaves together
    if float(bad.item()) == 0.0:
        return
    session.events.emit("trainer.numerics", step=step, reason="non-finite loss")
    session.agent.report_numerics(step, "non-finite loss")
    raise NumericsRollback(step, "non-finite loss")


def silent_fault(session: WorkerSession, step: int, model: nn.Module) -> None:
    """Where an ``sdc`` chaos fault says so, flip one bit of this rank's gradient shard, silently.

    Call it after backward (and after any cross-replica average of the gradients), before the
    optimizer step.  No event: the runtime has to find the flip by itself (``sdc.check_every``);
    what was flipped goes into the fault's ``.fired`` file only (chaos's ground truth)."""
    fault = session.hooks.sdc(step)
    if fault is None:
        return
    from elastic.sdc.flip import flip_in_grads

    spec = fault.spec
    flip = flip_in_grads(list(model.parameters()), int(spec.get("param", 0)), spec.get("element"), spec.get("bit"))
    session.hooks.sdc_fired(fault, step, flip.record())
