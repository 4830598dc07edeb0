"""`chaos soak`: seeded random faults at one run of the DiT job, goodput accounted, weights replayed.

The short soak (slow tier, about a minute and a half here) fires faults for 25 s at a 2-node run of
``examples/tiny.yaml``: it must recover from every one, end bitwise equal to a fault-free replay
that skips the same batches, and its goodput parts must add up to its wall time.  The 10-minute,
4-node soak the README's test tiers name and docs/chaos.md shows an operator is the ``soak``-marked
test (``pytest -m soak``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.soak import PARTS

REPO = Path(__file__).resolve().parents[1]


def _soak(out: Path, env: dict, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chaos", "soak", "--config", str(REPO / "examples" / "tiny.yaml"),
                           "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _check_report(out: Path, proc: subprocess.CompletedProcess) -> dict:
    report = json.loads((out / "soak.json").read_text())
    assert proc.returncode == 0 and report["ok"], (report["broken"], proc.stdout[-3000:], proc.stderr[-2000:])
    goodput = json.loads((out / "goodput.json").read_text())
    assert goodput == report["goodput"]
    total = sum(goodput[p] for p in PARTS)
    assert abs(total - goodput["wall_s"]) <= 0.02, (total, goodput)  # the parts add up to the wall time
    assert all(goodput[p] >= 0 for p in PARTS) and 0 < goodput["goodput"] < 1
    assert report["injected"] >= 1 and report["recovered"] == report["injected"]
    assert sum(k["injected"] for k in report["per_kind"].values()) == report["injected"]
    names = {i["name"]: i for i in report["soak"]["result"]["invariants"]}
    assert names["weights_bitwise_equal"]["ok"] and names["goodput_accounted"]["ok"]
    assert names["every_fault_recovered"]["ok"] and names["checkpoints_intact"]["ok"]
    assert report["soak"]["result"]["final_checksum"] == report["replay_checksum"]
    assert "goodput" in proc.stdout and "recovered" in proc.stdout
    assert "data:image/png;base64," in (out / "report.html").read_text()
    return report


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_soak_recovers_every_fault_and_accounts_goodput(tmp_path, subprocess_env):
    out = tmp_path / "soak"
    proc = _soak(out, subprocess_env, "--nodes", "2", "--duration", "25s", "--mtbf", "8s", "--seed", "3",
                 "--faults", "kill_worker,nan,corrupt_checkpoint,etcd_outage", "--steps", "200",
                 "--set", "agent.preflight.enabled=false", timeout=840)
    report = _check_report(out, proc)
    assert set(report["per_kind"]) <= {"kill_worker", "nan", "corrupt_checkpoint", "etcd_outage"}


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_ten_minute_soak_on_four_nodes(tmp_path, subprocess_env):
    """What the docs show (docs/chaos.md): 4 nodes, the DiT tiny job, faults every ~60 s for 10 minutes."""
    out = tmp_path / "soak"
    proc = _soak(out, subprocess_env, "--duration", "10m", "--mtbf", "60s", timeout=3500)
    report = _check_report(out, proc)
    assert report["nodes"] == 4
