"""FP8 linears: emulation error bounds, saturation, real-kernel parity, conversion filter, stats.

Stated bounds (relative Frobenius error of Y = X W^T + b against fp32, random normal
operands, K = 128): e4m3 keeps 3 mantissa bits, so each quantized operand carries a
relative rounding error of at most 2^-4 (about 2-3 % rms); the product's relative error
must stay below 8 % (tensorwise) and gradients (e5m2 grad_output, 2 mantissa bits)
below 15 %.  bf16 (7 mantissa bits) is checked to be an order of magnitude better,
as a sanity check of the error measure.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from elastic.common.config import from_dict
from trainer.dit import build_dit
from trainer.dit_config import ModelConfig
from trainer.fp8 import (
    E4M3,
    E4M3_MAX,
    Float8Linear,
    compute_scale,
    convert_to_fp8,
    fp8_stats,
    quantize,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def pair(recipe="tensorwise", use_mm=False, seed=0, k=128, n=64):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n)
    return ref, Float8Linear.from_linear(ref, recipe, use_mm)


def test_quantize_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -2000.0, 3.0, 447.0, 1e30])
    q, saturated = quantize(x, E4M3, torch.tensor(1.0))
    assert torch.isfinite(q.float()).all()
    assert q.float().tolist()[:2] == [E4M3_MAX, -E4M3_MAX]
    assert int(saturated) == 3
    assert E4M3_MAX == 448.0


def test_dynamic_scale_maps_amax_to_fp8_max_and_handles_zeros():
    x = torch.randn(16, 32) * 1e4  # far beyond the e4m3 range before scaling
    scale, _ = compute_scale(x, E4M3, rowwise=False)
    q, saturated = quantize(x, E4M3, scale)
    assert float(q.float().abs().max()) == E4M3_MAX and int(saturated) == 0
    zero_scale, _ = compute_scale(torch.zeros(4, 4), E4M3, rowwise=False)
    assert torch.isfinite(zero_scale)
    row_scale, row_amax = compute_scale(x, E4M3, rowwise=True)
    assert row_scale.shape == (16, 1) and torch.allclose(row_amax.squeeze(1), x.abs().amax(1))


def test_forward_error_bound_vs_fp32_and_bf16():
    ref, fp8 = pair()
    x = torch.randn(256, 128)
    y = ref(x)
    err_fp8 = rel_err(fp8(x), y)
    err_bf16 = rel_err(nn.functional.linear(x.bfloat16(), ref.weight.bfloat16(), ref.bias.bfloat16()), y)
    assert 0 < err_fp8 < 0.08, err_fp8
    assert err_bf16 < err_fp8 / 5, (err_bf16, err_fp8)


def test_large_inputs_are_finite_and_scale_invariant():
    ref, fp8 = pair()
    x = torch.randn(64, 128)
    big = x * 5e3  # |x| >> 448: without dynamic scaling and clamping this would not survive the cast
    out = fp8(big)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref(big)) < 0.08


def test_gradient_error_bound():
    ref, fp8 = pair(seed=1)
    x = torch.randn(256, 128, requires_grad=True)
    x8 = x.detach().clone().requires_grad_(True)
    g = torch.randn(256, 64)
    ref(x).backward(g)
    fp8(x8).backward(g)
    assert rel_err(x8.grad, x.grad) < 0.15
    assert rel_err(fp8.weight.grad, ref.weight.grad) < 0.15
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # bias grad uses the exact grad_output


def test_rowwise_beats_tensorwise_on_outlier_rows():
    ref, tw = pair("tensorwise")
    rw = Float8Linear.from_linear(ref, "rowwise", False)
    x = torch.randn(128, 128)
    # a few rows 1e5 x larger: beyond e4m3 dynamic range (448 / 2^-9 ~ 2.3e5 incl. subnormals), so
    # one tensor-wide scale flushes the ordinary rows towards zero; per-row scales do not
    x[::16] *= 1e5
    y = ref(x)
    small = torch.ones(128, dtype=torch.bool)
    small[::16] = False
    assert rel_err(rw(x)[small], y[small]) < 0.08
    assert rel_err(rw(x)[small], y[small]) < rel_err(tw(x)[small], y[small]) / 2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_scaled_mm_kernel_matches_emulation(recipe):
    """torch ships a CPU _scaled_mm: run the real-kernel code path (layouts, scales) against emulation."""
    ref, emu = pair(recipe, use_mm=False, seed=2)
    real = Float8Linear.from_linear(ref, recipe, use_scaled_mm=True)
    x = torch.randn(64, 128)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = emu(xa), real(xb)
    tol = 1e-5 if recipe == "tensorwise" else 2e-2  # rowwise _scaled_mm only writes bf16
    assert rel_err(yb, ya) < tol
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert rel_err(xb.grad, xa.grad) < tol
    assert rel_err(real.weight.grad, emu.weight.grad) < tol


def test_convert_filter_and_stats():
    model = build_dit(from_dict(ModelConfig, {"preset": "tiny"}), 0)
    model.extra = nn.Linear(24, 32)  # 24 is not a multiple of 16: never converted
    names = convert_to_fp8(model, include=["blocks.*", "extra"], exclude=["*adaLN*"])
    assert names == [
        f"blocks.{i}.{leaf}" for i in range(2) for leaf in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ]
    assert type(model.blocks[0].adaLN_modulation[1]) is nn.Linear
    assert type(model.extra) is nn.Linear and type(model.t_embedder.mlp[0]) is nn.Linear
    assert fp8_stats(model) == {}
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([0, 1])).square().mean().backward()
    stats = fp8_stats(model)
    assert stats["layers"] == 8
    for key in ("amax_input_max", "amax_weight_max", "amax_grad_max"):
        assert stats[key] > 0
    assert not any(key.startswith("sat_") for key in stats)  # dynamic scaling cannot saturate: not counted
    # state-dict keys unchanged: FP8 and plain checkpoints are interchangeable
    assert set(model.state_dict()) == set(build_dit(from_dict(ModelConfig, {"preset": "tiny"}), 0).state_dict()) | {
        "extra.weight", "extra.bias"}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _fp64_reference(ref: nn.Linear, x: torch.Tensor, g: torch.Tensor):
    x64 = x.detach().double().requires_grad_(True)
    w64 = ref.weight.detach().double().requires_grad_(True)
    (x64 @ w64.t() + ref.bias.detach().double()).backward(g.double())
    return x64.grad, w64.grad


@pytest.mark.parametrize("use_mm", [False, True], ids=["emulate", "scaled_mm"])
@pytest.mark.parametrize("rows", [64, 50], ids=["aligned", "padded"])
def test_rowwise_backward_against_fp64(use_mm, rows):
    """Both gradient GEMMs in FP8 with per-contraction-row scales: relative Frobenius error vs an
    fp64 reference within the e4m3 bound (3 mantissa bits per operand: ~2-3 % rms each), also
    when the token count is not a multiple of 16 (the dW contraction is zero-padded)."""
    ref, fp8 = pair("rowwise", use_mm=use_mm, seed=3)
    x = torch.randn(rows, 128, requires_grad=True)
    g = torch.randn(rows, 64)
    fp8(x).backward(g)
    dx64, dw64 = _fp64_reference(ref, x, g)
    assert rel_err(x.grad, dx64) < 0.06
    assert rel_err(fp8.weight.grad, dw64) < 0.06
    torch.testing.assert_close(fp8.bias.grad, g.sum(0))  # the bias gradient uses the exact grad_output


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_gemm_runs_in_fp8_no_high_precision_fallback(recipe, dtype):
    """With the real kernel, forward + backward is exactly three _scaled_mm and no other matmul
    (the old rowwise backward, and any shape not a multiple of 16, fell back to fp32 matmuls)."""
    ref, fp8 = pair(recipe, use_mm=True, seed=4)
    fp8 = fp8.to(dtype)
    x = torch.randn(2, 25, 128, dtype=dtype, requires_grad=True)  # 50 tokens: M % 16 != 0
    with _CountOps() as count:
        fp8(x).backward(torch.randn(2, 25, 64, dtype=dtype))
    assert count.ops["_scaled_mm"] == 3
    assert not {"mm", "addmm", "bmm", "matmul", "linear"} & set(count.ops), count.ops
    assert x.grad.dtype == dtype and fp8.weight.grad.dtype == dtype


def test_compiles_without_graph_breaks_and_records_forward_stats():
    ref, fp8 = pair("rowwise", use_mm=False, seed=5)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fp8)(torch.randn(32, 128, requires_grad=True))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert set(fp8.stats) >= {"amax_input", "amax_weight"}
