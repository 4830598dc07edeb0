"""GPU health read while the GPUs work: the idle snapshot never sees a loaded GPU throttle.

Clocks drop, temperatures rise, hardware slowdowns kick in and ECC errors and Xids appear under
load, not at idle; the ``gpu`` check reads NVML before any load.  The benchmark checks take a
:class:`LoadMonitor` and call :meth:`LoadMonitor.sample` during their load (queues still full)
and right after it; the samples are judged with the ``gpu`` check's own rules
(:func:`~diagnostics.checks.gpu.device_findings`), findings prefixed with when they were seen.
"""

from __future__ import annotations

from typing import Any

from diagnostics.readers import GpuUnavailable, ReaderError

_KEPT = ("index", "sm_clock_mhz", "throttle_reasons", "temperature_c", "memory_temperature_c", "power_w",
         "ecc_uncorrected_volatile", "xid_events")


class LoadMonitor:
    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.samples: list[tuple[str, list[dict[str, Any]]]] = []
        self.unavailable: str | None = None

    def sample(self, label: str) -> None:
        """Read every GPU now (no-op on a host without GPUs: the reason is kept instead)."""
        if self.unavailable is not None:
            return
        try:
            self.samples.append((label, self.reader.gpus_now()))
        except (GpuUnavailable, ReaderError) as exc:
            self.unavailable = str(exc)

    def findings(self, thresholds: Any) -> list[tuple[str, str]]:
        """(verdict, "gpuN under load (label): message") for every problem any sample shows."""
        from diagnostics.checks.gpu import device_findings

        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        for label, devices in self.samples:
            for dev in devices:
                for verdict, message in device_findings(dev, thresholds):
                    key = f"{dev.get('index')}:{message}"  # one finding per GPU, whichever sample saw it first
                    if key not in seen:
                        seen.add(key)
                        out.append((verdict, f"gpu{dev.get('index')} under load ({label}): {message}"))
        return out

    def details(self) -> dict[str, Any]:
        if self.unavailable is not None:
            return {"skipped": self.unavailable}
        return {label: [{k: d.get(k) for k in _KEPT} for d in devices] for label, devices in self.samples}
