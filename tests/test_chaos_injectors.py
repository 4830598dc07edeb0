"""Each injector really fires: processes really die or stop, files really change, etcd really freezes.

Cheap stand-ins replace the training run: a sleeping child process plays the
worker/agent/torchrun (its pid written into hand-made run events), a
single-process CheckpointManager writes a real committed checkpoint, and the
conftest etcd fixture is the server to freeze.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from chaos.follow import RunFollower
from chaos.injectors import (
    InjectionContext, TargetNotFound,
)
from chaos.plan import parse_plan
from elastic.worker.faults import FaultHooks
from elastic.common.procs import alive

pytestmark = pytest.mark.timeout(120)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper():
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class Events:
    """Hand-written run events (the fields the runtime's writers emit)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "events"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ts = time.time()

    def add(self, source: str, kind: str, pid: int, **fields) -> None:
        self.ts += 0.01
        name = source.replace("/", "-") + ".jsonl"
        event = {"ts": self.ts, "mono": self.ts, "kind": kind, "source": source, "pid": pid, **fields}
        with open(self.dir / name, "a") as fh:
            fh.write(json.dumps(event) + "\n")


def make_ctx(run_dir: Path) -> InjectionContext:
    follower = RunFollower(run_dir)
    follower.poll()
    return InjectionContext(run_dir, follower, None, ["node0", "node1"])


def injector(name: str, target: str, **params):
    spec = parse_plan({"faults": [{"fault": name, "target": target, "at_step": 0, "params": params}]}).faults[0]
    return spec.build()


def wait_until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# -- signals ------------------------------------------------------------------------------
def test_kill_worker_sigkills_the_targets_live_worker(tmp_path, sleeper):
    w0, w1 = sleeper(), sleeper()
    ev = Events(tmp_path)
    ev.add("trainer/rank0", "trainer.start", w0.pid, node="node0", step=0)
    ev.add("trainer/rank1", "trainer.start", w1.pid, node="node1", step=0)
    ev.add("trainer/rank1", "trainer.step", w1.pid, step=5, loss=0.1, step_time=0.1)
    record = injector("kill_worker", "node1").inject(make_ctx(tmp_path))
    assert record.pids == [w1.pid] and record.step == 5 and record.detail["rank"] == 1
    assert w1.wait(timeout=5) == -9
    assert w0.poll() is None
    # Now node1 has no live worker: the injector says so instead of hitting something else.
    with pytest.raises(TargetNotFound):
        injector("kill_worker", "node1").inject(make_ctx(tmp_path))
    injector("kill_worker", "rank0").inject(make_ctx(tmp_path))
    assert w0.wait(timeout=5) == -9


def test_kill_agent_sigkills_the_node_agent(tmp_path, sleeper):
    agent = sleeper()
    Events(tmp_path).add("launcher", "launcher.agent_started", 1, node="node1", agent_pid=agent.pid)
    record = injector("kill_agent", "node1").inject(make_ctx(tmp_path))
    assert record.pids == [agent.pid]
    assert agent.wait(timeout=5) == -9


def test_hang_worker_stops_and_optionally_resumes(tmp_path, sleeper):
    w = sleeper()
    Events(tmp_path).add("trainer/rank1", "trainer.start", w.pid, node="node1", step=0)
    hang = injector("hang_worker", "rank1", resume_after_s=0.5)
    hang.inject(make_ctx(tmp_path))
    assert wait_until(lambda: proc_state(w.pid) == "T", 2), "not stopped"
    assert wait_until(lambda: proc_state(w.pid) != "T", 5), "not continued after resume_after_s"
    forever = injector("hang_worker", "rank1")
    forever.inject(make_ctx(tmp_path))
    assert wait_until(lambda: proc_state(w.pid) == "T", 2)
    time.sleep(0.6)
    assert proc_state(w.pid) == "T"  # no resume asked for: stays stopped
    forever.cleanup()  # but never left stopped after the run
    assert wait_until(lambda: proc_state(w.pid) != "T", 2)


def test_kill_during_rendezvous_waits_for_a_new_round(tmp_path, sleeper):
    torchrun, worker = sleeper(), sleeper()
    ev = Events(tmp_path)
    ev.add("agent/node1", "agent.state", 11, state="RUNNING", epoch=0, torchrun_pid=worker.pid)
    ev.add("trainer/rank1", "trainer.start", worker.pid, node="node1", step=0)
    inj = injector("kill_during_rendezvous", "node1")
    assert not inj.ready(make_ctx(tmp_path))  # epoch 0 is excluded by min_epoch=1, and it has started
    ev.add("agent/node1", "agent.state", 11, state="RUNNING", epoch=1, torchrun_pid=torchrun.pid)
    ctx = make_ctx(tmp_path)
    assert inj.ready(ctx)
    record = inj.inject(ctx)
    assert record.pids == [torchrun.pid] and record.detail["epoch"] == 1
    assert torchrun.wait(timeout=5) == -9
    # Once a worker of the round has started, the rendezvous is over.
    ev.add("agent/node1", "agent.state", 11, state="RUNNING", epoch=2, torchrun_pid=worker.pid)
    ev.add("trainer/rank0", "trainer.start", 12, node="node0", step=4)
    assert not injector("kill_during_rendezvous", "node1").ready(make_ctx(tmp_path))


def test_kill_during_checkpoint_only_inside_the_save_window(tmp_path, sleeper):
    w = sleeper()
    ev = Events(tmp_path)
    ev.add("trainer/rank1", "trainer.start", w.pid, node="node1", step=0)
    ev.add("trainer/rank1", "checkpoint.save_start", w.pid, step=4)
    ev.add("trainer/rank1", "checkpoint.committed", w.pid, step=4)
    inj = injector("kill_during_checkpoint", "rank1", min_step=4)
    assert not inj.ready(make_ctx(tmp_path))  # step 4's save already committed
    ev.add("trainer/rank1", "checkpoint.save_start", w.pid, step=8)
    ctx = make_ctx(tmp_path)
    assert inj.ready(ctx)
    record = inj.inject(ctx)
    assert record.pids == [w.pid] and record.detail["checkpoint_step"] == 8
    assert w.wait(timeout=5) == -9



def test_kill_spare_kills_the_nodes_unassigned_warm_spare_only(tmp_path):
    def spare() -> subprocess.Popen:
        # What the agent starts: `python -m elastic.worker.spare ...` (its cmdline names the module).
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "elastic.worker.spare"])
        # Right after fork the child still shows the parent's command line.
        assert wait_until(lambda: b"elastic.worker.spare" in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), 10)
        return proc

    old, s0, s1 = spare(), spare(), spare()
    impostor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ev = Events(tmp_path)
        ev.add("agent/node1", "agent.spare_started", 21, spare_pid=old.pid)
        ev.add("agent/node0", "agent.spare_started", 20, spare_pid=s0.pid)
        ev.add("agent/node1", "agent.inprocess_replace", 21, local_rank=0, spare_pid=old.pid, gen=1)
        with pytest.raises(TargetNotFound):  # node1's only spare became a worker: it is no target
            injector("kill_spare", "node1").inject(make_ctx(tmp_path))
        ev.add("agent/node1", "agent.spare_started", 21, spare_pid=s1.pid)
        record = injector("kill_spare", "node1").inject(make_ctx(tmp_path))
        assert record.pids == [s1.pid] and record.detail["node"] == "node1"
        assert s1.wait(timeout=5) == -9
        assert old.poll() is None and s0.poll() is None
        with pytest.raises(TargetNotFound):  # dead (a zombie until reaped) is not a spare either
            injector("kill_spare", "node1").inject(make_ctx(tmp_path))
        ev.add("agent/node2", "agent.spare_started", 22, spare_pid=impostor.pid)  # a pid that is no spare
        with pytest.raises(TargetNotFound):
            injector("kill_spare", "node2").inject(make_ctx(tmp_path))
        assert impostor.poll() is None
        assert injector("kill_spare", "any").inject(make_ctx(tmp_path)).pids == [s0.pid]
        assert s0.wait(timeout=5) == -9
    finally:
        for proc in (old, s0, s1, impostor):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_kill_during_recovery_waits_for_a_replacement_that_has_not_stepped(tmp_path, sleeper):
    w0, w1, replacement = sleeper(), sleeper(), sleeper()
    ev = Events(tmp_path)
    ev.add("trainer/rank0", "trainer.start", w0.pid, node="node0", step=0)
    ev.add("trainer/rank1", "trainer.start", w1.pid, node="node1", step=0)
    ev.add("trainer/rank0", "trainer.step", w0.pid, step=1, loss=0.1, step_time=0.1)
    inj = injector("kill_during_recovery", "node0")
    assert not inj.ready(make_ctx(tmp_path))  # the first start is no recovery
    ev.add("agent/node1", "agent.inprocess_replace", 31, local_rank=0, spare_pid=replacement.pid, gen=1)
    ctx = make_ctx(tmp_path)
    assert inj.ready(ctx)
    record = inj.inject(ctx)
    assert record.fault == "kill_during_recovery" and record.pids == [w0.pid]
    assert w0.wait(timeout=5) == -9
    ev.add("trainer/rank1", "trainer.step", replacement.pid, step=2, loss=0.1, step_time=0.1)
    assert not injector("kill_during_recovery", "node1").ready(make_ctx(tmp_path))  # re-formed


