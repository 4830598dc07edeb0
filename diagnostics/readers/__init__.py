"""Hardware readings behind one interface, so every check can be fed fake hardware.

A check never calls NVML or reads sysfs itself: it asks a :class:`HardwareReader`.
Modules: :mod:`~diagnostics.readers.base` (fields, errors, protocol), :mod:`~diagnostics.readers.nvml`,
:mod:`~diagnostics.readers.kernel_log` (Xids from dmesg, split at GPU resets),
:mod:`~diagnostics.readers.sysfs`, :mod:`~diagnostics.readers.inject`.
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
    gpu_under_load:         # overrides seen only by the samples taken under load (gpus_now)
      2: {throttle_reasons: [hw_thermal_slowdown], memory_temperature_c: 104}
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

from diagnostics.readers.base import (
    GPU_FIELDS,
    IB_FIELDS,
    INJECT_ENV,
    KNOB_SECTIONS,
    NVLINK_FIELDS,
    RECOVERY_ACTIONS,
    THROTTLE_BITS,
    GpuUnavailable,
    HardwareReader,
    InjectionError,
    ReaderError,
)
from diagnostics.readers.inject import HostReader, InjectedReader, default_reader, load_injection
from diagnostics.readers.kernel_log import kernel_log_xids, read_kernel_log
from diagnostics.readers.nvml import NvmlReader, throttle_names
from diagnostics.readers.sysfs import IB_COUNTERS, SysfsReader

__all__ = [
    "GPU_FIELDS", "IB_COUNTERS", "IB_FIELDS", "INJECT_ENV", "KNOB_SECTIONS", "NVLINK_FIELDS", "RECOVERY_ACTIONS",
    "THROTTLE_BITS", "GpuUnavailable", "HardwareReader", "HostReader", "InjectedReader", "InjectionError",
    "NvmlReader", "ReaderError", "SysfsReader", "default_reader", "kernel_log_xids", "load_injection",
    "read_kernel_log", "throttle_names",
]
