"""Burn-in on the GPU path: calibration files, health under load, resets, fabric allowlist, NVML fallbacks.

Everything here runs on a CPU host: GPU readings come from the injection overlay or from the
real pynvml module with its C-calling functions replaced (tests/test_diag_readers.py).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from diagnostics.calibration import Calibration, CalibrationError, Entry, gemm_key, load_calibration
from diagnostics.cli import main as diag_main
from diagnostics.preflight import run_calibration, run_screen
from diagnostics.readers import InjectedReader, NvmlReader, SysfsReader, kernel_log_xids, load_injection
from diagnostics.readers.kernel_log import parse_kernel_log
from tests.test_diag_readers import HEALTHY_PORT, NoHardware, _fake_nvml, make_ib_tree

FIXTURES = Path(__file__).parent / "fixtures" / "diag"
pytestmark = pytest.mark.timeout(120)


# -- calibration ----------------------------------------------------------------------


def test_calibration_round_trip_and_judging_against_it(tmp_path):
    calibration = run_calibration("quick", ["gemm", "membw"], repeats=2, reader=InjectedReader(NoHardware(), {}))
    assert calibration.device == "cpu" and calibration.repeats == 2
    fp32 = calibration.checks["gemm"][gemm_key("fp32", 256)]
    assert fp32.unit == "TFLOPS" and len(fp32.samples) == 2 and fp32.median > 0 and fp32.spread >= 0
    path = tmp_path / "cal.json"
    calibration.write(path)
    loaded = load_calibration(path)
    assert loaded.to_dict() == calibration.to_dict() and loaded.source == str(path)

    report = run_screen("quick", checks=["gemm", "membw"], reader=InjectedReader(NoHardware(), {}), calibration=path)
    gemm = report.check("gemm")
    assert gemm.details["devices"]["cpu"]["fp32"]["expected_source"] == "calibration"
    assert "calibrated" in gemm.threshold["fp32"]
    assert report.check("membw").details["devices"]["cpu"]["expected_source"] == "calibration"
    # A node at 10 % of the calibrated median fails against the calibration (spread zeroed: two
    # samples on a loaded 2-core host can be far apart, which would rightly widen the band).
    tight = Calibration(device="cpu", mode="quick", checks={"gemm": {
        key: Entry(median=e.median, spread=0.0, unit=e.unit) for key, e in loaded.checks["gemm"].items()}})
    slow = run_screen("quick", checks=["gemm"], inject={"gemm": {"tflops_scale": 0.1}},
                      reader=NoHardware(), calibration=tight)
    assert slow.check("gemm").verdict == "fail" and "calibrated" in slow.check("gemm").reason


def test_calibrated_lines_widen_with_the_spread_and_fall_back_per_device():
    tight = Entry(median=700.0, spread=5.0, unit="TFLOPS")
    assert tight.lines(0.9, 0.8) == (630.0, 560.0)  # the fractions bind
    noisy = Entry(median=700.0, spread=40.0, unit="TFLOPS")
    assert noisy.lines(0.9, 0.8) == (580.0, 460.0)  # median - 3 / 6 spreads bind
    cal = Calibration(device="NVIDIA H100 80GB HBM3", mode="quick", checks={"gemm": {"bf16@4096": tight}})
    assert cal.entry("gemm", "bf16@4096", "nvidia h100 80gb  hbm3") is tight
    assert cal.entry("gemm", "bf16@4096", "NVIDIA H200") is None  # another model: datasheet fallback
    assert cal.entry("gemm", "fp8@4096", "NVIDIA H100 80GB HBM3") is None


def test_bad_calibration_files_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "elastic-diag-calibration-v1", "device": "cpu",
                               "checks": {"gemm": {"fp32@256": {"median": -1, "spread": 0}}}}))
    with pytest.raises(CalibrationError, match=r"checks\.gemm\.fp32@256: median must be > 0"):
        load_calibration(bad)
    assert diag_main(["gemm", "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diag: error: --calibration:") and "\n" not in err
    assert diag_main(["calibrate", "--output", str(tmp_path / "c.json"), "--checks", "disk"]) == 2


def test_diag_calibrate_cli_writes_the_file(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert diag_main(["calibrate", "--quick", "--repeats", "2", "--checks", "membw", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and list(data["checks"]) == ["membw"]
    (entry,) = data["checks"]["membw"].values()
    assert set(entry) == {"median", "spread", "unit", "samples"}
    assert "written to" in capsys.readouterr().out


# -- readings under load --------------------------------------------------------------


def test_gpu_throttling_only_under_load_fails_the_gemm_check(tmp_path):
    injection = {"include": str(FIXTURES / "h100-healthy.yaml"),
                 "gpu_under_load": {2: {"throttle_reasons": ["hw_thermal_slowdown"], "memory_temperature_c": 104}}}
    path = tmp_path / "under-load.yaml"
    path.write_text(json.dumps(injection))
    report = run_screen("quick", checks=["gpu", "gemm"], inject=load_injection(path), reader=NoHardware())
    assert report.check("gpu").verdict == "pass"  # the idle snapshot sees nothing
    gemm = report.check("gemm")
    assert gemm.verdict == "fail"
    assert "gpu2 under load (during): clocks throttled by hw_thermal_slowdown" in gemm.reason
    assert "HBM temperature 104 C >= 100.0" in gemm.reason
    samples = gemm.details["under_load"]
    assert [s["memory_temperature_c"] for s in samples["after"]][2] == 104 and len(samples["during"]) == 8


def test_without_gpus_the_load_monitor_reports_why():
    report = run_screen("quick", checks=["gemm"], reader=NoHardware())
    assert report.check("gemm").details["under_load"] == {"skipped": "no NVIDIA driver (test host)"}


# -- Xids and resets ------------------------------------------------------------------


LOG_WITH_RESET = """[  10.0] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.86.15
[  12.1] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, GPU has fallen off the bus.
[  13.0] NVRM: Xid (PCI:0000:19:00): 94, pid=1, Contained ECC error
[ 900.0] NVRM: GPU at PCI:0000:18:00: GPU-2f1b1c3e-0000-0000-0000-000000000000
[ 950.0] NVRM: Xid (PCI:0000:18:00): 13, pid=77, Graphics Exception
"""


def test_xids_before_a_gpu_reset_are_history():
    parsed = parse_kernel_log(LOG_WITH_RESET)
    assert kernel_log_xids(LOG_WITH_RESET) == {"18:00": [13], "19:00": [94]}
    assert parsed.before_reset == {"18:00": {79}}
    reloaded = LOG_WITH_RESET + "[1000.0] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.86.15\n"
    assert kernel_log_xids(reloaded) == {} and parse_kernel_log(reloaded).before_reset["19:00"] == {94}


def test_nvml_reader_splits_xids_at_the_reset_and_reads_hbm_temperature(monkeypatch):
    import pynvml as nv

    from diagnostics.readers import kernel_log

    _fake_nvml(monkeypatch)
    monkeypatch.setattr(kernel_log, "read_kernel_log", lambda: LOG_WITH_RESET)
    fields = {nv.NVML_FI_DEV_MEMORY_TEMP: 71, nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: 0}

    def field_values(h, ids):
        return [types.SimpleNamespace(nvmlReturn=0 if i in fields else nv.NVML_ERROR_NOT_SUPPORTED,
                                      valueType=1, value=types.SimpleNamespace(uiVal=fields.get(i, 0)))
                for i in ids]

    monkeypatch.setattr(nv, "nvmlDeviceGetFieldValues", field_values)
    d0, d1 = NvmlReader().gpus()
    assert d0["xid_events"] == [13] and d0["xid_events_before_reset"] == [79]
    assert d1["xid_events"] == [94] and d0["memory_temperature_c"] == 71 and d0["recovery_action"] == "none"
    report = run_screen(checks=["gpu"], reader=types.SimpleNamespace(
        gpus=lambda: [d0], gpus_now=lambda: [d0], driver_version=lambda: "570", ib_ports=dict, knobs=lambda s: {}),
        config={"gpu": {"expected_count": 1}})
    gpu = report.check("gpu")
    assert "79" not in gpu.reason and gpu.details["xid_before_reset"] == {"0": [79]}


def test_nvlink_counters_fall_back_to_field_values(monkeypatch):
    import pynvml as nv

    _fake_nvml(monkeypatch)

    def unsupported(*_a):
        raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)

    def field_values(h, ids):
        out = []
        for spec in ids:
            fid, link = spec if isinstance(spec, tuple) else (spec, None)
            value = {nv.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: 40 + (link or 0),
                     nv.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: 0}.get(fid)
            if fid == nv.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_L0 + 1:  # per-link field of link 1 only
                value = 5
            out.append(types.SimpleNamespace(nvmlReturn=0 if value is not None else nv.NVML_ERROR_NOT_SUPPORTED,
                                             valueType=3, value=types.SimpleNamespace(ullVal=value or 0)))
        return out

    monkeypatch.setattr(nv, "nvmlDeviceGetNvLinkErrorCounter", unsupported)
    monkeypatch.setattr(nv, "nvmlDeviceGetFieldValues", field_values)
    links = NvmlReader().gpus()[0]["nvlink"]
    assert [(lk["crc_errors"], lk["replay_errors"]) for lk in links[:3]] == [(40, 0), (41, 0), (42, 0)]
    assert links[1]["recovery_errors"] == 5 and links[0]["recovery_errors"] is None


# -- IB fabric allowlist --------------------------------------------------------------


def test_ib_ports_outside_the_training_fabric_are_not_judged(tmp_path):
    down = {**HEALTHY_PORT, "state": "1: DOWN", "phys_state": "3: Disabled"}
    root = make_ib_tree(tmp_path, {"mlx5_0": {"1": HEALTHY_PORT}, "mlx5_1": {"1": HEALTHY_PORT},
                                   "mlx5_bond_0": {"1": down}})
    reader = InjectedReader(SysfsReader(root), {})
    assert run_screen(checks=["ib"], reader=reader).check("ib").verdict == "fail"
    ib = run_screen(checks=["ib"], reader=reader, config={"ib": {"ports": ["mlx5_[0-9]/1"]}}).check("ib")
    assert ib.verdict == "pass" and ib.value == "2/2 ports up" and ib.details["ignored"] == ["mlx5_bond_0/1"]
    none = run_screen(checks=["ib"], reader=reader, config={"ib": {"ports": ["ib9/*"]}}).check("ib")
    assert none.verdict == "skip" and "mlx5_0/1" in none.reason
