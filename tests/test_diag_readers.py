"""Readers: sysfs IB trees, the NVML reader on a driverless host, YAML injection overlays."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnostics.readers import (
    INJECT_ENV,
    GpuUnavailable,
    HardwareReader,
    HostReader,
    InjectedReader,
    InjectionError,
    NvmlReader,
    SysfsReader,
    default_reader,
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
