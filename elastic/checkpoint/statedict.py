"""A cheap (model, optimizer) state dict for per-step snapshots, checked once against DCP's.

DCP's ``get_state_dict`` rebuilds its FQN maps on every call: 2.3 ms for the tiny DiT on a quiet
core, 10.8 ms median inside a 4-node run on 2 shared cores, most of what a per-step snapshot cost
the training thread (``benchmarks/recovery.py``).  ``Module.state_dict()`` and
``Optimizer.state_dict()`` hold the same tensors (FSDP2: the same local shards); only the
optimizer's keys differ (parameter indices instead of FQNs).  The first call takes DCP's answer,
reads the index -> FQN map from its ``param_groups`` (both list a group's parameters in the same
order), and checks that the cheap tree matches DCP's exactly (keys, tensor types, shapes, dtypes and
values, every other value); from then on the cheap tree is used.  Where anything differs (a wrapper
that renames parameters, another optimizer layout) it keeps calling DCP: slower, never different.

DCP saves and snapshot restores keep ``get_state_dict``/``set_state_dict`` (a fresh optimizer has
no state yet: DCP creates it); only the per-step capture takes this path.

Sizing (:func:`sizing`, the snapshot cap's check before training) must not create that state: DCP
creates it with a zero-gradient ``step()`` at lr 0, which leaves the weights but counts a step in
Adam's state, so a run that sized its snapshots before step 1 trained a different trajectory
(its bias correction one step on) from the same run without snapshots (found by the chaos suite:
weights differed from step 2).  While sizing, a fresh optimizer's state is reported empty.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor


def same_tree(a: Any, b: Any) -> bool:
    """Equal structure and values: dict keys, sequence lengths, tensor kind/shape/dtype/bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and set(a) == set(b) \
            and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN == NaN here


def _same_tensor(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor):
        if a.placements != b.placements or a.shape != b.shape:
            return False
        a, b = a._local_tensor, b._local_tensor
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Bitwise view (NaN equals the same NaN; -0.0 differs from 0.0)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


_SIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("snapshot_sizing", default=False)


@contextlib.contextmanager
def sizing() -> Iterator[None]:
    """Inside: state dicts are read only for their tensors' sizes (see the module: no state created)."""
    token = _SIZING.set(True)
    try:
        yield
    finally:
        _SIZING.reset(token)


def _fresh(optim: torch.optim.Optimizer) -> bool:
    """No state and no gradient: DCP's ``get_state_dict`` would step this optimizer to create its state."""
    return not optim.state and all(p.grad is None for g in optim.param_groups for p in g["params"])


class SnapshotStateDict:
    """``(model_sd, optim_sd)`` as ``get_state_dict(model, optim)`` returns them, cheaply (see the module)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self.fast: bool | None = None  # None: not checked yet
        self._names: list[list[str]] = []

    def __call__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if _SIZING.get() and self.fast is None and _fresh(self.optim):
            return dict(self.model.state_dict(keep_vars=True)), {"state": {}, "param_groups": []}
        if self.fast:
            return self._cheap()
        if self.fast is None:
            return self._check()
        return get_state_dict(self.model, self.optim)

    def _check(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        self._names = [list(group["params"]) for group in optim_sd.get("param_groups", [])]
        cheap = self._cheap()
        self.fast = len(self._names) == len(self.optim.param_groups) and same_tree(cheap, (model_sd, optim_sd))
        return model_sd, optim_sd

    def _cheap(self) -> tuple[dict[str, Any], dict[str, Any]]:
        raw = self.optim.state_dict()
        fqn: dict[int, str] = {}
        for names, group in zip(self._names, raw["param_groups"]):
            fqn.update(zip(group["params"], names))
        state = {fqn[index]: value for index, value in raw["state"].items() if index in fqn}
        groups = [{**group, "params": [fqn[i] for i in group["params"] if i in fqn]} for group in raw["param_groups"]]
        # keep_vars: the parameters themselves, not a detached alias of each (a DTensor's detach goes
        # through its dispatcher: 31 of them were 0.5 ms of the tiny DiT's 0.9 ms capture, quiet core).
        # The snapshot only reads them, under no_grad.
        return dict(self.model.state_dict(keep_vars=True)), {"state": state, "param_groups": groups}
