"""In-worker faults: written as fault files (:mod:`elastic.worker.faults`) that the worker session fires."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from chaos.follow import parse_target
from chaos.injection import InjectionContext, InjectionRecord, Injector, register
from elastic.worker.faults import write_fault

@dataclass(kw_only=True)
class StraggleParams:
    delay_s: float = 0.3
    """Extra seconds per step on the target rank."""
    num_steps: int = 4
    """Steps the slowdown lasts, starting at the fault's step."""


def _worker_rank(target: str) -> int | None:
    """Rank named by a target; a bare ``nodeN`` maps to rank N (one worker per node locally)."""
    node, rank = parse_target(target)
    if rank is not None:
        return rank
    if node is not None and node.startswith("node") and node[4:].isdigit():
        return int(node[4:])
    return None


def _fault_step(ctx: InjectionContext, at: int | None) -> int:
    # A file fault names a future step; +2 because the fastest rank may already be inside step+1.
    return max(ctx.step + 2, at or 0)


@register("straggler")
class Straggler(Injector):
    """A slow rank: write a ``straggle`` fault file for the next ``num_steps`` steps."""

    Params = StraggleParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        start = _fault_step(ctx, None)
        spec = {"kind": "straggle", "from_step": start, "to_step": start + self.params.num_steps - 1,
                "delay_s": self.params.delay_s}
        rank = _worker_rank(self.target)
        if rank is not None:
            spec["rank"] = rank
        path = write_fault(ctx.run_dir, f"chaos-straggle-{start}", spec)
        return self._record(ctx, file=str(path), spec=spec)


@dataclass(kw_only=True)
class AtStepParams:
    step: int | None = None
    """Step at which the worker-side fault fires; default: the step after the newest one seen."""


@register("nan")
class NanLoss(Injector):
    """A NaN loss on the target rank at one step (``nan_loss`` fault file, fires once)."""

    Params = AtStepParams
    needs_run = False
    # The default numerics action skips the batch in place; a rollback's restart is still measured
    # when it comes before the next fault (chaos.analysis).
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        step = self.params.step if self.params.step is not None else _fault_step(ctx, None)
        spec: dict[str, Any] = {"kind": "nan_loss", "step": step}
        rank = _worker_rank(self.target)
        if rank is not None:
            spec["rank"] = rank
        path = write_fault(ctx.run_dir, f"chaos-nan-{step}", spec)
        return self._record(ctx, file=str(path), spec=spec)


@dataclass(kw_only=True)
class SdcParams:
    step: int | None = None
    """Step whose gradients get the flip; default: the step after the newest one seen.  For the
    cross-replica check to keep the run bitwise, a step it checks (a multiple of sdc.check_every)."""
    rank: int | None = None
    """Rank (within the node's group in replica mode) whose shard is hit; default: the first to claim it."""
    bit: int | None = None
    """Mantissa bit to flip; default: the top one (fp32 bit 22), which always moves the weights."""
    at: Literal["shard", "local", "replay"] = "shard"
    """``shard``: the rank's reduced gradient shard before its optimizer step (only that rank's
    weights change: what cross-replica agreement, ``sdc.check_every``, finds); ``local``: the rank's
    own gradient before the reduce-scatter, as a GPU that computes wrong would (every rank steps the
    same wrong weights: only replay verification, ``sdc.replay_every``, finds it, at a checked step);
    ``replay``: the node's warm spare computes its replay of the checked step wrong (a verifier on a bad
    GPU): the training is right, the arbitration must name the verifying node, never the checked one."""


@register("sdc")
class SilentCorruption(Injector):
    """One bit of one rank's gradient shard flipped after backward, silently (silent data corruption).

    An ``sdc`` fault file: fires once, emits no event; what it flipped goes into its ``.fired`` file."""

    Params = SdcParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        step = self.params.step if self.params.step is not None else _fault_step(ctx, None)
        spec: dict[str, Any] = {"kind": "sdc", "step": step}
        node, rank = parse_target(self.target)
        if node is not None:
            spec["node"] = node
        if rank is not None:
            spec["rank"] = rank
        for name in ("rank", "bit"):
            if getattr(self.params, name) is not None:
                spec[name] = getattr(self.params, name)
        if self.params.at != "shard":
            spec["at"] = self.params.at
        path = write_fault(ctx.run_dir, f"chaos-sdc-{step}", spec)
        return self._record(ctx, file=str(path), spec=spec)


@register("ckpt_write_error")
class CheckpointWriteError(Injector):
    """One checkpoint save fails with ENOSPC (``ckpt_write_error`` fault file, fires once)."""

    Params = AtStepParams
    needs_run = False
    restarts_workers = False

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        # Without a step: the first save from two steps on (a step from the clock is rarely a save's).
        step = self.params.step if self.params.step is not None else _fault_step(ctx, None)
        when = "step" if self.params.step is not None else "from_step"
        spec = {"kind": "ckpt_write_error", when: step}
        path = write_fault(ctx.run_dir, f"chaos-ckpt-write-{step}", spec)
        return self._record(ctx, file=str(path), spec=spec)


# -- checkpoint corruption ------------------------------------------------------------
