"""A second fault while the world re-forms after a node's loss: the run still recovers from memory.

The world shrank (node2 lost, 4 -> 3 nodes) and, before the shrunk generation trained a step, a
survivor's worker died too: its spare takes the slot and the world re-forms once more.  The
snapshots every rank holds were taken in the generation before the node's loss, with that
generation's ranks, so the restore must read them by the ranks they were taken with, not by the
ranks of the generation that never trained.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.launch_helpers import kill_node, wait_for_event, worker_pid, write_run_config
from tests.test_inprocess_e2e import _after_retire, _assert_in_process, _run, _steps_lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_worker_lost_while_the_world_shrinks_is_recovered_from_memory(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="3:4", steps=120, run_id="double-fault")
    second: list[float] = []

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node0", min_step=10)
        _after_retire(run_dir, proc, "node2", min_step=10)
        victim = worker_pid(run_dir, "node0")
        kill_ts = kill_node(run_dir, "node2")
        wait_for_event(run_dir, lambda e: e["kind"] == "trainer.peer_lost" and e["ts"] > kill_ts,
                       timeout=30, proc=proc)
        second.append(time.time())
        os.kill(victim, signal.SIGKILL)
        return kill_ts

    summary, events, kill_ts = _run(config, subprocess_env, act)
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert not [e for e in events if e["kind"] == "trainer.recovery_failed"]
    _assert_in_process(events, kill_ts)
    # The shrunk generation (1) never trained: every rank recovered into generation 2, from the
    # snapshots of generation 0, resharded from 4 ranks to 3.
    assert {(e["gen"], e["world_size"]) for e in recovered} == {(2, 3)}, [(e["source"], e["gen"]) for e in recovered]
    # Judged by the generation each step names, not by its time: a generation-0 step whose
    # collectives finished before the kill landed may log just after ``kill_ts`` (CI, stop 43).
    assert not [e for e in events if e["kind"] == "trainer.step" and e["gen"] == 1]
    assert not [e for e in events if e["kind"] == "trainer.step" and kill_ts < e["ts"] < second[0] and e["gen"] != 0]
    assert all(not e["bitwise"] and "resharded" in e["trajectory_changed"] for e in recovered)
    assert _steps_lost(events, kill_ts) <= 1
    assert summary["last_step"] == 120 and summary["nodes"]["node2"] == -9
    lost = [e for e in events if e["kind"] == "agent.node_lost"]
    assert [e["node"] for e in lost] == ["node2"]  # one record of the loss, from one agent
