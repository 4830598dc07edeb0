"""Failed checkpoint saves are never silent: the summary lists them with the last durable step and the
unsaved steps, a run that ends with unsaved work exits 3 (not 0), and with the default policy saves
that keep failing stop the run with the reason.  Real launches; the disk fills up through the run's
fault files (``ckpt_write_error``: the checkpoint writer gets ENOSPC part-way through a shard)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.common.events import read_run_events
from elastic.worker.faults import write_fault
from tests.launch_helpers import write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _launch(config: Path, env: dict, *args: str) -> tuple[int, str, dict]:
    proc = subprocess.run([sys.executable, "-m", "launch", str(config), *args], env=env, capture_output=True,
                          text=True, timeout=240)
    summary = json.loads((config.parent / "run" / "summary.json").read_text())
    return proc.returncode, proc.stdout + proc.stderr, summary


def _disk_full_from(run_dir: Path, step: int) -> None:
    write_fault(run_dir, "disk-full", {"kind": "ckpt_write_error", "from_step": step, "once": False})


def test_warn_policy_trains_on_but_the_run_does_not_look_clean(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="1", steps=12, interval=3, step_sleep=0.0,
                              checkpoint={"on_save_failure": "warn", "max_consecutive_failures": 2})
    _disk_full_from(tmp_path / "run", 6)
    rc, out, s = _launch(config, subprocess_env)
    assert rc == 3, out
    assert s["last_step"] == 12 and s["checkpoints_committed"] == [3]
    assert [f["step"] for f in s["failed_saves"]] == [6, 9, 12] and {f["errno"] for f in s["failed_saves"]} == {"ENOSPC"}
    assert s["last_durable_step"] == 3 and s["unsaved_steps"] == 9
    assert "failed saves: steps 6, 9, 12 (ENOSPC)" in out
    assert "UNSAVED: 9 steps after the last durable checkpoint (step 3)" in out
    failing = [e for e in read_run_events(tmp_path / "run") if e["kind"] == "checkpoint.failing"]
    assert [e["failed_steps"] for e in failing] == [[6, 9]]


def test_saves_that_keep_failing_stop_the_run_with_the_reason(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="2", steps=40, interval=3, step_sleep=0.02,
                              checkpoint={"max_consecutive_failures": 2})
    _disk_full_from(tmp_path / "run", 6)
    rc, out, s = _launch(config, subprocess_env)
    assert rc == 1, out
    assert s["last_step"] == 12 and s["last_durable_step"] == 3 and s["unsaved_steps"] == 9
    assert {6, 9} <= {f["step"] for f in s["failed_saves"]}
    assert set(s["stop_reasons"]) == {"node0", "node1"}
    for reason in s["stop_reasons"].values():
        assert "checkpoint.on_save_failure=stop: 2 checkpoint saves failed in a row (steps 6, 9; last error: " \
            in reason, reason
        assert "[ENOSPC]); last committed step: 3" in reason
    assert "  node0 gave_up: " in out and "  node1 gave_up: " in out  # the launcher says why, for every node
    assert s["restarts"] == 0  # stopped on purpose, not restarted into the same full disk
