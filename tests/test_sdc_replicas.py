"""Silent data corruption in replica-group mode: the cross-replica agreement check, end to end.

The real stack (launcher, embedded etcd, three agents = three replica groups, the torchft Lighthouse,
torchrun, gloo) with the tiny DiT:

* a fault-free run with ``sdc.check_every: 2`` ends bitwise equal to one with the check off, and its
  checks all agree;
* one bit flipped in node1's gradient shard at step 6 (the ``sdc`` fault: after the cross-group
  allreduce, silent) is caught by the check right after step 6 commits, node1 is named with both
  checksums, it heals from a live peer at the next quorum without a restart, and the run ends
  bitwise equal to the fault-free one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("torchft")

from elastic.common.events import read_run_events
from elastic.worker.faults import fired_records, write_fault
from tests.launch_helpers import start_launcher

NODES, STEPS, FLIP_STEP, EVERY = 3, 12, 6, 2
LADDER = {"heartbeat_timeout_ms": 1000, "join_timeout_ms": 2000, "quorum_timeout_s": 4, "timeout_s": 6}


def _config(tmp_path: Path, check_every: int) -> Path:
    cfg = {
        "run": {"id": "sdc", "dir": str(tmp_path / "run")},
        "launch": {"nodes": str(NODES), "nproc_per_node": 1, "workload": "dit"},
        "agent": {"max_restarts": 2, "term_grace_s": 2, "preflight": {"enabled": False},
                  "heartbeat": {"step_timeout_s": 8}},
        "checkpoint": {"interval_steps": 5, "keep_last": 2},
        # min_replicas = every group: each step has the same quorum, so the trajectory is reproducible.
        "replicas": {"enabled": True, "min_replicas": NODES, **LADDER},
        "sdc": {"check_every": check_every},
        "trainer": {"steps": STEPS, "global_batch_size": 6, "step_sleep": 0.02},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(tmp_path: Path, env: dict, check_every: int, fault: dict | None = None) -> tuple[Path, list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = _config(tmp_path, check_every)
    if fault is not None:
        write_fault(tmp_path / "run", "sdc", fault)
    proc = start_launcher(config, env)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    return tmp_path / "run", read_run_events(tmp_path / "run")


def _checksums(run_dir: Path) -> set[str]:
    return {(run_dir / f"final_checksum-node{i}.txt").read_text().strip() for i in range(NODES)}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, subprocess_env_session) -> str:
    run_dir, _ = _run(tmp_path_factory.mktemp("sdc-off"), subprocess_env_session, check_every=0)
    sums = _checksums(run_dir)
    assert len(sums) == 1
    return sums.pop()


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the flipped-bit test below runs the same check and compares with the same fault-free run.
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agreement_check_on_a_fault_free_run_changes_nothing(tmp_path, subprocess_env, fault_free):
    run_dir, events = _run(tmp_path, subprocess_env, check_every=EVERY)
    assert _checksums(run_dir) == {fault_free}
    checked = [e for e in events if e["kind"] == "sdc.checked"]
    assert {e["step"] for e in checked} == set(range(EVERY, STEPS, EVERY)), checked
    assert all(e["agree"] and e["groups"] == NODES for e in checked)
    assert len(checked) == NODES * len(range(EVERY, STEPS, EVERY))  # every group checked every time
    assert not [e for e in events if e["kind"] in ("sdc.suspect", "sdc.no_majority", "trainer.healed")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flipped_bit_in_one_group_is_named_healed_and_the_run_ends_bitwise(tmp_path, subprocess_env, fault_free):
    run_dir, events = _run(tmp_path, subprocess_env, check_every=EVERY,
                           fault={"kind": "sdc", "node": "node1", "rank": 0, "step": FLIP_STEP})
    # Ground truth, from the fault's own record: one finite value changed, on node1, at step 6.
    [fired] = fired_records(run_dir, "sdc")
    flip = fired["fired"]
    assert (flip["node"], flip["rank"], flip["step"]) == ("node1", 0, FLIP_STEP)
    assert flip["before"] != flip["after"] and abs(flip["after"]) < float("inf")
    # Silent: the trainer said nothing about it.
    assert not [e for e in events if e["kind"] in ("fault.fired", "trainer.numerics")]
    [suspect] = [e for e in events if e["kind"] == "sdc.suspect"]
    assert suspect["source"] == "trainer/node1/rank0"
    assert (suspect["node"], suspect["rank"], suspect["step"]) == ("node1", 0, FLIP_STEP)
    assert suspect["checksum"] != suspect["majority"]
    seen = [e for e in events if e["kind"] == "sdc.checked" and e["step"] == FLIP_STEP and not e["agree"]]
    assert len(seen) == NODES and all(e["suspects"] == [suspect["quorum_rank"]] for e in seen)
    # Healed from a live peer, in place: node1's worker never restarted.
    healed = [e for e in events if e["kind"] == "trainer.healed" and e["ts"] > suspect["ts"]]
    assert [(e["source"], e["from_step"], e["to_step"]) for e in healed] == [
        ("trainer/node1/rank0", FLIP_STEP - 1, FLIP_STEP)]
    starts = [e for e in events if e["kind"] == "trainer.start"]
    assert len(starts) == NODES
    # Caught right after step 6 committed, before step 7 shared a gradient: nobody had to undo anything.
    assert all(e["committed"] for e in events if e["kind"] == "trainer.step")
    later = [e for e in events if e["kind"] == "sdc.checked" and e["step"] > FLIP_STEP]
    assert later and all(e["agree"] for e in later)
    assert _checksums(run_dir) == {fault_free}
