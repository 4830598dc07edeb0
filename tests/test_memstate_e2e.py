"""End to end: a SIGKILLed worker restarts on its surviving node and loads from the agent's memory."""

from __future__ import annotations

import json
import os
import signal

import pytest

from elastic.common.events import read_run_events
from tests.launch_helpers import start_launcher, wait_for_event, write_run_config


# Long tier (pytest -m soak): checkpoint.memory is off by default; its cache protocol has unit tests
# (test_memstate.py) and restores from agent memory are test_inprocess_e2e.py's.
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkilled_worker_resumes_from_memory_bitwise(baseline_run, tmp_path, subprocess_env_session):
    # The checkpoint-level fast path serves the epoch restart: in-process recovery (which restores
    # from per-step snapshots and never reloads a checkpoint) is off here.
    config = write_run_config(tmp_path, checkpoint={"memory": {"enabled": True}},
                              agent={"max_restarts": 3, "term_grace_s": 2, "preflight": {"enabled": False},
                                     "inprocess": {"enabled": False}})
    proc = start_launcher(config, subprocess_env_session)
    run_dir = tmp_path / "run"
    # Wait until rank 1's state of a committed step sits in its agent's memory, then kill it.
    pushed = wait_for_event(run_dir, lambda e: e["kind"] == "checkpoint.memory_pushed"
                            and e["source"] == "trainer/rank1", timeout=120, proc=proc)
    victim = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["source"] == "trainer/rank1"
                            and e["step"] > pushed["step"] + 1, timeout=60, proc=proc)
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    events = read_run_events(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts_counted"] == 1, summary
    loads = [e for e in events if e["kind"] == "checkpoint.loaded"]
    assert loads and {e["loaded_from"] for e in loads} == {"memory"}, loads
    assert len(loads) == 2 and all(e["step"] >= pushed["step"] for e in loads)  # both ranks of the restart
    assert all(e["load_s"] < 5 for e in loads)
    assert not [e for e in events if e["kind"] == "checkpoint.memory_miss"]
    assert summary["final_checksum"] == baseline_run["summary"]["final_checksum"]