@pytest.fixture
def etcd3(tmp_path):
    from elastic.control.etcd_cluster import EtcdCluster

    cluster = EtcdCluster(tmp_path / "etcd3", members=3)
    cluster.start()
    yield cluster
    for member in cluster.members:
        member.resume()
    cluster.close()


def test_etcd_member_stop_stops_the_leader_and_the_other_two_serve(tmp_path, etcd3, etcd_server):
    from elastic.control.store import EtcdStore

    Events(tmp_path).add("launcher", "launcher.etcd_started", 1, etcd_pid=etcd3.pids[0], etcd_pids=etcd3.pids,
                         endpoint=etcd3.endpoints)
    leader = etcd3.leader_index()
    stop = injector("etcd_member_stop", "etcd", duration_s=1.5)
    record = stop.inject(make_ctx(tmp_path))
    pid = etcd3.pids[leader]
    try:
        assert record.pids == [pid] and record.detail["member"] == leader and record.detail["leader"]
        assert wait_until(lambda: proc_state(pid) == "T", 1.0)
        store = EtcdStore(etcd3.endpoints, request_timeout=1.0, retry_deadline=10.0)
        store.put("/chaos/member", "written while one member is stopped")  # two members keep a quorum
        assert wait_until(lambda: proc_state(pid) != "T", 5)
    finally:
        stop.cleanup()
    assert wait_until(lambda: etcd_healthy(etcd3.members[leader].endpoint), 10)
    # A single-member etcd has no member to spare.
    single = tmp_path / "single"
    Events(single).add("launcher", "launcher.etcd_started", 1, etcd_pid=etcd_server.pid, etcd_pids=[etcd_server.pid],
                       endpoint=etcd_server.endpoint)
    with pytest.raises(TargetNotFound, match="3-member"):
        injector("etcd_member_stop", "etcd").inject(make_ctx(single))


