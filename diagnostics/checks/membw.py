"""Memory bandwidth: device-local copy GB/s (host memory on a CPU-only host).

``dst.copy_(src)`` of a large buffer, repeated for ``quick_seconds`` (CPU) / ``quick_seconds_gpu`` /
``full_seconds`` after a warm-up, timed with CUDA events on a GPU (by the thread's own CPU time on
the CPU: a busy host reads as fewer copies, not as slow memory); bandwidth counts bytes read plus bytes written (STREAM "copy"
convention), so it is comparable with the memory's peak figure.  The copy is
verified at the end (``dst`` must equal ``src``).  Knob: ``membw: {gbps_scale}``.
"""

from __future__ import annotations

import time
from typing import Any

from diagnostics.calibration import membw_key
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
from diagnostics.report import CheckResult, worst

#: Buffer size in bytes per (device type, mode).
#: Copies timed at least, however short the time budget or small this thread's share of a busy CPU.
MIN_ITERS = 8
SIZES = {("cpu", "quick"): 16 << 20, ("cpu", "full"): 256 << 20, ("cuda", "quick"): 1 << 30, ("cuda", "full"): 4 << 30}


def run_copy(device: Any, nbytes: int, seconds: float, warmup: int = 2) -> dict[str, Any]:
    import torch

    src = torch.arange(nbytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):  # page in both buffers, wake the memory clocks
        dst.copy_(src)
    synchronize(device)
    timer = DeviceTimer(device, thread_cpu=True)
    iters = 0
    start = time.perf_counter()
    timer.start()
    while True:
        dst.copy_(src)
        iters += 1
        if device.type == "cpu" or iters % 8 == 0:
            synchronize(device)
            if time.perf_counter() - start >= seconds and iters >= MIN_ITERS:
                break
    timer.stop()
    synchronize(device)
    elapsed = timer.seconds()
    return {
        "bytes": src.numel() * 4,
        "iters": iters,
        "seconds": elapsed,
        "gbps": 2 * src.numel() * 4 * iters / elapsed / 1e9,
        "verified": bool(torch.equal(src, dst)),
        "cpu_share": timer.cpu_share,
    }


@register
class MembwCheck(Check):
    name = "membw"
    description = "device memory copy bandwidth (host memory on CPU)"

    def run(self, ctx: Context) -> CheckResult:
        t = ctx.thresholds.membw
        scale = float(ctx.reader.knobs("membw").get("gbps_scale", 1.0))
        verdicts, problems, per_device = [], [], {}
        low, text = float("inf"), "none"
        for device in compute_devices():
            seconds = t.full_seconds if ctx.full else (t.quick_seconds_gpu if device.type == "cuda" else t.quick_seconds)
            model, spec = spec_for(device, ctx.thresholds)
            with single_cpu_thread(device):
                r = run_copy(device, SIZES[(device.type, ctx.mode)], seconds)
            r["unscaled_gbps"] = unscaled = r["gbps"]
            r["gbps"] *= scale
            expected = cpu_expected(device, spec.membw_gbps if spec else None, unscaled, scale)
            verdict, text, source = judge_measurement(ctx, "membw", membw_key(r["bytes"]), model, r["gbps"],
                                                      expected, t)
            if verdict != "pass":
                problems.append(f"{device} copy {r['gbps']:.4g} GB/s {text}")
            if not r["verified"]:
                verdict = "fail"
                problems.insert(0, f"{device} copy produced wrong data")
            r.update(model=model, verdict=verdict, expected_gbps=expected, expected_source=source)
            per_device[str(device)] = r
            verdicts.append(verdict)
            low = min(low, r["gbps"])
        verdict = worst(verdicts)
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value=round(low, 3),
            threshold=text,
            reason="ok" if verdict == "pass" else "; ".join(problems[:3]),
            details={"unit": "GB/s (read+write)", "gbps_scale": scale, "devices": per_device},
        )
