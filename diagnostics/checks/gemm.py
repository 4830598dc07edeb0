"""GEMM burn-in: sustained matmul throughput per dtype, with the results verified.

For each dtype (fp32, bf16, and fp8 through ``torch._scaled_mm`` on GPUs with
compute capability >= 8.9 or on a CPU build that has the kernel -- torch 2.13's
does), square matrices with deterministic contents (seeded generator, uniform in
[-1, 1)) are multiplied back to back on **every GPU at once** (or the CPU) for
``quick_seconds_gpu`` / ``quick_seconds`` / ``full_seconds``, after a warm-up,
timed with CUDA events (on the CPU, by the thread's own CPU time: see
:class:`~diagnostics.checks._devices.DeviceTimer`).  GPU health (clocks, throttle reasons, GPU and HBM
temperature, ECC, Xids) is read during and after the bf16 load and judged with
the ``gpu`` check's rules (:mod:`diagnostics.checks._under_load`).  Throughput is judged
against the calibration when the screen has one (:mod:`diagnostics.calibration`),
else the datasheet peak.  Two correctness tests, in the spirit of gpu-burn's
result comparison:

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

from diagnostics.calibration import gemm_key
from diagnostics.checks import Check, Context, register
from diagnostics.checks._devices import (
    DeviceTimer,
    compute_devices,
    cpu_expected,
    judge_measurement,
    single_cpu_thread,
    spec_for,
    synchronize,
)
from diagnostics.checks._under_load import LoadMonitor
from diagnostics.report import CheckResult, worst

#: Matrix size per (device type, mode).
SIZES = {("cpu", "quick"): 256, ("cpu", "full"): 1024, ("cuda", "quick"): 4096, ("cuda", "full"): 8192}
REFERENCE_ROWS = 16
#: Products timed at least, however short the time budget or small this thread's share of a busy CPU.
MIN_ITERS = 8


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


CPU_FP8_SKIPPED = ("not measured on cpu: the trainer emulates FP8 there, and torch's CPU fp8 kernel ran "
                   "0.012 TFLOPS on one 2-core host and 5.7e-05 on another, so its speed says nothing of a node")


def fp8_measured(device: Any) -> bool:
    """Whether the screen measures FP8 GEMM on ``device``: a GPU with the kernel.  Not on a CPU:
    :data:`CPU_FP8_SKIPPED` (at 5.7e-05 TFLOPS one 256^3 product took 0.58 s, and a quick screen
    runs at least eight)."""
    return device.type == "cuda" and fp8_supported(device)


class _Gemm:
    """Deterministic ``n x n`` operands on one device and the product in one dtype."""

    def __init__(self, device: Any, dtype: str, a64: Any, b64: Any) -> None:
        import torch

        n = a64.shape[0]
        self.device, self.dtype, self.n = device, dtype, n
        if dtype == "fp8":
            fp8 = torch.float8_e4m3fn
            self.a = a64.to(device=device, dtype=fp8)
            self.b = b64.t().contiguous().to(device=device, dtype=fp8).t()  # column-major, as _scaled_mm wants
            self.one = torch.ones((), device=device, dtype=torch.float32)
        else:
            torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
            self.a, self.b = a64.to(device=device, dtype=torch_dtype), b64.to(device=device, dtype=torch_dtype)

    def __call__(self) -> Any:
        import torch

        if self.dtype == "fp8":
            return torch._scaled_mm(self.a, self.b, scale_a=self.one, scale_b=self.one, out_dtype=torch.bfloat16)
        return self.a @ self.b

    def verify(self, first: Any, last: Any, corrupt: bool) -> tuple[float, bool]:
        """(max relative error of sampled rows against fp64, first and last products bitwise equal)."""
        import torch

        n = self.n
        if corrupt:
            last = last.clone()
            last[0, 0] += 64.0 * n
        rows = torch.linspace(0, n - 1, REFERENCE_ROWS).long().to(self.device)
        # fp64 reference (on the device) from the rounded inputs, so only the product's own error counts.
        a_ref = self.a.to(torch.float32)[rows].to(torch.float64)
        b_ref = self.b.to(torch.float32).to(torch.float64)
        ref = a_ref @ b_ref
        bound = a_ref.abs() @ b_ref.abs()
        rel_err = float(((last[rows].to(torch.float64) - ref).abs() / bound.clamp_min(1e-30)).max())
        return rel_err, bool(torch.equal(first, last))


def run_gemm_all(devices: list[Any], dtype: str, n: int, seconds: float, corrupt: bool = False, seed: int = 1234,
                 warmup: int = 3, monitor: LoadMonitor | None = None) -> dict[str, dict[str, Any]]:
    """Time ``n x n`` products in ``dtype`` on every device *at once* and verify them.

    One host thread keeps every GPU busy: launches are asynchronous, so issuing one product per
    device in turn fills all their queues (the node is loaded as training loads it, power and
    heat included).  After ``warmup`` products per device, CUDA events time each device's own
    stream; ``monitor`` samples GPU health half-way (queues still full) and right after.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    a64 = torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1  # one host copy for every device
    b64 = torch.rand(n, n, generator=gen, dtype=torch.float64) * 2 - 1
    gemms = [_Gemm(device, dtype, a64, b64) for device in devices]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, not TF32
    try:
        firsts = [g() for g in gemms]
        for _ in range(warmup):
            for g in gemms:
                g()
        _sync(devices)
        timers = [DeviceTimer(device, thread_cpu=True) for device in devices]
        for timer in timers:
            timer.start()
        lasts, iters, start = firsts, 0, time.perf_counter()
        while True:
            lasts = [g() for g in gemms]
            iters += 1
            if iters % 4 == 0 or devices[0].type == "cpu":
                elapsed = time.perf_counter() - start
                if monitor is not None and not monitor.samples and elapsed >= seconds / 2:
                    monitor.sample("during")
                _sync(devices)
                if time.perf_counter() - start >= seconds and iters >= MIN_ITERS:
                    break
        for timer in timers:
            timer.stop()
        _sync(devices)
        if monitor is not None:
            monitor.sample("after")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = {}
    for g, timer, first, last in zip(gemms, timers, firsts, lasts):
        elapsed = timer.seconds()
        rel_err, consistent = g.verify(first, last, corrupt)
        out[str(g.device)] = {"n": n, "iters": iters, "seconds": elapsed, "tflops": 2.0 * n**3 * iters / elapsed / 1e12,
                              "rel_err": rel_err, "consistent": consistent, "cpu_share": timer.cpu_share}
    return out


