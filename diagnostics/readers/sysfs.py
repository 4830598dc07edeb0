"""InfiniBand / RoCE port readings from sysfs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from diagnostics.readers.base import GpuUnavailable

# ---------------------------------------------------------------------------
# sysfs (InfiniBand / RoCE)

#: Port counters read from ``ports/<n>/counters`` when present.
IB_COUNTERS = (
    "symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
    "port_rcv_remote_physical_errors", "port_xmit_discards", "local_link_integrity_errors",
    "excessive_buffer_overrun_errors", "port_rcv_constraint_errors", "port_xmit_constraint_errors",
)


class SysfsReader:
    """IB port readings from ``<root>/class/infiniband``; ``root`` defaults to ``/sys``."""

    def __init__(self, root: str | os.PathLike[str] = "/sys") -> None:
        self.root = Path(root)

    def gpus(self) -> list[dict[str, Any]]:
        raise GpuUnavailable("no NVIDIA driver (sysfs reader has no GPU readings)")

    def gpus_now(self) -> list[dict[str, Any]]:
        return self.gpus()

    def driver_version(self) -> str | None:
        return None

    def knobs(self, section: str) -> dict[str, Any]:
        return {}

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        base = self.root / "class" / "infiniband"
        if not base.is_dir():
            return {}
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for dev in sorted(p for p in base.iterdir() if (p / "ports").is_dir()):
            ports = {}
            for port in sorted((dev / "ports").iterdir(), key=lambda p: p.name):
                ports[port.name] = self._port(port)
            out[dev.name] = ports
        return out

    @staticmethod
    def _port(path: Path) -> dict[str, Any]:
        state = _read(path / "state")  # e.g. "4: ACTIVE"
        phys = _read(path / "phys_state")  # e.g. "5: LinkUp"
        rate = _read(path / "rate")  # e.g. "400 Gb/sec (4X NDR)"
        counters = {}
        for name in IB_COUNTERS:
            text = _read(path / "counters" / name)
            if text is not None:
                try:
                    counters[name] = int(text)
                except ValueError:
                    continue
        return {
            "state": _after_colon(state),
            "phys_state": _after_colon(phys),
            "rate_gbps": _rate_gbps(rate),
            "link_layer": _read(path / "link_layer"),
            "counters": counters,
        }


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _after_colon(text: str | None) -> str | None:
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text


def _rate_gbps(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text.split()[0])
    except ValueError:
        return None


