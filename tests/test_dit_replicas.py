"""Replica-group mode for the DiT trainer (torchft): the data split, the timeout ladder, and the real thing.

The end-to-end tests run the real stack (launcher, embedded etcd, one agent per replica group, the
real torchft Lighthouse, torchrun, gloo) with the tiny DiT:

* SIGKILL one group's worker: the survivors commit again within seconds without restarting, at
  most one step is thrown away, the restarted group heals from a live peer, every committed step
  trains the right global batch split over its quorum, and all groups end with equal weights;
* SIGKILL every group's worker at once: the groups resume from the newest committed disk checkpoint
  (written by the quorum's rank-0 group) and end bitwise equal to a fault-free run;
* NaN in one group: every group skips that step; a hang in one group is detected by its agent
  while the other keeps training, and the hung group heals when it comes back.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torchft")

from elastic.common.config import ConfigError, from_dict
from elastic.common.events import read_run_events
from elastic.run.schema import RunConfig
from elastic.worker.faults import write_fault
from tests.launch_helpers import start_launcher, wait_for_event
from trainer.data import GlobalSampler, part_bounds
from trainer.dit_ft_train import batch_crc


# -- the data split (fast) --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [6, 8, 12, 13])
def test_group_slices_tile_every_global_batch_at_any_quorum_size(n):
    batch = list(range(100, 100 + n))
    for groups in range(1, 4):
        for dp in (1, 2):
            if n < groups * dp:
                continue
            seen = []
            for g in range(groups):
                lo, hi = part_bounds(n, g, groups)
                for r in range(dp):
                    mine, weight, bounds = GlobalSampler.group_slice(batch, g, groups, r, dp)
                    assert bounds == (lo, hi) and set(mine) <= set(batch[lo:hi])
                    seen += mine
                    # Averaging over dp ranks and then over groups weighs a rank's mean loss by
                    # weight / (dp * groups): that must be its share of the batch.
                    assert weight / (dp * groups) == pytest.approx(len(mine) / n)
            assert seen == batch  # contiguous, in order, nothing twice, nothing left out


def test_equal_parts_are_the_plain_trainers_split_with_weight_one():
    batch = list(range(24))
    for g in range(3):
        for r in range(2):
            mine, weight, _ = GlobalSampler.group_slice(batch, g, 3, r, 2)
            assert weight == 1.0 and mine == GlobalSampler.rank_slice(batch, g * 2 + r, 6)
    with pytest.raises(ValueError, match="cannot feed 4 groups x 2 dp ranks"):
        GlobalSampler.group_slice(list(range(7)), 0, 4, 0, 2)


def _dit_replicas(**sections) -> dict:
    cfg = {"launch": {"nodes": "2", "workload": "dit"}, "replicas": {"enabled": True}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def test_dit_runs_its_torchft_entry_and_the_timeout_ladder_is_enforced():
    cfg = from_dict(RunConfig, _dit_replicas())
    assert cfg.entrypoint() == ["-m", "trainer.dit_ft_train"] and not cfg.inprocess_recovery()
    cases = {
        "replicas.heartbeat_timeout_ms: must be below replicas.quorum_timeout_s":
            {"replicas": {"heartbeat_timeout_ms": 6000}},
        "replicas.quorum_timeout_s: must be below replicas.timeout_s": {"replicas": {"quorum_timeout_s": 10}},
        "replicas.join_timeout_ms: must be below replicas.quorum_timeout_s": {"replicas": {"join_timeout_ms": 5000}},
        "replicas.timeout_s: must be below agent.heartbeat.step_timeout_s":
            {"agent": {"heartbeat": {"step_timeout_s": 8}}},
    }
    for message, sections in cases.items():
        with pytest.raises(ConfigError, match="^" + message.replace(".", r"\.")) as err:
            from_dict(RunConfig, _dit_replicas(**sections))
        assert "\n" not in str(err.value)
    # The ladder is a replica-mode rule: the same timeouts are fine without it.
    from_dict(RunConfig, {"agent": {"heartbeat": {"step_timeout_s": 8}}})


def test_launch_check_uses_the_group_world_and_the_most_groups():
    cfg = from_dict(RunConfig, _dit_replicas(launch={"nodes": "2:4", "nproc_per_node": 2},
                                             trainer={"global_batch_size": 8, "parallel": {"cp": 2}}))
    cfg.check_launch()  # groups of dp 1 x cp 2; 8 samples feed up to 4 groups
    small = from_dict(RunConfig, _dit_replicas(launch={"nodes": "2:4", "nproc_per_node": 2},
                                               trainer={"global_batch_size": 6}))
    with pytest.raises(ConfigError, match=r"^trainer\.global_batch_size: must be >= 8: 4 replica groups x dp 2"):
        small.check_launch()


def test_replica_examples_load():
    root = Path(__file__).resolve().parents[1] / "examples"
    from elastic.run.schema import load_run_file

    local = load_run_file(root / "dit-replicas.yaml")
    assert local.replicas.enabled and local.workload().name == "dit"
    local.check_launch()
    big = load_run_file(root / "dit-64node-replicas.yaml")
    assert big.replicas.enabled and (big.launch.max_nodes, big.launch.nproc_per_node) == (64, 8)
    big.check_launch()


# -- end to end (slow) -----------------------------------------------------------------------------
# join_timeout_ms well above a step (~0.3 s here): a healthy group is never left out of a quorum.
GROUP_LADDER = {"heartbeat_timeout_ms": 1000, "join_timeout_ms": 2000, "quorum_timeout_s": 4, "timeout_s": 6}


def _config(tmp_path: Path, nodes: int, steps: int, interval: int = 5, min_replicas: int = 1, **trainer) -> Path:
    cfg = {
        "run": {"id": "dft", "dir": str(tmp_path / "run")},
        "launch": {"nodes": str(nodes), "nproc_per_node": 1, "workload": "dit"},
        "agent": {"max_restarts": 3, "term_grace_s": 2, "preflight": {"enabled": False},
                  "heartbeat": {"step_timeout_s": 8}},
        "checkpoint": {"interval_steps": interval, "keep_last": 2},
        "replicas": {"enabled": True, "min_replicas": min_replicas, **GROUP_LADDER},
        "trainer": {"steps": steps, "global_batch_size": 6, "step_sleep": 0.05, **trainer},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _attempts(events: list[dict], node: str) -> list[dict]:
    return [e for e in events if e["kind"] == "trainer.step" and e["source"] == f"trainer/{node}/rank0"]


def _checksums(run_dir: Path, nodes: int) -> set[str]:
    return {(run_dir / f"final_checksum-node{i}.txt").read_text().strip() for i in range(nodes)}


def _check_data_order(events: list[dict], nodes: int, batch: int = 6, seed: int = 0, samples: int = 512) -> None:
    """Committed step s trained the s-th global batch; the groups of its quorum tiled it."""
    sampler = GlobalSampler(samples, batch, seed)
    expected = {s: batch_crc(sampler.next_global_batch()) for s in range(1, 1 + max(
        e["step"] for e in events if e["kind"] == "trainer.step"))}
    by_step: dict[int, dict[str, dict]] = {}
    for i in range(nodes):
        for e in _attempts(events, f"node{i}"):
            assert e["batch_crc"] == expected[e["step"]], e  # attempts too: a retry trains the same batch
            if e["committed"]:
                by_step.setdefault(e["step"], {})[e["replica_group"]] = e
    for step, groups in by_step.items():
        quorum = {e["quorum_id"] for e in groups.values()}
        if len(quorum) != 1 or len(groups) != next(iter(groups.values()))["participants"]:
            continue  # a group healed past this step or committed it in another quorum: not all here
        parts = sorted((e["quorum_rank"], tuple(e["slice"])) for e in groups.values())
        assert [p[0] for p in parts] == list(range(len(parts)))
        assert [p[1] for p in parts] == [part_bounds(batch, r, len(parts)) for r in range(len(parts))], (step, parts)


def _run(config: Path, env: dict, act=None, timeout: float = 150) -> tuple[str, list[dict], object]:
    proc = start_launcher(config, env)
    acted = act(proc) if act else None
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out, read_run_events(config.parent / "run"), acted


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sigkill_one_group_survivors_go_on_and_the_group_heals(tmp_path, subprocess_env):
    steps = 60  # long enough that the killed group is back before its peers finish
    config = _config(tmp_path, nodes=3, steps=steps, step_sleep=0.2)
    run_dir = tmp_path / "run"

    def kill(proc):
        # node0 is quorum rank 0: the disk writer.  Killing it moves the writing to a survivor.
        victim = wait_for_event(run_dir, lambda e: e["kind"] == "trainer.step" and e["source"] == "trainer/node0/rank0"
                                and e["committed"] and e["step"] >= 8, timeout=120, proc=proc)
        kill_ts = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        return kill_ts, victim

    _, events, (kill_ts, victim) = _run(config, subprocess_env, kill)
    for node in ("node1", "node2"):
        after = [e for e in _attempts(events, node) if e["ts"] > kill_ts]
        first_commit = next(e for e in after if e["committed"])
        assert first_commit["ts"] - kill_ts < 5.0, (node, first_commit["ts"] - kill_ts)
        assert sum(1 for e in after if not e["committed"]) <= 1
        assert len({e["pid"] for e in _attempts(events, node)}) == 1  # never restarted
        assert any(e["participants"] == 2 for e in after)
    healed = [e for e in events if e["kind"] == "trainer.healed" and e["source"] == "trainer/node0/rank0"
              and e["ts"] > kill_ts]
    assert healed and healed[0]["to_step"] > victim["step"], healed
    rejoined = [e for e in _attempts(events, "node0") if e["ts"] > kill_ts]
    assert rejoined[0]["step"] == healed[0]["to_step"] + 1 and rejoined[-1]["participants"] == 3
    _check_data_order(events, 3)
    # While node0 was away a survivor wrote the checkpoints; every commit verifies on disk.
    commits = [e for e in events if e["kind"] == "checkpoint.committed"]
    assert {e["source"].split("/")[1] for e in commits} >= {"node0", "node1"}
    assert max(e["step"] for e in commits) == steps
    assert len(_checksums(run_dir, 3)) == 1


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: resume from disk bitwise stays in the default suite (test_launch_e2e.py, test_inprocess_e2e.py's fallback).
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_groups_killed_resume_from_disk_bitwise(tmp_path, subprocess_env):
    steps = 24
    clean_dir, fault_dir = tmp_path / "clean", tmp_path / "fault"
    clean_dir.mkdir()
    fault_dir.mkdir()
    # min_replicas = every group: each step has the same quorum, so the trajectory is reproducible.
    _, clean, _ = _run(_config(clean_dir, nodes=2, steps=steps, min_replicas=2), subprocess_env)

    def kill_all(proc):
        run_dir = fault_dir / "run"
        wait_for_event(run_dir, lambda e: e["kind"] == "checkpoint.committed" and e["step"] == 10, timeout=120,
                       proc=proc)
        pids = {}
        while len(pids) < 2:  # each group's newest worker, once it has trained past the checkpoint
            for e in read_run_events(run_dir):
                if e["kind"] == "trainer.step" and e["step"] >= 12:
                    pids[e["replica_group"]] = e["pid"]
            time.sleep(0.05)
        kill_ts = time.time()
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        return kill_ts

    _, events, kill_ts = _run(_config(fault_dir, nodes=2, steps=steps, min_replicas=2), subprocess_env, kill_all)
    newest = max(e["step"] for e in events if e["kind"] == "checkpoint.committed" and e["ts"] < kill_ts)
    starts = [e for e in events if e["kind"] == "trainer.start" and e["ts"] > kill_ts]
    assert sorted(e["replica_group"] for e in starts) == ["node0", "node1"]
    assert all(e["resumed"] and e["step"] == newest == e["ft_step"] for e in starts), (newest, starts)
    assert not [e for e in events if e["kind"] == "trainer.healed" and e["ts"] > kill_ts]  # from disk, not a peer
    clean_sums = _checksums(clean_dir / "run", 2)
    assert len(clean_sums) == 1 and _checksums(fault_dir / "run", 2) == clean_sums
    _check_data_order(events, 2)


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: a replica group's loss and heal stays in the default suite (the SIGKILL test).
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_nan_in_one_group_is_skipped_everywhere_and_a_hang_is_detected(tmp_path, subprocess_env):
    run_dir = tmp_path / "run"
    # Long enough after the hang (8 s to detect it, then a restart) for the hung group to come back.
    config = _config(tmp_path, nodes=2, steps=110, step_sleep=0.2)
    write_fault(run_dir, "nan", {"kind": "nan_loss", "node": "node1", "step": 6})
    write_fault(run_dir, "hang", {"kind": "hang", "node": "node1", "step": 14})
    _, events, _ = _run(config, subprocess_env)
    numerics = [e for e in events if e["kind"] == "trainer.numerics"]
    assert sorted(e["source"] for e in numerics) == ["trainer/node0/rank0", "trainer/node1/rank0"]
    assert all(e["step"] == 6 and e["action"] == "skip" for e in numerics), numerics
    for node in ("node0", "node1"):
        step6 = [e for e in _attempts(events, node) if e["step"] == 6 and e["committed"]]
        assert step6 and step6[0]["skipped"], step6  # consumed everywhere, applied nowhere
    done = [e for e in events if e["kind"] == "trainer.done"]
    assert {e["total_skips"] for e in done} == {1}
    hang = [e for e in events if e["kind"] == "agent.hang_detected" and e["source"] == "agent/node1"]
    assert hang, "node1's agent must detect its hung worker"
    survivor = _attempts(events, "node0")
    assert len({e["pid"] for e in survivor}) == 1
    assert any(e["committed"] and e["participants"] == 1 and e["ts"] > hang[0]["ts"] - 5 for e in survivor)
    healed = [e for e in events if e["kind"] == "trainer.healed" and e["source"] == "trainer/node1/rank0"]
    assert healed and healed[-1]["to_step"] > 14
    assert len(_checksums(run_dir, 2)) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["nodes"] == {"node0": 0, "node1": 0}


def test_a_wildcard_lighthouse_is_advertised_at_the_nodes_address(tmp_path):
    # A cluster binds every interface; peers must be told an address they can reach, not 0.0.0.0.
    from elastic.replicas.config import ReplicaConfig
    from elastic.replicas.runtime import LighthouseHost

    host = LighthouseHost(ReplicaConfig(enabled=True, lighthouse_host="0.0.0.0"), tmp_path / "lh.log", "127.0.0.1")
    try:
        address = host.start()
        assert address.startswith("http://127.0.0.1:") and host.running()
    finally:
        host.stop()
    assert not host.running()
