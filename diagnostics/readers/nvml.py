"""GPU readings through NVML (pynvml)."""

from __future__ import annotations

import copy
from typing import Any

from diagnostics.readers import kernel_log as klog
from diagnostics.readers.base import GPU_FIELDS, RECOVERY_ACTIONS, THROTTLE_BITS, GpuUnavailable, ReaderError

#: (counter, NVML field scoped by link id, per-link field name prefix for links 0-11) for the
#: field-value fallback of the NVLink error counters.
_NVLINK_FIELDS = (
    ("replay_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_L"),
    ("recovery_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_L"),
    ("crc_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_CRC", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L"),
)


_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


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
      Xids logged before the GPU's last reset go to ``xid_events_before_reset``
      (:mod:`diagnostics.readers.kernel_log`).

    :meth:`gpus` is taken once per reader and cached (the screen's idle snapshot);
    :meth:`gpus_now` reads again every time, for the samples taken under load.
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
        if self._cache is None:
            self._cache = self._read(self.xid_window_s)
        return copy.deepcopy(self._cache)

    def gpus_now(self) -> list[dict[str, Any]]:
        return self._read(0.0)

    def _read(self, xid_window_s: float) -> list[dict[str, Any]]:
        nv = self._init()
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise ReaderError(f"nvmlDeviceGetCount failed: {exc}") from exc
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        devices = [self._device(nv, i, h) for i, h in enumerate(handles)]
        xids = self._listen_xids(nv, handles, xid_window_s)
        logged = klog.KernelLogXids()
        if self.kernel_log:
            text = klog.read_kernel_log()
            self.kernel_log_read = text is not None
            logged = klog.parse_kernel_log(text or "")
        for dev in devices:
            bus = klog._norm_bus_id(dev.get("pci_bus_id"))
            dev["xid_events"] = sorted(set(xids.get(dev["index"], [])) | logged.current.get(bus, set()))
            dev["xid_events_before_reset"] = sorted(logged.before_reset.get(bus, set()))
            dev["xid_kernel_log"] = self.kernel_log_read
        return devices

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
        d["memory_temperature_c"] = _field(nv, h, getattr(nv, "NVML_FI_DEV_MEMORY_TEMP", None))  # HBM
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
        raw = _field(nv, h, getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None))
        if raw is None:
            return None  # older drivers (< 570) do not know the field
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
            if all(v is None for v in counters.values()):
                # Newer drivers do not support the per-link call on Hopper: the same counters
                # are NVML field values (scoped by link, or one field per link for links 0-11).
                counters = _nvlink_field_counters(nv, h, link)
            links.append({"link": link, "state": "up" if state else "down", **counters})
        return links or None

    def _listen_xids(self, nv: Any, handles: list[Any], window_s: float) -> dict[int, list[int]]:
        if window_s <= 0 or not handles:
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

            deadline = time.monotonic() + window_s
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


def _field(nv: Any, h: Any, field_id: Any, scope: int | None = None) -> int | None:
    """One NVML field value as an int; None when the field, device or driver does not have it."""
    if field_id is None:
        return None
    values = _opt(nv, nv.nvmlDeviceGetFieldValues, h, [field_id if scope is None else (field_id, scope)])
    if not values or values[0].nvmlReturn != 0:
        return None
    # nvmlValue_t is a union; valueType says which member NVML wrote (nvml.h NVML_VALUE_TYPE_*).
    member = _VALUE_MEMBERS.get(getattr(values[0], "valueType", 1), "uiVal")
    return int(getattr(values[0].value, member))


def _nvlink_field_counters(nv: Any, h: Any, link: int) -> dict[str, int | None]:
    counters: dict[str, int | None] = {}
    for key, scoped, per_link in _NVLINK_FIELDS:
        value = _field(nv, h, getattr(nv, scoped, None), scope=link)
        if value is None and link < 12:
            value = _field(nv, h, getattr(nv, f"{per_link}{link}", None))
        counters[key] = value
    return counters


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


