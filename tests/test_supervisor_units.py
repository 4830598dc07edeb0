"""Supervisor building blocks: classification, hang verdicts, cluster policy, election, faults, goodput."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from elastic.agent.config import AgentConfig, FailurePolicy, HeartbeatConfig
from elastic.control.leader import LeaderConfig
from elastic.agent.classify import FailureKind, classify, worker_exit_codes
from elastic.common.config import ConfigError, from_dict
from elastic.common.events import EventLog
from elastic.worker.faults import FaultHooks, FaultSpecError, write_fault
from elastic.run.goodput import compute_goodput
from elastic.agent.heartbeat import HeartbeatMonitor, Silence
from elastic.control.leader import ClusterPolicy, LeaderElection
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.worker.channel import skip_steps


# -- classification -----------------------------------------------------------------
def _error_file(tmp_path, message: str, rank: int = 0):
    d = tmp_path / "attempt" / "attempt_0" / str(rank)
    d.mkdir(parents=True, exist_ok=True)
    (d / "error.json").write_text(json.dumps({"message": {"message": message}}))
    return tmp_path / "attempt"


def test_classify_from_error_files(tmp_path):
    assert classify(_error_file(tmp_path / "a", "RuntimeError: Connection reset by peer"), 1)[0] == FailureKind.PEER_LOST
    assert classify(_error_file(tmp_path / "b", "torch.OutOfMemoryError: CUDA out of memory"), 1)[0] == FailureKind.OOM
    assert classify(_error_file(tmp_path / "c", "Timed out waiting 30000ms for recv"), 1)[0] == \
        FailureKind.COLLECTIVE_TIMEOUT
    kind, detail = classify(_error_file(tmp_path / "d", "ValueError: bad shape"), 1)
    assert kind == FailureKind.WORKER_ERROR and "bad shape" in detail


def test_classify_from_torchrun_log(tmp_path):
    log = "  exitcode  : -9 (pid: 123)\n  error_file: <N/A>\n"
    assert worker_exit_codes(log) == [-9]
    assert classify(tmp_path, 1, log) == (FailureKind.WORKER_SIGNAL, "worker killed by signal 9")
    assert classify(tmp_path, 1, "  exitcode  : 87 (pid: 5)")[0] == FailureKind.NUMERICS
    assert classify(tmp_path, 1, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError")[0] == \
        FailureKind.RENDEZVOUS_TIMEOUT
    assert classify(tmp_path, -15, "")[0] == FailureKind.TORCHRUN
    assert classify(tmp_path, 1, "", numerics_reported=True)[0] == FailureKind.NUMERICS


# -- heartbeat verdicts ---------------------------------------------------------------
def test_init_timeout_then_steady_state_timeout():
    clock = FakeClock()
    mon = HeartbeatMonitor(HeartbeatConfig(init_timeout_s=10, step_timeout_s=2), clock=clock)
    clock.now += 9
    assert mon.check()[0] == Silence.NONE  # warm-up is allowed to be slow
    clock.now += 2
    assert mon.check()[0] == Silence.INIT


def test_stopped_worker_is_the_culprit_and_sleeping_one_a_victim():
    clock = FakeClock()
    cfg = HeartbeatConfig(step_timeout_s=2, stall_factor=2)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mon = HeartbeatMonitor(cfg, clock=clock)
        mon.observe({"type": "step", "rank": 0, "pid": sleeper.pid, "step": 3, "step_time": 0.1})
        clock.now += 1.5
        assert mon.check()[0] == Silence.NONE
        clock.now += 1.0  # silent 2.5 s: past step_timeout, but the worker is merely blocked:
        assert mon.check()[0] == Silence.SUSPECT  # the agents attribute it (elastic.agent.hangs) first
        clock.now += 2.0  # 4.5 s > 2 x 2 s: give up waiting on the peers
        verdict, detail = mon.check()
        assert verdict == Silence.VICTIM and "blocked" in detail
        sleeper.send_signal(signal.SIGSTOP)
        # SIGSTOP is delivered asynchronously: wait (bounded) until /proc says the process stopped.
        deadline = time.monotonic() + 2
        while _proc_state(sleeper.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        verdict, detail = mon.check()
        assert verdict == Silence.CULPRIT and "stopped" in detail
        mon.observe({"type": "done", "rank": 0, "step": 3})
        assert mon.check()[0] == Silence.NONE  # after "done", silence is shutdown, not a hang
    finally:
        sleeper.kill()
        sleeper.wait()


def test_silence_after_an_in_process_recovery_counts_from_the_recovery():
    """A recovery slower than stall_factor x step_timeout_s (a cold spare joining: 5.4 s under a CPU
    hog) must not read as a stall the moment it ends: the run would restart from disk for nothing."""
    clock = FakeClock()
    mon = HeartbeatMonitor(HeartbeatConfig(step_timeout_s=2, stall_factor=2), clock=clock, recovery_grace_s=60)
    mon.observe({"type": "step", "rank": 0, "local_rank": 0, "pid": 1, "step": 4, "step_time": 0.1})
    mon.observe({"type": "fault", "rank": 0, "local_rank": 0, "pid": 1, "step": 5})
    clock.now += 5.4
    assert mon.check()[0] == Silence.NONE  # re-forming: silence is expected
    mon.observe({"type": "recovered", "rank": 0, "local_rank": 0, "pid": 1, "step": 4})
    assert mon.check()[0] == Silence.NONE  # not "blocked 5.4s": it trains again from here
    clock.now += 1.9
    assert mon.check()[0] == Silence.NONE
    clock.now += 0.2  # and a real silence after the recovery is still seen
    assert mon.check()[0] != Silence.NONE


def _proc_state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_heartbeat_summary_uses_busy_time():
    mon = HeartbeatMonitor(HeartbeatConfig())
    for step in range(1, 6):
        mon.observe({"type": "step", "rank": 0, "pid": 1, "step": step, "step_time": 0.5, "busy_time": 0.1})
    summary = mon.summary()
    assert summary["step"] == 5 and summary["step_time"] == 0.5 and summary["busy_time"] == 0.1
    assert summary["samples"] == 5


# -- cluster policy ---------------------------------------------------------------------
def _hb(busy: float) -> dict:
    return {"busy_time": busy, "samples": 10}


def test_straggler_needs_consecutive_slow_evaluations():
    excluded = []
    policy = ClusterPolicy(LeaderConfig(straggler_evaluations=3, straggler_action="exclude"),
                           lambda n, r, t: excluded.append((n, r)), EventLog(None, "t"))
    beats = {"a": _hb(0.1), "b": _hb(0.11), "c": _hb(0.5)}
    assert policy.evaluate_stragglers(beats) == []
    assert policy.evaluate_stragglers({**beats, "c": _hb(0.1)}) == []  # streak broken
    for _ in range(2):
        assert policy.evaluate_stragglers(beats) == []
    assert policy.evaluate_stragglers(beats) == ["c"]
    assert excluded and excluded[0][0] == "c" and "straggler" in excluded[0][1]
    policy.evaluate_stragglers(beats)
    assert len(excluded) == 1  # excluded once, not every evaluation


def test_straggler_noise_floor_and_flag_only():
    excluded = []
    policy = ClusterPolicy(LeaderConfig(straggler_evaluations=1, straggler_min_excess_s=0.05),
                           lambda n, r, t: excluded.append(n), EventLog(None, "t"))
    # 3x slower but only 2 ms more: noise for tiny steps.
    assert policy.evaluate_stragglers({"a": _hb(0.001), "b": _hb(0.001), "c": _hb(0.003)}) == []
    assert policy.evaluate_stragglers({"a": _hb(0.1), "b": _hb(0.1), "c": _hb(0.4)}) == ["c"]
    assert excluded == []  # default action is flag


def test_lemon_node_excluded_within_window():
    excluded = []
    policy = ClusterPolicy(LeaderConfig(lemon_failures=3, lemon_window_s=60),
                           lambda n, r, t: excluded.append(n), EventLog(None, "t"))
    now = 1000.0
    assert policy.evaluate_lemons({"a": [now - 100, now - 90, now - 5]}, now) == []  # two old ones
    assert policy.evaluate_lemons({"a": [now - 30, now - 20, now - 5]}, now) == ["a"]
    assert excluded == ["a"]


def test_leader_election_and_failover():
    clock = FakeClock()
    store = MemoryStore(clock)
    a = LeaderElection(store, "/r/leader", "a", ttl_s=2)
    b = LeaderElection(store, "/r/leader", "b", ttl_s=2)
    assert a.try_acquire() and not b.try_acquire()
    clock.advance(1.5)
    assert a.try_acquire()  # refresh keeps it
    clock.advance(1.5)
    assert not b.try_acquire() and b.current() == "a"
    # a dies without resigning: its lease runs out and b takes over.
    clock.advance(2.1)
    assert b.try_acquire()
    assert a.current() == "b"
    b.resign()
    assert store.get("/r/leader") is None


def test_follower_polls_the_leader_key_without_writing():
    # Every follower tries each interval: a held key must cost a read, not a lease grant, a lost
    # compare-and-swap and a revoke (three raft writes per follower per second on etcd).
    store = MemoryStore(FakeClock())
    leader, follower = LeaderElection(store, "/r/leader", "a", ttl_s=2), LeaderElection(store, "/r/leader", "b", ttl_s=2)
    assert leader.try_acquire()
    granted = store._next_lease
    assert not any(follower.try_acquire() for _ in range(5))
    assert store._next_lease == granted


# -- config -------------------------------------------------------------------------------
def test_agent_config_rejects_pg_timeout_below_heartbeat():
    with pytest.raises(ConfigError, match="pg_timeout_s"):
        from_dict(AgentConfig, {"pg_timeout_s": 10, "heartbeat": {"step_timeout_s": 30}})


def test_failure_policy_actions():
    policy = FailurePolicy(actions={"hang": "exclude"})
    assert policy.action("hang") == "exclude"
    assert policy.action("numerics") == "rollback"
    assert policy.action("peer_lost") == "restart"  # never punish a node for a peer's failure


# -- worker-side pieces ---------------------------------------------------------------------
def test_skip_steps_parse():
    assert skip_steps("") == frozenset()
    assert skip_steps("3-5,9") == frozenset({3, 4, 5, 9})


def test_fault_hooks_fire_once_and_by_rank(tmp_path):
    write_fault(tmp_path, "nan", {"kind": "nan_loss", "rank": 1, "step": 4})
    other = FaultHooks(tmp_path, rank=0)
    target = FaultHooks(tmp_path, rank=1)
    loss = torch.tensor(0.5, requires_grad=True) * 2
    assert other.loss(4, loss) is loss
    assert target.loss(3, loss) is loss
    bad = target.loss(4, loss)
    assert math.isnan(bad.item()) and bad.requires_grad
    assert not (tmp_path / "faults" / "nan.json").exists() and (tmp_path / "faults" / "nan.fired").exists()
    assert target.loss(4, loss) is loss  # once: the replay after rollback runs clean


def test_fault_straggle_delays_and_bad_spec(tmp_path):
    write_fault(tmp_path, "slow", {"kind": "straggle", "from_step": 2, "to_step": 3, "delay_s": 0.2})
    hooks = FaultHooks(tmp_path, rank=0)
    t0 = time.monotonic()
    hooks.before_step(1)
    assert time.monotonic() - t0 < 0.15
    t0 = time.monotonic()
    hooks.before_step(2)
    hooks.before_step(3)
    assert time.monotonic() - t0 >= 0.4  # two delayed steps; straggle is not once
    with pytest.raises(FaultSpecError, match="kind"):
        write_fault(tmp_path, "x", {"kind": "meteor"})


def test_fault_hang_stops_the_process(tmp_path):
    write_fault(tmp_path, "h", {"kind": "hang", "step": 2})
    code = ("import sys; from elastic.worker.faults import FaultHooks; h = FaultHooks(sys.argv[1], 0); "
            "h.before_step(1); h.before_step(2); print('resumed', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        state = ""
        while time.monotonic() < deadline:
            state = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if state == "T":
                break
            time.sleep(0.05)
        assert state == "T"
        proc.send_signal(signal.SIGCONT)
        assert proc.communicate(timeout=20)[0].strip() == "resumed"
    finally:
        proc.kill()


# -- goodput -----------------------------------------------------------------------------------
def test_goodput_counts_redone_steps_as_lost():
    ev = [{"ts": 0.0, "source": "launcher", "kind": "launcher.start"}]
    ev += [{"ts": 10.0, "source": "trainer/rank0", "kind": "trainer.start", "step": 0}]
    ev += [{"ts": 10.0 + s, "source": "trainer/rank0", "kind": "trainer.step", "step": s, "step_time": 1.0}
           for s in range(1, 6)]  # steps 1..5 at t=11..15
    ev += [{"ts": 25.0, "source": "trainer/rank0", "kind": "trainer.start", "step": 3}]
    ev += [{"ts": 26.0 + i, "source": "trainer/rank0", "kind": "trainer.step", "step": s, "step_time": 1.0}
           for i, s in enumerate(range(4, 7))]  # 4, 5 redone, then 6; ends t=28
    g = compute_goodput(ev)
    assert g["steps_kept"] == 6 and g["steps_redone"] == 2
    assert g["productive_s"] == 6.0 and g["lost_s"] == 2.0
    assert g["startup_s"] == 10.0  # first step began at t=10
    assert g["recovery_s"] == 10.0  # last step before restart ended 15, next began 25
    assert g["goodput"] == round(6.0 / 28.0, 4)


def test_a_peer_lost_in_the_final_collectives_is_a_failed_recovery_not_this_ranks_fault():
    """Measured: a rank that crashed in the final checksum made each peer exit 1, counted as its
    node's own failure, until the lemon policy excluded a healthy node of a fixed-size run."""
    from elastic.common.exits import EXIT_RECOVERY_FAILED
    from elastic.worker.session import RecoveryFailed, _final_peer_lost

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:53400: Connection reset by peer")
    out = _final_peer_lost(lost, 120)
    assert isinstance(out, RecoveryFailed) and out.code == EXIT_RECOVERY_FAILED and "step 120" in str(out)
    bug = ValueError("a bug of this rank")
    assert _final_peer_lost(bug, 120) is bug


