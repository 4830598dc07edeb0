"""Checkpoint directory: free space and fsync'd write throughput.

Writes ``quick_bytes`` / ``full_bytes`` in 1 MiB chunks to a temporary file in
the checkpoint directory, ``fsync``s the file and the directory (what a
checkpoint commit does), and times the whole thing; the file is removed
afterwards.  The page cache is not bypassed, so the fsync is what makes the
number mean "reached the device / the file server".  Knobs (``disk:``):
``mbps_scale`` multiplies the result, ``free_gb`` replaces the free space read.
"""

from __future__ import annotations

import os
import shutil
import time

from diagnostics.checks import Check, Context, register
from diagnostics.report import CheckResult, worst

CHUNK = 1 << 20


def write_throughput(directory: str, nbytes: int) -> dict[str, float]:
    """Write, fsync and remove a file of ``nbytes`` in ``directory``; MB/s = 1e6 bytes/s."""
    path = os.path.join(directory, f".diag-write-{os.getpid()}-{time.monotonic_ns()}.tmp")
    chunk = os.urandom(CHUNK)
    written = 0
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while written < nbytes:
            written += os.write(fd, chunk[: min(CHUNK, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    elapsed = time.perf_counter() - start
    os.unlink(path)
    return {"bytes": written, "seconds": elapsed, "mbps": written / elapsed / 1e6}


@register
class DiskCheck(Check):
    name = "disk"
    description = "checkpoint dir free space and fsync'd write throughput"

    def run(self, ctx: Context) -> CheckResult:
        if not ctx.ckpt_dir:
            return self.skip("no checkpoint dir given (--ckpt-dir)")
        t = ctx.thresholds.disk
        knobs = ctx.reader.knobs("disk")
        directory = ctx.ckpt_dir
        if not os.path.isdir(directory):
            return CheckResult(name=self.name, verdict="fail", reason=f"checkpoint dir {directory} does not exist",
                               details={"dir": directory})
        free_gb = float(knobs.get("free_gb", shutil.disk_usage(directory).free / 1e9))
        try:
            r = write_throughput(directory, t.full_bytes if ctx.full else t.quick_bytes)
        except OSError as exc:
            return CheckResult(name=self.name, verdict="fail", reason=f"write to {directory} failed: {exc}",
                               details={"dir": directory, "free_gb": free_gb})
        mbps = r["mbps"] * float(knobs.get("mbps_scale", 1.0))
        findings = []
        if mbps < t.fail_mbps:
            findings.append(("fail", f"write {mbps:.4g} MB/s < {t.fail_mbps:g}"))
        elif mbps < t.warn_mbps:
            findings.append(("warn", f"write {mbps:.4g} MB/s < {t.warn_mbps:g}"))
        if free_gb < t.min_free_gb:
            findings.append(("fail", f"{free_gb:.3g} GB free < {t.min_free_gb:g}"))
        verdict = worst([v for v, _ in findings] or ["pass"])
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value={"MB/s": round(mbps, 1), "free_GB": round(free_gb, 1)},
            threshold=f">={t.warn_mbps:g} MB/s (fail<{t.fail_mbps:g}), free>={t.min_free_gb:g} GB",
            reason="ok" if verdict == "pass" else "; ".join(m for v, m in findings if v == verdict),
            details={"dir": directory, **r, "mbps": mbps, "free_gb": free_gb},
        )
