"""benchmarks/gpu_validate.py runs on a CPU host: the checks that can run there pass, the GPU-only
sections say why they were skipped, and ``--json PATH`` writes the same object it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_validate_runs_on_cpu_and_writes_the_json(tmp_path):
    out = tmp_path / "validate.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_validate.py", "--json", str(out), "--steps", "6"],
                          cwd=REPO, capture_output=True, text=True, timeout=560, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["t_dtype_at_embedding"] == "float32" and result["t_exact"] is True
    assert set(result["fp8_max_rel_err"]) == {"tensorwise", "rowwise"}
    assert all(0 < err < 0.08 for err in result["fp8_max_rel_err"].values())
    for section in ("scaled_mm", "linear_timing", "snapshot_copy", "nccl_abort", "fsdp_rebuild", "spare_cost"):
        assert "CUDA" in result["skipped"][section] and section not in result
    assert result["collectives"]["backend"] == "cpu:gloo" and result["collectives"]["ok"]
    assert result["dit_step"]["ok"] and set(result["dit_step"]["loss_rel_diff"]) == {"tensorwise", "rowwise"}
    kill = result["kill_resume"]
    assert kill["deterministic"]["killed_exit_code"] == 137 and kill["deterministic"]["equal"]
    assert kill["default"]["equal"]  # a CPU run is deterministic without the flag too
    burnin = result["diag_burnin"]["report"]
    assert {c["name"] for c in burnin["checks"]} >= {"gpu", "gemm", "membw", "collective"}
    assert result["environment"]["device"] == "cpu" and result["ok"] is True
