"""Pushed faults: the agent's board and hold, the signal watch's delivery, the worker's latch and
monitor, and the monitor unwinding a training thread blocked in a real gloo collective whose peer
is frozen (no error anywhere: what NCCL does with a dead peer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elastic.checkpoint.memclient import MemStateClient, PeerHold
from elastic.checkpoint.memstate import MemStateServer, RoundBoard
from elastic.control.keys import RunKeys
from elastic.control.memstore import MemoryStore
from elastic.control.runstate import RunState
from elastic.control.signals import SignalWatch
from elastic.control.store import EtcdStore
from elastic.worker.faultwatch import FaultLatch, FaultMonitor, PeerAborted, hang_until_torn, wait_unless_torn

KEYS = RunKeys.of("/elastic", "push")


def test_the_board_keeps_the_newest_faulted_generation_and_answers_waits_from_a_generation_on():
    board = RoundBoard()
    assert board.wait_fault(0, 0, 0.01)["timeout"]
    assert board.post_fault(0, {"gen": 2, "node": "a"})
    assert not board.post_fault(0, {"gen": 2, "node": "b"})  # the same generation: already told
    assert not board.post_fault(0, {"gen": 1, "node": "c"})  # an older one says nothing new
    assert board.wait_fault(0, 2, 0.01)["value"]["node"] == "a"
    assert board.wait_fault(0, 3, 0.01)["timeout"]  # a worker past generation 2 waits on
    threading.Timer(0.05, lambda: board.post_fault(0, {"gen": 3, "node": "d"})).start()
    assert board.wait_fault(0, 3, 5.0)["value"]["node"] == "d"


def test_a_wait_for_a_faulted_generation_ends_at_once():
    """A worker waiting for generation 2's store hears that 2 broke instead of waiting out the join
    timeout for a store its rank 0 may never publish; a wait for 3 goes on."""
    board = RoundBoard()
    board.post_fault(0, {"gen": 1, "node": "a", "kind": "node_lost"})
    waited = board.wait(0, 2, "plan", 0.01)  # an older generation's fault: 2 may still form
    assert waited["ok"] is False and "faulted" not in waited and "within" in waited["error"]
    threading.Timer(0.05, lambda: board.post_fault(0, {"gen": 2, "node": "b", "kind": "worker_died"})).start()
    t0 = time.monotonic()
    answer = board.wait(0, 2, "store", 30.0)
    assert answer["ok"] is False and answer["faulted"] and "worker_died of b" in answer["error"]
    assert time.monotonic() - t0 < 5.0
    threading.Timer(0.05, lambda: board.post(0, 3, "plan", {"gen": 3})).start()
    assert board.wait(0, 3, "plan", 5.0) == {"ok": True, "value": {"gen": 3}}


def test_a_nodes_loss_pushed_before_the_plan_waits_for_the_plan_to_judge_it():
    """A loss pushed for generation 1 before its plan: the wait goes on; a plan that left the node
    out answers it (nothing broke); a plan that counts the node is faulted."""
    board = RoundBoard()
    board.post_fault(0, {"gen": 1, "node": "n2", "kind": "node_lost"})
    assert "faulted" not in board.wait(0, 1, "plan", 0.05)  # timed out waiting, not faulted
    assert board.wait(0, 1, "store", 0.05)["faulted"]  # a store is waited for once the plan is known
    threading.Timer(0.05, lambda: board.post(0, 1, "plan", {"plan": {"gen": 1, "lost": ["n2"]}})).start()
    assert board.wait(0, 1, "plan", 5.0)["ok"]
    assert board.wait(0, 1, "store", 0.05).get("faulted") is None  # the plan left n2 out: 1 stands
    board.post_fault(0, {"gen": 2, "node": "n3", "kind": "node_lost"})
    board.post(0, 2, "plan", {"plan": {"gen": 2, "lost": []}})
    assert board.wait(0, 2, "store", 5.0)["faulted"]  # the plan counts n3: 2 broke
    board.post_fault(0, {"gen": 3, "node": "n1", "kind": "worker_died"})
    assert board.wait(0, 3, "plan", 5.0)["faulted"]  # a dead worker breaks its generation at once


def test_a_faulted_generation_reaches_the_worker_as_a_peer_failure_it_retries():
    """Over the real memory store: the worker's wait raises GenerationFaulted, and the worker's
    judgement (is_peer_failure, as after a collective's error) re-forms for the next generation."""
    from elastic.checkpoint.memstate import GenerationFaulted
    from elastic.common.env import WorkerEnv
    from elastic.worker.generation import GenerationClient, RecoveryUnavailable
    from elastic.worker.inprocess import is_peer_failure

    server = MemStateServer(1 << 20)
    try:
        client = MemStateClient(server.addr, server.token, 5.0)
        server.board.post_fault(0, {"gen": 3, "node": "n2", "kind": "worker_died"})
        with pytest.raises(GenerationFaulted, match="generation 3 was faulted"):
            client.round_wait(0, 3, "store", 5.0)
        env = WorkerEnv(node_id="n1", run_id="r", etcd_endpoint="127.0.0.1:1", run_prefix="/p", epoch="0",
                        inprocess="5", join_gen="3")
        spare = GenerationClient(env, 0, client)
        with pytest.raises(RecoveryUnavailable) as raised:
            spare.next_plan()
        assert is_peer_failure(raised.value)
        assert not is_peer_failure(RecoveryUnavailable("no snapshot of step 7 for rank 2"))
    finally:
        server.close()


def test_a_store_connect_is_abandoned_when_its_generation_is_torn_down():
    """A c10d store client retries its connect in C until its timeout; nothing of an abort reaches
    it.  until_torn gives up on it as soon as the generation is torn down."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from elastic.worker.inprocess import until_torn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: the connect is refused, and retried
        latch = FaultLatch(lambda: {"connections": 0})
        latch.forming(4)
        threading.Timer(0.2, lambda: latch.fault_through(4, {"gen": 4, "node": "n7", "kind": "node_lost"})).start()
        t0 = time.monotonic()
        with pytest.raises(PeerAborted, match="n7"):
            until_torn(latch, 4, lambda: dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30)))
        assert time.monotonic() - t0 < 5.0
    latch.forming(5)
    assert until_torn(latch, 5, lambda: "connected") == "connected"


def test_a_worker_waits_for_a_fault_over_the_agents_memory_store():
    server = MemStateServer(1 << 20)
    try:
        client = MemStateClient(server.addr, server.token, 5.0)
        assert client.fault_wait(0, 0, 0.05) is None
        server.board.post_fault(0, {"gen": 0, "node": "n1", "ts": 1.0})
        assert client.fault_wait(0, 0, 5.0)["node"] == "n1"
    finally:
        server.close()


def test_a_hold_on_a_peer_agent_ends_when_that_agent_dies():
    """The ring's node-loss detector: a killed agent's kernel closes the held connection at once."""
    code = textwrap.dedent("""
        import sys, time
        from elastic.checkpoint.memstate import MemStateServer
        server = MemStateServer(1 << 20)
        print(server.addr, server.token, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        addr, token = proc.stdout.readline().split()
        lost = threading.Event()
        reasons: list[str] = []
        hold = PeerHold(addr, token, lambda why: (reasons.append(why), lost.set()))
        assert not lost.wait(0.3)  # a live peer: the connection stays silent
        proc.kill()
        assert lost.wait(5.0) and hold.lost and reasons
    finally:
        proc.kill()
        proc.wait()
    server = MemStateServer(1 << 20)  # closing a hold never reports a loss
    try:
        quiet = threading.Event()
        hold = PeerHold(server.addr, server.token, lambda why: quiet.set())
        hold.close()
        assert not quiet.wait(0.3)
    finally:
        server.close()


def test_the_signal_watch_delivers_a_pushed_fault_as_it_comes(etcd_endpoint):
    """One put by the agent that saw the fault; every other agent hears it on its signal stream's
    own thread, not at its supervisor's next look."""
    state = RunState(EtcdStore(etcd_endpoint), KEYS)
    heard: list[dict] = []
    got = threading.Event()
    with SignalWatch(state, "n2", on_fault=lambda record: (heard.append(record), got.set())) as watch:
        watch.current()
        state.push_fault({"epoch": 0, "gen": 4, "node": "n1", "kind": "worker_died", "ts": time.time()})
        assert got.wait(5.0)  # nobody called current(): the stream's reader delivered it
        assert heard == [{"epoch": 0, "gen": 4, "node": "n1", "kind": "worker_died", "ts": heard[0]["ts"]}]
        watch.current()
        assert len(heard) == 1  # the same put is delivered once


def test_a_fault_pushed_before_the_watch_starts_is_delivered_by_its_first_read():
    state = RunState(MemoryStore(), KEYS)
    state.push_fault({"epoch": 1, "gen": 0, "node": "n3"})
    heard: list[dict] = []
    with SignalWatch(state, "n1", on_fault=heard.append) as watch:
        watch.current()
        watch.current()
    assert [r["node"] for r in heard] == ["n3"]


def test_the_latch_tears_each_generation_down_once_and_only_the_current_one():
    torn: list[int] = []
    latch = FaultLatch(lambda: (torn.append(latch.gen), {"connections": 1})[1])
    assert latch.teardown(fault={"gen": 0}) == {"connections": 1}
    assert latch.teardown() is None  # the training thread's own teardown after the monitor's
    with pytest.raises(PeerAborted):
        latch.check(0)
    latch.forming(1)
    latch.check()  # generation 1 stands
    assert latch.teardown(gen=0) is None  # a late fault of an old generation cuts nothing of the new one
    assert torn == [0]


def test_a_fault_of_a_generation_not_yet_formed_fails_it_as_soon_as_it_forms():
    # A worker still in generation 1 hears that generation 2 broke (its plan counted a rank that
    # died before its agent could reap it): 1 is torn down now, 2 fails its check when it forms,
    # 3 forms as usual.  Without the mark the worker's store would wait for the dead rank.
    torn: list[int] = []
    latch = FaultLatch(lambda: (torn.append(latch.gen), {"connections": 0})[1])
    latch.forming(1)
    assert latch.fault_through(2, {"gen": 2, "node": "n1", "kind": "worker_died"}) == {"connections": 0}
    assert torn == [1]
    latch.forming(2)
    assert latch.torn() and latch.torn_event.is_set()
    with pytest.raises(PeerAborted, match="n1"):
        latch.check(2)
    assert latch.teardown() is None  # nothing of it formed: nothing to cut
    latch.forming(3)
    latch.check()
    assert not latch.torn_event.is_set()
    assert latch.fault_through(2, {"gen": 2}) is None and torn == [1]  # a late copy touches nothing of 3


def test_the_unwind_lands_only_inside_the_armed_zone():
    latch = FaultLatch(dict)
    outcome: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def training() -> None:
        try:
            with latch.armed():
                inside.set()
                while True:
                    time.sleep(0.001)
        except PeerAborted:
            outcome.append("unwound")
        release.wait(5.0)
        time.sleep(0.05)
        outcome.append("after the zone: untouched")

    thread = threading.Thread(target=training)
    thread.start()
    assert inside.wait(5.0)
    latch.teardown()
    assert latch.unwind()
    assert not latch.unwind()  # once per zone
    release.set()
    thread.join(5.0)
    assert outcome == ["unwound", "after the zone: untouched"]


def test_the_monitor_acts_on_a_fault_of_its_generation_only():
    class Channel:
        def __init__(self) -> None:
            self.board = RoundBoard()

        def fault_wait(self, epoch, since_gen, timeout_s):
            answer = self.board.wait_fault(epoch, since_gen, timeout_s)
            return answer["value"] if answer["ok"] else None

    channel, events = Channel(), []
    latch = FaultLatch(lambda: {"connections": 0})
    latch.forming(3)
    monitor = FaultMonitor(channel, 0, latch, lambda kind, **f: events.append((kind, f)), lambda: latch.gen)
    monitor.POLL_S = 0.05
    monitor.start()
    try:
        channel.board.post_fault(0, {"gen": 2, "node": "old", "ts": time.time()})  # before this generation
        time.sleep(0.2)
        assert events == [] and not latch.torn_event.is_set()
        channel.board.post_fault(0, {"gen": 3, "node": "n2", "kind": "worker_died", "ts": time.time()})
        deadline = time.monotonic() + 5.0
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        name, fields = events[0]
        assert name == "recovery.fault_pushed" and fields["acted"] and fields["node"] == "n2"
        assert latch.torn_event.is_set() and "n2" in latch.describe()
    finally:
        monitor.stop()


def _board_channel():
    class Channel:
        def __init__(self) -> None:
            self.board = RoundBoard()

        def fault_wait(self, epoch, since_gen, timeout_s):
            answer = self.board.wait_fault(epoch, since_gen, timeout_s)
            return answer["ok"] and answer["value"] or None
    return Channel()


@pytest.mark.parametrize("reaches_recovery", [False, True])
def test_a_training_thread_that_never_reaches_its_recovery_ends_the_process(reaches_recovery):
    """The training thread sits in a C call the abort does not end (here a sleep; once it was a
    gloo wait): the unwind cannot land, so after STUCK_S the monitor ends the process (on_stuck)
    and its spare takes the slot.  A thread that reaches its recovery in time is left alone."""
    channel, events, stuck = _board_channel(), [], threading.Event()
    latch = FaultLatch(lambda: {"connections": 0})
    latch.forming(2)
    monitor = FaultMonitor(channel, 0, latch, lambda kind, **f: events.append((kind, f)), lambda: latch.gen,
                           on_stuck=stuck.set)
    monitor.POLL_S, monitor.STUCK_S = 0.05, 0.3
    inside = threading.Event()

    def training() -> None:
        try:
            with latch.armed():
                inside.set()
                time.sleep(0.05 if reaches_recovery else 1.5)  # C: an asynchronous exception waits
        except PeerAborted:
            pass
        if reaches_recovery:
            latch.note_recovering()  # InProcess.leave()

    thread = threading.Thread(target=training)
    thread.start()
    assert inside.wait(5.0)
    monitor.start()
    try:
        channel.board.post_fault(0, {"gen": 2, "node": "n4", "kind": "node_lost", "ts": time.time()})
        assert stuck.wait(1.2) is not reaches_recovery
        if not reaches_recovery:
            name, fields = next(e for e in events if e[0] == "recovery.stuck")
            assert fields["gen"] == 2 and any("training" in line for line in fields["where"])
    finally:
        monitor.stop()
        thread.join(5.0)


def test_a_hang_ends_only_when_its_generation_is_torn_down():
    latch = FaultLatch(dict)
    latch.forming(5)
    raised: list[BaseException] = []

    def collective() -> None:
        try:
            hang_until_torn(latch, RuntimeError("Connection closed by peer"))
        except PeerAborted as exc:
            raised.append(exc)

    thread = threading.Thread(target=collective)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # blocked, as NCCL's collective would be
    latch.teardown(fault={"gen": 5, "node": "n9", "kind": "node_lost", "reason": "gone"})
    thread.join(5.0)
    assert raised and "n9" in str(raised[0]) and "Connection closed by peer" in str(raised[0])


def test_a_sliced_wait_returns_the_collective_or_leaves_once_its_generation_is_torn_down():
    """Real gloo, two ranks in threads: a wait longer than many slices still returns the collective's
    result; a wait whose peer never comes ends with PeerAborted at the teardown (in a slice)."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list = [None, None]

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    forming = [threading.Thread(target=form, args=(rank,)) for rank in (0, 1)]
    [t.start() for t in forming]
    [t.join(30) for t in forming]
    latch = FaultLatch(dict)
    latch.forming(3)
    mine, peer = torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
    late = threading.Timer(0.3, lambda: groups[1].allreduce([peer]).wait())
    late.start()
    t0 = time.monotonic()
    wait_unless_torn(latch, groups[0].allreduce([mine]))
    assert mine.tolist() == [3.0] * 3 and time.monotonic() - t0 >= 0.25  # six slices and more
    late.join()
    threading.Timer(0.3, lambda: latch.teardown(fault={"gen": 3, "node": "n2", "kind": "node_lost"})).start()
    pending = groups[0].allreduce([mine])
    t0 = time.monotonic()
    with pytest.raises(PeerAborted, match="n2"):
        wait_unless_torn(latch, pending)
    assert time.monotonic() - t0 < 0.3 + 2.0
    groups[1].allreduce([peer]).wait()  # the abandoned work completes: the groups close cleanly
    pending.wait()


_GLOO_PEERS = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    from elastic.checkpoint.memstate import MemStateServer
    from elastic.checkpoint.memclient import MemStateClient
    from elastic.worker.faultwatch import FaultLatch, FaultMonitor, install_hang_switch
    from elastic.worker.inprocess import abort_generation, is_peer_failure

    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    store = dist.TCPStore("127.0.0.1", int(port), 2, rank == 0, wait_for_workers=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        if mode == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)   # frozen: no error reaches rank 0, ever
        os._exit(0)                                # dead: rank 0's collective fails at once
    agent = MemStateServer(1 << 20)                # the agent's board, in this process for the test
    latch = FaultLatch(lambda: abort_generation({agent.port}))
    install_hang_switch(latch)
    events = []
    monitor = FaultMonitor(MemStateClient(agent.addr, agent.token, 10.0), 0, latch,
                           lambda kind, **f: events.append(f), lambda: latch.gen).start()
    def push():
        time.sleep(1.0)
        agent.board.post_fault(0, {"gen": 0, "node": "n1", "kind": "worker_died", "reason": "test",
                                   "ts": time.time()})
    threading.Thread(target=push, daemon=True).start()
    t0 = time.time()
    try:
        with latch.armed():
            while True:
                dist.all_reduce(t)
    except Exception as exc:
        print(json.dumps({"unwound_after_s": time.time() - t0, "type": type(exc).__name__,
                          "peer_failure": is_peer_failure(exc), "initialized": dist.is_initialized(),
                          "acted": [e["acted"] for e in events]}), flush=True)
""")


@pytest.mark.parametrize("mode, env", [("frozen", {}), ("dead", {"ELASTIC_TEST_PEER_FAILURE": "hang"})])
def test_the_monitor_unwinds_a_training_thread_blocked_in_a_gloo_collective(mode, env, subprocess_env):
    """Frozen peer: gloo never raises (a real hang).  Dead peer with the test switch: the raised
    error blocks, as NCCL's collective would.  Either way only the pushed fault (1 s in) ends the
    wait: the monitor aborts the world and the training thread unwinds with a peer failure."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_PEERS, str(rank), port, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**subprocess_env, **env}) for rank in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=60)
        report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        assert report, err[-2000:]
        assert report["peer_failure"] and report["acted"] == [True] and not report["initialized"]
        assert report["unwound_after_s"] >= 0.9  # nothing ended the wait before the push
        if env:
            assert report["type"] == "PeerAborted"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_node_loss_pushed_for_a_generation_whose_plan_left_the_node_out_breaks_nothing():
    """Measured once in a full run: node3's loss was pushed for generation 1 while 1 was being
    planned (node3 might have joined it); the plan then declared node3 lost.  The workers failed 1
    anyway, formed 2 relative to a world that never trained (no snapshot matched it) and fell back
    to disk.  A loss the plan already left out now breaks neither the latch nor the agent's waits."""
    torn: list[int] = []
    latch = FaultLatch(lambda: (torn.append(latch.gen), {"connections": 0})[1])
    latch.forming(0)
    latch.teardown()  # generation 0 failed: the worker re-forms
    latch.fault_through(1, {"gen": 1, "node": "node3", "kind": "node_lost"})
    latch.forming(1, {"node3"})
    latch.check(1)  # not torn: its plan formed without node3
    assert not latch.torn_event.is_set()
    assert latch.fault_through(1, {"gen": 1, "node": "node3", "kind": "node_lost"}) is None and torn == [0]
    assert latch.fault_through(1, {"gen": 1, "node": "node2", "kind": "node_lost"}) == {"connections": 0}
    # Another node's loss (or a worker's death) still breaks a generation ahead of its forming.
    latch.fault_through(2, {"gen": 2, "node": "node2", "kind": "node_lost"})
    latch.forming(2, {"node3"})
    with pytest.raises(PeerAborted):
        latch.check(2)

    board = RoundBoard()
    board.post(0, 1, "plan", {"plan": {"gen": 1, "lost": ["node3"], "gone": ["node3"]}})
    board.post_fault(0, {"gen": 1, "node": "node3", "kind": "node_lost"})
    waited = board.wait(0, 1, "store", 0.05)  # waits for the store as usual (here: times out)
    assert waited["ok"] is False and "faulted" not in waited
    board.post_fault(0, {"gen": 2, "node": "node2", "kind": "node_lost"})
    assert board.wait(0, 1, "store", 0.05)["faulted"]


_ABORT_RAISES = textwrap.dedent("""
    import contextlib, json
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from elastic.worker.inprocess import abort_generation

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.new_group([0])                       # a mesh's subgroup, as FSDP's are

    @contextlib.contextmanager
    def window_that_fails(group=None, device=None, *args, **kwargs):
        yield                                 # the aborts run here
        raise RuntimeError("a collective issued in the window failed on the aborted group")

    c10d._coalescing_manager = window_that_fails
    figures = abort_generation(set())
    left = dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    print(json.dumps({"figures": figures, "initialized_after_abort": left, "reduced": t.tolist()}))
""")


def test_a_generation_whose_abort_raises_is_forgotten_so_the_next_one_forms(subprocess_env):
    """``_abort_process_group`` aborts inside a coalescing window; a collective issued into that
    window makes the window's end raise, after the aborts but before the world's tables are cleared.
    The teardown then clears them itself: the next ``init_process_group`` forms (before, it raised
    "trying to initialize the default process group twice")."""
    proc = subprocess.run([sys.executable, "-c", _ABORT_RAISES], capture_output=True, text=True, timeout=60,
                          env=subprocess_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["figures"]["abort_error"] is True and "aborted group" in out["figures"]["error"]
    assert out["figures"]["groups_aborted"] == 2
    assert out["initialized_after_abort"] is False and out["reduced"] == [1.0, 1.0]


_LEFTOVER = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from elastic.worker.inprocess import abort_generation, forget_leftover_groups

    def names():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return [dist.new_group([0]).group_name, dist.new_group([0]).group_name]

    fresh = names()
    abort_generation(set())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    late = dist.new_group([0])           # as a mesh's new_group that finishes after the monitor's abort:
    c10d._update_default_pg(None)        # the abort cleared the world, this group registered after it
    c10d._world.pg_map.pop(c10d._world.default_pg, None) if c10d._world.default_pg else None
    forgotten = forget_leftover_groups()
    again = names()
    print(json.dumps({"fresh": fresh, "again": again, "forgotten": forgotten}))
""")


def test_groups_registered_after_a_teardown_are_forgotten_so_the_next_world_names_its_groups_alike(subprocess_env):
    """A group the training thread registered after the fault monitor's abort (its mesh still
    forming) made the next generation name its groups differently from its peers; they then waited
    for each other's store keys for 60 s.  Leaving a generation forgets such leftovers."""
    proc = subprocess.run([sys.executable, "-c", _LEFTOVER], capture_output=True, text=True, timeout=60,
                          env=subprocess_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["forgotten"] >= 1 and out["again"] == out["fresh"], out