def test_cluster_runner_member_stop_holds_its_member_through_a_whole_etcd_outage(etcd3):
    from chaos.cluster_runner import _MemberStop, _WholeEtcd
    from chaos.injectors import MemberStopParams

    whole = _WholeEtcd(etcd3)
    stop = _MemberStop(MemberStopParams(duration_s=5.0, member=2), whole)
    detail = stop.begin()
    pids = etcd3.pids
    assert detail["member"] == 2 and wait_until(lambda: proc_state(pids[2]) == "T", 1.0)
    whole.pause()  # an etcd_outage meanwhile: every member stops ...
    assert wait_until(lambda: all(proc_state(p) == "T" for p in pids), 1.0)
    whole.resume()  # ... and comes back, except the one the member stop still holds
    assert wait_until(lambda: proc_state(pids[0]) != "T" and proc_state(pids[1]) != "T", 2.0)
    assert proc_state(pids[2]) == "T"
    stop.end()
    assert wait_until(lambda: proc_state(pids[2]) != "T", 2.0)
    assert wait_until(lambda: etcd_healthy(etcd3.members[2].endpoint), 10)

# -- in-worker fault files --------------------------------------------------------------------
def test_nan_fault_makes_the_workers_hook_return_nan_once(tmp_path):
    record = injector("nan", "rank1", step=7).inject(make_ctx(tmp_path))
    assert Path(record.detail["file"]).exists()
    rank1, rank0 = FaultHooks(tmp_path, rank=1), FaultHooks(tmp_path, rank=0)
    assert rank0.loss(7, 1.0) == 1.0  # other ranks untouched
    assert rank1.loss(6, 1.0) == 1.0
    assert math.isnan(rank1.loss(7, 1.0))
    assert rank1.loss(7, 1.0) == 1.0  # fired once: the replay after a rollback runs clean


