"""Xid events from the kernel log (``dmesg``), split at each GPU's last reset.

The ring buffer keeps Xids from before a GPU was reset (``nvidia-smi -r``, a driver reload);
those were dealt with by the reset and must not fail the node at every screen until the next
reboot.  The driver prints ``NVRM: GPU at PCI:<bus>: GPU-<uuid>`` when it (re)initialises a GPU
and ``NVRM: loading NVIDIA UNIX ... Kernel Module`` when the driver itself (re)loads; Xids of a
bus logged before its latest such line are "before reset".  The log is chronological, so one
pass in order is enough.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")
_GPU_INIT = re.compile(r"NVRM: GPU at PCI:([0-9A-Fa-f:.]+?):? GPU-")
_DRIVER_LOAD = re.compile(r"NVRM: loading NVIDIA UNIX")


def read_kernel_log(timeout_s: float = 2.0) -> str | None:
    """The kernel ring buffer via ``dmesg``, or None when it cannot be read."""
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


@dataclass
class KernelLogXids:
    """Xids per normalised PCI bus id: since the bus's last reset, and before it."""

    current: dict[str, set[int]] = field(default_factory=dict)
    before_reset: dict[str, set[int]] = field(default_factory=dict)

    def reset(self, bus: str | None) -> None:
        """A GPU (``bus``) or the whole driver (None) was (re)initialised: earlier Xids are history."""
        for key in [bus] if bus is not None else list(self.current):
            self.before_reset.setdefault(key, set()).update(self.current.pop(key, set()))


def parse_kernel_log(text: str) -> KernelLogXids:
    out = KernelLogXids()
    for line in text.splitlines():
        if (m := _XID_LINE.search(line)) is not None:
            out.current.setdefault(_norm_bus_id(m.group(1)), set()).add(int(m.group(2)))
        elif (m := _GPU_INIT.search(line)) is not None:
            out.reset(_norm_bus_id(m.group(1)))
        elif _DRIVER_LOAD.search(line):
            out.reset(None)
    return out


def kernel_log_xids(text: str) -> dict[str, list[int]]:
    """``NVRM: Xid (PCI:0000:18:00): 79, ...`` lines since each GPU's last reset -> {bus id: sorted Xids}."""
    return {bus: sorted(x) for bus, x in parse_kernel_log(text).current.items() if x}


def _norm_bus_id(bus: str | None) -> str:
    """NVML says ``00000000:18:00.0``, the kernel ``0000:18:00``: compare bus:device only."""
    if not bus:
        return ""
    parts = bus.lower().rstrip(":").split(":")
    if len(parts) >= 2:
        return f"{parts[-2]}:{parts[-1].split('.')[0]}"
    return bus.lower()
