"""Multi-process checkpoint tests: real gloo ranks, FSDP2, real etcd, real files.

Each test starts one Python process per rank running a scenario from
``tests/workers/checkpoint_worker.py`` and then checks exit codes, the event
logs and what is left on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.worker.faults import write_fault
from elastic.common.events import read_events

pytestmark = pytest.mark.slow  # every test here runs real gloo ranks in subprocesses

WORKER = Path(__file__).parent / "workers" / "checkpoint_worker.py"


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


def run_ranks(scenario: str, world: int, workdir: Path, env: dict[str, str], timeout: float = 60.0) -> list[int]:
    """Run ``scenario`` on ``world`` ranks; return their exit codes (all killed on timeout)."""
    proc = subprocess.Popen([sys.executable, str(WORKER), scenario, str(world), str(workdir), str(_free_port())],
                            env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return [-9] * world
    codes = workdir / f"{scenario}-w{world}.codes"
    assert codes.exists(), f"launcher exited {proc.returncode} without codes\n" + _logs(workdir, scenario)
    return [int(c) for c in codes.read_text().split()]


def _logs(workdir: Path, scenario: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(workdir.glob(f"{scenario}-*.log")))


def _kinds(events: list[dict], kind: str, **match) -> list[dict]:
    return [e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def _index(events: list[dict], kind: str, **match) -> int:
    for i, event in enumerate(events):
        if event["kind"] == kind and all(event.get(k) == v for k, v in match.items()):
            return i
    raise AssertionError(f"no {kind} {match} in events")


def test_async_save_retention_disk_full_corruption_publish(tmp_path, subprocess_env, etcd_endpoint):
    write_fault(tmp_path, "disk-full", {"kind": "ckpt_write_error", "step": 8, "rank": 1})
    env = dict(subprocess_env, TEST_CKPT_ETCD=etcd_endpoint)
    codes = run_ranks("main", 2, tmp_path, env, timeout=80)
    assert codes == [0, 0], _logs(tmp_path, "main")
    ev0 = read_events([tmp_path / "events-rank0.jsonl"])  # one writer: file order == emit order
    ev1 = read_events([tmp_path / "events-rank1.jsonl"])

    # save() returned (and training stepped) before anything was persisted or committed.
    assert _index(ev0, "checkpoint.staged", step=2) < _index(ev0, "test.save_returned", step=2)
    assert _index(ev0, "test.save_returned", step=2) < _index(ev0, "test.gate_open", step=2)
    assert _index(ev0, "test.gate_open", step=2) < _index(ev0, "checkpoint.committed", step=2)
    assert _kinds(ev0, "checkpoint.staged", step=2)[0]["blocking_s"] >= 0
    committed2 = _kinds(ev0, "checkpoint.committed", step=2)[0]
    assert committed2["bytes"] > 0 and committed2["persist_s"] > 0
    # The save of step 6 started only after step 4 was committed (rank 0) / persisted (rank 1).
    assert _index(ev0, "test.gate_open", step=4) < _index(ev0, "checkpoint.committed", step=4)
    assert _index(ev0, "checkpoint.committed", step=4) < _index(ev0, "checkpoint.save_start", step=6)
    assert _index(ev1, "checkpoint.persisted", step=4) < _index(ev1, "checkpoint.save_start", step=6)

    # Retention (keep_last=2): 2 then 4 deleted, never the newest.
    assert [e["step"] for e in _kinds(ev0, "checkpoint.deleted")] == [2, 4]

    # Disk full on rank 1: every rank reports the failure; rank 1 sees ENOSPC itself.
    for events in (ev0, ev1):
        assert len(_kinds(events, "checkpoint.save_failed", step=8)) == 1
    assert _kinds(ev1, "checkpoint.save_failed", step=8)[0]["errno"] == "ENOSPC"
    assert "ENOSPC" in json.dumps(_kinds(ev0, "checkpoint.save_failed", step=8)[0])
    assert not _kinds(ev0, "checkpoint.committed", step=8)

    # Corruption: step 10 skipped with a checksum reason; another run config's manager refuses the newest.
    skipped = _kinds(ev0, "checkpoint.skipped_corrupt", step=10)
    assert skipped and "checksum mismatch in shard-00001.safetensors" in skipped[0]["reason"]
    foreign = _kinds(ev0, "checkpoint.foreign")
    assert foreign and all("different run config" in e["reason"] for e in foreign), foreign
    assert [e["step"] for e in _kinds(ev0, "checkpoint.loaded")] == [2, 10, 6]
    assert [e["step"] for e in _kinds(ev0, "checkpoint.published")] == [2, 4, 6, 10]

    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000006", "step-00000010"]
    assert sorted(p.name for p in (ckpt / "step-00000006").iterdir()) == [
        "COMMIT", "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"]


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: resharding stays in the default suite (test_reshard_p2p.py, test_dit_e2e.py's resume with fewer ranks).
@pytest.mark.soak
def test_reshard_2_to_1_to_2(tmp_path, subprocess_env):
    for world in (2, 1, 2):
        codes = run_ranks("hop", world, tmp_path, subprocess_env, timeout=60)
        assert codes == [0] * world, _logs(tmp_path, "hop")
    loads = read_events(sorted(tmp_path.glob("events-hop*-rank0.jsonl")))
    loaded = _kinds(loads, "checkpoint.loaded")
    assert [(e["saved_world_size"], e["world_size"]) for e in loaded] == [(2, 1), (1, 2)]
    rank1 = _kinds(read_events([tmp_path / "events-hop2-rank1.jsonl"]), "checkpoint.loaded")
    assert rank1[0]["extra_found"] is False  # rank 1 did not exist in the 1-rank save


@pytest.mark.parametrize("dying", ["1", "0,1"])
def test_rank_killed_mid_save_previous_checkpoint_loads(tmp_path, subprocess_env, dying):
    """Rank 1 dies mid-write (rank 0 survives and reports it), or every rank dies (tmp dir left)."""
    env = dict(subprocess_env, TEST_KILL_RANKS=dying)
    codes = run_ranks("kill", 2, tmp_path, env, timeout=60)
    ckpt = tmp_path / "ckpt"
    assert not (ckpt / "step-00000004").exists()  # the partial save never became visible
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("step-")] == ["step-00000002"]
    if dying == "1":
        assert codes == [0, 9], _logs(tmp_path, "kill")
        ev0 = read_events([tmp_path / "events-kill-rank0.jsonl"])
        assert _kinds(ev0, "checkpoint.save_failed", step=4)  # gloo reported the dead peer
        assert not list(ckpt.glob(".step-00000004.tmp-*"))  # and rank 0 cleaned up
    else:
        assert codes == [9, 9], _logs(tmp_path, "kill")
        assert len(list(ckpt.glob(".step-00000004.tmp-*"))) == 1  # nobody left to clean up
    codes = run_ranks("kill_resume", 1, tmp_path, subprocess_env, timeout=60)
    assert codes == [0], _logs(tmp_path, "kill_resume")
    resumed = read_events([tmp_path / "events-resume-rank0.jsonl"])
    assert len(_kinds(resumed, "checkpoint.stale_tmp_removed")) == (0 if dying == "1" else 1)
    assert [e["step"] for e in _kinds(resumed, "checkpoint.loaded")] == [2]


def test_saves_agreed_at_the_sync_point_broadcast_nothing_until_a_save_fails(tmp_path, subprocess_env):
    codes = run_ranks("agreed", 2, tmp_path, subprocess_env, timeout=60)
    assert codes == [0, 0], _logs(tmp_path, "agreed")
    for rank in (0, 1):
        saved = {e["step"]: e for e in _kinds(read_events([tmp_path / f"events-agreed-rank{rank}.jsonl"]), "test.saved")}
        assert sorted(saved) == [2, 4, 6, 8]
        # 2 and 4: rank 0 had nothing to tell; 6: its save of 4 failed, so the streak is broadcast
        # (and every rank holds it); 8: 6 committed and ended the streak, no broadcast again.
        assert [saved[s]["broadcasts"] for s in (2, 4, 6, 8)] == [0, 0, 1, 0], saved
        assert [saved[s]["streak"] for s in (2, 4, 6, 8)] == [[], [], [4], []], saved
