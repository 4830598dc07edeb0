"""Hardware readings behind one interface, so every check can be fed fake hardware.

A check never calls NVML or reads sysfs itself: it asks a :class:`HardwareReader`.
Three implementations exist, and :func:`default_reader` composes them:

* :class:`NvmlReader` -- GPUs through pynvml.  If NVML cannot be initialised
  (no driver, no library) it raises :class:`GpuUnavailable`, which the GPU-side
  checks turn into ``skip``.
* :class:`SysfsReader` -- InfiniBand / RoCE ports from ``/sys/class/infiniband``
  (the root is a parameter, so tests point it at a fixture tree).
* :class:`InjectedReader` -- an overlay loaded from YAML that replaces any
  reading of the reader under it, in the spirit of DCGM's NVML injection.  It is
  how tests reach every failing path on a CPU host, and how the chaos module
  makes a node look bad (it sets ``ELASTIC_DIAG_INJECT=<file>`` for that node).

Readings are plain dicts with the keys listed in :data:`GPU_FIELDS` and
:data:`IB_FIELDS`; a key whose value is ``None`` means "not available on this
device" and the checks report it as such rather than guessing.

Injection file format (every section optional)::

    gpu_devices:            # replaces the whole GPU list (synthetic devices)
      - {name: "NVIDIA H100 80GB HBM3", ecc_uncorrected_volatile: 0, ...}
    gpu:                    # per-device overrides, by index, on top of the base list
      0: {ecc_uncorrected_volatile: 3, xid_events: [79]}
    driver_version: "570.86"
    ib_ports:               # replaces the whole port map
      mlx5_0: {1: {state: ACTIVE, ...}}
    ib:                     # per-port overrides
      mlx5_0: {1: {state: DOWN}}
    nvlink:                 # per-device, per-link overrides
      0: {3: {state: down, crc_errors: 12}}
    gemm: {tflops_scale: 0.3, corrupt: true}      # benchmark knobs, see KNOB_SECTIONS
    membw: {gbps_scale: 0.1}
    collective: {busbw_scale: 0.1, corrupt: true}
    disk: {mbps_scale: 0.01}
    etcd: {clock_offset_s: 30}
    nvlink_bw: {gbps_scale: 0.1}
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

INJECT_ENV = "ELASTIC_DIAG_INJECT"

#: Keys of one GPU reading.  Counters are ints, flags bools, clocks MHz, power W.
GPU_FIELDS = (
    "index", "name", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib",
    "ecc_enabled", "ecc_uncorrected_volatile", "ecc_corrected_volatile",
    "ecc_uncorrected_aggregate", "ecc_corrected_aggregate",
    "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
    "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failed",
    "sm_clock_mhz", "mem_clock_mhz", "sm_clock_max_mhz", "mem_clock_max_mhz",
    "throttle_reasons", "temperature_c", "power_w", "power_limit_w",
    "pcie_link_width", "pcie_link_width_max", "pcie_link_gen", "pcie_link_gen_max",
    "xid_events", "xid_kernel_log", "recovery_action", "nvlink",
)
#: Keys of one NVLink reading (``gpu["nvlink"]`` is a list of these).
NVLINK_FIELDS = ("link", "state", "replay_errors", "recovery_errors", "crc_errors")
#: Keys of one IB port reading.
IB_FIELDS = ("state", "phys_state", "rate_gbps", "link_layer", "counters")
#: Sections of an injection file that are knobs for benchmark checks, not readings.
KNOB_SECTIONS = ("gemm", "membw", "collective", "disk", "etcd", "nvlink_bw")

# NVML clock-event (throttle) reason bits -> names, from nvml.h.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (driver >= 570).
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}


class ReaderError(RuntimeError):
    """A reading could not be taken."""


class GpuUnavailable(ReaderError):
    """NVML could not be initialised: no NVIDIA driver or library on this host."""


class InjectionError(ValueError):
    """The injection file is unreadable or malformed; ``str()`` names the file and key."""


@runtime_checkable
class HardwareReader(Protocol):
    """Everything the checks read from the host."""

    def gpus(self) -> list[dict[str, Any]]:
        """One reading per GPU; raises GpuUnavailable when there is no GPU stack."""
        ...

    def driver_version(self) -> str | None: ...

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{device: {port: reading}}``; empty when the host has no IB/RoCE devices."""
        ...

    def knobs(self, section: str) -> dict[str, Any]:
        """Benchmark overrides for one check (empty unless injected)."""
        ...