def run_gemm(device: Any, dtype: str, n: int, seconds: float, corrupt: bool = False, seed: int = 1234) -> dict[str, Any]:
    """:func:`run_gemm_all` on one device; returns its raw numbers."""
    return run_gemm_all([device], dtype, n, seconds, corrupt=corrupt, seed=seed)[str(device)]


def _sync(devices: list[Any]) -> None:
    for device in devices:
        synchronize(device)


@register
class GemmCheck(Check):
    name = "gemm"
    description = "sustained matmul TFLOPS (fp32, bf16, fp8 where supported) with fp64-checked results"

    def run(self, ctx: Context) -> CheckResult:
        t = ctx.thresholds.gemm
        knobs = ctx.reader.knobs("gemm")
        scale = float(knobs.get("tflops_scale", 1.0))
        corrupt = bool(knobs.get("corrupt", False))
        devices = compute_devices()
        on_gpu = devices[0].type == "cuda"
        seconds = t.full_seconds if ctx.full else (t.quick_seconds_gpu if on_gpu else t.quick_seconds)
        n = SIZES[(devices[0].type, ctx.mode)]
        monitor = LoadMonitor(ctx.reader)
        verdicts: list[str] = []
        problems: list[str] = []
        per_device: dict[str, Any] = {str(d): {"model": spec_for(d, ctx.thresholds)[0]} for d in devices}
        value: dict[str, float] = {}
        threshold: dict[str, str] = {}
        for dtype in ["fp32", "bf16", "fp8"]:
            with_fp8 = [d for d in devices if fp8_measured(d)] if dtype == "fp8" else devices
            if not with_fp8:
                continue
            with single_cpu_thread(devices[0]):
                results = run_gemm_all(with_fp8, dtype, n, seconds, corrupt=corrupt, warmup=t.warmup_iters,
                                       monitor=monitor if dtype == "bf16" else None)
            for device in with_fp8:
                r = results[str(device)]
                verdict, text = self._judge(ctx, device, dtype, r, scale, problems)
                per_device[str(device)][dtype] = r
                verdicts.append(verdict)
                value[dtype] = min(value.get(dtype, float("inf")), r["tflops"])
                threshold[dtype] = text
        for device in devices:
            if "fp8" not in per_device[str(device)]:
                per_device[str(device)]["fp8"] = (CPU_FP8_SKIPPED if device.type == "cpu"
                                                  else "needs compute capability >= 8.9")
        for verdict, message in monitor.findings(ctx.thresholds.gpu):
            verdicts.append(verdict)
            problems.append(message)
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
            details={"unit": "TFLOPS", "tflops_scale": scale, "corrupt": corrupt, "devices": per_device,
                     "seconds": seconds, "under_load": monitor.details()},
        )

    @staticmethod
    def _judge(ctx: Context, device: Any, dtype: str, r: dict[str, Any], scale: float,
               problems: list[str]) -> tuple[str, str]:
        t = ctx.thresholds.gemm
        model, spec = spec_for(device, ctx.thresholds)
        r["unscaled_tflops"] = unscaled = r["tflops"]
        r["tflops"] *= scale
        expected = getattr(spec, f"{dtype}_tflops") if spec else None
        expected = cpu_expected(device, expected, unscaled, scale)
        verdict, text, source = judge_measurement(ctx, "gemm", gemm_key(dtype, r["n"]), model, r["tflops"],
                                                  expected, t)
        if verdict != "pass":
            problems.append(f"{device} {dtype} {r['tflops']:.4g} TFLOPS {text}")
        rtol = t.rtol.get(dtype)
        if rtol is not None and not r["rel_err"] <= rtol:
            verdict = "fail"
            problems.append(f"{device} {dtype} wrong result: rel err {r['rel_err']:.3g} > {rtol:g}")
        if not r["consistent"]:
            verdict = "fail"
            problems.append(f"{device} {dtype} results differ between identical runs")
        r.update(verdict=verdict, expected_tflops=expected, expected_source=source)
        return verdict, text
