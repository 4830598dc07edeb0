"""The ``sdc`` chaos fault's effect: one bit flipped in one element of a gradient shard, in place.

A mantissa bit keeps a finite value finite (the exponent is untouched), so the NaN guard never sees
it: only about 1% of real GPU silent corruptions surface as NaN/Inf.  The default is the top mantissa
bit (fp32 bit 22, bf16 bit 6, fp16 bit 9): the element changes by a third to a half of its value,
enough to survive the optimizer step (a flip in the last bit of a gradient can round away in Adam).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}
MANTISSA_BITS = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}


class FlipError(ValueError):
    """The flip cannot be made as asked (no gradient shard, a bit outside the mantissa)."""


@dataclass(frozen=True)
class Flip:
    """What was flipped (for the fault's record, never an event: the fault is silent)."""

    param: int
    element: int
    bit: int
    before: float
    after: float

    def record(self) -> dict[str, Any]:
        return {"param": self.param, "element": self.element, "bit": self.bit, "before": self.before,
                "after": self.after}


def flip_bit(tensor: torch.Tensor, element: int, bit: int | None = None) -> Flip:
    """Flip mantissa ``bit`` (default: the top one) of ``tensor.view(-1)[element]`` in place."""
    if tensor.dtype not in _INT_VIEW:
        raise FlipError(f"cannot flip a bit of a {tensor.dtype} tensor")
    top = MANTISSA_BITS[tensor.dtype] - 1
    bit = top if bit is None else bit
    if not 0 <= bit <= top:
        raise FlipError(f"bit {bit} is outside the {tensor.dtype} mantissa (0..{top})")
    flat = tensor.view(-1)
    if not 0 <= element < flat.numel():
        raise FlipError(f"element {element} outside a shard of {flat.numel()}")
    before = float(flat[element])
    ints = flat.view(_INT_VIEW[tensor.dtype])
    ints[element] ^= 1 << bit
    return Flip(-1, element, bit, before, float(flat[element]))


def flip_in_grads(params: list[torch.nn.Parameter], index: int = 0, element: int | None = None,
                  bit: int | None = None) -> Flip:
    """Flip one bit of this rank's local shard of the ``index``-th parameter that has a gradient here.

    ``element`` defaults to the largest-magnitude entry: a flip there always moves the weights (a flip
    in a zero gradient makes a denormal that the optimizer rounds away)."""
    shards = [g for g in (_local(p.grad) for p in params if p.grad is not None) if g.numel()]
    if not shards:
        raise FlipError("no gradient shard on this rank")
    grad = shards[index % len(shards)]
    if element is None:
        element = int(grad.detach().view(-1).abs().argmax())
    flip = flip_bit(grad, element, bit)
    return Flip(index % len(shards), flip.element, flip.bit, flip.before, flip.after)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