# ---------------------------------------------------------------------------
# NVML


class NvmlReader:
    """GPU readings via pynvml.

    Xid events come from two places, merged per device:

    * an NVML event set, listened to for ``xid_window_s`` -- NVML only delivers
      events that arrive while registered, so this sees Xids raised *during* the
      screen;
    * the kernel log since boot (``NVRM: Xid (PCI:<bus id>): <xid>, ...`` lines),
      read with ``dmesg`` when the host allows it (``kernel.dmesg_restrict=1``
      needs CAP_SYSLOG).  Each reading's ``xid_kernel_log`` is False when the log
      could not be read, so a missing log is visible rather than a silent pass.

    Readings are taken once per reader and cached: a screen is one snapshot.
    """

    def __init__(self, xid_window_s: float = 0.0, kernel_log: bool = True) -> None:
        self.xid_window_s = xid_window_s
        self.kernel_log = kernel_log
        self.kernel_log_read: bool | None = None
        self._nvml: Any = None
        self._cache: list[dict[str, Any]] | None = None

    def _init(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            import pynvml
        except ImportError as exc:
            raise GpuUnavailable("no NVIDIA driver (pynvml not installed)") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"no NVIDIA driver ({exc})") from exc
        self._nvml = pynvml
        return pynvml

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            finally:
                self._nvml = None

    def driver_version(self) -> str | None:
        nv = self._init()
        value = _opt(nv, nv.nvmlSystemGetDriverVersion)
        return value.decode() if isinstance(value, bytes) else value

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {}

    def knobs(self, section: str) -> dict[str, Any]:
        return {}

    def gpus(self) -> list[dict[str, Any]]:
        if self._cache is not None:
            return copy.deepcopy(self._cache)
        nv = self._init()
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise ReaderError(f"nvmlDeviceGetCount failed: {exc}") from exc
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        devices = [self._device(nv, i, h) for i, h in enumerate(handles)]
        xids = self._listen_xids(nv, handles)
        logged: dict[str, list[int]] = {}
        if self.kernel_log:
            text = read_kernel_log()
            self.kernel_log_read = text is not None
            logged = kernel_log_xids(text or "")
        for dev in devices:
            from_log = logged.get(_norm_bus_id(dev.get("pci_bus_id")), [])
            dev["xid_events"] = sorted(set(xids.get(dev["index"], [])) | set(from_log))
            dev["xid_kernel_log"] = self.kernel_log_read
        self._cache = devices
        return copy.deepcopy(devices)

    def _device(self, nv: Any, index: int, h: Any) -> dict[str, Any]:
        d: dict[str, Any] = dict.fromkeys(GPU_FIELDS)
        d["index"] = index
        name = _opt(nv, nv.nvmlDeviceGetName, h)
        d["name"] = name.decode() if isinstance(name, bytes) else name
        uuid = _opt(nv, nv.nvmlDeviceGetUUID, h)
        d["uuid"] = uuid.decode() if isinstance(uuid, bytes) else uuid
        pci = _opt(nv, nv.nvmlDeviceGetPciInfo, h)
        if pci is not None:
            bus = pci.busId
            d["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
        mem = _opt(nv, nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            d["memory_total_mib"] = mem.total // 2**20
            d["memory_used_mib"] = mem.used // 2**20
        mode = _opt(nv, nv.nvmlDeviceGetEccMode, h)
        d["ecc_enabled"] = None if mode is None else bool(mode[0])
        ecc = nv.nvmlDeviceGetTotalEccErrors
        d["ecc_uncorrected_volatile"] = _opt(nv, ecc, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        d["ecc_corrected_volatile"] = _opt(nv, ecc, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
        d["ecc_uncorrected_aggregate"] = _opt(nv, ecc, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC)
        d["ecc_corrected_aggregate"] = _opt(nv, ecc, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC)
        sbe = _opt(nv, nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = _opt(nv, nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        d["retired_pages_sbe"] = None if sbe is None else len(sbe)
        d["retired_pages_dbe"] = None if dbe is None else len(dbe)
        pending = _opt(nv, nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        d["retired_pages_pending"] = None if pending is None else bool(pending)
        rows = _opt(nv, nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            corr, unc, pend, fail = rows
            d.update(remap_correctable=corr, remap_uncorrectable=unc, remap_pending=int(pend), remap_failed=int(fail))
        d["sm_clock_mhz"] = _opt(nv, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        d["mem_clock_mhz"] = _opt(nv, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        d["sm_clock_max_mhz"] = _opt(nv, nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
        d["mem_clock_max_mhz"] = _opt(nv, nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        bits = _opt(nv, reasons_fn, h)
        d["throttle_reasons"] = None if bits is None else throttle_names(bits)
        d["temperature_c"] = _opt(nv, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        power = _opt(nv, nv.nvmlDeviceGetPowerUsage, h)
        d["power_w"] = None if power is None else power / 1000.0
        limit = _opt(nv, nv.nvmlDeviceGetEnforcedPowerLimit, h)
        d["power_limit_w"] = None if limit is None else limit / 1000.0
        d["pcie_link_width"] = _opt(nv, nv.nvmlDeviceGetCurrPcieLinkWidth, h)
        d["pcie_link_width_max"] = _opt(nv, nv.nvmlDeviceGetMaxPcieLinkWidth, h)
        d["pcie_link_gen"] = _opt(nv, nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
        d["pcie_link_gen_max"] = _opt(nv, nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
        d["recovery_action"] = self._recovery_action(nv, h)
        d["nvlink"] = self._nvlinks(nv, h)
        return d

    @staticmethod
    def _recovery_action(nv: Any, h: Any) -> str | None:
        fid = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if fid is None:
            return None
        values = _opt(nv, nv.nvmlDeviceGetFieldValues, h, [fid])
        if not values or values[0].nvmlReturn != 0:
            return None  # older drivers (< 570) do not know the field
        raw = int(values[0].value.uiVal)
        return RECOVERY_ACTIONS.get(raw, f"unknown({raw})")

    @staticmethod
    def _nvlinks(nv: Any, h: Any) -> list[dict[str, Any]] | None:
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError:
                # Links are numbered densely; the first unsupported one ends the list.
                break
            counters = {}
            for key, kind in (
                ("replay_errors", nv.NVML_NVLINK_ERROR_DL_REPLAY),
                ("recovery_errors", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
                ("crc_errors", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            ):
                counters[key] = _opt(nv, nv.nvmlDeviceGetNvLinkErrorCounter, h, link, kind)
            links.append({"link": link, "state": "up" if state else "down", **counters})
        return links or None

    def _listen_xids(self, nv: Any, handles: list[Any]) -> dict[int, list[int]]:
        if self.xid_window_s <= 0 or not handles:
            return {}
        out: dict[int, list[int]] = {}
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return {}
        try:
            index_of = {}
            for i, h in enumerate(handles):
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                    index_of[i] = h
                except nv.NVMLError:
                    continue
            if not index_of:
                return {}
            import time

            deadline = time.monotonic() + self.xid_window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    data = nv.nvmlEventSetWait(event_set, max(1, int(left * 1000)))
                except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing arrived
                    break
                for i, h in index_of.items():
                    if nv.nvmlDeviceGetIndex(data.device) == nv.nvmlDeviceGetIndex(h):
                        out.setdefault(i, []).append(int(data.eventData))
        finally:
            nv.nvmlEventSetFree(event_set)
        return out


_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


def read_kernel_log(timeout_s: float = 2.0) -> str | None:
    """The kernel ring buffer via ``dmesg``, or None when it cannot be read."""
    try:
        proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def kernel_log_xids(text: str) -> dict[str, list[int]]:
    """``NVRM: Xid (PCI:0000:18:00): 79, ...`` lines -> {normalised PCI bus id: sorted Xids}."""
    out: dict[str, set[int]] = {}
    for match in _XID_LINE.finditer(text):
        out.setdefault(_norm_bus_id(match.group(1)), set()).add(int(match.group(2)))
    return {bus: sorted(x) for bus, x in out.items()}


def _norm_bus_id(bus: str | None) -> str:
    """NVML says ``00000000:18:00.0``, the kernel ``0000:18:00``: compare bus:device only."""
    if not bus:
        return ""
    parts = bus.lower().split(":")
    if len(parts) >= 2:
        return f"{parts[-2]}:{parts[-1].split('.')[0]}"
    return bus.lower()


def _opt(nv: Any, fn: Any, *args: Any) -> Any:
    """Call an NVML getter; None if the device or driver does not support it."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def throttle_names(bits: int) -> list[str]:
    """NVML clock-event reason bitmask -> sorted reason names (unknown bits kept as hex)."""
    names = [name for bit, name in THROTTLE_BITS.items() if bits & bit]
    unknown = bits & ~sum(THROTTLE_BITS)
    if unknown:
        names.append(f"unknown_0x{unknown:x}")
    return sorted(names)


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


# ---------------------------------------------------------------------------
# composition and injection


class HostReader:
    """The real host: GPUs from NVML, IB ports from sysfs."""

    def __init__(self, nvml: NvmlReader | None = None, sysfs: SysfsReader | None = None) -> None:
        self.nvml = nvml or NvmlReader()
        self.sysfs = sysfs or SysfsReader()

    def gpus(self) -> list[dict[str, Any]]:
        return self.nvml.gpus()

    def driver_version(self) -> str | None:
        return self.nvml.driver_version()

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.sysfs.ib_ports()

    def knobs(self, section: str) -> dict[str, Any]:
        return {}


_TOP_KEYS = {"gpu_devices", "gpu", "driver_version", "ib_ports", "ib", "nvlink", *KNOB_SECTIONS}


class InjectedReader:
    """Overlay of ``injection`` (a dict in the format of the module docstring) on ``base``."""

    def __init__(self, base: HardwareReader, injection: Mapping[str, Any], source: str = "<inject>") -> None:
        self.base = base
        self.source = source
        self.injection = _validate(dict(injection or {}), source)

    @classmethod
    def from_file(cls, base: HardwareReader, path: str | os.PathLike[str]) -> InjectedReader:
        return cls(base, load_injection(path), source=str(path))

    def gpus(self) -> list[dict[str, Any]]:
        inj = self.injection
        if "gpu_devices" in inj:
            devices = []
            for i, raw in enumerate(inj["gpu_devices"]):
                dev = dict.fromkeys(GPU_FIELDS)
                dev.update(copy.deepcopy(raw))
                if dev.get("index") is None:
                    dev["index"] = i
                devices.append(dev)
        else:
            devices = copy.deepcopy(self.base.gpus())
        by_index = {d["index"]: d for d in devices}
        for idx, fields in (inj.get("gpu") or {}).items():
            if idx not in by_index:
                raise InjectionError(f"{self.source}: gpu.{idx}: no such device (have {sorted(by_index)})")
            by_index[idx].update(copy.deepcopy(fields))
        for idx, links in (inj.get("nvlink") or {}).items():
            if idx not in by_index:
                raise InjectionError(f"{self.source}: nvlink.{idx}: no such device (have {sorted(by_index)})")
            dev = by_index[idx]
            current = {link["link"]: link for link in dev.get("nvlink") or []}
            for link, fields in links.items():
                entry = current.setdefault(link, {"link": link, **dict.fromkeys(NVLINK_FIELDS[1:])})
                entry.update(fields)
            dev["nvlink"] = [current[k] for k in sorted(current)]
        return devices

    def driver_version(self) -> str | None:
        if "driver_version" in self.injection:
            return self.injection["driver_version"]
        if "gpu_devices" in self.injection:
            return None
        return self.base.driver_version()

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        inj = self.injection
        ports = copy.deepcopy(inj["ib_ports"]) if "ib_ports" in inj else copy.deepcopy(self.base.ib_ports())
        for dev, per_port in (inj.get("ib") or {}).items():
            for port, fields in per_port.items():
                entry = ports.setdefault(dev, {}).setdefault(port, {"counters": {}})
                fields = dict(fields)
                if "counters" in fields:
                    entry.setdefault("counters", {}).update(fields.pop("counters"))
                entry.update(fields)
        return ports

    def knobs(self, section: str) -> dict[str, Any]:
        merged = dict(self.base.knobs(section))
        merged.update(self.injection.get(section) or {})
        return merged


def load_injection(path: str | os.PathLike[str], _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read an injection file.

    Top-level keys starting with ``x-`` are ignored (holders for YAML anchors).
    ``include: other.yaml`` (or a list), relative to the file, is loaded first and
    this file's sections are merged over it, so a fault file can say "the healthy
    node, except GPU 3 has a pending row remap".
    """
    path = Path(path)
    if str(path.resolve()) in _seen:
        raise InjectionError(f"{path}: include cycle")
    try:
        text = path.read_text()
    except OSError as exc:
        raise InjectionError(f"{path}: cannot read injection file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InjectionError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InjectionError(f"{path}: expected a mapping at top level")
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    includes = data.pop("include", None)
    if includes is None:
        return data
    merged: dict[str, Any] = {}
    for inc in [includes] if isinstance(includes, str) else list(includes):
        if not isinstance(inc, str):
            raise InjectionError(f"{path}: include: expected a file name or a list of them")
        _merge(merged, load_injection(path.parent / inc, _seen + (str(path.resolve()),)))
    _merge(merged, data)
    return merged


def _merge(into: dict[Any, Any], over: Mapping[Any, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _validate(inj: dict[str, Any], source: str) -> dict[str, Any]:
    inj = {k: v for k, v in inj.items() if not str(k).startswith("x-")}
    unknown = sorted(set(map(str, inj)) - _TOP_KEYS)
    if unknown:
        raise InjectionError(f"{source}: {unknown[0]}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    if "gpu_devices" in inj and not isinstance(inj["gpu_devices"], list):
        raise InjectionError(f"{source}: gpu_devices: expected a list of device readings")
    for i, dev in enumerate(inj.get("gpu_devices") or []):
        _check_fields(dev, GPU_FIELDS, f"{source}: gpu_devices[{i}]")
    for section in ("gpu", "nvlink"):
        value = inj.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of device index -> readings")
        fixed = {}
        for key, fields in value.items():
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise InjectionError(f"{source}: {section}.{key}: device index must be an integer") from None
            if section == "gpu":
                _check_fields(fields, GPU_FIELDS, f"{source}: gpu.{key}")
                fixed[idx] = fields
            else:
                if not isinstance(fields, dict):
                    raise InjectionError(f"{source}: nvlink.{key}: expected a mapping of link -> readings")
                links = {}
                for link, lf in fields.items():
                    _check_fields(lf, NVLINK_FIELDS, f"{source}: nvlink.{key}.{link}")
                    links[int(link)] = lf
                fixed[idx] = links
        inj[section] = fixed
    for section in ("ib_ports", "ib"):
        value = inj.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of device -> port -> readings")
        fixed_ib: dict[str, dict[str, Any]] = {}
        for dev, ports in value.items():
            if not isinstance(ports, dict):
                raise InjectionError(f"{source}: {section}.{dev}: expected a mapping of port -> readings")
            fixed_ib[str(dev)] = {}
            for port, fields in ports.items():
                _check_fields(fields, IB_FIELDS, f"{source}: {section}.{dev}.{port}")
                fixed_ib[str(dev)][str(port)] = fields
        inj[section] = fixed_ib
    for section in KNOB_SECTIONS:
        if section in inj and not isinstance(inj[section], dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of knob -> value")
    return inj


def _check_fields(fields: Any, known: tuple[str, ...], where: str) -> None:
    if not isinstance(fields, dict):
        raise InjectionError(f"{where}: expected a mapping of readings")
    unknown = sorted(set(map(str, fields)) - set(known))
    if unknown:
        raise InjectionError(f"{where}.{unknown[0]}: unknown reading (known: {', '.join(known)})")


def default_reader(
    inject: str | os.PathLike[str] | Mapping[str, Any] | None = None, xid_window_s: float = 0.0
) -> HardwareReader:
    """The host reader, overlaid with ``inject`` (a path or dict) or else ``$ELASTIC_DIAG_INJECT``."""
    base: HardwareReader = HostReader(nvml=NvmlReader(xid_window_s=xid_window_s))
    if inject is None:
        inject = os.environ.get(INJECT_ENV) or None
    if inject is None:
        return base
    if isinstance(inject, Mapping):
        return InjectedReader(base, inject)
    return InjectedReader.from_file(base, inject)
