"""FP8 linear layers with dynamic scaling, real on Ada/Hopper+, emulated elsewhere.

Recipe (per call, no amax history - "current" / dynamic scaling):

* forward: input X and weight W are cast to ``float8_e4m3fn`` with
  ``scale = 448 / amax`` (tensorwise: one amax per tensor; rowwise: one per
  row of X and one per output row of W).  Values are clamped to +-448 before
  the cast: e4m3fn has no infinity, and an out-of-range cast gives NaN.
  Y = (Xq / sx) @ (Wq / sw)^T + b.
* backward: grad_output G is cast to ``float8_e5m2`` (range 57344, more
  exponent bits for gradients) with its own tensorwise scale.  dX = Gq @ Wq and
  dW = Gq^T @ Xq reuse the forward's quantized operands, i.e. the backward is
  the exact gradient of the quantized forward with respect to the quantized
  operands, passed straight through the quantizers.  The bias gradient is
  computed from the unquantized G.
* backends: ``scaled_mm`` runs ``torch._scaled_mm`` (CUDA, compute capability
  >= 8.9, or torch's reference CPU kernel; the second operand must be
  column-major); ``emulate`` dequantizes the
  same fp8 values and multiplies in fp32, so CPU tests see the numerics of the
  real kernel up to accumulation order.  The backward on CUDA uses
  ``_scaled_mm`` when the shapes allow it (all dims multiples of 16), else
  emulation.

Each layer keeps the last amax of X, W and G and the number of values that
hit the clamp; :func:`fp8_stats` collects them for logging.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Literal

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
E5M2_MAX = float(torch.finfo(E5M2).max)  # 57344
_AMAX_FLOOR = 1e-12

Recipe = Literal["tensorwise", "rowwise"]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x * scale`` to fp8 with saturation; returns (fp8 tensor, count of saturated values).

    With a dynamic scale, amax * (fmax / amax) can exceed fmax by one float32
    rounding step; such values are clamped too but not counted as saturated.
    """
    fmax = float(torch.finfo(dtype).max)
    scaled = x.float() * scale
    saturated = (scaled.abs() > fmax * (1 + 1e-6)).sum()
    return scaled.clamp(-fmax, fmax).to(dtype), saturated


