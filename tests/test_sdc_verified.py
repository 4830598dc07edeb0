"""Replay verification and checkpoints: the COMMIT marker says whether the run was verified through
its step, later checks upgrade it, a resume prefers the newest verified one, retention keeps it
(elastic/checkpoint/verified.py; the run's verified step from RunState.sdc_verified_through)."""

from __future__ import annotations

import json

import pytest

from elastic.checkpoint.verified import marker_field, trusted, upgrade
from elastic.common.events import read_events
from elastic.control.keys import RunKeys
from elastic.control.memstore import FakeClock, MemoryStore
from elastic.control.runstate import RunState
from tests.test_checkpoint import _manager, _state, _trained

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _run() -> RunState:
    return RunState(MemoryStore(FakeClock()), RunKeys.of("/elastic", "r"))


def test_an_epoch_is_verified_through_the_lowest_verifiers_newest_check_once_every_node_has_one():
    state = _run()
    state.put_sdc_verified("node1", {"step": 30, "rank": 0, "tag": "0.0"})
    assert state.sdc_verified_through(nodes=2, epoch=0) is None  # node0's neighbour not verified yet
    state.put_sdc_verified("node0", {"step": 20, "rank": 1, "tag": "0.0"})
    assert state.sdc_verified_through(nodes=2, epoch=0) == 20
    # A check verifies its epoch's trajectory only (a restart retrains, a rollback throws steps away).
    state.put_sdc_verified("node0", {"step": 40, "rank": 1, "tag": "1.0"})
    assert state.sdc_verified_through(nodes=2, epoch=0) is None and state.sdc_verified_through(nodes=2, epoch=1) is None
    assert state.sdc_verified_through(nodes=1, epoch=0) == 30 and state.sdc_verified_through(nodes=1, epoch=1) == 40


def test_a_node_that_left_in_process_does_not_hold_the_epochs_verified_step_back():
    state = _run()
    for node, step in (("node0", 20), ("node1", 20), ("node2", 20)):
        state.put_sdc_verified(node, {"step": step, "rank": 0, "tag": "0.0"})
    assert state.sdc_verified_through(nodes=3, epoch=0) == 20
    # node2 left: generation 1 has two nodes; until both have checked in it, nothing is verified.
    state.put_sdc_verified("node0", {"step": 40, "rank": 0, "tag": "0.1"})
    assert state.sdc_verified_through(nodes=2, epoch=0) is None
    state.put_sdc_verified("node1", {"step": 50, "rank": 0, "tag": "0.1"})
    assert state.sdc_verified_through(nodes=2, epoch=0) == 40


def test_a_marker_is_trusted_when_verified_then_or_since_and_upgrades_in_place(tmp_path):
    assert marker_field(20, 20)["sdc"] == {"verified_step": 20, "verified": True}
    assert marker_field(30, 20)["sdc"]["verified"] is False and marker_field(10, None)["sdc"]["verified"] is False
    assert trusted({"step": 30}, None)  # written with verification off
    marker = {"step": 30, "epoch": 1, **marker_field(30, 20)}
    assert not trusted(marker, None) and not trusted(marker, lambda epoch: 29)
    assert trusted(marker, lambda epoch: {1: 30}.get(epoch)) and not trusted(marker, lambda epoch: {0: 30}.get(epoch))
    assert not trusted({**marker, "epoch": None}, lambda epoch: 99)
    step_dir = tmp_path / "step-00000030"
    step_dir.mkdir()
    (step_dir / "COMMIT").write_text(json.dumps({**marker, "files": {"a": {"bytes": 1}}}))
    assert not upgrade(step_dir, 29, epoch=1) and not upgrade(step_dir, 40, epoch=2)
    assert upgrade(step_dir, 40, epoch=1) and not upgrade(step_dir, 50, epoch=1)  # once
    after = json.loads((step_dir / "COMMIT").read_text())
    assert after["sdc"] == {"verified": True, "verified_step": 40, "verified_after_commit": True}
    assert after["files"] == {"a": {"bytes": 1}} and sorted(p.name for p in step_dir.iterdir()) == ["COMMIT"]


def _verifying_manager(tmp_path, verified: list[int | None], **cfg):
    """Epoch 1's checks agree through ``verified[0]`` (a list: the test moves it on)."""
    mgr, events = _manager(tmp_path, async_save=False, **cfg)
    mgr.epoch = 1
    mgr.sdc_verified = lambda epoch: verified[0] if epoch == 1 else None
    return mgr, events


def _markers(tmp_path) -> dict[int, dict]:
    return {int(p.name.split("-")[1]): json.loads((p / "COMMIT").read_text())["sdc"]
            for p in sorted((tmp_path / "ckpt").glob("step-*"))}


def test_commits_say_whether_they_were_verified_and_a_later_commit_upgrades_them(tmp_path):
    verified = [None]
    mgr, _ = _verifying_manager(tmp_path, verified, keep_last=3)
    model, optim = _trained()
    mgr.save(10, _state(model, optim))
    verified[0] = 10  # step 10's check answered after its commit
    mgr.save(20, _state(model, optim))
    assert _markers(tmp_path) == {10: {"verified": True, "verified_step": 10, "verified_after_commit": True},
                                  20: {"verified": False, "verified_step": 10}}
    kinds = [(e["kind"], e.get("step")) for e in read_events([tmp_path / "events.jsonl"])]
    assert ("checkpoint.verified", 10) in kinds
    mgr.close()


