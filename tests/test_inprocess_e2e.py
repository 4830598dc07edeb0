"""In-process recovery end to end: real launcher, agents, etcd, torchrun, gloo workers, warm spares.

After torchrun has formed the world and retired, a dead worker is replaced by its node's warm spare
and every other worker re-forms in-process; a lost node's state comes from its buddy's memory; when
a snapshot is nowhere to be found, the run falls back to a full restart from disk.  Each test checks
the events that say which path recovered, the steps lost and (where the world size stays) that the
final weights are bitwise those of a fault-free run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from elastic.common.events import read_run_events
from elastic.worker.faults import write_fault
from tests.launch_helpers import kill_node, start_launcher, wait_for_event, worker_pid, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DIT_TRAINER = {"steps": 40, "seed": 0, "global_batch_size": 12, "step_sleep": 0.05,
               "model": {"preset": "tiny", "input_size": 8, "num_heads": 2}, "data": {"num_samples": 96},
               "optim": {"lr": 0.001, "warmup_steps": 5}}


def _dit_config(tmp_path: Path, name: str, nodes: str, nproc: int, cp: int) -> Path:
    trainer = {**DIT_TRAINER, "parallel": {"cp": cp}}
    (tmp_path / name).mkdir()
    cfg = write_run_config(tmp_path / name, nodes=nodes, run_id=name, launch={"workload": "dit", "nproc_per_node": nproc})
    data = yaml.safe_load(cfg.read_text())
    data["trainer"] = trainer  # the DiT section replaces the MLP one of the standard config
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _run(config: Path, env: dict, act=None, timeout: float = 240) -> tuple[dict, list[dict], float | None]:
    proc = start_launcher(config, env)
    run_dir = Path(yaml.safe_load(config.read_text())["run"]["dir"])
    acted = act(run_dir, proc) if act is not None else None
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads((run_dir / "summary.json").read_text()), read_run_events(run_dir), acted


def _after_retire(run_dir: Path, proc, node: str, min_step: int) -> None:
    wait_for_event(run_dir, lambda e: e["kind"] == "agent.spare_started" and e["source"] == f"agent/{node}",
                   timeout=150, proc=proc)
    wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["step"] >= min_step, timeout=60, proc=proc)


def _kill_worker(node: str, min_step: int, local_rank: int = 0):
    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, node, min_step)
        pid = worker_pid(run_dir, node, local_rank)
        kill_ts = time.time()
        os.kill(pid, signal.SIGKILL)
        return kill_ts
    return act


def _steps_lost(events: list[dict], kill_ts: float) -> int:
    before = max(e["step"] for e in events if e["kind"] == "trainer.step" and e["ts"] <= kill_ts)
    resumed = min(e["step"] for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts)
    return before - resumed


def _assert_in_process(events: list[dict], kill_ts: float) -> None:
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert recovered and all(e["path"] == "inprocess" for e in recovered)
    assert not any(e["kind"] == "agent.epoch_bump" and e["ts"] > kill_ts for e in events)  # no full restart
    disk = [e for e in events if e["kind"] == "checkpoint.loaded" and e["ts"] > kill_ts]
    assert disk == []  # memory only: nothing was read from the disk checkpoints after the fault


def test_dit_2x2_cp2_worker_kill_recovers_in_process_bitwise(tmp_path, subprocess_env):
    baseline, _, _ = _run(_dit_config(tmp_path, "base", "2", 2, cp=2), subprocess_env)
    summary, events, kill_ts = _run(_dit_config(tmp_path, "kill", "2", 2, cp=2), subprocess_env,
                                    _kill_worker("node1", min_step=8, local_rank=1))
    _assert_in_process(events, kill_ts)
    assert _steps_lost(events, kill_ts) <= 1
    replaced = [e for e in events if e["kind"] == "agent.inprocess_replace"]
    assert [e["source"] for e in replaced] == ["agent/node1"]
    # The world kept every rank: node1 wrote the plan itself as its round began (plan_in_place).
    assert [e["source"] for e in events if e["kind"] == "round.in_place"] == ["agent/node1"]
    spare = next(e for e in events if e["kind"] == "trainer.start" and e["ts"] > kill_ts)
    assert spare["loaded_from"] == "agent memory" and spare["cp"] == 2
    # The three healthy workers never restarted: each finished in the process it started in.
    starts = {e["pid"] for e in events if e["kind"] == "trainer.start" and e["ts"] <= kill_ts}
    done = {e["pid"] for e in events if e["kind"] == "trainer.done"}
    assert len(starts & done) == 3
    # The survivors' snapshots were copied beside their steps' starts (deferred), and restored bitwise.
    assert all(e["snapshot"]["deferred"] > 0 for e in events if e["kind"] == "trainer.done" and e["pid"] in starts)
    assert summary["final_checksum"] == baseline["final_checksum"]
    assert summary["restarts_counted"] == 1


# Soak tier: the same run with collectives that hang on a dead peer (NCCL's way) is the default
# suite's test_peer_hang_e2e.py::test_dit_worker_kill_recovers_in_process_bitwise_when_collectives_hang,
# and gloo's raising path runs in the cp=2 test above and the chaos quick suite's kill_worker.
@pytest.mark.soak
def test_dit_2x1_worker_kill_recovers_in_process_bitwise(tmp_path, subprocess_env):
    baseline, _, _ = _run(_dit_config(tmp_path, "base", "2", 1, cp=1), subprocess_env)
    summary, events, kill_ts = _run(_dit_config(tmp_path, "kill", "2", 1, cp=1), subprocess_env,
                                    _kill_worker("node0", min_step=8))
    _assert_in_process(events, kill_ts)
    assert _steps_lost(events, kill_ts) <= 1
    assert summary["final_checksum"] == baseline["final_checksum"]


# Soak tier: a node's loss in an elastic run, the world shrinking in-process from the buddy's memory, is
# the default suite's test_double_fault_e2e.py (the same loss, then a second fault; it asserts these
# records too) and test_peer_hang_e2e.py::test_node_loss_recovers_in_process_when_collectives_hang.
@pytest.mark.soak
def test_node_loss_continues_on_the_others_from_the_buddys_memory(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="3:4", steps=120, run_id="nodeloss")

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node2", min_step=10)
        return kill_node(run_dir, "node2")

    summary, events, kill_ts = _run(config, subprocess_env, act)
    _assert_in_process(events, kill_ts)
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert {e["world_size"] for e in recovered} == {3} and {e["loaded_from"] for e in recovered} == {"memory, resharded"}
    assert _steps_lost(events, kill_ts) <= 1
    lost = [e for e in events if e["kind"] == "agent.node_lost"]
    assert [e["node"] for e in lost] == ["node2"]  # one record of the loss, from one agent
    assert summary["last_step"] == 120 and summary["nodes"]["node2"] == -9


def test_a_kill_during_the_snapshot_push_loses_at_most_one_step(baseline_run, tmp_path, subprocess_env):
    config = write_run_config(tmp_path)  # the standard small config of the fault-free baseline
    write_fault(tmp_path / "run", "torn", {"kind": "snapshot_kill", "rank": 1, "step": 10})
    summary, events, _ = _run(config, subprocess_env)
    fired = next(e for e in events if e["kind"] == "fault.fired" and e["fault"] == "snapshot_kill")
    lost = _steps_lost(events, fired["ts"])
    assert lost <= 1
    torn = [e for e in events if e["kind"] == "memstate.request_failed"]
    assert torn, "the torn upload reached the agent's store and was refused"
    _assert_in_process(events, fired["ts"])
    assert summary["final_checksum"] == baseline_run["summary"]["final_checksum"]


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the fallback to disk stays in the default suite (a corrupted snapshot, below).
@pytest.mark.soak
def test_two_adjacent_nodes_lost_fall_back_to_the_disk_checkpoint(tmp_path, subprocess_env):
    """node1's snapshots live on node2 (its buddy): losing both leaves one rank's state nowhere in
    memory, so in-process recovery refuses and the run restarts from disk on the two nodes left."""
    config = write_run_config(tmp_path, nodes="2:4", steps=60, run_id="fallback")

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node2", min_step=10)
        kill_ts = kill_node(run_dir, "node1")
        kill_node(run_dir, "node2")
        return kill_ts

    summary, events, kill_ts = _run(config, subprocess_env, act)
    failed = [e for e in events if e["kind"] == "trainer.recovery_failed" and e["ts"] > kill_ts]
    assert failed and all("no snapshot" in e["error"] for e in failed), failed
    assert any(e["kind"] == "agent.inprocess_fallback" and e["reason"] == "recovery failed" for e in events)
    assert any(e["kind"] == "agent.epoch_bump" and e["ts"] > kill_ts for e in events)
    loaded = [e for e in events if e["kind"] == "checkpoint.loaded" and e["ts"] > kill_ts]
    assert loaded and all(e["loaded_from"] == "disk" and e["world_size"] == 2 for e in loaded)
    assert summary["last_step"] == 60


def test_a_corrupted_snapshot_is_refused_on_read_and_the_run_falls_back_to_disk(tmp_path, subprocess_env):
    """node1's worker stores every snapshot with one byte changed after its checksum (memory at rest);
    its spare's restore reads it from the agent, refuses it, and the run restarts from disk."""
    config = write_run_config(tmp_path, nodes="2", steps=40, run_id="corrupt")
    write_fault(tmp_path / "run", "corrupt", {"kind": "snapshot_corrupt", "node": "node1", "from_step": 1})
    summary, events, kill_ts = _run(config, subprocess_env, _kill_worker("node1", min_step=10))
    failed = [e for e in events if e["kind"] == "trainer.recovery_failed" and e["ts"] > kill_ts]
    assert any("checksum" in err for e in failed for err in e.get("snapshot_errors", [])), failed
    assert any(e["kind"] == "agent.epoch_bump" and e["ts"] > kill_ts for e in events)
    loaded = [e for e in events if e["kind"] == "checkpoint.loaded" and e["ts"] > kill_ts]
    assert loaded and all(e["loaded_from"] == "disk" for e in loaded)
    assert summary["last_step"] == 40
