"""Hang attribution: each rank's Python stack on SIGUSR1 and its last collective mark say who is not
where the others wait.  Here: a real worker-side probe in a real process (its dump read back by the
agent-side code), and the attribution rule.  tests/test_hang_attribution_e2e.py runs a real launch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from elastic.agent.hangs import HangAttribution, RankPosition, attribute, main_thread, parse_threads, position
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState
from elastic.worker.hangprobe import find_stack_file

REPO = Path(__file__).resolve().parents[1]

_SLEEPER = """
import sys, threading, time
from pathlib import Path
from elastic.worker.hangprobe import HangProbe
probe = HangProbe(Path(sys.argv[1]), 3, "rank1")
with probe.collective("sync", 5):
    pass
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a second thread in the dump
def read_shard():
    print("ready", flush=True)  # from here on the innermost frame is this one
    time.sleep(60)  # asleep outside any collective, like a worker stuck in I/O
read_shard()
"""


def test_a_sleeping_worker_is_found_outside_the_collective(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        state = RunState(MemoryStore(), RunKeys("/elastic/runs/r"))
        hangs = HangAttribution("node1", tmp_path, state, EventLog(None, "agent/node1"), wait_s=0.0)
        (pos,) = hangs.probe(3, {1: proc.pid})
    finally:
        proc.kill()
        proc.wait()
    assert not pos.waiting and pos.where.endswith(" read_shard") and pos.marker == "out sync 5"
    assert pos.stack_file == f"stacks/e3-rank1-pid{proc.pid}.txt"
    dump = find_stack_file(tmp_path, 3, proc.pid).read_text()
    assert len(parse_threads(dump)) == 2 and main_thread(parse_threads(dump))[0][2] == "read_shard"


_WAITING = '''Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2809 in all_reduce
  File "/repo/elastic/worker/session.py", line 171 in sync_point
  File "/repo/trainer/train.py", line 96 in train
  File "<frozen runpy>", line 198 in _run_module_as_main
'''


def test_ranks_not_in_the_collective_the_others_wait_in_are_the_culprits():
    waiting = [position(r, "node0", _WAITING, "in sync 6", f"stacks/e0-rank{r}.txt") for r in (0, 2)]
    assert all(p.waiting and p.where == "distributed_c10d.py:2809 all_reduce" for p in waiting)
    culprit = RankPosition(1, "node1", False, "faults.py:160 before_step", "out sync 5", "stacks/e0-rank1.txt")
    found, label = attribute([*waiting, culprit])
    assert found == [culprit] and label == "sync 6"
    assert attribute(waiting) == ([], "")  # everyone waits: the hung one is elsewhere (or gone)
    unknown = RankPosition(3, "node1", False, "unknown", "", "")
    assert attribute([*waiting, unknown]) == ([], "")  # a rank that could not dump is not blamed


def test_every_agent_reaches_the_verdict_and_only_the_culprits_agent_acts(tmp_path):
    state = RunState(MemoryStore(), RunKeys("/elastic/runs/r"))
    for node in ("node0", "node1"):
        state.put_heartbeat(node, {"node": node, "epoch": 2, "step": 6})
    blocked = RankPosition(1, "node1", False, "faults.py:160 before_step", "out sync 5", "stacks/e2-rank1.txt")
    victim = RankPosition(0, "node0", True, "distributed_c10d.py:2809 all_reduce", "in sync 6", "stacks/e2-rank0.txt")
    agents = {}
    for node, pos in (("node0", victim), ("node1", blocked)):
        agent = HangAttribution(node, tmp_path, state, EventLog(None, f"agent/{node}"), wait_s=30.0)
        agent.probe = lambda epoch, ranks, pos=pos: [pos]  # the real probe is covered above
        agents[node] = agent
    assert agents["node0"].step(2, {0: 1}) is None  # node1 has not reported yet: wait
    time.sleep(0.6)
    blame = agents["node1"].step(2, {1: 2})
    assert blame is not None and blame.rank == 1 and blame.stack_file == "stacks/e2-rank1.txt"
    assert "rank 1 on node1 is not in a collective (at faults.py:160 before_step" in blame.detail
    assert "ranks [0] wait in sync 6" in blame.detail
    assert agents["node0"].step(2, {0: 1}) is None  # node0 is a victim: it waits for node1 to move