def test_a_spare_that_took_a_slot_leaves_without_interpreter_teardown(tmp_path, subprocess_env):
    """Measured once in a full suite: a spare that had joined in-process generations aborted in C++
    teardown at exit (SIGABRT after the run's final step), and its agent counted a crash.  It now
    leaves as torchrun's workers do: exit code kept, no atexit handler (no teardown) run."""
    (tmp_path / "fake_trainer.py").write_text(
        "import atexit, pathlib, sys\n"
        "def main(argv):\n"
        "    atexit.register(lambda: pathlib.Path(argv[0]).write_text('teardown ran'))\n"
        "    return 3\n")
    marker = tmp_path / "teardown"
    env = {**subprocess_env, "PYTHONPATH": f"{tmp_path}:{subprocess_env['PYTHONPATH']}"}
    proc = subprocess.run([sys.executable, "-m", "elastic.worker.spare", "-m", "fake_trainer", str(marker)],
                          input=json.dumps({"slot": 0, "env": {}}) + "\n", capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert '"spare": "assigned"' in proc.stdout and not marker.exists()


def test_reports_left_by_the_last_attempt_are_dropped_before_the_next_one(tmp_path):
    """An agent re-screening its node after a hang read nothing for 6 s; its stopped workers' last
    step report then counted as the next attempt's first step, 12 s before that attempt's workers
    had started, and the agent declared its node a stall victim (chaos soak, seed 1)."""
    import socket
    from types import SimpleNamespace

    from elastic.agent.attempt import ReportInbox
    from elastic.agent.node import NodeAgent
    from elastic.common.events import read_events

    inbox = ReportInbox()
    host, port = inbox.address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for step in (1327, 1328):
            sock.sendto(json.dumps({"type": "step", "step": step, "pid": 4242}).encode(), (host, int(port)))
    time.sleep(0.05)  # loopback datagrams: queued at once
    agent = SimpleNamespace(inbox=inbox, events=EventLog(tmp_path / "agent.jsonl", "agent/node0"))
    NodeAgent._drop_stale_reports(agent, epoch=1)  # type: ignore[arg-type]
    assert inbox.drain() == []
    [dropped] = [e for e in read_events([tmp_path / "agent.jsonl"]) if e["kind"] == "agent.stale_reports"]
    assert (dropped["epoch"], dropped["count"], dropped["pids"]) == (1, 2, [4242])
    inbox.close()


def test_a_loop_blocked_on_etcd_is_not_the_workers_silence(tmp_path):
    """With the etcd leader killed, a heartbeat put held the agent's loop ~5 s while its workers kept
    reporting; judged before those reports were read, that was a 5 s "silence" of healthy workers
    (a hang at a 3 s step_timeout_s).  The reports waiting in the inbox are read first."""
    import socket
    import threading
    from types import SimpleNamespace

    from elastic.agent.attempt import ReportInbox
    from elastic.agent.failures import ProgressGuard
    from elastic.agent.metrics import AgentMetrics
    from elastic.agent.records import NodeRecords
    from elastic.agent.scopes import RunScope
    from elastic.agent.supervise import Supervisor
    from elastic.control.keys import RunKeys
    from elastic.control.runstate import RunState

    clock = FakeClock()
    state = RunState(MemoryStore(clock), RunKeys.of("/elastic", "r"))
    events = EventLog(tmp_path / "agent.jsonl", "agent/node0")
    inbox = ReportInbox()
    sup = Supervisor("node0", AgentConfig(heartbeat=HeartbeatConfig(step_timeout_s=3)), state, events,
                     AgentMetrics("node0", tmp_path), inbox, RunScope(SimpleNamespace(nnodes="2", run_id="r"),
                                                                        state, events),
                     NodeRecords(state, "node0", events, lambda: None), ProgressGuard(0), threading.Event(),
                     lambda: "running")
    sup.monitor = HeartbeatMonitor(sup.config.heartbeat, clock=clock)
    sup.monitor.observe({"type": "step", "rank": 0, "pid": 1, "step": 10, "step_time": 0.15})
    attempt = SimpleNamespace(number=0, runtime_s=lambda: 1.0)
    host, port = inbox.address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # sent while the loop was blocked
        sock.sendto(json.dumps({"type": "step", "rank": 0, "pid": 1, "step": 40, "step_time": 0.15}).encode(),
                    (host, int(port)))
    time.sleep(0.05)  # loopback datagrams: queued at once
    clock.now += 5.0
    try:
        assert sup._silence(attempt, epoch=0) is None  # type: ignore[arg-type]
        assert sup.monitor.summary()["step"] == 40
        clock.now += 3.5  # and a real silence after them is still judged
        assert sup.monitor.check()[0] != Silence.NONE
    finally:
        inbox.close()
