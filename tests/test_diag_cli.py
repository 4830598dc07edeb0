"""The `diag` CLI (exit codes, table, JSON report) and the preflight API the agent calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diagnostics.cli import main
from diagnostics.preflight import exclude_if_failed, run_screen
from diagnostics.thresholds import load_thresholds
from elastic.control.runstate import Exclusions
from elastic.common.config import ConfigError
from elastic.control.store import EtcdStore

FIXTURES = Path(__file__).parent / "fixtures" / "diag"
REPO = Path(__file__).resolve().parents[1]
HEALTHY = str(FIXTURES / "h100-healthy.yaml")
BAD_GPU = str(FIXTURES / "h100-gpu3-remap-pending.yaml")


def diag(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diagnostics.cli", *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_burnin_passes_and_writes_json(tmp_path, capsys, etcd_endpoint):
    # In-process (torch is already imported here); the subprocess tests below cover the entry point.
    out = tmp_path / "report.json"
    code = main(["burnin", "--quick", "--json", str(out), "--etcd-endpoint", etcd_endpoint,
                 "--ckpt-dir", str(tmp_path)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "overall: PASS" in stdout or "overall: WARN" in stdout
    assert "skipped: no NVIDIA driver" in stdout and "skipped: no IB devices" in stdout
    report = json.loads(out.read_text())
    assert set(report) == {"host", "ts", "mode", "verdict", "checks", "duration_s"}
    assert report["mode"] == "quick" and report["verdict"] in ("pass", "warn")
    names = [c["name"] for c in report["checks"]]
    assert names == ["gpu", "nvlink", "ib", "gemm", "membw", "collective", "disk", "etcd"]
    for c in report["checks"]:
        assert {"name", "verdict", "value", "threshold", "reason", "details"} <= set(c)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["gpu"]["verdict"] == "skip"
    assert by_name["gemm"]["verdict"] in ("pass", "warn") and by_name["gemm"]["value"]["fp32"] > 0
    assert by_name["collective"]["value"] > 0
    assert by_name["etcd"]["verdict"] == "pass" and by_name["etcd"]["details"]["members"] == 1


def test_cli_single_check_fails_with_exit_1(subprocess_env):
    proc = diag("gpu", "--inject", BAD_GPU, env=subprocess_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "gpu3: row remap pending" in proc.stdout


def test_cli_bad_config_exits_2_via_subprocess(tmp_path, subprocess_env):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("disk: {fail_mbps: 500, warn_mbps: 100}\n")
    proc = diag("disk", "--config", str(cfg), env=subprocess_env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"diag: error: --config {cfg}: disk.fail_mbps: must not exceed warn_mbps"
    assert proc.stdout == ""


def test_cli_injection_from_env_var(subprocess_env):
    proc = diag("gpu", env={**subprocess_env, "ELASTIC_DIAG_INJECT": HEALTHY})
    assert proc.returncode == 0 and "8x NVIDIA H100 80GB HBM3" in proc.stdout


@pytest.mark.parametrize(
    "args, config, fragment",
    [
        (["burnin", "--bogus"], None, "unrecognized arguments: --bogus"),
        (["burnin", "--quick", "--full"], None, "not allowed with argument"),
        (["gpu", "--config", "{cfg}"], "gemm:\n  fail_fraction: fast\n", "gemm.fail_fraction: expected a number"),
        (["gpu", "--config", "{cfg}"], "gpu:\n  temprature_warn_c: 80\n", "gpu.temprature_warn_c: unknown key"),
        (["gpu", "--config", "{missing}"], None, "--config: no such file"),
        (["gpu", "--inject", "{cfg}"], "gpu: {0: {ecc: 1}}\n", "--inject:"),
        (["etcd", "--etcd-endpoint", "host:notaport"], None, "--etcd-endpoint: bad etcd endpoint"),
    ],
)
def test_cli_usage_and_config_errors_exit_2(tmp_path, capsys, args, config, fragment):
    cfg = tmp_path / "cfg.yaml"
    if config is not None:
        cfg.write_text(config)
    argv = [a.format(cfg=cfg, missing=tmp_path / "nope.yaml") for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("gpu", "gemm", "membw", "nvlink", "ib", "collective", "disk", "etcd"):
        assert any(line.startswith(name) for line in out.splitlines())
    assert "alias: nccl" in out


def test_cli_nccl_alias_runs_collective(capsys):
    assert main(["nccl"]) == 0
    assert "collective" in capsys.readouterr().out


def test_example_thresholds_file_loads():
    t = load_thresholds(REPO / "examples" / "diag-thresholds.yaml")
    assert t.model_for("NVIDIA L40S").bf16_tflops == 362.0
    assert t.model_for("NVIDIA H200").membw_gbps == 4800.0  # defaults kept
    with pytest.raises(ConfigError, match="fail_fraction"):
        load_thresholds({"gemm": {"warn_fraction": 0.3, "fail_fraction": 0.6}})


# -- preflight API ------------------------------------------------------------------


def test_run_screen_quick_passes(tmp_path):
    # Behaviour only: how long a screen takes is for benchmarks/, not for a test on a shared host.
    report = run_screen("quick", ckpt_dir=tmp_path)
    assert report.verdict in ("pass", "warn"), report.failures
    assert report.failures == []
    assert {c.name for c in report.checks if c.verdict == "skip"} == {"gpu", "nvlink", "ib", "etcd"}
    d = report.to_dict()
    assert d["verdict"] == report.verdict and len(d["checks"]) == 8


def test_run_screen_selection_and_failures():
    report = run_screen(checks=["gpu", "nccl"], inject=BAD_GPU)
    assert [c.name for c in report.checks] == ["gpu", "collective"]
    assert report.verdict == "fail"
    assert report.failures == ["gpu: gpu3: row remap pending (1); gpu3: critical Xid 79"]


def test_skips_alone_do_not_fail_but_are_listed():
    report = run_screen(checks=["gpu", "ib"])
    assert report.verdict == "pass"
    assert report.skipped == ["gpu: " + report.check("gpu").reason, "ib: skipped: no IB devices"]


def test_exclusion_record_written_to_real_etcd(etcd_endpoint):
    store = EtcdStore(etcd_endpoint)
    prefix = "/elastic/runs/r1"
    bad = run_screen(checks=["gpu"], inject={"gpu_devices": [{"name": "NVIDIA H100 80GB HBM3", "remap_failed": 1}],
                                             "gpu": {0: {"xid_events": [48]}}})
    assert exclude_if_failed(bad, store, prefix, "node3", ttl_s=600) is True
    record = Exclusions(store, prefix).get("node3")  # the agent's reader accepts it
    assert record is not None
    assert record["by"] == "diag" and record["reason"].startswith("diag: gpu: ")
    assert "row remap failed" in record["reason"] and "critical Xid 48" in record["reason"]
    assert record["until"] == pytest.approx(record["ts"] + 600)
    assert record["report"]["verdict"] == "fail" and record["report"]["failures"] == bad.failures
    stored = json.loads(store.get(f"{prefix}/diag/node3").value)
    assert stored["verdict"] == "fail" and stored["checks"][0]["name"] == "gpu"

    good = run_screen(checks=["gpu"], inject=HEALTHY)
    assert exclude_if_failed(good, store, prefix, "node4", ttl_s=600) is False
    assert Exclusions(store, prefix).get("node4") is None
    assert json.loads(store.get(f"{prefix}/diag/node4").value)["verdict"] == "pass"


def test_cli_json_to_stdout_keeps_table_on_stderr(capsys):
    assert main(["gpu", "--inject", HEALTHY, "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "pass"
    assert "overall: PASS" in captured.err


def test_thresholds_model_merge_and_errors():
    t = load_thresholds({"models": {"H100": {"bf16_tflops": 900.0}}})
    h100 = t.model_for("NVIDIA H100 80GB HBM3")
    assert h100.bf16_tflops == 900.0 and h100.membw_gbps == 3350.0  # other fields kept
    assert t.model_for("NVIDIA A100-SXM4-80GB").bf16_tflops == 312.0  # other models kept
    with pytest.raises(ConfigError, match=r"^models\.B200\.names: must list the exact NVML device name"):
        load_thresholds({"models": {"B200": {"bf16_tflops": 2250.0}}})
    with pytest.raises(ConfigError, match=r"^models\.H100\.membw_gbps: must be positive"):
        load_thresholds({"models": {"H100": {"membw_gbps": -1.0}}})
    with pytest.raises(ConfigError, match=r"^collective\.cpu_ranks: must be >= 2"):
        load_thresholds({"collective": {"cpu_ranks": 1}})