def compute_scale(x: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, amax): scale maps amax to the fp8 max; rowwise gives [rows, 1] scales."""
    fmax = float(torch.finfo(dtype).max)
    if rowwise:
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    else:
        amax = x.detach().abs().amax().float()
    scale = fmax / amax.clamp(min=_AMAX_FLOOR)
    return scale, amax


def fp8_supported_on(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


def _mm_ok(*dims: int) -> bool:
    return all(d % 16 == 0 for d in dims)


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, layer):  # type: ignore[override]
        rowwise = layer.recipe == "rowwise"
        sx, ax = compute_scale(x2d, E4M3, rowwise)
        sw, aw = compute_scale(weight, E4M3, rowwise)
        xq, sat_x = quantize(x2d, E4M3, sx)
        wq, sat_w = quantize(weight, E4M3, sw)
        layer._record(amax_input=ax.max(), amax_weight=aw.max(), sat_input=sat_x, sat_weight=sat_w)
        out_dtype = x2d.dtype
        if layer.use_scaled_mm and _mm_ok(x2d.shape[1], weight.shape[0]):
            # _scaled_mm takes dequantization scales (1/scale): rowwise [M,1] and [1,N] (bf16 output only).
            mm_dtype = torch.bfloat16 if rowwise else out_dtype
            scale_b = (1.0 / sw).float().reshape(1, -1) if rowwise else (1.0 / sw).float()
            out = torch._scaled_mm(xq, wq.t(), scale_a=(1.0 / sx).float(), scale_b=scale_b, out_dtype=mm_dtype)
            out = out.to(out_dtype)
        else:
            out = (_dequant(xq, sx) @ _dequant(wq, sw).t()).to(out_dtype)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.dtypes = (x2d.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        xq, sx, wq, sw = ctx.saved_tensors
        layer = ctx.layer
        x_dtype, w_dtype = ctx.dtypes
        sg, ag = compute_scale(grad_out, E5M2, rowwise=False)
        gq, sat_g = quantize(grad_out, E5M2, sg)
        layer._record(amax_grad=ag, sat_grad=sat_g)
        m, n = grad_out.shape
        k = xq.shape[1]
        rowwise = layer.recipe == "rowwise"
        if layer.use_scaled_mm and not rowwise and _mm_ok(m, n, k):
            out_dtype = grad_out.dtype
            # dX [M,K] = G [M,N] @ W [N,K]; the second operand must be column-major.
            grad_x = torch._scaled_mm(gq, wq.t().contiguous().t(), scale_a=(1.0 / sg).float(),
                                      scale_b=(1.0 / sw).float(), out_dtype=out_dtype)
            # dW [N,K] = G^T [N,M] @ X [M,K].
            grad_w = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), scale_a=(1.0 / sg).float(),
                                      scale_b=(1.0 / sx).float(), out_dtype=out_dtype)
        else:
            g = _dequant(gq, sg)
            grad_x = g @ _dequant(wq, sw)
            grad_w = g.t() @ _dequant(xq, sx)
        grad_b = grad_out.sum(0) if ctx.has_bias else None
        return grad_x.to(x_dtype), grad_w.to(w_dtype), grad_b, None


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8 (same parameters and state-dict keys as nn.Linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe = "tensorwise",
                 use_scaled_mm: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe: Recipe = recipe
        self.use_scaled_mm = use_scaled_mm
        self.stats: dict[str, torch.Tensor] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, use_scaled_mm: bool) -> Float8Linear:
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe,
                  use_scaled_mm=use_scaled_mm, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def _record(self, **values: torch.Tensor) -> None:
        # Kept as tensors: converting here would force a device sync per layer per step.
        for key, value in values.items():
            self.stats[key] = value.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = _FP8Matmul.apply(x.reshape(-1, shape[-1]), self.weight, self.bias, self)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", recipe={self.recipe}, scaled_mm={self.use_scaled_mm}"


def _matches(name: str, include: list[str], exclude: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in include) and not any(fnmatch.fnmatch(name, p) for p in exclude)


def convert_to_fp8(model: nn.Module, include: list[str], exclude: list[str], recipe: Recipe = "tensorwise",
                   backend: Literal["auto", "emulate", "scaled_mm"] = "auto") -> list[str]:
    """Swap matching nn.Linear modules (both dims divisible by 16) for Float8Linear in place.

    Returns the converted module names.  ``scaled_mm`` raises if the hardware
    cannot run it; ``auto`` picks it on CUDA with compute capability >= 8.9.
    """
    device = next(model.parameters()).device
    hw = fp8_supported_on(device)
    if backend == "scaled_mm" and device.type == "cuda" and not hw:
        raise ValueError(f"fp8 backend 'scaled_mm' needs CUDA compute capability >= 8.9 (device {device})")
    # torch also has a (slow) CPU _scaled_mm kernel: 'scaled_mm' on CPU runs it, which tests the
    # real-kernel code path (operand layouts, scales) without a GPU.
    use_mm = hw if backend == "auto" else backend == "scaled_mm"
    converted = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not _matches(name, include, exclude):
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear.from_linear(module, recipe, use_mm))
        converted.append(name)
    return converted


def fp8_stats(model: nn.Module) -> dict[str, Any]:
    """Summary of the FP8 layers' last amax / saturation statistics (for trainer.step events).

    All values are gathered into one tensor first: one device sync per call, not one per layer.
    """
    layers = [m.stats for m in model.modules() if isinstance(m, Float8Linear) and m.stats]
    if not layers:
        return {}
    keys = sorted({key for stats in layers for key in stats})
    flat = [(key, stats[key]) for stats in layers for key in keys if key in stats]
    values = torch.stack([v.float().reshape(()) for _, v in flat]).tolist()
    columns: dict[str, list[float]] = {}
    for (key, _), value in zip(flat, values):
        columns.setdefault(key, []).append(value)
    summary: dict[str, Any] = {"layers": len(layers)}
    for key in ("amax_input", "amax_weight", "amax_grad"):
        if key in columns:
            summary[f"{key}_max"] = max(columns[key])
            summary[f"{key}_min"] = min(columns[key])
    for key in ("sat_input", "sat_weight", "sat_grad"):
        if key in columns:
            summary[key] = int(sum(columns[key]))
    return summary


def fp8_layer_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    return {
        name: {k: float(v) for k, v in m.stats.items()} for name, m in model.named_modules() if isinstance(m, Float8Linear)
    }
