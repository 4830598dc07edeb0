"""GPU inventory and health from NVML readings (no load is put on the GPUs).

Sub-checks per device, each pass / warn / fail (thresholds in
:class:`~diagnostics.thresholds.GpuThresholds`):

* count against the model's expected count, one model per node;
* ECC: uncorrected volatile errors (fail above 0), corrected volatile (warn above
  50 M), lifetime uncorrected (warn); ECC disabled is a warning;
* retired pages (fail above 10) and pending retirement (warn);
* row remapping: any pending or failed remap fails;
* clock-event reasons: hardware slowdowns fail, software thermal slowdown warns,
  idle / power cap / application clocks are normal;
* GPU and HBM temperature, power above the enforced limit (warn);
* PCIe link narrower than its maximum width fails (a lower *generation* is normal
  at idle and only checked against ``pcie_gen_min``);
* Xid events classed critical / non-critical with Meta GCM's non-critical set; Xids the kernel
  logged before the GPU's last reset are listed (``xid_before_reset``) but judge nothing;
* NVML recovery action (driver >= 570) other than ``none`` fails.
"""

from __future__ import annotations

from typing import Any

from diagnostics.checks import Check, Context, register
from diagnostics.readers import GpuUnavailable
from diagnostics.report import CheckResult, worst


@register
class GpuCheck(Check):
    name = "gpu"
    description = "GPU inventory, ECC, retired pages, row remap, throttle, temperature, power, PCIe, Xid"

    def run(self, ctx: Context) -> CheckResult:
        try:
            devices = ctx.reader.gpus()
        except GpuUnavailable as exc:
            return self.skip(str(exc))
        t = ctx.thresholds.gpu
        findings: list[tuple[str, str]] = []  # (verdict, message)
        if not devices:
            return CheckResult(name=self.name, verdict="fail", value=0, reason="NVML reports 0 GPUs")
        names = sorted({d.get("name") or "unknown" for d in devices})
        if len(names) > 1:
            findings.append(("warn", f"mixed GPU models {names}"))
        model_key = ctx.thresholds.model_key(names[0])
        model = ctx.thresholds.models[model_key] if model_key else None
        expected = t.expected_count if t.expected_count is not None else (model.expected_count if model else None)
        if expected is not None and len(devices) != expected:
            findings.append(("fail", f"{len(devices)} GPUs, expected {expected}"))
        per_device = {}
        for dev in devices:
            dev_findings = device_findings(dev, t)
            per_device[str(dev.get("index"))] = [f"{v}: {m}" for v, m in dev_findings]
            findings.extend((v, f"gpu{dev.get('index')}: {m}") for v, m in dev_findings)
        verdict = worst([v for v, _ in findings] or ["pass"])
        shown = [m for v, m in findings if v == verdict] if verdict != "pass" else []
        reason = "; ".join(shown[:4]) + (f" (+{len(shown) - 4} more)" if len(shown) > 4 else "")
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value=f"{len(devices)}x {names[0]}",
            threshold=f"count={expected if expected is not None else 'any'} ecc_ue<={t.ecc_uncorrected_volatile_max} "
            f"retired<={t.retired_pages_max} remap=0 critical_xid=0",
            reason=reason or "ok",
            details={
                "count": len(devices),
                "expected_count": expected,
                "model": model_key,
                "driver_version": _driver(ctx),
                # False: dmesg unreadable, so only Xids raised during the screen were seen.
                "xid_kernel_log_read": devices[0].get("xid_kernel_log"),
                "xid_before_reset": {str(d.get("index")): d["xid_events_before_reset"] for d in devices
                                     if d.get("xid_events_before_reset")},
                "findings": per_device,
                "devices": devices,
            },
        )


def _driver(ctx: Context) -> str | None:
    try:
        return ctx.reader.driver_version()
    except GpuUnavailable:
        return None


def xid_class(xid: int, non_critical: list[int]) -> str:
    """``"non-critical"`` for Xids in the non-critical set, else ``"critical"`` (Meta GCM's rule)."""
    return "non-critical" if xid in non_critical else "critical"