def test_straggler_fault_slows_only_its_rank_and_steps(tmp_path):
    ev = Events(tmp_path)
    ev.add("trainer/rank0", "trainer.step", 1, step=3, loss=0.1, step_time=0.1)
    record = injector("straggler", "node1", delay_s=0.2, num_steps=2).inject(make_ctx(tmp_path))
    assert record.detail["spec"]["from_step"] == 5 and record.detail["spec"]["to_step"] == 6
    slow, fast = FaultHooks(tmp_path, rank=1), FaultHooks(tmp_path, rank=0)

    def timed(hooks, step):
        t0 = time.monotonic()
        hooks.before_step(step)
        return time.monotonic() - t0

    assert timed(slow, 5) >= 0.2 and timed(slow, 6) >= 0.2
    assert timed(slow, 7) < 0.1 and timed(fast, 5) < 0.1


def test_ckpt_write_error_fault_hands_the_writer_an_enospc(tmp_path):
    injector("ckpt_write_error", "any", step=8).inject(make_ctx(tmp_path))
    hooks = FaultHooks(tmp_path, rank=0)
    assert hooks.checkpoint_write_error(4) is None
    err = hooks.checkpoint_write_error(8)
    assert isinstance(err, OSError) and err.errno == 28


def test_ckpt_write_error_without_a_step_fails_the_first_save_from_two_steps_on(tmp_path):
    """Soak seed 2 (2026-12-05): planted for step 642 with saves every 10 steps, it never fired.
    From the clock it now fails the first save at or after its step, once, on both paths."""
    from elastic.agent.fault_actions import ACTIONS, NodeView

    injector("ckpt_write_error", "any").inject(make_ctx(tmp_path))  # the run is at step 0: from step 2
    hooks = FaultHooks(tmp_path, rank=0)
    assert hooks.checkpoint_write_error(1) is None
    assert isinstance(hooks.checkpoint_write_error(10), OSError)  # the first save from step 2
    assert hooks.checkpoint_write_error(20) is None  # once
    agent_dir = tmp_path / "agent"
    view = NodeView("node2", agent_dir, agent_dir / "ckpt", step=640)
    done = ACTIONS["ckpt_write_error"](view, {})
    assert done["spec"] == {"kind": "ckpt_write_error", "from_step": 642, "node": "node2"}
    node2 = FaultHooks(agent_dir, rank=0, node="node2")
    assert node2.checkpoint_write_error(642) is not None  # a save at 642 (any interval) would fail
    asked = ACTIONS["ckpt_write_error"](NodeView("node2", tmp_path / "b", tmp_path / "b" / "ckpt", step=640),
                                        {"step": 650})
    assert asked["spec"] == {"kind": "ckpt_write_error", "step": 650, "node": "node2"}
    assert FaultHooks(tmp_path / "b", rank=0, node="node2").checkpoint_write_error(650) is not None


