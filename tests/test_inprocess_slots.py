"""An agent's worker slots after torchrun retired: real child processes, the real policy.

A slot's process counts as ended only through ``waitpid`` on the agent's own children, and a rank
as finished only when that very process reported the run's final step; a dead spare is noticed
and replaced; a replacement the spare cannot take fails the attempt instead of passing for a
recovery.  (Reproduces issue 26: a killed spare, then a killed worker, made a node declare
SUCCEEDED at step 31 of 40 and hung the run.)  The processes are small Python children standing
in for workers and spares; the in-memory store stands in for etcd (no etcd call is on this path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.agent.attempt import NodeSpec, Outcome, TorchrunAttempt
from elastic.agent.classify import FailureKind
from elastic.agent.config import InProcessConfig
from elastic.agent.inprocess import UNKNOWN_EXIT, InProcessWorkers
from elastic.agent.sparefork import ForkedSpare
from elastic.common.env import WorkerEnv
from elastic.common.events import EventLog, read_events
from elastic.common.procs import NotOurChild, reap
from elastic.control.generations import Plan
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState

pytestmark = pytest.mark.timeout(60)


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def _wait_exit(proc: subprocess.Popen[bytes]) -> None:
    """Until the child is a zombie (ended, not yet reaped): what the agent's poll then finds."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {proc.pid} did not exit")


@pytest.fixture
def slots(tmp_path: Path):
    spec = NodeSpec("run", "node0", "127.0.0.1:1", tmp_path, "2", 2, ["-m", "json.tool"])
    events = EventLog(tmp_path / "agent.jsonl", "agent/node0")
    workers = InProcessWorkers(spec, InProcessConfig(), RunState(MemoryStore(), RunKeys.of("/t", "run")), events,
                               None, epoch=0)  # type: ignore[arg-type]  (the store is not used on this path)
    workers._attempt = TorchrunAttempt(spec, 1, tmp_path, "", WorkerEnv(), ("2", "run"), 1.0)
    workers.worker_env = WorkerEnv()
    workers.detached = True
    started: list[subprocess.Popen[bytes]] = []
    workers.start_spare = lambda: started.append(_spare(workers))  # a cheap spare (no torch import)
    children: list[subprocess.Popen[bytes]] = []
    yield workers, children, started, lambda: read_events([tmp_path / "agent.jsonl"])
    for proc in [*children, *started]:
        proc.kill()
        proc.wait()
    events.close()


def _spare(workers: InProcessWorkers) -> subprocess.Popen[bytes]:
    workers.spare = _child("import sys, time; sys.stdin.readline(); time.sleep(30)")
    return workers.spare


def _hold(workers: InProcessWorkers, children: list, local: int, code: str) -> subprocess.Popen[bytes]:
    proc = _child(code)
    children.append(proc)
    workers.pids[local] = proc.pid
    return proc


def test_reap_reads_only_our_own_children():
    with pytest.raises(NotOurChild):
        reap(1)  # init: alive, not ours
    proc = _child("raise SystemExit(3)")
    _wait_exit(proc)
    assert reap(proc.pid) == 3
    with pytest.raises(NotOurChild):
        reap(proc.pid)  # reaped once: its status is gone, never read again as a success


def test_an_exit_0_without_the_final_step_reported_is_a_failure(slots):
    workers, children, _, _ = slots
    _hold(workers, children, 0, "import time; time.sleep(30)")
    quitter = _hold(workers, children, 1, "pass")
    _wait_exit(quitter)
    result = workers.poll(lambda result: False)  # no replacement allowed: the failure ends the attempt
    assert result is not None and result.outcome == Outcome.FAILED
    assert "before reporting the run's final step" in result.detail and result.kind == FailureKind.WORKER_ERROR


def test_a_rank_is_done_only_when_its_own_process_reported_the_final_step(slots):
    workers, children, _, _ = slots
    first = _hold(workers, children, 0, "pass")
    second = _hold(workers, children, 1, "pass")
    workers.drain_reports = lambda: workers.observe({"type": "done", "local_rank": 1, "pid": second.pid, "step": 40})
    workers.observe({"type": "done", "local_rank": 0, "pid": first.pid, "step": 40})
    workers.observe({"type": "done", "local_rank": 1, "pid": 12345, "step": 40})  # another process: not the slot's
    _wait_exit(first)
    _wait_exit(second)
    result = workers.poll(lambda result: False)  # rank 1's "done" is read only when its exit is found
    assert result is not None and result.outcome == Outcome.SUCCEEDED


