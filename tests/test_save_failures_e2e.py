"""Failed checkpoint saves are never silent: the summary lists them with the last durable step and the
unsaved steps, a run that ends with unsaved work exits 3 (not 0), and with the default policy saves
that keep failing stop the run with the reason, within a step of the failure that ended the streak,
and ``elastic-launch`` exits 88 (a script tells a full disk from a spent restart budget).  Real
launches; the disk fills up through the run's fault files (``ckpt_write_error``: the checkpoint
writer gets ENOSPC part-way through a shard)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage
from elastic.common.events import EventLog, read_run_events
from elastic.common.exits import EXIT_CHECKPOINT
from elastic.worker.faults import write_fault
from tests.launch_helpers import write_run_config

pytestmark = [pytest.mark.timeout(300)]


def _launch(config: Path, env: dict, *args: str) -> tuple[int, str, dict]:
    proc = subprocess.run([sys.executable, "-m", "launch", str(config), *args], env=env, capture_output=True,
                          text=True, timeout=240)
    summary = json.loads((config.parent / "run" / "summary.json").read_text())
    return proc.returncode, proc.stdout + proc.stderr, summary


def _disk_full_from(run_dir: Path, step: int) -> None:
    write_fault(run_dir, "disk-full", {"kind": "ckpt_write_error", "from_step": step, "once": False})


@pytest.mark.slow
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


def _step_when_failed(events: list[dict], step: int) -> int:
    """The last step rank 0 finished before it learned that the save of ``step`` failed."""
    failed = next(e["ts"] for e in events if e["kind"] == "checkpoint.save_failed" and e["step"] == step
                  and e["source"] == "trainer/rank0")
    return max(e["step"] for e in events if e["kind"] == "trainer.step" and e["source"] == "trainer/rank0"
               and e["ts"] <= failed)


@pytest.mark.slow
def test_saves_that_keep_failing_stop_the_run_with_the_reason(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="2", steps=40, interval=3, step_sleep=0.02,
                              checkpoint={"max_consecutive_failures": 2})
    _disk_full_from(tmp_path / "run", 6)
    rc, out, s = _launch(config, subprocess_env)
    assert rc == EXIT_CHECKPOINT, out  # the launcher's code says why, not only the workers'
    assert s["nodes"] == {"node0": EXIT_CHECKPOINT, "node1": EXIT_CHECKPOINT}  # every agent too (the stop record's code)
    events = read_run_events(tmp_path / "run")
    # Judged when the second failure is known (async: mid-step), not at the next save (step 12): the
    # step in flight then may finish, no later one starts.  Before: every step up to 12 trained.
    assert s["last_step"] <= _step_when_failed(events, 9) + 1 < 12, s["last_step"]
    assert not any(e["kind"] == "checkpoint.save_start" and e["step"] == 12 for e in events)
    assert s["last_durable_step"] == 3 and s["unsaved_steps"] == s["last_step"] - 3
    assert [f["step"] for f in s["failed_saves"]] == [6, 9]
    assert set(s["stop_reasons"]) == {"node0", "node1"}
    for reason in s["stop_reasons"].values():
        assert "checkpoint.on_save_failure=stop: 2 checkpoint saves failed in a row (steps 6, 9; last error: " \
            in reason, reason
        assert "[ENOSPC]); last committed step: 3" in reason
    assert "  node0 gave_up: " in out and "  node1 gave_up: " in out  # the launcher says why, for every node
    assert s["restarts"] == 0  # stopped on purpose, not restarted into the same full disk


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_an_async_saves_failure_ends_the_streak_when_it_is_recorded_not_at_the_next_save(tmp_path, policy):
    """Single process: what the worker session's sync point asks each step (no collective), and
    the agreement it then runs."""
    storage = FaultInjectingStorage(LocalStorage(), lambda step: step >= 6)
    mgr = CheckpointManager(CheckpointConfig(max_consecutive_failures=2, on_save_failure=policy), tmp_path,
                            events=EventLog(None, "trainer/rank0"), storage=storage)
    state = {"model": nn.Linear(4, 3).state_dict()}
    for step in (3, 6, 9):
        mgr.save(step, state)  # returns once staged; the save of 9 fails on the finalize thread
    deadline = time.monotonic() + 30
    while policy == "stop" and not mgr.streak_reached() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mgr.streak_reached() == (policy == "stop") and mgr.stops_on_failures == (policy == "stop")
    assert mgr.failing() is None  # what the save of 9 agreed on: only 6 had failed then
    line = mgr.agree_failing()
    if policy == "stop":
        assert "2 checkpoint saves failed in a row (steps 6, 9; " in line and "last committed step: 3" in line
    else:
        assert line is None
    mgr.close()