def test_bad_hardware_writes_the_nodes_diag_overlay(tmp_path):
    inj = injector("bad_hardware", "node2", readings={"gpu": {0: {"ecc_uncorrected_volatile": 4}}})
    record = inj.inject(make_ctx(tmp_path))
    path = tmp_path / "faults" / "diag-node2.yaml"
    assert record.detail["file"] == str(path)
    assert yaml.safe_load(path.read_text()) == {"gpu": {0: {"ecc_uncorrected_volatile": 4}}}
    injector("bad_hardware", "node1").inject(make_ctx(tmp_path))
    assert yaml.safe_load((tmp_path / "faults" / "diag-node1.yaml").read_text()) == {"gemm": {"tflops_scale": 0.1}}


@pytest.mark.slow
def test_bad_hardware_overlay_really_fails_the_diag_screen(tmp_path):
    injector("bad_hardware", "node1").inject(make_ctx(tmp_path))
    overlay = tmp_path / "faults" / "diag-node1.yaml"
    proc = subprocess.run([sys.executable, "-m", "diagnostics.cli", "burnin", "--quick", "--checks", "gemm",
                           "--json", str(tmp_path / "r.json"), "--inject", str(overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert [c["verdict"] for c in checks if c["name"] == "gemm"] == ["fail"]


# -- checkpoint corruption ----------------------------------------------------------------------
@pytest.fixture
def committed(tmp_path):
    import torch

    from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager

    manager = CheckpointManager(CheckpointConfig(interval_steps=4, keep_last=3), tmp_path / "checkpoints")
    for step in (4, 8):
        manager.save(step, {"app": {"w": torch.arange(4096, dtype=torch.float32) * step}})
    manager.close()  # saves commit in the background
    for step in (4, 8):
        manager.verify(step)  # both good before the fault
    return manager


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_corrupt_checkpoint_damages_the_newest_commit_so_verify_rejects_it(tmp_path, committed, mode):
    from elastic.checkpoint.manager import CheckpointCorrupt

    record = injector("corrupt_checkpoint", "any", mode=mode).inject(make_ctx(tmp_path))
    assert record.detail["checkpoint_step"] == 8
    assert Path(record.detail["file"]).name == "shard-00000.safetensors"  # the largest data file
    what = "checksum" if mode == "flip" else "size"  # a truncated file is caught by its size first
    with pytest.raises(CheckpointCorrupt, match=f"step-00000008: {what} mismatch in shard-00000.safetensors"):
        committed.verify(8)
    committed.verify(4)  # the older one is untouched

    from chaos.analysis import verify_committed

    verdicts = verify_committed(tmp_path / "checkpoints")
    assert verdicts[4] is None and "checksum mismatch" in verdicts[8]


def test_corrupt_checkpoint_follows_a_custom_checkpoint_dir(tmp_path):
    """The launcher's run file (config.resolved.yaml) names checkpoint.dir: chaos must use it, not the default."""
    import torch

    from chaos.analysis import verify_committed
    from chaos.injectors import checkpoint_root
    from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
    from elastic.common.config import override
    from elastic.run.schema import RESOLVED_NAME, RunConfig, dump_run_file

    dump_run_file(override(RunConfig(), "checkpoint.dir", "ckpt-elsewhere"), tmp_path / RESOLVED_NAME)
    assert checkpoint_root(tmp_path) == tmp_path / "ckpt-elsewhere"
    manager = CheckpointManager(CheckpointConfig(dir="ckpt-elsewhere"), checkpoint_root(tmp_path))
    manager.save(4, {"app": {"w": torch.arange(4096, dtype=torch.float32)}})
    manager.close()
    record = injector("corrupt_checkpoint", "any", mode="flip").inject(make_ctx(tmp_path))
    assert Path(record.detail["file"]).parent.parent == tmp_path / "ckpt-elsewhere"
    assert "checksum mismatch" in verify_committed(checkpoint_root(tmp_path))[4]
    assert not (tmp_path / "checkpoints").exists()


def test_corrupt_checkpoint_without_a_commit_is_not_found(tmp_path):
    (tmp_path / "checkpoints" / ".step-00000004.tmp-1").mkdir(parents=True)
    with pytest.raises(TargetNotFound):
        injector("corrupt_checkpoint", "any").inject(make_ctx(tmp_path))


# -- etcd ----------------------------------------------------------------------------------------
def etcd_healthy(endpoint: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as resp:
            return b'"health":"true"' in resp.read()
    except OSError:
        return False


def test_etcd_outage_stop_freezes_then_thaws_the_server(tmp_path, etcd_server):
    Events(tmp_path).add("launcher", "launcher.etcd_started", 1, etcd_pid=etcd_server.pid,
                         endpoint=etcd_server.endpoint)
    assert etcd_healthy(etcd_server.endpoint)
    outage = injector("etcd_outage", "etcd", duration_s=1.5)
    t0 = time.monotonic()
    outage.inject(make_ctx(tmp_path))
    try:
        # SIGSTOP is delivered asynchronously: a busy server can still read "R" for a moment.
        assert wait_until(lambda: proc_state(etcd_server.pid) == "T", 1.0)
        assert not etcd_healthy(etcd_server.endpoint, timeout=0.5)  # really unresponsive
        assert wait_until(lambda: etcd_healthy(etcd_server.endpoint), 6)
        assert time.monotonic() - t0 >= 1.5
    finally:
        outage.cleanup()


def test_etcd_outage_kill_restarts_it_with_its_data(tmp_path, etcd_server):
    from elastic.control.store import EtcdStore

    EtcdStore(etcd_server.endpoint).put("/chaos/probe", "kept")
    Events(tmp_path).add("launcher", "launcher.etcd_started", 1, etcd_pid=etcd_server.pid,
                         endpoint=etcd_server.endpoint)
    old = etcd_server.pid
    outage = injector("etcd_outage", "etcd", duration_s=1.0, mode="kill")
    outage.inject(make_ctx(tmp_path))
    try:
        assert wait_until(lambda: not alive(old), 3)
        assert not etcd_healthy(etcd_server.endpoint)
        assert wait_until(lambda: outage.respawned_pid is not None and etcd_healthy(etcd_server.endpoint), 15)
        assert outage.respawned_pid != old
        assert EtcdStore(etcd_server.endpoint).get("/chaos/probe").value in ("kept", b"kept")
    finally:
        outage.cleanup()
    assert not alive(outage.respawned_pid)  # cleanup stops the server it started


def test_exclusion_watcher_copies_etcd_exclusion_records_into_events(tmp_path, etcd_server):
    from chaos.runner import ExclusionWatcher
    from elastic.control.runstate import Exclusions
    from elastic.common.events import EventLog, read_run_events
    from elastic.control.store import EtcdStore

    log = EventLog(tmp_path / "events" / "chaos.jsonl", "chaos")
    watcher = ExclusionWatcher(etcd_server.endpoint, "/elastic/runs/t", log, interval_s=0.1)
    watcher.start()
    try:
        Exclusions(EtcdStore(etcd_server.endpoint), "/elastic/runs/t").add("node2", "diag: ecc errors")
        assert wait_until(lambda: any(e["kind"] == "chaos.exclusions" and e["nodes"] == ["node2"]
                                      for e in read_run_events(tmp_path)), 5)
    finally:
        watcher.stop()
    record = next(e for e in read_run_events(tmp_path) if e["kind"] == "chaos.exclusions")
    assert json.loads(record["records"]["node2"])["reason"] == "diag: ecc errors"
