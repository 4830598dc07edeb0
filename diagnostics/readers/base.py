"""What every hardware reader shares: the reading fields, the errors, the reader protocol."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

INJECT_ENV = "ELASTIC_DIAG_INJECT"

#: Keys of one GPU reading.  Counters are ints, flags bools, clocks MHz, power W.
GPU_FIELDS = (
    "index", "name", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib",
    "ecc_enabled", "ecc_uncorrected_volatile", "ecc_corrected_volatile",
    "ecc_uncorrected_aggregate", "ecc_corrected_aggregate",
    "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
    "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failed",
    "sm_clock_mhz", "mem_clock_mhz", "sm_clock_max_mhz", "mem_clock_max_mhz",
    "throttle_reasons", "temperature_c", "memory_temperature_c", "power_w", "power_limit_w",
    "pcie_link_width", "pcie_link_width_max", "pcie_link_gen", "pcie_link_gen_max",
    "xid_events", "xid_events_before_reset", "xid_kernel_log", "recovery_action", "nvlink",
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
        """One reading per GPU (taken once per reader: the screen's snapshot); raises GpuUnavailable
        when there is no GPU stack."""
        ...

    def gpus_now(self) -> list[dict[str, Any]]:
        """Fresh readings, never cached: what the benchmark checks sample during and after their
        load (clocks, throttle reasons, temperatures, ECC and Xids of a GPU at work)."""
        ...

    def driver_version(self) -> str | None: ...

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{device: {port: reading}}``; empty when the host has no IB/RoCE devices."""
        ...

    def knobs(self, section: str) -> dict[str, Any]:
        """Benchmark overrides for one check (empty unless injected)."""
        ...


