"""InfiniBand / RoCE ports from sysfs: state, physical state, rate, error counters.

Every port of every device under ``/sys/class/infiniband`` must be in an
``ok_states`` state (ACTIVE) and ``ok_phys_states`` (LinkUp), at least
``min_rate_gbps`` when set.  Error counters are cumulative since boot (or the
last counter reset), so a non-zero value in ``counters_warn`` warns and only the
limits in ``counters_fail`` fail; a fleet that clears counters after each screen
gets per-interval numbers.  In full mode the counters are read a second time
``full_window_s`` later and any increase of a ``delta_fail`` counter fails.  No
IB device at all is a skip, not a pass.  ``ports`` (fnmatch patterns of ``device/port``)
names the training fabric; other ports (a management or storage NIC) are listed as
ignored and judge nothing.
"""

from __future__ import annotations

import fnmatch
import time
from typing import Any

from diagnostics.checks import Check, Context, register
from diagnostics.report import CheckResult, worst


@register
class IbCheck(Check):
    name = "ib"
    description = "InfiniBand/RoCE port state, rate and error counters (sysfs)"

    def run(self, ctx: Context) -> CheckResult:
        t = ctx.thresholds.ib
        ports, ignored = _fabric_ports(ctx.reader.ib_ports(), t.ports)
        if not ports or not any(ports.values()):
            if ignored:
                return self.skip(f"no port matches ib.ports {t.ports} (ports seen: {', '.join(ignored)})", ignored=ignored)
            return self.skip("no IB devices")
        findings: list[tuple[str, str]] = []
        up = total = 0
        for dev, per_port in sorted(ports.items()):
            for port, r in sorted(per_port.items()):
                where = f"{dev}/{port}"
                total += 1
                state, phys = r.get("state"), r.get("phys_state")
                ok = True
                if state not in t.ok_states:
                    findings.append(("fail", f"{where} state {state}"))
                    ok = False
                if phys is not None and phys not in t.ok_phys_states:
                    findings.append(("fail", f"{where} phys_state {phys}"))
                    ok = False
                up += ok
                rate = r.get("rate_gbps")
                if t.min_rate_gbps is not None and (rate is None or rate < t.min_rate_gbps):
                    findings.append(("fail", f"{where} rate {rate} Gb/s < {t.min_rate_gbps:g}"))
                counters = r.get("counters") or {}
                for name, value in sorted(counters.items()):
                    limit = t.counters_fail.get(name)
                    if limit is not None and value > limit:
                        findings.append(("fail", f"{where} {name}={value} > {limit}"))
                    elif name in t.counters_warn and value > 0:
                        findings.append(("warn", f"{where} {name}={value}"))
        deltas: dict[str, dict[str, int]] = {}
        if ctx.full and t.full_window_s > 0:
            time.sleep(t.full_window_s)
            later, _ = _fabric_ports(ctx.reader.ib_ports(), t.ports)
            for dev, per_port in sorted(ports.items()):
                for port, r in sorted(per_port.items()):
                    before = r.get("counters") or {}
                    after = (later.get(dev, {}).get(port) or {}).get("counters") or {}
                    grown = {k: after[k] - before[k] for k in before if k in after and after[k] > before[k]}
                    if grown:
                        deltas[f"{dev}/{port}"] = grown
                    for name in sorted(set(grown) & set(t.delta_fail)):
                        findings.append(("fail", f"{dev}/{port} {name} +{grown[name]} in {t.full_window_s:g} s"))
        verdict = worst([v for v, _ in findings] or ["pass"])
        shown = [m for v, m in findings if v == verdict]
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value=f"{up}/{total} ports up",
            threshold=f"state in {t.ok_states}" + (f" rate>={t.min_rate_gbps:g}" if t.min_rate_gbps else ""),
            reason="ok" if verdict == "pass" else "; ".join(shown[:4]) + (f" (+{len(shown) - 4} more)" if len(shown) > 4 else ""),
            details={"ports": ports, "deltas": deltas, "ignored": ignored,
                     "findings": [f"{v}: {m}" for v, m in findings]},
        )


def _fabric_ports(ports: dict[str, dict[str, Any]], patterns: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(the ports ``ib.ports`` names as the training fabric, the other ports as ``dev/port``); all when empty."""
    if not patterns:
        return ports, []
    kept: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    for dev, per_port in sorted(ports.items()):
        for port, reading in sorted(per_port.items()):
            if any(fnmatch.fnmatch(f"{dev}/{port}", p) for p in patterns):
                kept.setdefault(dev, {})[port] = reading
            else:
                ignored.append(f"{dev}/{port}")
    return kept, ignored
