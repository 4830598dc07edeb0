"""Pass / warn / fail thresholds for every check, with defaults per GPU model.

Loaded from YAML through :func:`elastic.common.config.from_dict`, so an unknown key or a
value of the wrong type is rejected with the dotted path of the field
(``gemm.fail_fraction: expected a number ...``).  Every field has a default;
a thresholds file only lists what it changes (``examples/diag-thresholds.yaml``).

Where the numbers come from (``shared/reference/anchors.md`` section 4):

* H100 / H200 compute (BF16 ~989 TFLOPS dense, FP8 ~1979 dense), HBM bandwidth
  (H100 SXM 3.35 TB/s, H200 4.8 TB/s), NVLink4 18 links, and the 8-GPU
  NVLink all-reduce busbw of 460-480 GB/s (8xA100: 230-250, 8xH100 PCIe: 35-45),
  with ">20 % below means misconfiguration" -> collective fail below 0.8x.
* Meta GCM: ECC uncorrected volatile must be 0, corrected volatile <= 50,000,000,
  retired pages <= 10, any pending or failed row remap is critical, GPU count 8,
  and the non-critical Xid set {13, 31, 43, 45, 63, 68, 92, 109}.
* FP32 (non-tensor-core) peaks, the A100, PCIe, NVL and GH200 figures and the
  temperature limits are vendor spec-sheet figures or project choices, not
  anchored; they are marked ``[spec]`` / ``[choice]`` below.

A ``ModelSpec`` holds *peak* figures.  The burn-in checks judge a measurement
against a **calibration** first: ``diag calibrate`` on known-good nodes writes,
per check, size and dtype, the median and spread of repeated runs
(:mod:`diagnostics.calibration`), and ``calibration: FILE`` (or ``--calibration``)
makes those medians the expectation, with ``calibrated_warn_fraction`` /
``calibrated_fail_fraction``.  Only without one are datasheet peaks used, with
fractions low enough for what a healthy part reaches in a short screen (a healthy
H100 does ~600-750 of its 989 bf16 TFLOPS at 4096^3, ~1,100-1,300 of 1979 in FP8).
On a host without GPUs the ``cpu`` spec is used: small floors that only catch a
broken or badly contended host, never a benchmark ranking.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastic.common.config import ConfigError, from_dict


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """Peak figures of one device model, matched by its exact NVML device name(s)."""

    names: list[str] = field(default_factory=list)
    """NVML device names of this model, compared exactly (case and spacing aside): a substring
    match took "NVIDIA GH200 ..." for an H200 and PCIe / NVL parts for the SXM part."""
    #: GPUs per node expected for this model (None: do not check the count).
    expected_count: int | None = None
    fp32_tflops: float | None = None
    bf16_tflops: float | None = None
    fp8_tflops: float | None = None
    #: Device memory bandwidth, GB/s (copy bandwidth is compared with this).
    membw_gbps: float | None = None
    #: NVLink links per GPU (0 or None: no NVLink expected).
    nvlink_links: int | None = None
    #: All-reduce busbw measured on a healthy 8-GPU node, GB/s (an achieved figure, not a peak).
    allreduce_busbw_gbps: float | None = None

    def __post_init__(self) -> None:
        if not self.names or not all(isinstance(n, str) and n.strip() for n in self.names):
            raise ConfigError("names", "must list the exact NVML device name(s) of the model")
        for name in ("fp32_tflops", "bf16_tflops", "fp8_tflops", "membw_gbps", "allreduce_busbw_gbps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(name, f"must be positive, got {value}")

    def matches(self, device_name: str) -> bool:
        return normalize_name(device_name) in {normalize_name(n) for n in self.names}


def normalize_name(name: str) -> str:
    """NVML names compared case-insensitively with runs of spaces collapsed."""
    return " ".join(name.lower().split())


def _default_models() -> dict[str, ModelSpec]:
    # NVML names as nvidia-smi prints them.  Figures: anchors section 4 where marked, else
    # vendor spec sheets [spec] (dense, no sparsity).
    return {
        # anchors 4.3: BF16 989 / FP8 1979 dense, 3.35 TB/s, 18 NVLink4 links; 4.2: 460 GB/s busbw.
        # fp32 67 TFLOPS [spec].
        "H100": ModelSpec(names=["NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB", "NVIDIA H100 SXM5 64GB"],
                          expected_count=8, fp32_tflops=67.0, bf16_tflops=989.0, fp8_tflops=1979.0,
                          membw_gbps=3350.0, nvlink_links=18, allreduce_busbw_gbps=460.0),
        # H100 PCIe [spec]: 51 / 756 / 1513 TFLOPS, 2.0 TB/s; anchors 4.2: 8x busbw 35-45 GB/s.
        "H100 PCIe": ModelSpec(names=["NVIDIA H100 PCIe"], fp32_tflops=51.0, bf16_tflops=756.0, fp8_tflops=1513.0,
                               membw_gbps=2000.0, allreduce_busbw_gbps=35.0),
        # H100 NVL [spec]: 60 / 835 / 1671 TFLOPS, 3.9 TB/s; NVLink bridges pair GPUs only, so no
        # per-node link count or busbw figure (calibrate one).
        "H100 NVL": ModelSpec(names=["NVIDIA H100 NVL"], fp32_tflops=60.0, bf16_tflops=835.0, fp8_tflops=1671.0,
                              membw_gbps=3900.0),
        # anchors 4.3: same compute as H100, 4.8 TB/s HBM3e, NVLink4.
        "H200": ModelSpec(names=["NVIDIA H200", "NVIDIA H200 141GB HBM3e"], expected_count=8, fp32_tflops=67.0,
                          bf16_tflops=989.0, fp8_tflops=1979.0, membw_gbps=4800.0, nvlink_links=18,
                          allreduce_busbw_gbps=460.0),
        # H200 NVL [spec]: 60 / 836 / 1671 TFLOPS, 4.8 TB/s; 2- or 4-way NVLink bridges.
        "H200 NVL": ModelSpec(names=["NVIDIA H200 NVL"], fp32_tflops=60.0, bf16_tflops=836.0, fp8_tflops=1671.0,
                              membw_gbps=4800.0),
        # GH200 [spec]: the H100 compute die with 96 GB HBM3 (4.0 TB/s) or 144 GB HBM3e (4.9 TB/s);
        # the lower figure is the floor.  One GPU per superchip: no count, no NVLink expectation.
        "GH200": ModelSpec(names=["NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e", "NVIDIA GH200 96GB HBM3"],
                           fp32_tflops=67.0, bf16_tflops=989.0, fp8_tflops=1979.0, membw_gbps=4000.0),
        # A100 SXM [spec]: 19.5 fp32 / 312 bf16, no FP8, 1.555 TB/s (40 GB part; the 80 GB part is
        # faster, so this is the conservative floor), 12 NVLink3 links; anchors 4.2: 230 GB/s busbw.
        "A100": ModelSpec(names=["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"], expected_count=8,
                          fp32_tflops=19.5, bf16_tflops=312.0, membw_gbps=1555.0, nvlink_links=12,
                          allreduce_busbw_gbps=230.0),
        # A100 PCIe [spec]: same compute, 1.555 (40 GB) / 1.935 (80 GB) TB/s, NVLink bridge optional.
        "A100 PCIe": ModelSpec(names=["NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"], fp32_tflops=19.5,
                               bf16_tflops=312.0, membw_gbps=1555.0),
    }


def _default_cpu() -> ModelSpec:
    # [choice] Floors for a CPU-only host (tests, local mode), measured with one intra-op
    # thread (see checks._devices.single_cpu_thread) on the project's 2-core dev host:
    # idle ~0.1 TFLOPS fp32 / ~0.07 bf16 / ~0.012 fp8 at 256^3, ~7 GB/s copy, ~0.5 GB/s gloo
    # busbw; at load 10 on 2 cores copy fell to ~1 GB/s.  The floors below (fail at half of
    # them, 0.8x for busbw) only catch a broken or starved host, e.g. copy under 0.25 GB/s.
    # No fp8 floor: the screen does not measure fp8 on a CPU (diagnostics.checks.gemm.CPU_FP8_SKIPPED).
    return ModelSpec(names=["cpu"], fp32_tflops=0.005, bf16_tflops=0.0025, membw_gbps=0.5,
                     allreduce_busbw_gbps=0.02)


#: Xids Meta GCM treats as non-critical (anchors 4.5); every other Xid is critical.
NON_CRITICAL_XIDS = [13, 31, 43, 45, 63, 68, 92, 109]


@dataclass(kw_only=True, slots=True)
class GpuThresholds:
    #: Overrides the model's expected GPU count (None: use the model's).
    expected_count: int | None = None
    ecc_uncorrected_volatile_max: int = 0
    ecc_corrected_volatile_max: int = 50_000_000
    #: Aggregate (lifetime) uncorrected ECC above this is a warning, not a failure.
    ecc_uncorrected_aggregate_warn: int = 0
    retired_pages_max: int = 10
    temperature_warn_c: float = 85.0  # [choice]
    temperature_fail_c: float = 95.0  # [choice]
    #: HBM temperature (NVML_FI_DEV_MEMORY_TEMP); HBM3 throttles near 95 C [choice].
    memory_temperature_warn_c: float = 90.0
    memory_temperature_fail_c: float = 100.0
    non_critical_xids: list[int] = field(default_factory=lambda: list(NON_CRITICAL_XIDS))
    #: Clock-event reasons that fail the GPU: hardware slowdowns mean the board itself is pulling clocks.
    throttle_fail: list[str] = field(
        default_factory=lambda: ["hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"]
    )
    throttle_warn: list[str] = field(default_factory=lambda: ["sw_thermal_slowdown"])
    #: Fail when the PCIe link runs narrower than its maximum width (x8 instead of x16).
    pcie_width_degraded_fails: bool = True
    #: Warn when the current PCIe generation is below this (None: idle down-training is normal).
    pcie_gen_min: int | None = None
    #: Recovery actions (NVML, driver >= 570) other than these fail.
    recovery_ok: list[str] = field(default_factory=lambda: ["none"])

    def __post_init__(self) -> None:
        if self.temperature_warn_c > self.temperature_fail_c:
            raise ConfigError("temperature_warn_c", "must not exceed temperature_fail_c")
        if self.memory_temperature_warn_c > self.memory_temperature_fail_c:
            raise ConfigError("memory_temperature_warn_c", "must not exceed memory_temperature_fail_c")
        if self.expected_count is not None and self.expected_count < 0:
            raise ConfigError("expected_count", "must be >= 0")


def _check_fractions(warn: float, fail: float) -> None:
    if not 0 < fail <= warn <= 1.5:
        raise ConfigError("fail_fraction", f"need 0 < fail_fraction <= warn_fraction, got {fail} / {warn}")


@dataclass(kw_only=True, slots=True)
class GemmThresholds:
    #: Of the datasheet peak, when no calibration covers the measurement: a healthy H100 reaches
    #: 0.6-0.75 of its bf16 peak and 0.55-0.65 of its FP8 peak at 4096^3.
    warn_fraction: float = 0.5
    fail_fraction: float = 0.35
    #: Of the calibrated median (never above median - 3 / 6 spreads, see diagnostics.calibration).
    calibrated_warn_fraction: float = 0.9
    calibrated_fail_fraction: float = 0.8
    #: Max |C - C_ref| / (|A| |B| row-col norm bound) per dtype; fp64 reference.
    rtol: dict[str, float] = field(default_factory=lambda: {"fp32": 1e-5, "bf16": 2e-2, "fp8": 5e-2})
    #: Timed seconds per dtype on CPU and on GPUs (all GPUs at once), after the warm-up.  On a CPU
    #: host 50 ms is still 40-200 products per dtype at n=256, and the screen's wall time is what
    #: holds back the first step: local mode runs every simulated node's screen on the same cores
    #: (0.15 s per dtype cost 0.4 s more per screen, measured; the throughput floors are far below).
    quick_seconds: float = 0.05
    quick_seconds_gpu: float = 1.0
    full_seconds: float = 10.0
    warmup_iters: int = 3

    def __post_init__(self) -> None:
        _check_fractions(self.warn_fraction, self.fail_fraction)
        _check_fractions(self.calibrated_warn_fraction, self.calibrated_fail_fraction)


@dataclass(kw_only=True, slots=True)
class BandwidthThresholds:
    warn_fraction: float = 0.7
    fail_fraction: float = 0.5
    calibrated_warn_fraction: float = 0.9
    calibrated_fail_fraction: float = 0.8
    #: Timed seconds of copies on CPU (host memory: 40 copies of 16 MiB at 50 ms) and on GPUs.
    quick_seconds: float = 0.05
    quick_seconds_gpu: float = 0.15
    full_seconds: float = 5.0

    def __post_init__(self) -> None:
        _check_fractions(self.warn_fraction, self.fail_fraction)
        _check_fractions(self.calibrated_warn_fraction, self.calibrated_fail_fraction)


@dataclass(kw_only=True, slots=True)
class CollectiveThresholds:
    # anchors 4.2: more than 20 % below the reference busbw means a misconfiguration.
    warn_fraction: float = 0.9
    fail_fraction: float = 0.8
    calibrated_warn_fraction: float = 0.9
    calibrated_fail_fraction: float = 0.8
    #: Local ranks for the CPU (gloo) run; GPU runs use every visible GPU.
    cpu_ranks: int = 2
    quick_bytes_cpu: int = 1 << 20
    full_bytes_cpu: int = 64 << 20
    #: The reference busbw is a large-message figure: 256 MiB messages reach only part of it.
    quick_bytes_gpu: int = 1 << 30
    full_bytes_gpu: int = 4 << 30
    quick_iters: int = 10
    full_iters: int = 20
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_fractions(self.warn_fraction, self.fail_fraction)
        _check_fractions(self.calibrated_warn_fraction, self.calibrated_fail_fraction)
        if self.cpu_ranks < 2:
            raise ConfigError("cpu_ranks", "must be >= 2")


@dataclass(kw_only=True, slots=True)
class NvlinkThresholds:
    #: Per-link error counters: warn above ``warn``, fail above ``fail``.
    error_warn: int = 0
    error_fail: int = 1000  # [choice]
    #: Peer copy bandwidth, fraction of the NVLink4 unidirectional bound per GPU (anchors 4.3: 450 GB/s).
    peer_gbps_expected: dict[str, float] = field(default_factory=lambda: {"H100": 450.0, "H200": 450.0, "A100": 300.0})
    warn_fraction: float = 0.6
    fail_fraction: float = 0.4

    def __post_init__(self) -> None:
        _check_fractions(self.warn_fraction, self.fail_fraction)
        if self.error_fail < self.error_warn:
            raise ConfigError("error_fail", "must be >= error_warn")


_IB_WARN = ["symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
            "port_rcv_remote_physical_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors"]


@dataclass(kw_only=True, slots=True)
class IbThresholds:
    #: fnmatch patterns of the ports that are the training fabric, as ``device/port``
    #: (``mlx5_[0-7]/1``); other ports (management, storage) are listed but not judged.
    #: Empty: every port is judged.
    ports: list[str] = field(default_factory=list)
    #: Port states that pass (from ``ports/<n>/state``).
    ok_states: list[str] = field(default_factory=lambda: ["ACTIVE"])
    ok_phys_states: list[str] = field(default_factory=lambda: ["LinkUp"])
    #: Minimum link rate, Gb/s (None: not checked); NDR is 400 (anchors 4.3).
    min_rate_gbps: float | None = None
    #: Counters (cumulative since boot or last clear) that warn when non-zero.
    counters_warn: list[str] = field(default_factory=lambda: list(_IB_WARN))
    #: Counters that fail above a limit [choice].
    counters_fail: dict[str, int] = field(default_factory=lambda: {"link_downed": 10, "symbol_error": 10_000})
    #: Full mode reads the counters twice, ``full_window_s`` apart; any increase of these fails
    #: (errors accumulating on an idle link mean it is bad now, not at some point since boot).
    full_window_s: float = 5.0
    delta_fail: list[str] = field(default_factory=lambda: [
        "symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors"])

    def __post_init__(self) -> None:
        if self.full_window_s < 0:
            raise ConfigError("full_window_s", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class DiskThresholds:
    warn_mbps: float = 100.0  # [choice]
    fail_mbps: float = 10.0  # [choice]
    min_free_gb: float = 1.0
    quick_bytes: int = 8 << 20
    full_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.fail_mbps > self.warn_mbps:
            raise ConfigError("fail_mbps", "must not exceed warn_mbps")


@dataclass(kw_only=True, slots=True)
class EtcdThresholds:
    rtt_warn_ms: float = 100.0  # [choice]
    rtt_fail_ms: float = 2000.0  # [choice]
    #: Clock skew against the etcd server; exclusion expiry and event merging use wall clocks.
    skew_warn_s: float = 1.0  # [choice]
    skew_fail_s: float = 5.0  # [choice]
    timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if self.rtt_fail_ms < self.rtt_warn_ms:
            raise ConfigError("rtt_fail_ms", "must be >= rtt_warn_ms")
        if self.skew_fail_s < self.skew_warn_s:
            raise ConfigError("skew_fail_s", "must be >= skew_warn_s")


@dataclass(kw_only=True, slots=True)
class Thresholds:
    models: dict[str, ModelSpec] = field(default_factory=_default_models)
    cpu: ModelSpec = field(default_factory=_default_cpu)
    gpu: GpuThresholds = field(default_factory=GpuThresholds)
    gemm: GemmThresholds = field(default_factory=GemmThresholds)
    membw: BandwidthThresholds = field(default_factory=BandwidthThresholds)
    collective: CollectiveThresholds = field(default_factory=CollectiveThresholds)
    nvlink: NvlinkThresholds = field(default_factory=NvlinkThresholds)
    ib: IbThresholds = field(default_factory=IbThresholds)
    disk: DiskThresholds = field(default_factory=DiskThresholds)
    etcd: EtcdThresholds = field(default_factory=EtcdThresholds)
    calibration: str = ""
    """Calibration file written by ``diag calibrate`` on known-good nodes; its medians replace the
    datasheet figures for the measurements it covers (relative paths: from the working directory)."""

    def model_key(self, device_name: str | None) -> str | None:
        """The name of the model whose NVML names include ``device_name`` exactly, or None."""
        if not device_name:
            return None
        return next((key for key, spec in self.models.items() if spec.matches(device_name)), None)

    def model_for(self, device_name: str | None) -> ModelSpec | None:
        key = self.model_key(device_name)
        return self.models[key] if key is not None else None


def load_thresholds(source: str | os.PathLike[str] | dict[str, Any] | None) -> Thresholds:
    """Defaults, overlaid with a YAML file or dict.  ``models`` entries merge by name."""
    if source is None:
        return Thresholds()
    if isinstance(source, dict):
        data = source
        where = ""
    else:
        where = str(source)
        try:
            data = yaml.safe_load(Path(source).read_text()) or {}
        except OSError as exc:
            raise ConfigError("", f"cannot read {where}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError("", f"not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError("", "thresholds file must be a mapping")
    data = dict(data)
    if isinstance(data.get("cpu"), dict):  # a file that tunes the CPU floors keeps the rest of them
        data["cpu"] = {**_spec_dict(_default_cpu()), **data["cpu"]}
    models = data.get("models")
    if isinstance(models, dict):
        # A file that tunes one model keeps the built-in others.
        merged = {name: _spec_dict(spec) for name, spec in _default_models().items()}
        for name, spec in models.items():
            if isinstance(spec, dict) and name in merged:
                merged[name] = {**merged[name], **spec}
            else:
                merged[name] = spec
        data["models"] = merged
    return from_dict(Thresholds, data)


def _spec_dict(spec: ModelSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in ModelSpec.__slots__}
