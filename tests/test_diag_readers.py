"""Readers: sysfs IB trees, the NVML reader on a driverless host, YAML injection overlays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.readers import (
    GPU_FIELDS,
    INJECT_ENV,
    GpuUnavailable,
    HardwareReader,
    HostReader,
    InjectedReader,
    InjectionError,
    NvmlReader,
    SysfsReader,
    default_reader,
    kernel_log_xids,
    load_injection,
    throttle_names,
)

FIXTURES = Path(__file__).parent / "fixtures" / "diag"


def make_ib_tree(root: Path, ports: dict[str, dict[str, dict]]) -> Path:
    """Write a /sys/class/infiniband look-alike: {dev: {port: {file: text, counters: {name: n}}}}."""
    for dev, per_port in ports.items():
        for port, files in per_port.items():
            pdir = root / "class" / "infiniband" / dev / "ports" / port
            (pdir / "counters").mkdir(parents=True)
            for name, text in files.items():
                if name == "counters":
                    for cname, n in text.items():
                        (pdir / "counters" / cname).write_text(f"{n}\n")
                else:
                    (pdir / name).write_text(f"{text}\n")
    return root


HEALTHY_PORT = {
    "state": "4: ACTIVE",
    "phys_state": "5: LinkUp",
    "rate": "400 Gb/sec (4X NDR)",
    "link_layer": "InfiniBand",
    "counters": {"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0},
}


class NoHardware:
    """A host with nothing: no driver, no IB."""

    def gpus(self):
        raise GpuUnavailable("no NVIDIA driver (test host)")

    def gpus_now(self):
        return self.gpus()

    def driver_version(self):
        return None

    def ib_ports(self):
        return {}

    def knobs(self, section):
        return {}


def test_sysfs_reader_parses_ports_and_counters(tmp_path):
    root = make_ib_tree(tmp_path, {
        "mlx5_0": {"1": HEALTHY_PORT},
        "mlx5_1": {"1": {**HEALTHY_PORT, "state": "1: DOWN", "phys_state": "3: Disabled",
                         "counters": {"link_downed": 7, "symbol_error": 3}}},
    })
    ports = SysfsReader(root).ib_ports()
    assert ports["mlx5_0"]["1"] == {
        "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 400.0, "link_layer": "InfiniBand",
        "counters": {"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0},
    }
    assert ports["mlx5_1"]["1"]["state"] == "DOWN"
    assert ports["mlx5_1"]["1"]["phys_state"] == "Disabled"
    assert ports["mlx5_1"]["1"]["counters"] == {"link_downed": 7, "symbol_error": 3}


def test_sysfs_reader_without_infiniband_dir_is_empty(tmp_path):
    assert SysfsReader(tmp_path).ib_ports() == {}


def test_nvml_reader_raises_typed_error_without_driver():
    # This host has no NVIDIA driver; on a GPU host the reader must return devices instead.
    reader = NvmlReader()
    try:
        devices = reader.gpus()
    except GpuUnavailable as exc:
        assert "no NVIDIA driver" in str(exc)
    else:
        assert devices and all("ecc_uncorrected_volatile" in d for d in devices)


def test_readers_satisfy_protocol():
    for r in (NvmlReader(), SysfsReader(), HostReader(), InjectedReader(NoHardware(), {})):
        assert isinstance(r, HardwareReader)


def test_throttle_bitmask_names():
    assert throttle_names(0x1 | 0x8) == ["gpu_idle", "hw_slowdown"]
    assert throttle_names(0x40 | 0x4000) == ["hw_thermal_slowdown", "unknown_0x4000"]


def test_injection_replaces_device_list_and_overrides_one_device():
    inj = load_injection(FIXTURES / "h100-healthy.yaml")
    inj["gpu"] = {2: {"ecc_uncorrected_volatile": 3, "xid_events": [79]}}
    inj["nvlink"] = {1: {5: {"state": "down", "crc_errors": 9}}}
    reader = InjectedReader(NoHardware(), inj)
    devices = reader.gpus()
    assert len(devices) == 8 and {d["name"] for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert devices[2]["ecc_uncorrected_volatile"] == 3 and devices[2]["xid_events"] == [79]
    assert devices[3]["ecc_uncorrected_volatile"] == 0
    assert devices[1]["nvlink"][5] == {"link": 5, "state": "down", "replay_errors": 0, "recovery_errors": 0, "crc_errors": 9}
    # YAML anchors share one link list; the override must touch only GPU 1.
    assert devices[0]["nvlink"][5]["state"] == "up"
    assert reader.driver_version() == "570.86.15"


def test_injection_overrides_ib_ports_of_the_base(tmp_path):
    root = make_ib_tree(tmp_path, {"mlx5_0": {"1": HEALTHY_PORT, "2": HEALTHY_PORT}})
    reader = InjectedReader(SysfsReader(root), {"ib": {"mlx5_0": {1: {"state": "DOWN", "counters": {"link_downed": 4}}}}})
    ports = reader.ib_ports()
    assert ports["mlx5_0"]["1"]["state"] == "DOWN"
    assert ports["mlx5_0"]["1"]["counters"]["link_downed"] == 4
    assert ports["mlx5_0"]["1"]["counters"]["symbol_error"] == 0
    assert ports["mlx5_0"]["2"]["state"] == "ACTIVE"


def test_include_merges_fault_file_over_healthy_base():
    inj = load_injection(FIXTURES / "h100-gpu3-remap-pending.yaml")
    devices = InjectedReader(NoHardware(), inj).gpus()
    assert devices[3]["remap_pending"] == 1 and devices[3]["xid_events"] == [79]
    assert devices[2]["remap_pending"] == 0


@pytest.mark.parametrize(
    "injection, fragment",
    [
        ({"gpuz": {}}, "gpuz: unknown key"),
        ({"gpu": {0: {"ecc_uncorected_volatile": 1}}}, "gpu.0.ecc_uncorected_volatile: unknown reading"),
        ({"gpu": {"zero": {}}}, "gpu.zero: device index must be an integer"),
        ({"ib": {"mlx5_0": {1: {"stat": "DOWN"}}}}, "ib.mlx5_0.1.stat: unknown reading"),
        ({"gemm": 3}, "gemm: expected a mapping"),
    ],
)
def test_bad_injection_names_the_key(injection, fragment):
    with pytest.raises(InjectionError, match=fragment.replace(".", r"\.")):
        InjectedReader(NoHardware(), injection, source="f.yaml")


def test_override_of_missing_device_is_an_error():
    with pytest.raises(InjectionError, match="gpu.9: no such device"):
        InjectedReader(NoHardware(), {"gpu_devices": [{"name": "NVIDIA H100"}], "gpu": {9: {"temperature_c": 1}}}).gpus()


def test_unreadable_and_invalid_injection_files(tmp_path):
    with pytest.raises(InjectionError, match="cannot read"):
        load_injection(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu: [unclosed\n")
    with pytest.raises(InjectionError, match="not valid YAML"):
        load_injection(bad)


def test_env_var_selects_injection_file(tmp_path, monkeypatch):
    path = tmp_path / "inj.yaml"
    path.write_text("gemm: {tflops_scale: 0.25}\n")
    monkeypatch.setenv(INJECT_ENV, str(path))
    assert default_reader().knobs("gemm") == {"tflops_scale": 0.25}
    monkeypatch.delenv(INJECT_ENV)
    assert default_reader().knobs("gemm") == {}


# -- NvmlReader against a faked NVML ---------------------------------------------------
# The real pynvml module with its C-calling functions replaced (monkeypatch refuses names
# that pynvml does not have, so this also pins the API names the reader relies on).


def _fake_nvml(monkeypatch, count=2):
    import types

    import pynvml as nv

    def not_supported(*_a):
        raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)

    events = [types.SimpleNamespace(device=1, eventData=79)]

    def event_wait(_set, _ms):
        if events:
            return events.pop()
        raise nv.NVMLError(nv.NVML_ERROR_TIMEOUT)

    ecc = {(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC): 2,
           (nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC): 5,
           (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC): 2,
           (nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC): 40}
    fns = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlSystemGetDriverVersion": lambda: "570.86.15",
        "nvmlDeviceGetCount": lambda: count,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
        "nvmlDeviceGetPciInfo": lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0"),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(total=80 << 30, used=3 << 20),
        "nvmlDeviceGetEccMode": lambda h: [1, 1],
        "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: ecc[(kind, counter)] if h == 1 else 0,
        "nvmlDeviceGetRetiredPages": not_supported,  # H100 remaps rows instead
        "nvmlDeviceGetRetiredPagesPendingStatus": not_supported,
        "nvmlDeviceGetRemappedRows": lambda h: (0, 0, 1 if h == 1 else 0, 0),
        "nvmlDeviceGetClockInfo": lambda h, clk: 1980 if clk == nv.NVML_CLOCK_SM else 2619,
        "nvmlDeviceGetMaxClockInfo": lambda h, clk: 1980 if clk == nv.NVML_CLOCK_SM else 2619,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x1 | (0x8 if h == 1 else 0),
        "nvmlDeviceGetTemperature": lambda h, sensor: 33,
        "nvmlDeviceGetPowerUsage": lambda h: 71500,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700000,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 1,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
        "nvmlDeviceGetFieldValues": lambda h, ids: [
            types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=2 if h == 1 else 0))],
        "nvmlDeviceGetNvLinkState": lambda h, link: (link != 3) if link < 18 else not_supported(),
        "nvmlDeviceGetNvLinkErrorCounter": lambda h, link, kind: 7 if (link, kind) == (2, nv.NVML_NVLINK_ERROR_DL_CRC_FLIT) else 0,
        "nvmlEventSetCreate": lambda: "set",
        "nvmlDeviceRegisterEvents": lambda h, kinds, s: None,
        "nvmlEventSetWait": event_wait,
        "nvmlEventSetFree": lambda s: None,
    }
    for name, fn in fns.items():
        monkeypatch.setattr(nv, name, fn)
    from diagnostics import readers

    monkeypatch.setattr(readers.kernel_log, "read_kernel_log", lambda: (
        "[  12.1] NVRM: Xid (PCI:0000:18:00): 63, pid=1234, Row Remapper: New row marked for remapping\n"
        "[  13.0] unrelated line\n"))


def test_nvml_reader_maps_every_reading(monkeypatch):
    _fake_nvml(monkeypatch)
    reader = NvmlReader(xid_window_s=0.05)
    devices = reader.gpus()
    assert reader.driver_version() == "570.86.15"
    assert [d["index"] for d in devices] == [0, 1]
    d0, d1 = devices
    assert set(d0) == set(GPU_FIELDS)
    assert d0["name"] == "NVIDIA H100 80GB HBM3" and d0["pci_bus_id"] == "00000000:18:00.0"
    assert d0["memory_total_mib"] == 80 * 1024 and d0["ecc_enabled"] is True
    assert (d1["ecc_uncorrected_volatile"], d1["ecc_corrected_volatile"], d1["ecc_corrected_aggregate"]) == (2, 5, 40)
    assert d0["retired_pages_sbe"] is None and d0["retired_pages_pending"] is None  # not supported -> None
    assert d1["remap_pending"] == 1 and d0["remap_pending"] == 0
    assert d1["throttle_reasons"] == ["gpu_idle", "hw_slowdown"]
    assert d0["power_w"] == 71.5 and d0["power_limit_w"] == 700.0
    assert (d0["pcie_link_width"], d0["pcie_link_gen"], d0["pcie_link_gen_max"]) == (16, 1, 5)
    assert d0["recovery_action"] == "none" and d1["recovery_action"] == "node_reboot"
    assert len(d0["nvlink"]) == 18 and d0["nvlink"][3]["state"] == "down" and d0["nvlink"][2]["crc_errors"] == 7
    # Xid 79 arrived on the event set for GPU 1; Xid 63 is in the kernel log for bus 18 (GPU 0).
    assert d1["xid_events"] == [79] and d0["xid_events"] == [63]
    assert d0["xid_kernel_log"] is True


def test_gpu_check_over_faked_nvml(monkeypatch):
    from diagnostics.preflight import run_screen

    _fake_nvml(monkeypatch)
    report = run_screen(checks=["gpu", "nvlink"], reader=HostReader(nvml=NvmlReader(xid_window_s=0.05)))
    gpu = report.check("gpu")
    assert gpu.verdict == "fail"
    for fragment in ("2 GPUs, expected 8", "gpu1: ECC uncorrected volatile 2 > 0", "gpu1: row remap pending",
                     "hw_slowdown", "critical Xid 79", "recovery action node_reboot"):
        assert fragment in json.dumps(gpu.details["findings"]) + gpu.reason, fragment
    assert "warn: non-critical Xid 63" in gpu.details["findings"]["0"]
    nvlink = report.check("nvlink")
    assert nvlink.verdict == "fail" and "17/18 links up (down: 3)" in nvlink.reason


def test_kernel_log_xid_parsing():
    text = ("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', GPU has fallen off the bus.\n"
            "NVRM: Xid (PCI:0000:3b:00): 79, again\nNVRM: Xid (PCI:0000:5E:00): 13, Graphics Exception\n")
    assert kernel_log_xids(text) == {"3b:00": [79], "5e:00": [13]}
    assert kernel_log_xids("nothing here") == {}
