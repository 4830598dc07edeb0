"""Each check's pass and fail paths: injected readings, sysfs fixture trees, real CPU runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from diagnostics import checks
from diagnostics.checks import Context
from diagnostics.checks.collective import allreduce_factor, busbw
from diagnostics.checks.etcd import min_abs, skew_interval
from diagnostics.checks.gemm import CPU_FP8_SKIPPED, fp8_supported, run_gemm
from diagnostics.checks.gpu import xid_class
from diagnostics.readers import InjectedReader, SysfsReader, load_injection
from diagnostics.thresholds import NON_CRITICAL_XIDS, Thresholds, load_thresholds
from tests.test_diag_readers import HEALTHY_PORT, NoHardware, make_ib_tree

FIXTURES = Path(__file__).parent / "fixtures" / "diag"


def healthy_h100(**sections) -> dict:
    inj = load_injection(FIXTURES / "h100-healthy.yaml")
    inj.update(sections)
    return inj


def run(name: str, injection: dict | None = None, base=None, mode="quick", thresholds=None, **ctx):
    reader = InjectedReader(base or NoHardware(), injection or {})
    context = Context(mode=mode, thresholds=thresholds or Thresholds(), reader=reader, **ctx)
    return checks.get(name)(context)


# -- gpu ----------------------------------------------------------------------


def test_gpu_skipped_without_driver_on_this_host():
    # The real host reader: no NVIDIA driver here, so the check must skip, never pass.
    from diagnostics.readers import HostReader

    result = checks.get("gpu")(Context(mode="quick", thresholds=Thresholds(), reader=HostReader()))
    assert result.verdict == "skip"
    assert result.reason.startswith("skipped: no NVIDIA driver")


def test_gpu_healthy_h100_passes():
    r = run("gpu", healthy_h100())
    assert (r.verdict, r.reason) == ("pass", "ok")
    assert r.value == "8x NVIDIA H100 80GB HBM3"
    assert r.details["model"] == "H100" and r.details["expected_count"] == 8


@pytest.mark.parametrize(
    "fields, verdict, fragment",
    [
        ({"ecc_uncorrected_volatile": 3}, "fail", "ECC uncorrected volatile 3 > 0"),
        ({"ecc_corrected_volatile": 60_000_000}, "warn", "ECC corrected volatile"),
        ({"ecc_enabled": False}, "warn", "ECC disabled"),
        ({"retired_pages_sbe": 8, "retired_pages_dbe": 3}, "fail", "11 retired pages > 10"),
        ({"retired_pages_sbe": 8, "retired_pages_dbe": 2}, "pass", "ok"),
        ({"retired_pages_pending": True}, "warn", "page retirement pending"),
        ({"remap_pending": 1}, "fail", "row remap pending"),
        ({"remap_failed": 1}, "fail", "row remap failed"),
        ({"throttle_reasons": ["hw_slowdown"]}, "fail", "throttled by hw_slowdown"),
        ({"throttle_reasons": ["sw_thermal_slowdown"]}, "warn", "sw_thermal_slowdown"),
        ({"throttle_reasons": ["gpu_idle", "sw_power_cap"]}, "pass", "ok"),
        ({"temperature_c": 88}, "warn", "temperature 88"),
        ({"temperature_c": 97}, "fail", "temperature 97"),
        ({"power_w": 800.0}, "warn", "above enforced limit"),
        ({"pcie_link_width": 8}, "fail", "PCIe link x8 < max x16"),
        ({"pcie_link_gen": 1}, "pass", "ok"),  # idle gen down-training is normal
        ({"xid_events": [79]}, "fail", "critical Xid 79"),
        ({"xid_events": [63, 92]}, "warn", "non-critical Xid 63,92"),
        ({"xid_events": [63, 48]}, "fail", "critical Xid 48"),
        ({"recovery_action": "node_reboot"}, "fail", "recovery action node_reboot"),
    ],
)
def test_gpu_fault_paths(fields, verdict, fragment):
    r = run("gpu", healthy_h100(gpu={5: fields}))
    assert r.verdict == verdict, r.reason
    assert fragment in r.reason
    if verdict != "pass":
        assert r.reason.startswith("gpu5:")


def test_gpu_count_below_expected_fails():
    inj = healthy_h100()
    inj["gpu_devices"] = inj["gpu_devices"][:7]  # one fell off the bus
    r = run("gpu", inj)
    assert r.verdict == "fail" and "7 GPUs, expected 8" in r.reason


def test_gpu_expected_count_from_config():
    inj = healthy_h100()
    inj["gpu_devices"] = inj["gpu_devices"][:4]
    assert run("gpu", inj, thresholds=load_thresholds({"gpu": {"expected_count": 4}})).verdict == "pass"


def test_gpu_zero_devices_fails():
    assert run("gpu", {"gpu_devices": []}).verdict == "fail"


def test_xid_classes_follow_gcm_non_critical_set():
    assert all(xid_class(x, NON_CRITICAL_XIDS) == "non-critical" for x in (13, 31, 43, 45, 63, 68, 92, 109))
    assert all(xid_class(x, NON_CRITICAL_XIDS) == "critical" for x in (48, 64, 74, 79, 94, 95, 119))


@pytest.mark.parametrize("nvml_name, key", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),  # a substring match took this for an H200
    ("NVIDIA GH200 144G HBM3e", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
    ("nvidia  h100 80gb hbm3", "H100"),  # case and spacing aside
    ("Tesla T4", None),
    ("NVIDIA H100", None),  # not a name NVML gives any part: unknown, not guessed
])
def test_model_lookup_is_exact(nvml_name, key):
    t = Thresholds()
    assert t.model_key(nvml_name) == key
    assert (t.model_for(nvml_name) is None) == (key is None)


def test_pcie_nvl_and_gh200_parts_get_their_own_figures():
    t = Thresholds()
    assert t.model_for("NVIDIA H100 PCIe").bf16_tflops == 756.0 and t.model_for("NVIDIA H100 PCIe").nvlink_links is None
    assert t.model_for("NVIDIA H200 NVL").expected_count is None
    gh200 = t.model_for("NVIDIA GH200 480GB")
    assert gh200.membw_gbps == 4000.0 and gh200.expected_count is None and gh200.nvlink_links is None
    assert t.model_for("NVIDIA H200").membw_gbps == 4800.0 and t.model_for("NVIDIA H200").expected_count == 8


# -- nvlink -------------------------------------------------------------------


def test_nvlink_skipped_without_driver():
    r = run("nvlink")
    assert r.verdict == "skip" and r.reason.startswith("skipped: no NVIDIA driver")


def test_nvlink_healthy_passes():
    r = run("nvlink", healthy_h100())
    assert r.verdict == "pass" and r.value == "144/144 links up"


def test_nvlink_link_down_fails_and_errors_warn():
    r = run("nvlink", healthy_h100(nvlink={2: {7: {"state": "down"}}}))
    assert r.verdict == "fail" and "gpu2: 17/18 links up (down: 7)" in r.reason
    r = run("nvlink", healthy_h100(nvlink={0: {1: {"crc_errors": 5}}}))
    assert r.verdict == "warn" and "crc_errors=5" in r.reason
    r = run("nvlink", healthy_h100(nvlink={0: {1: {"replay_errors": 5000}}}))
    assert r.verdict == "fail" and "replay_errors=5000 > 1000" in r.reason


def test_nvlink_missing_links_fail():
    inj = healthy_h100()
    for dev in inj["gpu_devices"]:
        dev["nvlink"] = dev["nvlink"][:12]
    r = run("nvlink", inj)
    assert r.verdict == "fail" and "12/18 links up" in r.reason


def test_nvlink_skipped_on_model_without_nvlink():
    r = run("nvlink", {"gpu_devices": [{"name": "NVIDIA H100 PCIe"}]})
    assert r.verdict == "skip" and "no NVLink" in r.reason


# -- ib -----------------------------------------------------------------------


def test_ib_skipped_without_devices(tmp_path):
    r = run("ib", base=SysfsReader(tmp_path))
    assert (r.verdict, r.reason) == ("skip", "skipped: no IB devices")


def test_ib_healthy_tree_passes(tmp_path):
    root = make_ib_tree(tmp_path, {f"mlx5_{i}": {"1": HEALTHY_PORT} for i in range(4)})
    r = run("ib", base=SysfsReader(root))
    assert r.verdict == "pass" and r.value == "4/4 ports up"


@pytest.mark.parametrize(
    "port, verdict, fragment",
    [
        ({"state": "1: DOWN"}, "fail", "mlx5_1/1 state DOWN"),
        ({"phys_state": "3: Disabled"}, "fail", "phys_state Disabled"),
        ({"counters": {"symbol_error": 12}}, "warn", "symbol_error=12"),
        ({"counters": {"link_downed": 11}}, "fail", "link_downed=11 > 10"),
    ],
)
def test_ib_fault_paths_from_sysfs_tree(tmp_path, port, verdict, fragment):
    bad = {**HEALTHY_PORT, **port}
    root = make_ib_tree(tmp_path, {"mlx5_0": {"1": HEALTHY_PORT}, "mlx5_1": {"1": bad}})
    r = run("ib", base=SysfsReader(root))
    assert r.verdict == verdict and fragment in r.reason


def test_ib_min_rate_and_injected_down(tmp_path):
    root = make_ib_tree(tmp_path, {"mlx5_0": {"1": {**HEALTHY_PORT, "rate": "200 Gb/sec (4X HDR)"}}})
    t = load_thresholds({"ib": {"min_rate_gbps": 400}})
    r = run("ib", base=SysfsReader(root), thresholds=t)
    assert r.verdict == "fail" and "rate 200.0 Gb/s < 400" in r.reason
    r = run("ib", {"ib": {"mlx5_0": {1: {"state": "DOWN"}}}}, base=SysfsReader(root))
    assert r.verdict == "fail" and "mlx5_0/1 state DOWN" in r.reason


# -- gemm ---------------------------------------------------------------------


def test_gemm_really_runs_on_cpu_and_verifies():
    r = run("gemm")
    # Throughput on a shared host may dip under the warn level; correctness may not.
    assert r.verdict in ("pass", "warn"), r.reason
    cpu = r.details["devices"]["cpu"]
    dtypes = ("fp32", "bf16")
    assert cpu["fp8"] == CPU_FP8_SKIPPED  # an emulated kernel's speed is no health signal
    for dtype in dtypes:
        assert cpu[dtype]["tflops"] > 0 and cpu[dtype]["iters"] >= 1
        assert cpu[dtype]["consistent"] is True
        assert cpu[dtype]["rel_err"] <= Thresholds().gemm.rtol[dtype]
    assert set(r.value) == set(dtypes)


def test_gemm_reference_check_catches_each_dtype():
    # run_gemm directly: a perturbed element must exceed every dtype's tolerance.
    rtol = Thresholds().gemm.rtol
    dtypes = ["fp32", "bf16"] + (["fp8"] if fp8_supported(torch.device("cpu")) else [])
    for dtype in dtypes:
        r = run_gemm(torch.device("cpu"), dtype, 64, 0.01, corrupt=True)
        assert r["rel_err"] > rtol[dtype] and r["consistent"] is False, dtype


def test_gemm_corrupted_result_is_caught():
    r = run("gemm", {"gemm": {"corrupt": True}})
    assert r.verdict == "fail"
    assert "wrong result" in r.reason and "differ between identical runs" in r.reason


def test_gemm_low_throughput_fails_and_warns():
    r = run("gemm", {"gemm": {"tflops_scale": 1e-4}})
    assert r.verdict == "fail" and "TFLOPS" in r.reason
    # Below the warn level (0.5 x an absurd expectation) but above a 1 MFLOPS fail floor: warn.
    t = load_thresholds({"cpu": {"fp32_tflops": 1e6, "bf16_tflops": 1e6},
                         "gemm": {"fail_fraction": 1e-12}})
    r = run("gemm", thresholds=t)
    assert r.verdict == "warn"


# -- membw --------------------------------------------------------------------


def test_membw_really_copies_host_memory():
    r = run("membw")
    # Throughput on a shared host may dip under the warn level; correctness may not.
    assert r.verdict in ("pass", "warn"), r.reason
    d = r.details["devices"]["cpu"]
    assert d["gbps"] > 0 and d["verified"] is True and r.value > 0


def test_membw_low_bandwidth_fails():
    r = run("membw", {"membw": {"gbps_scale": 1e-4}})
    assert r.verdict == "fail" and "GB/s" in r.reason


# -- collective ---------------------------------------------------------------


def test_busbw_formula_matches_nccl_tests():
    assert allreduce_factor(2) == 1.0
    assert allreduce_factor(8) == pytest.approx(1.75)
    assert allreduce_factor(1) == 0.0
    # 1 GB in 10 ms on 8 ranks: algbw 100 GB/s, busbw 175 GB/s.
    assert busbw(10**9, 0.01, 8) == pytest.approx(175.0)
    with pytest.raises(ValueError):
        busbw(1, 0.0, 2)


def test_collective_really_runs_two_gloo_ranks():
    r = run("collective")
    # Throughput on a shared host may dip under the warn level; correctness may not.
    assert r.verdict in ("pass", "warn"), r.reason
    d = r.details
    assert d["backend"] == "gloo" and d["ranks"] == 2 and d["wrong_elements"] == 0
    assert d["busbw_gbps"] > 0 and d["algbw_gbps"] > 0
    assert d["busbw_gbps"] == pytest.approx(d["algbw_gbps"] * allreduce_factor(2))


def test_collective_wrong_result_and_low_busbw_fail():
    r = run("collective", {"collective": {"corrupt": True, "busbw_scale": 1e-6}})
    assert r.verdict == "fail"
    assert "all-reduce result wrong in 1 elements" in r.reason and "busbw" in r.reason


def test_nccl_is_an_alias():
    assert checks.resolve("nccl") == "collective"
    with pytest.raises(KeyError, match="unknown check"):
        checks.resolve("gpux")


# -- disk ---------------------------------------------------------------------


def test_disk_skipped_without_dir_and_passes_on_tmp(tmp_path):
    assert run("disk").reason == "skipped: no checkpoint dir given (--ckpt-dir)"
    r = run("disk", ckpt_dir=str(tmp_path))
    assert r.verdict in ("pass", "warn"), r.reason  # shared dev disks can dip under 100 MB/s
    assert r.details["mbps"] > 0 and r.details["bytes"] == Thresholds().disk.quick_bytes
    assert list(tmp_path.iterdir()) == []  # probe file removed


def test_disk_fail_paths(tmp_path):
    assert run("disk", ckpt_dir=str(tmp_path / "missing")).verdict == "fail"
    r = run("disk", {"disk": {"mbps_scale": 1e-6}}, ckpt_dir=str(tmp_path))
    assert r.verdict == "fail" and "MB/s < 10" in r.reason
    r = run("disk", {"disk": {"free_gb": 0.2}}, ckpt_dir=str(tmp_path))
    assert r.verdict == "fail" and "GB free < 1" in r.reason


# -- etcd ---------------------------------------------------------------------


def test_skew_interval_math():
    # Sent at 100.2, answered at 100.3 local, server said second 100 -> offset in [-0.3, 0.8].
    assert skew_interval([(100.2, 100.3, 100.0)]) == pytest.approx((-0.3, 0.8))
    # A second sample just after the server ticked narrows the upper bound.
    lo, hi = skew_interval([(100.2, 100.3, 100.0), (100.95, 101.0, 101.0)])
    assert (lo, hi) == pytest.approx((0.0, 0.8))
    assert skew_interval([(0.0, 0.1, 0.0), (5.0, 5.1, 0.0)]) is None
    assert min_abs((-0.3, 0.8)) == 0.0 and min_abs((29.0, 30.1)) == 29.0 and min_abs((-7.0, -6.0)) == 6.0


def test_etcd_skipped_without_endpoint():
    assert run("etcd").reason == "skipped: no etcd endpoint given (--etcd-endpoint)"


def test_etcd_reachable_and_in_sync(etcd_endpoint):
    r = run("etcd", etcd_endpoint=etcd_endpoint)
    assert r.verdict == "pass", r.reason
    assert r.details["skew_lo_s"] <= 0 <= r.details["skew_hi_s"]
    assert r.value["rtt_ms"] > 0


def test_etcd_full_mode_narrows_skew(etcd_endpoint):
    r = run("etcd", mode="full", etcd_endpoint=etcd_endpoint)
    assert r.verdict == "pass", r.reason
    assert r.details["skew_resolution_s"] < 0.5


def test_etcd_skewed_clock_fails(etcd_endpoint):
    r = run("etcd", {"etcd": {"clock_offset_s": -30}}, etcd_endpoint=etcd_endpoint)
    assert r.verdict == "fail" and "clock skew" in r.reason
    assert r.details["skew_lo_s"] > 28
    r = run("etcd", {"etcd": {"clock_offset_s": 3}}, etcd_endpoint=etcd_endpoint)
    assert r.verdict == "warn"


def test_etcd_unreachable_fails():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = load_thresholds({"etcd": {"timeout_s": 0.5}})
    r = run("etcd", etcd_endpoint=f"127.0.0.1:{port}", thresholds=t)
    assert r.verdict == "fail" and "unreachable" in r.reason


class GrowingCounters(NoHardware):
    """An IB port whose symbol_error counter rises between two reads (a link erroring right now)."""

    def __init__(self):
        self.reads = 0

    def ib_ports(self):
        self.reads += 1
        return {"mlx5_0": {"1": {"state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 400.0,
                                 "counters": {"symbol_error": 3 * self.reads, "link_downed": 0}}}}


def test_ib_full_mode_fails_on_counters_rising_during_window():
    t = load_thresholds({"ib": {"full_window_s": 0.01}})
    quick = run("ib", base=GrowingCounters(), thresholds=t)
    assert quick.verdict == "warn" and "symbol_error=3" in quick.reason  # cumulative only
    full = run("ib", base=GrowingCounters(), thresholds=t, mode="full")
    assert full.verdict == "fail" and "mlx5_0/1 symbol_error +3" in full.reason
    assert full.details["deltas"] == {"mlx5_0/1": {"symbol_error": 3}}


class BrokenReader(NoHardware):
    def ib_ports(self):
        raise RuntimeError("sysfs exploded")


def test_crashing_check_is_a_failure_not_a_crash():
    r = run("ib", base=BrokenReader())
    assert r.verdict == "fail" and r.reason == "check raised RuntimeError: sysfs exploded"


@pytest.mark.parametrize(
    "check, knob, scale, verdict",
    [
        ("gemm", "tflops_scale", 0.2, "fail"),   # below fail_fraction 0.35 of its own unscaled run
        ("gemm", "tflops_scale", 0.42, "warn"),  # between 0.35 and warn_fraction 0.5
        ("membw", "gbps_scale", 0.3, "fail"),
        ("collective", "busbw_scale", 0.3, "fail"),
        ("collective", "busbw_scale", 0.85, "warn"),  # between 0.8 and 0.9
    ],
)
def test_scale_knobs_make_a_cpu_node_look_slow(check, knob, scale, verdict):
    # The chaos module's "slow node" injection must work on CPU hosts as it does on GPUs.
    r = run(check, {check: {knob: scale}})
    assert r.verdict == verdict, r.reason


def test_cpu_timer_counts_the_threads_own_time_not_the_wait():
    # A CPU measurement that shares its cores (the worker's start, other simulated nodes) must not
    # read the time it was descheduled as slowness: sleeping stands in for being descheduled.
    from diagnostics.checks._devices import DeviceTimer

    timer = DeviceTimer(torch.device("cpu"), thread_cpu=True)
    timer.start()
    time.sleep(0.2)
    busy_until = time.thread_time() + 0.05
    while time.thread_time() < busy_until:
        pass
    timer.stop()
    assert 0.04 <= timer.seconds() < 0.15
    assert timer.cpu_share is not None and timer.cpu_share < 0.6
    wall = DeviceTimer(torch.device("cpu"))
    wall.start()
    time.sleep(0.05)
    wall.stop()
    assert wall.seconds() >= 0.05  # collectives keep the host clock


def test_etcd_versions_whose_stalled_leader_revokes_leases():
    from diagnostics.checks.etcd import stale_leader_revokes

    affected = [("3.5.1", 3), ("3.5.10", 5), ("3.4.23", 3), ("3.3.25", 3)]
    fixed = [("3.5.11", 3), ("3.5.17", 3), ("3.4.28", 3), ("3.6.0", 3), ("3.5.1", 1), ("", 3), ("garbage", 3)]
    assert [stale_leader_revokes(v, n) for v, n in affected] == [True] * len(affected)
    assert [stale_leader_revokes(v, n) for v, n in fixed] == [False] * len(fixed)
