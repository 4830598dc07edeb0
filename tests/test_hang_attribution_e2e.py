"""A worker that is alive but asleep outside the collectives (in I/O, on a lock: neither stopped nor
spinning) is blamed: the agents collect every rank's Python stack and last collective, the rank that is
not waiting where the others wait is the culprit, its stacks are in the run dir and its node is named
in the fault.  When it keeps happening the lemon-node policy excludes the node and the elastic run
shrinks around it and finishes.  Real launcher, etcd, agents, torchrun and gloo trainers."""

from __future__ import annotations

import json

import pytest

from elastic.agent.hangs import main_thread, parse_threads
from elastic.common.events import read_run_events
from elastic.worker.faults import write_fault
from tests.launch_helpers import start_launcher, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]


def test_a_blocked_rank_is_named_from_its_stack_and_excluded_when_it_repeats(tmp_path, subprocess_env):
    run = tmp_path / "run"
    # node1's worker falls asleep at step 6 every time it gets there (also after each resume from step 4: its
    # first step there, 5, is reported, so the agents judge the silence as a hang, not as a slow start).
    write_fault(run, "asleep", {"kind": "block", "node": "node1", "from_step": 6, "once": False, "duration_s": 600})
    config = write_run_config(
        tmp_path, nodes="1:2", steps=12, interval=2, step_sleep=0.05,
        agent={"max_restarts": 4, "term_grace_s": 2, "preflight": {"enabled": False}, "pg_timeout_s": 90,
               # A victim would give up only after 10 x 3 s: what acts here is the attribution.
               "heartbeat": {"step_timeout_s": 3, "stall_factor": 10},
               "leader": {"lemon_failures": 2, "lemon_window_s": 600}})
    proc = start_launcher(config, subprocess_env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    s = json.loads((run / "summary.json").read_text())
    assert s["last_step"] == 12
    assert "node1" in s["excluded"] and "lemon node" in s["excluded"]["node1"]  # shrunk around it
    hangs = [f for f in s["faults"] if f["failure_kind"] == "hang"]
    assert len(hangs) == 2 and {f["node"] for f in hangs} == {"node1"}
    for fault in hangs:
        assert "is not in a collective (at faults.py:" in fault["detail"] and "before_step" in fault["detail"]
        assert "wait in sync 6" in fault["detail"]
    events = read_run_events(run)
    detected = [e for e in events if e["kind"] == "agent.hang_detected"]
    assert detected and {e["source"] for e in detected} == {"agent/node1"}  # node0 never blamed itself
    stack_file = hangs[0]["detail"].rsplit("stacks: ", 1)[1]
    innermost = main_thread(parse_threads((run / stack_file).read_text()))[0]
    assert innermost[0].endswith("elastic/worker/faults.py") and innermost[2] == "before_step"  # asleep there
    verdicts = [e for e in events if e["kind"] == "agent.hang_attribution"]
    # The culprit's agent reaches the verdict naming node1 each time. node0's agent reaches it too unless node1's
    # acted first and node0's worker was already re-forming when node0 probed it (a race seen under load): then
    # no rank waits in a collective and its verdict names nobody. No verdict ever names node0.
    assert "agent/node1" in {e["source"] for e in verdicts} <= {"agent/node0", "agent/node1"}
    assert sum(1 for e in verdicts if e["source"] == "agent/node1" and e["culprits"]) == 2
    assert all({c["node"] for c in e["culprits"]} <= {"node1"} for e in verdicts)