def test_a_resume_prefers_the_newest_verified_checkpoint_and_says_which_it_passed_over(tmp_path):
    verified = [10]
    mgr, _ = _verifying_manager(tmp_path, verified, keep_last=3)
    for step in (10, 20, 30):
        mgr.save(step, _state(*_trained(steps=step // 10)))
    verified[0] = 20  # step 20 is verified since; 30 is not
    step, _ = mgr.load_latest(_state(*_trained(seed=5, steps=1)))
    assert step == 20
    events = read_events([tmp_path / "events.jsonl"])
    [skipped] = [e for e in events if e["kind"] == "checkpoint.skipped_unverified"]
    assert (skipped["step"], skipped["verified_step"], skipped["marker_verified_step"]) == (30, 20, 10)

    def unreachable(epoch):
        raise ConnectionError("etcd away")
    mgr.sdc_verified = unreachable  # only the markers count then (10 verified at its commit)
    step, _ = mgr.load_latest(_state(*_trained(seed=5, steps=1)))
    assert step == 10
    mgr.close()


def test_with_nothing_verified_the_newest_is_taken_and_said_to_be_unverified(tmp_path):
    verified = [None]
    mgr, _ = _verifying_manager(tmp_path, verified)
    mgr.save(10, _state(*_trained()))
    mgr.save(20, _state(*_trained(steps=3)))
    step, _ = mgr.load_latest(_state(*_trained(seed=5, steps=1)))
    assert step == 20
    [said] = [e for e in read_events([tmp_path / "events.jsonl"]) if e["kind"] == "checkpoint.resume_unverified"]
    assert said["step"] == 20
    mgr.close()


def test_retention_keeps_the_newest_verified_checkpoint_a_resume_would_take(tmp_path):
    verified = [10]
    mgr, _ = _verifying_manager(tmp_path, verified, keep_last=1)
    for step in (10, 20, 30):
        mgr.save(step, _state(*_trained()))
    assert mgr.committed_steps() == [10, 30]  # 20 went; 10 is the verified one, 30 the newest
    verified[0] = 30
    mgr.save(40, _state(*_trained()))
    assert mgr.committed_steps() == [30, 40]  # 30 upgraded at 40's commit: 10 may go now
    mgr.close()


def test_after_a_mismatch_a_verifier_no_longer_says_its_epoch_is_verified(tmp_path):
    """The checks after a corruption replay from the corrupted weights and agree: they must not mark
    the corrupted steps' checkpoints verified."""
    from elastic.sdc.results import write_result
    from tests.test_sdc_replay import SUMS, _Agents

    agents = _Agents(tmp_path)
    for step, sums in ((10, SUMS), (20, {**SUMS, "blocks.0": 23}), (30, SUMS)):
        agents.checked(step)
        write_result(agents.captured(step), {"step": step, "rank": 1, "checksums": sums, "replay_s": 0.2})
        agents.clock.advance(1)
        agents.node0.poll()
    assert [e["step"] for e in agents.events("sdc.verified")] == [10, 30]
    assert agents.state.sdc_verified_through(nodes=1, epoch=0) == 10
    agents.checked(40, tag="1.0")  # the next epoch (after the rollback) starts afresh
    write_result(agents.captured(40, tag="1.0"), {"step": 40, "rank": 1, "checksums": SUMS, "replay_s": 0.2})
    agents.node0.poll()
    assert agents.state.sdc_verified_through(nodes=1, epoch=1) == 40


def test_a_checks_replay_runs_niced_and_an_arbiters_does_not(monkeypatch, tmp_path):
    """The spare replays a check in a thread at niceness 19 (it takes the CPU the ranks leave idle);
    an arbiter's replay, which a verdict waits for, and the spare's main thread keep their priority."""
    import os
    import threading

    from elastic.sdc.results import OFF_PATH_NICE
    from elastic.worker import spare

    seen = []
    monkeypatch.setattr(spare, "verify", lambda module, argv, path, arbiter=False: seen.append(
        (arbiter, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    spare.verify_niced(None, [], tmp_path / "x.pt")
    spare.verify_niced(None, [], tmp_path / "x.pt", arbiter=True)
    assert seen == [(False, max(base, OFF_PATH_NICE)), (True, base)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_a_resume_does_not_go_back_further_than_a_stalled_verification_is_worth(tmp_path):
    verified = [10]
    mgr, _ = _verifying_manager(tmp_path, verified, keep_last=5)
    for step in (10, 20, 30, 40):
        mgr.save(step, _state(*_trained()))
    mgr.sdc_verified_within = 20  # 40 -> 10 is 30 steps back: verification has stalled
    step, _ = mgr.load_latest(_state(*_trained(seed=5, steps=1)))
    assert step == 40
    events = read_events([tmp_path / "events.jsonl"])
    assert [e["step"] for e in events if e["kind"] == "checkpoint.skipped_unverified"] == [40, 30, 20]
    [said] = [e for e in events if e["kind"] == "checkpoint.resume_unverified"]
    assert said["step"] == 40 and "stalled" in said["reason"]
    mgr.sdc_verified_within = 30
    step, _ = mgr.load_latest(_state(*_trained(seed=5, steps=1)))
    assert step == 10
    mgr.close()
