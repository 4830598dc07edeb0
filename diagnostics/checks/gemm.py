"""GEMM burn-in: sustained matmul throughput per dtype, with the results verified.

For each device (every GPU, or the CPU) and dtype (fp32, bf16, and fp8 through
``torch._scaled_mm`` on GPUs with compute capability >= 8.9 or on a CPU build
that has the kernel -- torch 2.13's does), square matrices with deterministic contents
(seeded generator, uniform in [-1, 1)) are multiplied back to back for
``quick_seconds`` / ``full_seconds``.  Two correctness tests, in the spirit of
gpu-burn's result comparison:

* **accuracy** -- a sample of rows of the last product is compared with an fp64
  product of the same (already rounded) inputs.  The error of element (i, j) is
  divided by ``(|A| @ |B|)[i, j]``, the largest magnitude rounding can act on,
  and must stay under ``rtol[dtype]``;
* **consistency** -- the first and last products must be bitwise identical (same
  inputs, same kernel); a faulty math unit or memory corrupts one of them.

Injection knobs (``gemm:`` section): ``tflops_scale`` multiplies the measured
throughput (to simulate a slow GPU; on a CPU it is judged against the unscaled
run, see :func:`~diagnostics.checks._devices.cpu_expected`), ``corrupt: true`` perturbs one element of
the last product, which both tests must catch.
"""

from __future__ import annotations

import time
from typing import Any

from diagnostics.checks import Check, Context, register
from diagnostics.checks._devices import (
    compute_devices,
    cpu_expected,
    judge,
    single_cpu_thread,
    spec_for,
    synchronize,
)
from diagnostics.report import CheckResult, worst

#: Matrix size per (device type, mode).
SIZES = {("cpu", "quick"): 256, ("cpu", "full"): 1024, ("cuda", "quick"): 4096, ("cuda", "full"): 8192}
REFERENCE_ROWS = 16


_CPU_FP8: bool | None = None


def fp8_supported(device: Any) -> bool:
    """FP8 GEMM (``torch._scaled_mm``): CUDA compute capability >= 8.9, or a CPU build that has the kernel."""
    global _CPU_FP8
    import torch

    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    if _CPU_FP8 is None:
        try:
            a = torch.ones(16, 16).to(torch.float8_e4m3fn)
            one = torch.ones((), dtype=torch.float32)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            _CPU_FP8 = True
        except (RuntimeError, NotImplementedError):
            _CPU_FP8 = False
    return _CPU_FP8


def run_gemm(device: Any, dtype: str, n: int, seconds: float, corrupt: bool = False, seed: int = 1234) -> dict[str, Any]:
    """Time ``n x n`` products in ``dtype`` on ``device`` and verify them; returns the raw numbers."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    a64 = torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1
    b64 = torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1
    if dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        a_in = a64.to(device=device, dtype=fp8)
        b_in = b64.t().contiguous().to(device=device, dtype=fp8).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device, dtype=torch.float32)

        def matmul() -> Any:
            return torch._scaled_mm(a_in, b_in, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    else:
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        a_in = a64.to(device=device, dtype=torch_dtype)
        b_in = b64.to(device=device, dtype=torch_dtype)

        def matmul() -> Any:
            return a_in @ b_in

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, not TF32
    try:
        first = matmul()
        synchronize(device)
        iters = 0
        start = time.perf_counter()
        deadline = start + seconds
        last = first
        while True:
            last = matmul()
            iters += 1
            if iters % 4 == 0 or device.type == "cpu":
                synchronize(device)
                if time.perf_counter() >= deadline:
                    break
        synchronize(device)
        elapsed = time.perf_counter() - start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if corrupt:
        last = last.clone()
        last[0, 0] += 64.0 * n
    rows = torch.linspace(0, n - 1, REFERENCE_ROWS).long().to(device)
    # fp64 reference (on the device) from the rounded inputs, so only the product's own error counts.
    a_ref = a_in.to(torch.float32)[rows].to(torch.float64)
    b_ref = b_in.to(torch.float32).to(torch.float64)
    ref = a_ref @ b_ref
    bound = a_ref.abs() @ b_ref.abs()
    got = last[rows].to(torch.float64)
    rel_err = float(((got - ref).abs() / bound.clamp_min(1e-30)).max())
    del b_ref
    consistent = bool(torch.equal(first, last))
    return {
        "n": n,
        "iters": iters,
        "seconds": elapsed,
        "tflops": 2.0 * n**3 * iters / elapsed / 1e12,
        "rel_err": rel_err,
        "consistent": consistent,
    }


@register
class GemmCheck(Check):
    name = "gemm"
    description = "sustained matmul TFLOPS (fp32, bf16, fp8 where supported) with fp64-checked results"

    def run(self, ctx: Context) -> CheckResult:
        t = ctx.thresholds.gemm
        knobs = ctx.reader.knobs("gemm")
        scale = float(knobs.get("tflops_scale", 1.0))
        corrupt = bool(knobs.get("corrupt", False))
        seconds = t.full_seconds if ctx.full else t.quick_seconds
        verdicts: list[str] = []
        problems: list[str] = []
        per_device: dict[str, Any] = {}
        value: dict[str, float] = {}
        threshold: dict[str, str] = {}
        for device in compute_devices():
            model, spec = spec_for(device, ctx.thresholds)
            n = SIZES[(device.type, ctx.mode)]
            dtypes = ["fp32", "bf16"] + (["fp8"] if fp8_supported(device) else [])
            results: dict[str, Any] = {"model": model}
            for dtype in dtypes:
                with single_cpu_thread(device):
                    r = run_gemm(device, dtype, n, seconds, corrupt=corrupt)
                unscaled = r["tflops"]
                r["tflops"] *= scale
                expected = getattr(spec, f"{dtype}_tflops") if spec else None
                expected = cpu_expected(device, expected, unscaled, scale)
                verdict, text = judge(r["tflops"], expected, t.warn_fraction, t.fail_fraction)
                if verdict != "pass":
                    problems.append(f"{device} {dtype} {r['tflops']:.4g} TFLOPS {text}")
                rtol = t.rtol.get(dtype)
                if rtol is not None and not r["rel_err"] <= rtol:
                    verdict = "fail"
                    problems.append(f"{device} {dtype} wrong result: rel err {r['rel_err']:.3g} > {rtol:g}")
                if not r["consistent"]:
                    verdict = "fail"
                    problems.append(f"{device} {dtype} results differ between identical runs")
                r["verdict"] = verdict
                r["expected_tflops"] = expected
                results[dtype] = r
                verdicts.append(verdict)
                value[dtype] = min(value.get(dtype, float("inf")), r["tflops"])
                threshold[dtype] = text
            if "fp8" not in dtypes:
                results["fp8"] = "not supported by this torch build on cpu" if device.type == "cpu" else \
                    "needs compute capability >= 8.9"
            per_device[str(device)] = results
        verdict = worst(verdicts)
        if verdict == "pass":
            reason = "ok"
        else:
            # Lead with the problems that set the verdict (wrong results before slow ones).
            problems.sort(key=lambda p: "wrong" not in p and "differ" not in p)
            reason = "; ".join(problems[:3])
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value={k: round(v, 4) for k, v in value.items()},
            threshold=threshold,
            reason=reason,
            details={"unit": "TFLOPS", "tflops_scale": scale, "corrupt": corrupt, "devices": per_device},
        )
