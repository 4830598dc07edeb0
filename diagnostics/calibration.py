"""Thresholds measured on known-good nodes: ``diag calibrate`` writes them, the screen reads them.

A datasheet peak says little about what a healthy node reaches in a seconds-long screen (a
healthy H100 does 600-750 of its 989 bf16 TFLOPS at 4096^3, and busbw depends on the message
size), so fixed fractions of it either miss slow nodes or exclude healthy ones.  A calibration
file holds, per check and per measured configuration (dtype and size), the median and the
spread of repeated runs on nodes known to be good::

    {"format": "elastic-diag-calibration-v1", "device": "NVIDIA H100 80GB HBM3", "mode": "quick",
     "host": "gpu-017", "created": 1764700000.0, "repeats": 5,
     "checks": {"gemm": {"bf16@4096": {"median": 702.1, "spread": 9.8, "unit": "TFLOPS", "samples": [...]}},
                "membw": {"copy@1073741824": {...}}, "collective": {"allreduce@1073741824x8": {...}}}}

``spread`` is 1.4826 x the median absolute deviation (the normal-consistent robust sigma).  A
measurement is judged against ``warn = min(warn_fraction * median, median - 3 spread)`` and
``fail = min(fail_fraction * median, median - 6 spread)``: a noisy calibration widens the band
instead of failing healthy nodes.  Entries are only used for the device model they were
measured on; anything the file does not cover falls back to the datasheet fractions.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "elastic-diag-calibration-v1"
WARN_SPREADS, FAIL_SPREADS = 3.0, 6.0
#: Checks that calibrate, and how a result of each is read (see :func:`measurements`).
CHECKS = ("gemm", "membw", "collective")


class CalibrationError(ValueError):
    """The calibration file is unreadable or malformed; ``str()`` names the file and key."""


def gemm_key(dtype: str, n: int) -> str:
    return f"{dtype}@{n}"


def membw_key(nbytes: int) -> str:
    return f"copy@{nbytes}"


def collective_key(nbytes: int, ranks: int) -> str:
    return f"allreduce@{nbytes}x{ranks}"


@dataclass(kw_only=True)
class Entry:
    median: float
    spread: float
    unit: str
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[float], unit: str) -> Entry:
        median = statistics.median(samples)
        mad = statistics.median(abs(s - median) for s in samples)
        return cls(median=median, spread=1.4826 * mad, unit=unit, samples=[round(s, 6) for s in samples])

    def lines(self, warn_fraction: float, fail_fraction: float) -> tuple[float, float]:
        """(warn below, fail below) for a throughput judged against this entry."""
        warn = max(0.0, min(warn_fraction * self.median, self.median - WARN_SPREADS * self.spread))
        fail = max(0.0, min(fail_fraction * self.median, self.median - FAIL_SPREADS * self.spread))
        return warn, min(fail, warn)


@dataclass(kw_only=True)
class Calibration:
    device: str
    mode: str
    checks: dict[str, dict[str, Entry]]
    host: str = field(default_factory=socket.gethostname)
    created: float = field(default_factory=time.time)
    repeats: int = 0
    source: str = ""

    def entry(self, check: str, key: str, device: str) -> Entry | None:
        """The entry for ``check``/``key`` if it was measured on ``device``'s model."""
        from diagnostics.thresholds import normalize_name

        if normalize_name(device) != normalize_name(self.device):
            return None
        return self.checks.get(check, {}).get(key)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "device": self.device, "mode": self.mode, "host": self.host,
                "created": self.created, "repeats": self.repeats,
                "checks": {c: {k: vars(e) for k, e in entries.items()} for c, entries in self.checks.items()}}

    def write(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read calibration file: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(f"{path}: format: expected {FORMAT!r}")
    checks: dict[str, dict[str, Entry]] = {}
    for check, entries in (data.get("checks") or {}).items():
        if check not in CHECKS or not isinstance(entries, dict):
            raise CalibrationError(f"{path}: checks.{check}: unknown check or not a mapping (known: {', '.join(CHECKS)})")
        checks[check] = {key: _entry(path, f"checks.{check}.{key}", raw) for key, raw in entries.items()}
    if not isinstance(data.get("device"), str) or not data["device"]:
        raise CalibrationError(f"{path}: device: expected the NVML device name (or 'cpu')")
    return Calibration(device=data["device"], mode=str(data.get("mode", "")), checks=checks,
                       host=str(data.get("host", "")), created=float(data.get("created", 0.0)),
                       repeats=int(data.get("repeats", 0)), source=str(path))


def _entry(path: Any, where: str, raw: Any) -> Entry:
    try:
        entry = Entry(median=float(raw["median"]), spread=float(raw["spread"]), unit=str(raw.get("unit", "")),
                      samples=[float(s) for s in raw.get("samples", [])])
    except (TypeError, KeyError, ValueError):
        raise CalibrationError(f"{path}: {where}: expected {{median, spread, unit, samples}}") from None
    if entry.median <= 0 or entry.spread < 0:
        raise CalibrationError(f"{path}: {where}: median must be > 0 and spread >= 0")
    return entry


def measurements(check: str, details: dict[str, Any]) -> list[tuple[str, str, float, str]]:
    """(device model, key, unscaled value, unit) for every measurement in one check result's details."""
    if check == "gemm":
        return [(d["model"], gemm_key(dtype, r["n"]), r["unscaled_tflops"], "TFLOPS")
                for d in details["devices"].values() for dtype, r in d.items() if isinstance(r, dict)]
    if check == "membw":
        return [(d["model"], membw_key(d["bytes"]), d["unscaled_gbps"], "GB/s") for d in details["devices"].values()]
    if check == "collective":
        return [(details["model"], collective_key(details["bytes"], details["ranks"]), details["unscaled_busbw_gbps"],
                 "GB/s busbw")]
    raise ValueError(f"check {check!r} does not calibrate (known: {', '.join(CHECKS)})")


def calibrate(run: Any, checks: list[str], repeats: int, mode: str) -> Calibration:
    """Run ``run(checks)`` (a screen returning a Report) ``repeats`` times; one entry per measurement key.

    Raises CalibrationError when a run fails or skips a check, or the node mixes device models:
    a calibration must come from a healthy, uniform node.
    """
    samples: dict[tuple[str, str], list[float]] = {}
    units: dict[tuple[str, str], str] = {}
    devices: set[str] = set()
    for _ in range(repeats):
        report = run(checks)
        for result in report.checks:
            if result.verdict in ("fail", "skip"):
                raise CalibrationError(f"{result.name}: {result.verdict} during calibration ({result.reason}); "
                                       "calibrate on known-good nodes only")
            for device, key, value, unit in measurements(result.name, result.details):
                devices.add(device)
                samples.setdefault((result.name, key), []).append(value)
                units[(result.name, key)] = unit
    if len(devices) != 1:
        raise CalibrationError(f"expected one device model on the node, found {sorted(devices)}")
    out: dict[str, dict[str, Entry]] = {}
    for (check, key), values in samples.items():
        out.setdefault(check, {})[key] = Entry.of(values, units[(check, key)])
    return Calibration(device=devices.pop(), mode=mode, checks=out, repeats=repeats)