def test_a_slot_whose_process_is_not_ours_ended_with_an_unknown_status(slots):
    workers, _, _, _ = slots
    workers.pids = {0: 1, 1: 1}  # e.g. a worker torchrun reaped before it retired
    result = workers.poll(lambda result: False)
    assert result is not None and result.outcome == Outcome.FAILED and result.rc == UNKNOWN_EXIT


def test_a_dead_worker_late_reports_do_not_repoint_its_slot(slots):
    workers, children, _, _ = slots
    live = _hold(workers, children, 0, "import time; time.sleep(30)")
    workers.observe({"type": "step", "local_rank": 0, "pid": live.pid + 100000, "step": 31, "gen": 0})
    assert workers.pids[0] == live.pid


def test_a_spare_killed_then_the_worker_the_new_spare_takes_the_slot(slots):
    workers, children, started, events = slots
    workers.start_spare()
    _hold(workers, children, 1, "import time; time.sleep(30)")
    first_spare = started[0]
    first_spare.kill()
    _wait_exit(first_spare)
    victim = _hold(workers, children, 0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _wait_exit(victim)
    assert workers.poll(lambda result: True) is None  # replaced: the attempt goes on
    kinds = [e["kind"] for e in events()]
    assert kinds.count("agent.spare_failed") == 1 and "agent.inprocess_replace" in kinds
    assert len(started) == 2 and workers.pids[0] == started[1].pid


def test_a_spare_that_cannot_take_the_slot_fails_the_attempt(slots):
    workers, children, started, events = slots
    deaf = _child("import os, time; os.close(0); time.sleep(30)")  # alive, but reads no assignment
    started.append(deaf)
    workers.spare = deaf
    time.sleep(0.5)  # its stdin is closed by then
    _hold(workers, children, 1, "import time; time.sleep(30)")
    victim = _hold(workers, children, 0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _wait_exit(victim)
    result = workers.poll(lambda result: True)
    assert result is not None and result.outcome == Outcome.FAILED and result.rc == -9
    seen = {e["kind"]: e for e in events()}
    assert seen["agent.spare_failed"]["assigned"] is True
    assert seen["agent.inprocess_fallback"]["reason"] == "the warm spare failed"
    assert workers.pids[0] == victim.pid  # the slot never went to the deaf spare


def test_spares_that_keep_dying_are_given_up(slots):
    workers, _, started, events = slots
    workers.start_spare()
    for _ in range(3):
        spare = workers.spare
        assert spare is not None
        spare.kill()
        _wait_exit(spare)
        workers._check_spare()
    assert workers.spare is None and len(started) == 3  # the first and two replacements
    assert any(e["kind"] == "agent.spare_given_up" for e in events())


def test_torchrun_without_workers_is_still_in_its_rendezvous(tmp_path):
    """The agent's warm-up clock (init_timeout_s) starts only once torchrun has spawned workers: a
    fixed-size run waiting for a lost node ends as a rendezvous timeout, never as a healthy node's
    counted init_timeout."""
    spec = NodeSpec("run", "node0", "127.0.0.1:1", tmp_path, "2", 1, ["-m", "json.tool"])
    attempt = TorchrunAttempt(spec, 1, tmp_path, "", WorkerEnv(), ("2", "run"), 1.0)
    assert not attempt.in_rendezvous()  # not started
    procs = [subprocess.Popen(["sleep", "30"]), subprocess.Popen(["sh", "-c", "sleep 30 & wait"])]
    try:
        attempt.proc = procs[0]
        assert attempt.in_rendezvous()
        attempt.proc = procs[1]
        deadline = time.monotonic() + 10
        while attempt.in_rendezvous() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not attempt.in_rendezvous()  # a worker exists: the rendezvous completed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_torchrun_is_retired_only_while_it_runs_and_holds_every_worker_alive(tmp_path):
    """An agent that stalled (etcd leader lost) reads its first step report late: the workers may
    have trained to the end and exited by then.  Adopting them read a finished run as two dead
    workers (CI: two bogus counted faults); torchrun whose workers are gone is left to exit."""
    spec = NodeSpec("run", "node0", "127.0.0.1:1", tmp_path, "2", 1, ["-m", "json.tool"])
    attempt = TorchrunAttempt(spec, 1, tmp_path, "", WorkerEnv(), ("2", "run"), 1.0)
    # A parent that keeps its child unreaped once it ends (a zombie, as torchrun's finished worker).
    code = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '30']); print(c.pid, flush=True); " \
           "sys.stdin.readline(); c.kill(); time.sleep(30)"
    attempt.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        worker = int(attempt.proc.stdout.readline())
        assert attempt.holds([worker]) and not attempt.holds([worker, attempt.proc.pid])
        attempt.proc.stdin.write(b"\n")
        attempt.proc.stdin.flush()
        deadline = time.monotonic() + 10
        while attempt.holds([worker]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not attempt.holds([worker])  # the worker ended: a zombie is not held
        assert attempt.holds([])
        attempt.proc.kill()
        attempt.proc.wait()
        assert not attempt.holds([])  # torchrun exited
    finally:
        attempt.proc.kill()
        attempt.proc.wait()


def test_a_round_probe_spares_nodes_that_left_cleanly_and_reads_once(slots):
    """A node that left the roster cleanly finished (its closed store is no loss); a node without a
    record is gone; the round's probe reads the node records and the roster once."""
    workers, _, _, _ = slots
    state = workers.state
    for node in ("node0", "node1", "node2", "node3"):
        state.set_member(node, "joined")
    state.set_member("node3", "SUCCEEDED")
    probe = workers._prober(1)
    assert probe(["node3"]) == {"node3": ""}
    assert "record is gone" in probe(["node2"])["node2"]
    state.put_node("node2", {"memstate": {"addr": "127.0.0.1:1"}})
    assert "record is gone" in probe(["node2"])["node2"]  # read once a round: the record came too late for it
    many = workers._prober(2)(["node0", "node1", "node2", "node3"] + [f"extra{i}" for i in range(8)])
    assert "refuses" in many["node2"] and many["node3"] == "" and "record is gone" in many["extra0"]


def test_a_node_joins_the_round_for_its_slots_once_every_slot_lives(slots):
    """Fault reports and a worker's wait ask for the round; the agent joins once, with every local
    slot and its rank, and hands the plan to the board its workers wait on."""
    workers, _, _, _ = slots
    gens = workers.gens
    workers.ranks = {0: 0, 1: 1}
    workers.pids = {0: 101, 1: 102}
    workers.register()
    gens.register_node("node1", {0: 2, 1: 3})
    workers.observe({"type": "fault", "gen": 0, "step": 5, "local_rank": 0, "pid": 101})
    workers.observe({"type": "fault", "gen": 0, "step": 5, "local_rank": 1, "pid": 102})
    workers.join_wanted()
    workers.join_wanted()  # one round thread per generation
    gens.join_node(1, "node1", {0: 2, 1: 3}, head_limit=3)
    answer = workers.board.wait(0, 1, "plan", timeout_s=10)
    assert answer["ok"], answer
    assert answer["value"]["slots"] == {"0": 0, "1": 1} and Plan.from_record(answer["value"]["plan"]).world == 4
    assert workers.ranks == {0: 0, 1: 1} and workers.gen == 1
    gens.put_store(1, "127.0.0.1:5")
    assert workers.board.wait(0, 1, "store", timeout_s=10) == {"ok": True, "value": "127.0.0.1:5"}
    assert json.loads(gens.store.get(gens.keys.gen_join(0, 1, "node0")).value)["slots"] == {"0": 0, "1": 1}
    noticed = json.loads(workers.state.store.get(workers.state.keys.noticed(0, 0)).value)
    assert noticed["by"] == "node0" and noticed["step"] == 5 and noticed["kind"] == "peer_lost"


def test_a_loss_needs_a_refusal_a_gone_record_or_three_timeouts(slots):
    import socket

    workers, _, _, _ = slots
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        strikes: dict[str, int] = {}
        assert "refuses" in workers._unreachable("node2", {"memstate": {"addr": f"127.0.0.1:{port}"}}, strikes)
    assert "record is gone" in workers._unreachable("node2", None, {})
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert workers._unreachable("node2", {"memstate": {"addr": "127.0.0.1:%d" % server.getsockname()[1]}}, {}) == ""


def test_a_worker_that_dies_after_its_node_joined_the_round_breaks_that_round(slots):
    """The survivors' errors reach the agent before the dead worker can be reaped (its sockets
    close before its exit is visible), so the node may join round 1 with the dying process in its
    slots.  Then round 1's plan counts a rank that will never come: the fault must name generation
    1, not 0 (which everyone knows broke; the board keeps one fault per generation, so it went
    unheard), and the spare must join generation 2.  Reproduces issue 26's CI failure: under a CPU
    hog the survivors waited out the new store's 60 s timeout and the run restarted from disk."""
    workers, children, started, events = slots
    workers.start_spare()
    workers.ranks = {0: 0, 1: 1}
    workers.register()
    workers.gens.register_node("node1", {0: 2, 1: 3})
    _hold(workers, children, 1, "import time; time.sleep(30)")
    victim = _hold(workers, children, 0, "import sys, time; sys.stdin.readline(); time.sleep(30)")
    workers.observe({"type": "fault", "gen": 0, "step": 5, "local_rank": 1, "pid": workers.pids[1]})
    workers.join_wanted()  # round 1, with both slots' processes; it waits for node1
    victim.kill()
    _wait_exit(victim)
    assert workers.poll(lambda result: True) is None  # the spare takes the slot
    workers.gens.join_node(1, "node1", {0: 2, 1: 3}, head_limit=3)
    assert workers.board.wait(0, 1, "plan", timeout_s=10)["faulted"]  # its workers ask for 2 instead
    deadline = time.monotonic() + 10
    while workers.gen < 1 and time.monotonic() < deadline:  # round 1 still closes: 2 builds on it
        time.sleep(0.01)
    assert workers.gen == 1
    pushed = workers.board.wait_fault(0, 1, timeout_s=1)
    assert pushed["ok"] and pushed["value"]["gen"] == 1 and pushed["value"]["kind"] == "worker_died"
    replaced = next(e for e in events() if e["kind"] == "agent.inprocess_replace")
    assert replaced["gen"] == 2 and workers.pids[0] == started[0].pid
    assert workers.wanted == 2


def test_a_node_lost_after_this_node_joined_a_round_breaks_that_round(slots):
    """The second of two nodes lost 0.2 s apart died after the round for the first had counted
    it: that round's generation is the one broken (a fault of the older one is on the board
    already and would be dropped), and a loss the newest plan already counts is not pushed again."""
    workers, _, _, _ = slots
    workers.ranks, workers.pids = {0: 0, 1: 1}, {0: 101, 1: 102}
    workers.register()
    workers.gens.register_node("node1", {0: 2, 1: 3})
    workers.push_fault("node3", "node_lost", "the first loss")  # generation 0 broke
    workers.join_wanted()  # round 1: it waits for node1
    workers._peer_gone("node2", "127.0.0.1:1", "its agent closed the connection")  # no record: gone
    pushed = workers.board.wait_fault(0, 1, timeout_s=1)
    assert pushed["ok"] and pushed["value"]["gen"] == 1 and pushed["value"]["node"] == "node2"
    workers.plan = Plan(gen=1, old_world=4, gone=("node2",))
    workers._peer_gone("node2", "127.0.0.1:1", "a late notice")
    assert workers.board.wait_fault(0, 2, timeout_s=0.2)["ok"] is False  # nothing new


def test_a_slot_the_spare_took_closes_its_round_in_place(slots):
    """A worker died, the spare took its slot: this node writes generation 1's plan itself (every
    rank kept), and its round ends without waiting for node1's join."""
    workers, children, started, events = slots
    workers.start_spare()
    workers.ranks = {0: 0, 1: 1}
    workers.register()
    workers.gens.register_node("node1", {0: 2, 1: 3})
    _hold(workers, children, 1, "import time; time.sleep(30)")
    victim = _hold(workers, children, 0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _wait_exit(victim)
    assert workers.poll(lambda result: True) is None  # the spare takes the slot and round 1 starts
    answer = workers.board.wait(0, 1, "plan", timeout_s=10)
    plan = Plan.from_record(answer["value"]["plan"])
    assert plan.by == "node0" and plan.keeps_ranks() and plan.world == 4
    assert answer["value"]["slots"] == {"0": 0, "1": 1} and workers.ranks == {0: 0, 1: 1}
    closed = next(e for e in events() if e["kind"] == "round.in_place")
    assert closed["gen"] == 1 and closed["world"] == 4


def test_a_plan_that_still_counts_a_node_found_lost_is_faulted_at_once(slots):
    """A worker's death and a node's loss meet: the in-place plan keeps every node, the loss's own
    fault was of the older generation (one per generation: unheard).  The agent that found the node
    lost pushes the new plan's generation as broken, so the next round (a full one) leaves it out."""
    workers, _, _, _ = slots
    workers.push_fault("node1", "worker_died", "a worker of node1 died")  # generation 0 broke
    workers._peer_gone("node2", "127.0.0.1:1", "its agent closed the connection")  # no record: gone
    assert workers.board.wait_fault(0, 1, timeout_s=0.1)["ok"] is False  # generation 0's fault: unheard
    workers._check_counts(Plan(gen=1, old_world=4, gone=("node2",)))
    assert workers.board.wait_fault(0, 1, timeout_s=0.1)["ok"] is False  # a plan without it: nothing to say
    workers._check_counts(Plan(gen=1, old_world=4, by="node1"))  # written in place by node1: counts node2
    pushed = workers.board.wait_fault(0, 1, timeout_s=1)
    assert pushed["ok"] and pushed["value"]["gen"] == 1 and pushed["value"]["node"] == "node2"


class _ReadyZygote:
    """A zygote that is ready and forks ``proc`` (a real child standing in for a forked spare)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self.forks = proc, 0
        self.state, self.announced, self.pid, self.hello, self.error = "ready", False, 0, {"import_s": 1.0}, ""

    def ready(self) -> bool:
        return True

    def fork(self, env: dict, log_path: Path) -> ForkedSpare:
        self.forks += 1
        assert self.proc.stdin is not None
        return ForkedSpare(self.proc.pid, os.dup(self.proc.stdin.fileno()))


_WAITING = "import sys, time; sys.stdin.readline(); time.sleep(30)"


def test_a_spare_still_importing_gives_way_to_a_forked_one_once_the_zygote_is_ready(slots, tmp_path):
    workers, children, _, events = slots
    importing, stand_in = _child(_WAITING), _child(_WAITING)
    children += [importing, stand_in]
    workers.spare, workers.spare_log = importing, tmp_path / "importing.log"  # no "warm" line yet
    workers.factory = zygote = _ReadyZygote(stand_in)
    workers._watch_zygote()
    assert isinstance(workers.spare, ForkedSpare) and workers.spare.pid == stand_in.pid
    assert importing.poll() == -9  # the importing one is gone, reaped
    (started,) = [e for e in events() if e["kind"] == "agent.spare_started"]
    assert started["forked"] and started["replaced_importing"] == importing.pid
    workers._watch_zygote()
    assert zygote.forks == 1  # a forked spare is kept


@pytest.mark.parametrize("why", ["warm", "checking"])
def test_a_warm_spare_or_one_with_a_replay_check_is_kept(slots, tmp_path, why):
    workers, children, _, _ = slots
    spare, stand_in = _child(_WAITING), _child(_WAITING)
    children += [spare, stand_in]
    log = tmp_path / "spare.log"
    log.write_text('{"spare": "ready"}\n' + ('{"spare": "warm"}\n' if why == "warm" else ""))
    workers.spare, workers.spare_log = spare, log
    if why == "checking":
        workers._asked.add(spare.pid)
    workers.factory = zygote = _ReadyZygote(stand_in)
    workers._watch_zygote()
    assert workers.spare is spare and zygote.forks == 0 and spare.poll() is None