def _limit(value: Any, what: str, warn: float, fail: float) -> list[tuple[str, str]]:
    if value is None or value < warn:
        return []
    verdict, limit = ("fail", fail) if value >= fail else ("warn", warn)
    return [(verdict, f"{what} {value} C >= {limit}")]


def device_findings(d: dict[str, Any], t: Any) -> list[tuple[str, str]]:
    """(verdict, message) for one GPU reading; also applied to the readings taken under load."""
    out: list[tuple[str, str]] = []

    def num(key: str) -> Any:
        return d.get(key)

    if d.get("ecc_enabled") is False:
        out.append(("warn", "ECC disabled"))
    ue = num("ecc_uncorrected_volatile")
    if ue is not None and ue > t.ecc_uncorrected_volatile_max:
        out.append(("fail", f"ECC uncorrected volatile {ue} > {t.ecc_uncorrected_volatile_max}"))
    ce = num("ecc_corrected_volatile")
    if ce is not None and ce > t.ecc_corrected_volatile_max:
        out.append(("warn", f"ECC corrected volatile {ce} > {t.ecc_corrected_volatile_max}"))
    agg = num("ecc_uncorrected_aggregate")
    if agg is not None and agg > t.ecc_uncorrected_aggregate_warn:
        out.append(("warn", f"ECC uncorrected aggregate {agg} > {t.ecc_uncorrected_aggregate_warn}"))
    retired = [num("retired_pages_sbe"), num("retired_pages_dbe")]
    if any(r is not None for r in retired):
        total = sum(r or 0 for r in retired)
        if total > t.retired_pages_max:
            out.append(("fail", f"{total} retired pages > {t.retired_pages_max}"))
    if d.get("retired_pages_pending"):
        out.append(("warn", "page retirement pending (reset to apply)"))
    if (num("remap_pending") or 0) > 0:
        out.append(("fail", f"row remap pending ({num('remap_pending')})"))
    if (num("remap_failed") or 0) > 0:
        out.append(("fail", f"row remap failed ({num('remap_failed')})"))
    reasons = d.get("throttle_reasons") or []
    bad = sorted(set(reasons) & set(t.throttle_fail))
    if bad:
        out.append(("fail", f"clocks throttled by {','.join(bad)} (SM {num('sm_clock_mhz')} MHz)"))
    soft = sorted(set(reasons) & set(t.throttle_warn))
    if soft:
        out.append(("warn", f"clocks throttled by {','.join(soft)}"))
    out += _limit(num("temperature_c"), "temperature", t.temperature_warn_c, t.temperature_fail_c)
    out += _limit(num("memory_temperature_c"), "HBM temperature", t.memory_temperature_warn_c,
                  t.memory_temperature_fail_c)
    power, limit = num("power_w"), num("power_limit_w")
    if power is not None and limit is not None and power > limit * 1.05:
        out.append(("warn", f"power {power:.0f} W above enforced limit {limit:.0f} W"))
    width, width_max = num("pcie_link_width"), num("pcie_link_width_max")
    if width is not None and width_max is not None and width < width_max:
        verdict = "fail" if t.pcie_width_degraded_fails else "warn"
        out.append((verdict, f"PCIe link x{width} < max x{width_max}"))
    gen = num("pcie_link_gen")
    if gen is not None and t.pcie_gen_min is not None and gen < t.pcie_gen_min:
        out.append(("warn", f"PCIe gen {gen} < {t.pcie_gen_min}"))
    xids = d.get("xid_events") or []
    critical = sorted({x for x in xids if xid_class(x, t.non_critical_xids) == "critical"})
    benign = sorted({x for x in xids if xid_class(x, t.non_critical_xids) == "non-critical"})
    if critical:
        out.append(("fail", f"critical Xid {','.join(map(str, critical))}"))
    if benign:
        out.append(("warn", f"non-critical Xid {','.join(map(str, benign))}"))
    action = d.get("recovery_action")
    if action is not None and action not in t.recovery_ok:
        out.append(("fail", f"NVML recovery action {action}"))
    return out
