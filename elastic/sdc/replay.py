"""Replay verification (``sdc.replay_every``): recompute one rank's gradient elsewhere and compare.

A GPU that computes wrong corrupts its rank's *local* gradient (the GEMMs of its forward and
backward).  FSDP's reduce-scatter then folds that gradient into every rank's shard, so all ranks
step the same wrong weights: no two ranks disagree, and only a recomputation can tell.  What is
recomputed is exactly what the rank contributes, before any reduction: its gradient of its own
micro-batches from the step's unsharded parameters.

Every ``replay_every`` steps, on every node (or ``replay_nodes`` of them, cycling through all:
:func:`checked_nodes`), one local rank (the same local index everywhere: round robin over the local
ranks for the first checks, then seeded random) is *checked*:

* the checked rank ``r`` arms a fingerprint in FSDP's reduce-scatter seam
  (:meth:`~torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter`): a CRC32 of each FSDP
  unit's reduce-scatter input, which is the rank's local gradient of the unit laid out by
  ``torch._chunk_cat`` (cast to ``reduce_dtype``; fp32/bf16 are not pre-divided).  The bytes are
  copied off the training thread's buffer and checksummed on a helper thread;
* the *capturing* rank ``c = (r + local_world) % world`` (the same local index on the next node when
  ranks are laid out node by node) copies the unsharded parameters each FSDP unit gathered for its
  forward (a pre-forward hook: the step's weights, identical on every rank) and writes them with the
  checked rank's batch into ``<run>/sdc/replay-<step>-r<rank>.pt`` on its own node, again on a helper
  thread; its agent hands the file to its warm spare;
* the spare rebuilds the model unsharded, loads those weights, replays rank ``r``'s micro-batches and
  lays its gradients out the way FSDP did (:func:`unit_checksums`).  The capturing node's agent
  compares the spare's checksums with the ones rank ``r``'s agent published in etcd.

Measured on CPU (torch 2.15, 2 ranks, the tiny DiT; ``tests/test_sdc_replay.py``): the replay is
bitwise for fp32, bf16 params with fp32 or bf16 reduction, micro-batches (FSDP accumulates in
``reduce_dtype``: the replay sets ``grad_dtype`` the same way), activation checkpointing and FP8
emulation.  Not replayable alone: context parallelism (a rank's forward all-to-alls with its cp
peers), fp16 reduction (pre-divided by the world size), replica-group mode.
"""

from __future__ import annotations

import contextlib
import random
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from elastic.sdc.results import inputs_path, nice_this_thread

_WRAPPER = "_checkpoint_wrapped_module."


def checked_local(check: int, local_world: int, seed: int) -> int:
    """The local rank checked at the ``check``-th check (1-based): round robin over the local ranks
    first (every rank within ``local_world`` checks), then seeded random (no fixed pattern a
    recurring fault could hide between)."""
    if check <= local_world:
        return (check - 1) % local_world
    return random.Random(seed * 1_000_003 + check).randrange(local_world)


