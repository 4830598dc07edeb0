"""NVLink: every link up, error counters, and GPU-to-GPU copy bandwidth.

Readings come from the reader (``gpu["nvlink"]``: per-link state and the
replay / recovery / CRC error counters NVML reports).  The model's
``nvlink_links`` is the number of links each GPU must have up.  When torch sees
two or more CUDA devices, a peer copy ``cuda:i -> cuda:(i+1)`` is timed for each
GPU and compared with ``peer_gbps_expected`` for the model (knob
``nvlink_bw: {gbps_scale}``).  Without an NVIDIA driver the check is skipped.
"""

from __future__ import annotations

import time
from typing import Any

from diagnostics.checks import Check, Context, register
from diagnostics.checks._devices import judge
from diagnostics.readers import GpuUnavailable
from diagnostics.report import CheckResult, worst

ERROR_KEYS = ("replay_errors", "recovery_errors", "crc_errors")


def peer_copy_gbps(src: int, dst: int, nbytes: int, seconds: float) -> float:
    """Unidirectional copy bandwidth cuda:src -> cuda:dst, GB/s."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    b.copy_(a, non_blocking=True)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            b.copy_(a, non_blocking=True)
        iters += 4
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
    return nbytes * iters / (time.perf_counter() - start) / 1e9


@register
class NvlinkCheck(Check):
    name = "nvlink"
    description = "NVLink link state, error counters, peer copy bandwidth"

    def run(self, ctx: Context) -> CheckResult:
        try:
            devices = ctx.reader.gpus()
        except GpuUnavailable as exc:
            return self.skip(str(exc))
        if not devices:
            return self.skip("no GPUs")
        t = ctx.thresholds.nvlink
        model = ctx.thresholds.model_for(devices[0].get("name"))
        expected_links = model.nvlink_links if model else None
        if not expected_links and not any(d.get("nvlink") for d in devices):
            return self.skip(f"no NVLink on {devices[0].get('name')}")
        findings: list[tuple[str, str]] = []
        up_total = link_total = 0
        for dev in devices:
            idx = dev.get("index")
            links = dev.get("nvlink") or []
            up = [l for l in links if l.get("state") == "up"]
            up_total += len(up)
            link_total += max(len(links), expected_links or 0)
            if expected_links and len(up) < expected_links:
                down = [str(l["link"]) for l in links if l.get("state") != "up"]
                missing = f" (down: {','.join(down)})" if down else ""
                findings.append(("fail", f"gpu{idx}: {len(up)}/{expected_links} links up{missing}"))
            elif not expected_links:
                for l in links:
                    if l.get("state") != "up":
                        findings.append(("fail", f"gpu{idx} link {l['link']} down"))
            for l in links:
                for key in ERROR_KEYS:
                    n = l.get(key)
                    if n is None:
                        continue
                    if n > t.error_fail:
                        findings.append(("fail", f"gpu{idx} link {l['link']} {key}={n} > {t.error_fail}"))
                    elif n > t.error_warn:
                        findings.append(("warn", f"gpu{idx} link {l['link']} {key}={n}"))
        bandwidth = self._peer_bandwidth(ctx, devices, model)
        findings.extend(bandwidth.pop("findings"))
        verdict = worst([v for v, _ in findings] or ["pass"])
        shown = [m for v, m in findings if v == verdict]
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value=f"{up_total}/{link_total} links up",
            threshold=f"{expected_links or 'all'} links/GPU up, errors<={t.error_fail}",
            reason="ok" if verdict == "pass" else "; ".join(shown[:4]) + (f" (+{len(shown) - 4} more)" if len(shown) > 4 else ""),
            details={"expected_links": expected_links, "peer_copy": bandwidth, "findings": [f"{v}: {m}" for v, m in findings]},
        )

    @staticmethod
    def _peer_bandwidth(ctx: Context, devices: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {"findings": []}
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            out["skipped"] = "needs >= 2 CUDA devices visible to torch"
            return out
        t = ctx.thresholds.nvlink
        scale = float(ctx.reader.knobs("nvlink_bw").get("gbps_scale", 1.0))
        key = ctx.thresholds.model_key(devices[0].get("name"))
        expected = t.peer_gbps_expected.get(key) if key else None
        n = torch.cuda.device_count()
        nbytes, seconds = (1 << 30, 2.0) if ctx.full else (256 << 20, 0.2)
        pairs = {}
        for i in range(n):
            j = (i + 1) % n
            gbps = peer_copy_gbps(i, j, nbytes, seconds) * scale
            verdict, text = judge(gbps, expected, t.warn_fraction, t.fail_fraction)
            pairs[f"{i}->{j}"] = round(gbps, 2)
            if verdict != "pass":
                out["findings"].append((verdict, f"peer copy {i}->{j} {gbps:.4g} GB/s {text}"))
        out.update(pairs=pairs, expected_gbps=expected, unit="GB/s")
        return out
