"""End to end: launcher + embedded etcd + agents + real torchrun + FSDP2 trainer on gloo.

Every test here runs the real stack; they share one uninterrupted baseline run
whose final checksum the fault runs must reproduce bitwise.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from elastic.common.events import read_run_events
from tests.launch_helpers import (
    kill_quietly, run_pids, start_launcher, wait_all_gone, wait_for_event, write_run_config,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def finish(proc, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


@pytest.fixture
def baseline(baseline_run) -> dict:
    return baseline_run


@pytest.fixture
def subprocess_env_module(subprocess_env_session) -> dict[str, str]:
    return subprocess_env_session


def test_uninterrupted_run_completes(baseline):
    s = baseline["summary"]
    assert s["last_step"] == 16 and s["steps_target"] == 16
    assert s["nodes"] == {"node0": 0, "node1": 0}
    assert s["restarts"] == 0 and s["failures"] == []
    assert s["checkpoints_committed"] == [4, 8, 12, 16]
    on_disk = sorted(p.name for p in (baseline["run_dir"] / "checkpoints").iterdir())
    assert on_disk == ["step-00000012", "step-00000016"]  # keep_last=2, nothing half-written left
    assert len(s["final_checksum"]) == 64
    assert (baseline["run_dir"] / "final_checksum.txt").read_text().strip() == s["final_checksum"]
    assert "16/16 steps" in baseline["out"]
    kinds = [e["kind"] for e in read_run_events(baseline["run_dir"])]
    for kind in ("launcher.start", "agent.state", "agent.first_step", "trainer.start", "trainer.step",
                 "checkpoint.committed", "trainer.done", "agent.exit", "launcher.etcd_stopped"):
        assert kind in kinds, kind
    # The run report's loss curve, and every agent served metrics.
    assert s["loss_png"] == str(baseline["run_dir"] / "loss.png")
    assert (baseline["run_dir"] / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert kinds.count("agent.metrics_started") == 2


def test_sigkill_worker_recovers_with_identical_weights(baseline, tmp_path, subprocess_env_module):
    proc = start_launcher(write_run_config(tmp_path), subprocess_env_module)
    run_dir = tmp_path / "run"
    victim = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["source"] == "trainer/rank1"
                            and e["step"] >= 6, timeout=120, proc=proc)
    victim_node = next(e["node"] for e in read_run_events(run_dir)
                       if e["kind"] == "trainer.start" and e["pid"] == victim["pid"])
    os.kill(victim["pid"], signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["last_step"] == 16
    assert s["restarts_counted"] == 1, s  # only the killed node's failure counts against a budget
    assert [(f["node"], f["failure_kind"]) for f in s["failures"]] == [(f"agent/{victim_node}", "worker_signal")]
    resumed = [e for e in read_run_events(run_dir) if e["kind"] == "trainer.start" and e["resumed"]]
    assert resumed and all(e["step"] >= 4 for e in resumed)  # resumed from a checkpoint, not from scratch
    assert s["final_checksum"] == baseline["summary"]["final_checksum"]  # bitwise equal to the fault-free run


def _assert_no_orphans(run_dir: Path, proc, how: int) -> None:
    wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["step"] >= 3, timeout=120, proc=proc)
    pids = run_pids(run_dir)
    assert pids["etcd"] and len(pids["agent"]) == 2 and len(pids["torchrun"]) == 2 and len(pids["trainer"]) == 2
    everything = set().union(*pids.values()) - {proc.pid}
    os.kill(proc.pid, how)
    try:
        proc.communicate(timeout=60)
        survivors = wait_all_gone(everything, timeout=30)
    finally:
        kill_quietly(everything)
    assert not survivors, f"orphans left: { {k: v & survivors for k, v in pids.items()} }"
    return proc.returncode


def test_launcher_sigterm_stops_everything(tmp_path, subprocess_env_module):
    proc = start_launcher(write_run_config(tmp_path, steps=200), subprocess_env_module)
    rc = _assert_no_orphans(tmp_path / "run", proc, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted_by_signal"] == signal.SIGTERM


def test_launcher_sigkill_leaves_no_orphans(tmp_path, subprocess_env_module):
    proc = start_launcher(write_run_config(tmp_path, steps=200), subprocess_env_module)
    _assert_no_orphans(tmp_path / "run", proc, signal.SIGKILL)