def checked_step(step: int, every: int, ab_block: int = 0) -> bool:
    """Whether ``step`` is a check step (``ab_block``: only in the odd blocks of that many steps,
    counting from 1, as ``sdc.replay_ab_block`` says)."""
    return every > 0 and step % every == 0 and (ab_block <= 0 or ((step - 1) // ab_block) % 2 == 0)


def checked_nodes(check: int, nodes: int, per_check: int, seed: int) -> frozenset[int]:
    """The node indices with a checked rank at the ``check``-th check (1-based): every node when
    ``per_check`` is 0 or covers them all; else ``per_check`` at a time, cycling through all of them
    (``sdc.replay_nodes``): index order in the first cycle, then each cycle in an order shuffled by
    the seed.  Every node comes once per cycle, so none goes unchecked for two cycles in a row (a
    checkpoint's verification waits on the node checked last), and a fault cannot learn a pattern."""
    if per_check <= 0 or per_check >= nodes:
        return frozenset(range(nodes))
    cycle, pos = divmod(check - 1, -(-nodes // per_check))
    order = list(range(nodes))
    if cycle:
        random.Random(seed * 1_000_033 + cycle).shuffle(order)
    # The last slot of a cycle wraps to the cycle's first nodes: the same count of replays every check.
    return frozenset(order[(pos * per_check + j) % nodes] for j in range(per_check))


def roles(step: int, every: int, rank: int, world: int, local_world: int, seed: int,
          ab_block: int = 0, per_check: int = 0) -> tuple[bool, int | None]:
    """(whether this rank is checked at ``step``, the rank whose inputs it captures or None);
    ``per_check``: ``sdc.replay_nodes``."""
    if not checked_step(step, every, ab_block) or world < 2:
        return False, None
    local = checked_local(step // every, local_world, seed)
    multi = world > local_world
    nodes = checked_nodes(step // every, -(-world // local_world) if multi else 1, per_check, seed)

    def is_checked(r: int) -> bool:
        return r % local_world == local and (r // local_world if multi else 0) in nodes

    # This rank captures for the one a node before it (on one node: the rank before it).
    target = (rank - (local_world if multi else 1)) % world
    return is_checked(rank), target if is_checked(target) else None


def clean_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper (as the state dict spells it)."""
    return name.replace(_WRAPPER, "")


def fsdp_units(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP unit's label -> its managed parameters' names, in FSDP's order (the unit's
    ``named_parameters`` without those of nested units): the order of its reduce-scatter input."""
    units = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    owner: dict[int, str] = {}
    for label in sorted(units, key=len, reverse=True):  # innermost first: a nested unit owns its params
        for pname, param in units[label].named_parameters():
            owner.setdefault(id(param), label)
    out: dict[str, list[str]] = {label: [] for label in units}
    for label, module in units.items():
        prefix = f"{label}." if label else ""
        out[label] = [clean_name(prefix + n) for n, p in module.named_parameters() if owner[id(p)] == label]
    return out


def crc(tensor: torch.Tensor) -> int:
    data = tensor.detach().contiguous().cpu()
    return zlib.crc32(data.view(-1).view(torch.uint8).numpy()) if data.numel() else 0


def unit_checksums(grads: dict[str, torch.Tensor | None], units: dict[str, list[str]], world: int,
                   reduce_dtype: torch.dtype) -> dict[str, int]:
    """The verifier's side of the fingerprint: each unit's gradients laid out as FSDP's reduce-scatter
    input (a parameter without a gradient is left out, as FSDP leaves it out), then CRC32."""
    out: dict[str, int] = {}
    for label, names in units.items():
        present = [grads[n].to(reduce_dtype) for n in names if grads.get(n) is not None]
        if present:
            out[label] = crc(torch._chunk_cat(present, 0, world))
    return out


class _Fingerprint(ReduceScatter):
    """FSDP's default reduce-scatter, plus a checksum of its input when the probe is armed."""

    def __init__(self, label: str, probe: ReplayProbe) -> None:
        self.label = label
        self.probe = probe

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        self.probe.reduce_input(self.label, input_tensor)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


@dataclass
class _Check:
    step: int
    checked: bool
    target: int | None
    sums: dict[str, Future[int]] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


class ReplayProbe:
    """One rank's part in replay verification: fingerprint its gradient when checked, capture the
    step's weights when it captures for a checked rank.  Off-step cost: nothing (a flag test in the
    reduce-scatter and in each unit's pre-forward hook)."""

    def __init__(self, model: torch.nn.Module, every: int, seed: int, rank: int, world: int, local_world: int,
                 corrupt: Callable[[int, str, torch.Tensor], None] | None = None, ab_block: int = 0,
                 per_check: int = 0) -> None:
        self.every, self.seed, self.ab_block, self.per_check = every, seed, ab_block, per_check
        self.rank, self.world, self.local_world = rank, world, local_world
        self.corrupt = corrupt
        self.units = fsdp_units(model)
        self.check: _Check | None = None
        self.step = 0
        # Niced: the checksums and input files are off the training thread's path (nothing waits on them).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdc-replay", initializer=nice_this_thread)
        self._lock = threading.Lock()
        for label, module in model.named_modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_Fingerprint(label, self))
                module.register_forward_pre_hook(self._capture_hook(label))

    def arm(self, step: int) -> _Check | None:
        """Before the step's forward: this rank's roles at ``step`` (None: not a check step for it)."""
        self.step = step
        checked, target = roles(step, self.every, self.rank, self.world, self.local_world, self.seed,
                                self.ab_block, self.per_check)
        self.check = _Check(step, checked, target) if checked or target is not None else None
        return self.check

    def reduce_input(self, label: str, tensor: torch.Tensor) -> None:
        if self.corrupt is not None:
            self.corrupt(self.step, label, tensor)  # chaos: a wrong GEMM on this rank (silent)
        check = self.check
        if check is None or not check.checked:
            return
        copy = tensor.detach().to("cpu", copy=True)
        check.sums[label] = self._pool.submit(crc, copy)

    def _capture_hook(self, label: str) -> Callable[..., None]:
        prefix = f"{label}." if label else ""

        def hook(module: torch.nn.Module, args: Any) -> None:
            check = self.check
            if check is None or check.target is None:
                return
            for name, param in module.named_parameters():
                full = clean_name(prefix + name)
                if not hasattr(param, "to_local") and full not in check.params:  # unsharded for this forward
                    check.params[full] = param.detach().to("cpu", copy=True)

        return hook

    def checksums(self, check: _Check) -> dict[str, int]:
        """The checked rank's fingerprint (waits for the helper thread: call after the step's backward)."""
        return {label: fut.result() for label, fut in check.sums.items()}

    def report_checksums(self, check: _Check, report: Callable[[dict[str, int]], None]) -> None:
        """``report(checksums)`` on the helper thread once its checksums are done (after the step's
        backward): the training thread does not wait for them."""
        self._pool.submit(lambda: report(self.checksums(check)))

    def write_inputs(self, check: _Check, run_dir: Path, inputs: dict[str, Any], reduce_dtype: torch.dtype,
                     done: Callable[[Path], None], failed: Callable[[OSError], None] = lambda exc: None) -> None:
        """Save what the spare needs to replay the target rank's step, off the training thread; then
        ``done(path)``, or ``failed(error)`` when it could not be written (a full disk: the check is lost)."""
        record = {"step": check.step, "rank": check.target, "world": self.world, "units": self.units,
                  "params": check.params, "reduce_dtype": str(reduce_dtype).removeprefix("torch."),
                  "threads": torch.get_num_threads(), "inputs": inputs}
        path = inputs_path(run_dir, check.step, check.target)
        self._pool.submit(_save_then, record, path, done, failed)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _save_then(record: dict[str, Any], path: Path, done: Callable[[Path], None],
               failed: Callable[[OSError], None]) -> None:
    """Write atomically (a spare never reads half a file), then tell the agent."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(record, tmp)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return failed(exc)
    return done(path)


@dataclass(frozen=True)
class Replayed:
    """What the spare computed for one check."""

    step: int
    rank: int
    checksums: dict[str, int]
    replay_s: float

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "checksums": self.checksums, "replay_s": self.replay_s}




def load_record(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def replay(path: Path, gradients: Callable[[dict[str, Any]], dict[str, torch.Tensor | None]],
           corrupt: Callable[[int, dict[str, torch.Tensor | None]], None] | None = None) -> Replayed:
    """The spare's side: the target rank's gradients recomputed by the trainer's ``gradients``
    (weights and inputs from the record), laid out and checksummed as the rank's FSDP did.
    ``corrupt(step, gradients)``: the chaos fault ``sdc`` at ``replay`` (a verifier that computes wrong)."""
    import time

    t0 = time.monotonic()
    record = load_record(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(record["threads"]))  # CPU GEMMs may block differently with other counts
    try:
        grads = gradients(record)
    finally:
        torch.set_num_threads(threads)
    if corrupt is not None:
        corrupt(int(record["step"]), grads)
    sums = unit_checksums(grads, record["units"], int(record["world"]), getattr(torch, record["reduce_dtype"]))
    return Replayed(int(record["step"]), int(record["rank"]), sums, round(time.monotonic() - t0, 3))
