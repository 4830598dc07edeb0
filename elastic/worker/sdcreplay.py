"""A trainer's part in replay verification (``sdc.replay_every``), over its worker session.

The trainer builds one :class:`ReplayVerification` with its model (after ``fully_shard``), calls
:meth:`~ReplayVerification.begin` before the step's forward and :meth:`~ReplayVerification.end`
after its backward, before the optimizer step.  What a check does is in :mod:`elastic.sdc.replay`;
this module decides whether one can run here, and reports through the worker's agent channel:

* the checked rank's checksums (``replay_sum``): its agent publishes them in etcd;
* the capturing rank's input file (``replay``): its agent hands it to its warm spare.

The chaos fault ``sdc`` with ``"at": "local"`` flips a bit in the checked seam itself: the rank's
local gradient before the reduce-scatter (what a GPU computing wrong does), whether or not the rank is
checked at that step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from elastic.sdc.flip import flip_bit
from elastic.sdc.replay import ReplayProbe, _Check
from elastic.worker.session import WorkerSession


def unsupported(session: WorkerSession, model: torch.nn.Module, cp: int, reduce_dtype: torch.dtype) -> str | None:
    """Why this world cannot replay a rank's step alone (None: it can)."""
    if session.world < 2:
        return "one rank: nothing to compare a replay with"
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return "the model is not sharded with FSDP2 (the fingerprint is its reduce-scatter input)"
    if cp > 1:
        return f"context parallelism (cp={cp}): a rank's forward all-to-alls with its peers"
    if reduce_dtype == torch.float16:
        return "reduce_dtype float16 is pre-divided by the world size before the reduce-scatter"
    return None


class ReplayVerification:
    """Arms the probe each step and reports what a check produced (see the module docstring)."""

    def __init__(self, session: WorkerSession, probe: ReplayProbe, reduce_dtype: torch.dtype) -> None:
        self.session = session
        self.probe = probe
        self.reduce_dtype = reduce_dtype
        self.check: _Check | None = None
        inproc = session.inproc
        self.tag = f"{session.epoch}.{inproc.gen if inproc is not None else 0}"
        """Which world computed a step: a check is compared only with a replay of the same world."""

    @classmethod
    def open(cls, session: WorkerSession, model: torch.nn.Module, seed: int, cp: int = 1,
             reduce_dtype: torch.dtype = torch.float32) -> ReplayVerification | None:
        cfg = session.cfg.sdc
        if not cfg.replay:
            return None
        reason = unsupported(session, model, cp, reduce_dtype)
        if reason is not None:
            if session.rank == 0:
                session.events.emit("sdc.replay_off", reason=reason)
            return None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        probe = ReplayProbe(model, cfg.replay_every, seed, session.rank, session.world, local_world,
                            corrupt=_local_flip(session), ab_block=cfg.replay_ab_block,
                            per_check=cfg.replay_nodes)
        return cls(session, probe, reduce_dtype)

    def begin(self, step: int) -> None:
        """Before the step's forward: the pre-forward hooks capture, the reduce-scatter fingerprints."""
        self.check = self.probe.arm(step)

    def end(self, inputs_for: Callable[[int], dict[str, Any]]) -> None:
        """After the step's backward: report this rank's fingerprint, write what a spare replays.

        ``inputs_for(rank)``: what the trainer's ``replay_gradients`` needs besides the weights to
        recompute that rank's step (its batch), as plain data."""
        check, self.check = self.check, None
        if check is None:
            return
        agent = self.session.agent
        if check.checked:
            step, tag, threads = check.step, self.tag, torch.get_num_threads()
            self.probe.report_checksums(check, lambda sums: agent.report_replay_sum(step, tag, sums, threads))
        if check.target is not None:
            target, step, tag = check.target, check.step, self.tag
            events = self.session.events
            self.probe.write_inputs(check, self.session.run_dir, inputs_for(target), self.reduce_dtype,
                                    done=lambda path: agent.report_replay(step, target, str(path), tag),
                                    failed=lambda exc: events.emit("sdc.replay_skipped", step=step, rank=target,
                                                                   reason=f"its inputs were not written: {exc}"))

    def close(self) -> None:
        self.probe.close()


def _local_flip(session: WorkerSession) -> Callable[[int, str, torch.Tensor], None]:
    """The ``sdc`` chaos fault at ``"at": "local"``: one bit of this rank's local gradient, once."""
    flipped: set[int] = set()

    def corrupt(step: int, label: str, tensor: torch.Tensor) -> None:
        if step in flipped:
            return
        fault = session.hooks.sdc(step, at="local")
        if fault is None:
            return
        flipped.add(step)
        flat = tensor.detach().view(-1)
        element = fault.spec.get("element")
        element = int(flat.abs().argmax()) if element is None else int(element)
        flip = flip_bit(flat, element, fault.spec.get("bit"))
        session.hooks.sdc_fired(fault, step, {**flip.record(), "unit": label, "at": "local"})

    return corrupt
