"""Replay verification (sdc.replay_every): who is checked, and a rank's gradient replayed bitwise.

The replay test runs a real 2-rank gloo world with the DiT under FSDP2: each rank fingerprints its
local gradient in the reduce-scatter seam and captures the other's inputs; an unsharded replay of
each record (what a spare runs) must give the same checksums, for each dtype / micro-batch /
checkpointing / FP8 combination, and must not after one bit of one rank's gradient was flipped.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.common.config import from_dict
from elastic.sdc.flip import flip_bit
from elastic.sdc.replay import ReplayProbe, checked_local, replay, roles
from trainer.data import GlobalSampler, build_dataset
from trainer.dit_config import DiTTrainerConfig
from trainer.dit_replay import replay_gradients_of
from trainer.dit_train import build_model, micro_batch_loss, micro_batches
from trainer.parallel import TORCH_DTYPES, parallelize

WORLD = 2
FLIP_STEP, FLIP_RANK = 2, 1


def test_round_robin_checks_every_local_rank_then_draws_at_random():
    assert [checked_local(k, 4, seed=7) for k in range(1, 5)] == [0, 1, 2, 3]
    later = [checked_local(k, 4, seed=7) for k in range(5, 200)]
    assert set(later) == {0, 1, 2, 3} and later != [checked_local(k, 4, seed=8) for k in range(5, 200)]


@pytest.mark.parametrize("nodes,local", [(4, 8), (3, 2), (1, 4), (2, 1)])
def test_each_check_has_one_checked_rank_per_node_and_one_capturer_for_it_elsewhere(nodes, local):
    world = nodes * local
    for step in range(10, 200, 10):
        checked = {r for r in range(world) if roles(step, 10, r, world, local, seed=1)[0]}
        captures = {roles(step, 10, r, world, local, seed=1)[1]: r for r in range(world)}
        captures.pop(None, None)
        assert {r // local for r in checked} == set(range(nodes)) and len(checked) == nodes
        assert set(captures) == checked  # every checked rank has exactly one capturer
        for target, capturer in captures.items():
            assert capturer != target
            if nodes > 1:
                assert capturer // local != target // local  # on another node: another spare replays
    assert roles(15, 10, 0, world, local, seed=1) == (False, None)  # not a check step: nothing at all


def _cfg(variant: dict) -> DiTTrainerConfig:
    return from_dict(DiTTrainerConfig, {"global_batch_size": 8, **variant}, "trainer")


def _worker(rank: int, port: int, out: str, variant: dict, flip: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        _train(rank, Path(out), _cfg(variant), flip)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see tests/test_dit_parallel.py: gloo's threads and interpreter teardown


def _train(rank: int, out: Path, cfg: DiTTrainerConfig, flip: bool) -> None:
    torch.manual_seed(cfg.seed)
    model, _ = build_model(cfg, torch.device("cpu"))
    parallelize(model, cfg.parallel, WORLD, 1, "cpu")

    def corrupt(step: int, label: str, tensor: torch.Tensor) -> None:
        if flip and rank == FLIP_RANK and step == FLIP_STEP and not flipped:
            flipped.append(flip_bit(tensor.view(-1), int(tensor.view(-1).abs().argmax())))

    flipped: list = []
    probe = ReplayProbe(model, every=1, seed=cfg.seed, rank=rank, world=WORLD, local_world=1, corrupt=corrupt)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = build_dataset(cfg.data, cfg.model, cfg.seed)
    sampler = GlobalSampler(len(data), cfg.global_batch_size, cfg.seed, cfg.data.shuffle)
    written: list[str] = []
    for step in (1, 2, 3):
        batch = sampler.next_global_batch()
        indices = GlobalSampler.rank_slice(batch, rank, WORLD)
        check = probe.arm(step)
        optim.zero_grad(set_to_none=True)
        chunks = micro_batches(indices, cfg.micro_batch_size)
        for i, chunk in enumerate(chunks):
            if len(chunks) > 1:
                model.set_requires_gradient_sync(i == len(chunks) - 1)
            (micro_batch_loss(model, cfg, data, step, chunk, torch.device("cpu")) * (len(chunk) / len(indices))).backward()
        assert check is not None and check.checked and check.target == 1 - rank
        (out / f"sums-{step}-r{rank}.json").write_text(json.dumps(probe.checksums(check)))
        probe.write_inputs(check, out, {"indices": GlobalSampler.rank_slice(batch, check.target, WORLD)},
                           TORCH_DTYPES[cfg.parallel.reduce_dtype], done=lambda p: written.append(str(p)))
        optim.step()
    probe.close()
    assert len(written) == 3


VARIANTS = {
    "fp32": {},
    "bf16-fp32-microbatches-checkpointed": {"micro_batch_size": 2, "parallel": {
        "param_dtype": "bfloat16", "reduce_dtype": "float32", "activation_checkpointing": True}},
    "fp8": {"fp8": {"enabled": True}, "parallel": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}},
}


def _replayed(out: Path, cfg: DiTTrainerConfig) -> dict[tuple[int, int], bool]:
    """(step, rank) -> whether the replay's checksums equal the rank's own."""
    equal = {}
    for record in sorted((out / "sdc").glob("replay-*.pt")):
        result = replay(record, lambda rec: replay_gradients_of(cfg, rec))
        own = json.loads((out / f"sums-{result.step}-r{result.rank}.json").read_text())
        assert set(own) == set(result.checksums) == {"", "blocks.0", "blocks.1"}  # root and each block
        equal[(result.step, result.rank)] = own == result.checksums
    return equal


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_spare_replays_each_ranks_local_gradient_bitwise(tmp_path, variant):
    from elastic.control.etcd_server import free_port

    mp.spawn(_worker, args=(free_port(), str(tmp_path), VARIANTS[variant], False), nprocs=WORLD, join=True)
    equal = _replayed(tmp_path, _cfg(VARIANTS[variant]))
    assert equal == {(s, r): True for s in (1, 2, 3) for r in range(WORLD)}


@pytest.mark.timeout(180)
def test_one_flipped_bit_in_one_ranks_gradient_is_the_one_mismatch(tmp_path):
    from elastic.control.etcd_server import free_port

    mp.spawn(_worker, args=(free_port(), str(tmp_path), {}, True), nprocs=WORLD, join=True)
    equal = _replayed(tmp_path, _cfg({}))
    # The flip spread to both ranks' weights through the reduce-scatter (so every later step is
    # computed from the same wrong weights on both: nothing else disagrees); only a replay of the
    # flipped rank's own step sees it.
    assert [key for key, same in equal.items() if not same] == [(FLIP_STEP, FLIP_RANK)]
    assert len(equal) == 3 * WORLD


# -- the agents' side: publish, ask the spare, compare (in-memory store, files in tmp_path) ---------
from elastic.agent.replays import ReplayChecks  # noqa: E402
from elastic.common.events import EventLog, read_run_events  # noqa: E402
from elastic.control.keys import RunKeys  # noqa: E402
from elastic.control.memstore import FakeClock, MemoryStore  # noqa: E402
from elastic.control.runstate import RunState  # noqa: E402
from elastic.sdc.results import inputs_path, write_result  # noqa: E402

SUMS = {"": 11, "blocks.0": 22}


class _Agents:
    """Two agents over one store: node1's rank 1 is checked, node0 captured its inputs."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock()
        self.state = RunState(MemoryStore(self.clock), RunKeys.of("/elastic", "r"))
        self.run = tmp_path
        self.asked: list[dict] = []
        self.spare_pid: int | None = 100
        self.node1 = ReplayChecks("node1", self.state, EventLog(tmp_path / "events" / "agent-node1.jsonl", "agent/node1"))
        self.node0 = ReplayChecks("node0", self.state, EventLog(tmp_path / "events" / "agent-node0.jsonl", "agent/node0"),
                                  timeout_s=30, clock=self.clock)
        self.node0.ask = lambda request: (self.asked.append(request) or (self.spare_pid, "")) if self.spare_pid \
            else (None, "no warm spare on this node")
        self.node0.spare = lambda: self.spare_pid
        self.spare_state = "ready"
        self.node0.spare_state = lambda: self.spare_state if self.spare_pid else "none"

    def checked(self, step: int, sums: dict = SUMS, tag: str = "0.0") -> None:
        self.node1.observe({"type": "replay_sum", "rank": 1, "step": step, "tag": tag, "checksums": sums})

    def captured(self, step: int, tag: str = "0.0") -> Path:
        path = inputs_path(self.run, step, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights")
        self.node0.observe({"type": "replay", "rank": 0, "step": step, "checked_rank": 1, "path": str(path), "tag": tag})
        return path

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_run_events(self.run) if e["kind"] == kind]


def test_an_equal_replay_is_verified_and_its_files_are_removed(tmp_path):
    agents = _Agents(tmp_path)
    agents.checked(10)
    path = agents.captured(10)
    assert agents.asked == [{"verify": str(path)}]
    agents.node0.poll()
    assert agents.events("sdc.verified") == []  # the spare has not answered
    write_result(path, {"step": 10, "rank": 1, "checksums": SUMS, "replay_s": 0.2})
    agents.node0.poll()
    [verified] = agents.events("sdc.verified")
    assert (verified["step"], verified["rank"], verified["node"], verified["verifier"]) == (10, 1, "node1", "node0")
    assert not path.exists() and agents.node0.pending == {}


def test_a_differing_replay_names_the_checked_node_and_the_units(tmp_path):
    agents = _Agents(tmp_path)
    path = agents.captured(10)
    write_result(path, {"step": 10, "rank": 1, "checksums": {**SUMS, "blocks.0": 23}, "replay_s": 0.2})
    agents.node0.poll()
    assert agents.events("sdc.suspect") == []  # rank 1's agent has not published yet: wait
    agents.checked(10)
    agents.clock.advance(1)
    agents.node0.poll()
    [suspect] = agents.events("sdc.suspect")
    assert (suspect["node"], suspect["rank"], suspect["step"], suspect["units"]) == ("node1", 1, 10, ["blocks.0"])
    assert suspect["checksums"] == SUMS and suspect["replayed"]["blocks.0"] == 23


def test_a_rank_keeps_its_last_checks_so_a_slow_replay_is_still_compared(tmp_path):
    agents = _Agents(tmp_path)
    path = agents.captured(10)
    for step in (10, 20, 30, 40):
        agents.checked(step, {"": step})
    write_result(path, {"step": 10, "rank": 1, "checksums": {"": 10}, "replay_s": 9})
    agents.node0.poll()
    assert [e["step"] for e in agents.events("sdc.verified")] == [10]
    path = agents.captured(50)
    agents.checked(50, {"": 50})  # step 10's checksums are gone now (four kept)
    agents.checked(60, {"": 60})
    path = agents.captured(20)
    write_result(path, {"step": 20, "rank": 1, "checksums": {"": 20}, "replay_s": 9})
    agents.node0.poll()
    [skipped] = agents.events("sdc.replay_skipped")
    assert skipped["step"] == 20 and "replaced by newer checks" in skipped["reason"]


def test_checks_from_another_world_are_not_compared(tmp_path):
    agents = _Agents(tmp_path)
    agents.checked(10, tag="0.1")  # the rank re-formed (generation 1) and trained step 10 again
    path = agents.captured(10, tag="0.0")
    write_result(path, {"step": 10, "rank": 1, "checksums": {"": 1}, "replay_s": 0.1})
    agents.node0.poll()
    assert agents.events("sdc.suspect") == []
    [skipped] = agents.events("sdc.replay_skipped")
    assert "another world" in skipped["reason"]


def test_a_spare_that_is_absent_busy_gone_or_slow_skips_the_check_and_says_why(tmp_path):
    agents = _Agents(tmp_path)
    agents.captured(10)
    agents.captured(20)
    agents.captured(30)  # two wait already: the third is dropped, not queued
    agents.spare_pid = 200  # the spare took a worker's slot: the two it had will never be answered
    agents.node0.poll()
    agents.captured(40)
    agents.clock.advance(31)
    agents.node0.poll()
    agents.spare_pid = None
    agents.captured(50)
    reasons = {e["step"]: e["reason"] for e in agents.events("sdc.replay_skipped")}
    assert reasons == {30: "the spare has 2 checks to replay before it",
                       10: "the spare took a worker's slot before it answered",
                       20: "the spare took a worker's slot before it answered",
                       40: "no verdict within 30s", 50: "no warm spare on this node"}
    assert agents.node0.pending == {} and not list((tmp_path / "sdc").glob("*.pt"))


def test_a_replay_that_failed_is_a_skipped_check_not_a_suspect(tmp_path):
    agents = _Agents(tmp_path)
    agents.checked(10)
    path = agents.captured(10)
    write_result(path, {"error": "ValueError: replay record lacks weights for ['x']"})
    agents.node0.poll()
    assert agents.events("sdc.suspect") == []
    assert "the replay failed: ValueError" in agents.events("sdc.replay_skipped")[0]["reason"]


def test_checks_that_come_while_the_spare_imports_keep_only_the_newest_until_it_is_ready(tmp_path):
    agents = _Agents(tmp_path)
    agents.spare_state = "importing"
    first, second = agents.captured(10), agents.captured(20)
    assert agents.asked == [] and not first.exists() and second.exists()  # one model's weights held, not two
    agents.node0.poll()
    assert agents.asked == []
    agents.spare_state = "ready"
    agents.node0.poll()
    assert agents.asked == [{"verify": str(second)}]
    [skipped] = agents.events("sdc.replay_skipped")
    assert (skipped["step"], skipped["reason"]) == (10, "a newer check came while the spare was importing")


def test_replay_ab_blocks_check_only_in_the_odd_blocks():
    from elastic.sdc.replay import checked_step

    assert [s for s in range(1, 61) if checked_step(s, 5, ab_block=20)] == [5, 10, 15, 20, 45, 50, 55, 60]
    assert [s for s in range(1, 31) if checked_step(s, 10)] == [10, 20, 30]
    assert roles(25, 5, 0, 2, 1, seed=0, ab_block=20) == (False, None)


def test_inputs_that_cannot_be_written_are_reported_not_lost_silently(tmp_path):
    from elastic.sdc.replay import _save_then

    blocker = tmp_path / "sdc"
    blocker.write_text("a file where the directory should be")
    done, failed = [], []
    _save_then({"step": 1}, blocker / "replay-00000001-r0.pt", done.append, failed.append)
    assert done == [] and len(failed) == 1 and isinstance(failed[0], OSError)
    _save_then({"step": 1}, tmp_path / "ok" / "replay-00000001-r0.pt", done.append, failed.append)
    assert done == [tmp_path / "ok" / "replay-00000001-r0.pt"] and done[0].exists()


def test_a_rollback_distrusts_checkpoints_of_the_corrupted_steps_from_its_epoch_or_before(tmp_path):
    from elastic.checkpoint.config import CheckpointConfig
    from elastic.checkpoint.load import CommittedCheckpoints

    loader = CommittedCheckpoints(CheckpointConfig(), tmp_path)
    marker = lambda step, epoch=0: {"step": step, "epoch": epoch}  # noqa: E731
    assert not loader._distrusted(marker(90))  # no rollback: everything as before
    loader.distrust = (90, 0)  # a flip at step 90, found in epoch 0
    assert not loader._distrusted(marker(80))
    # Step 90's save was under way when the flip was found: it commits after the finding, still epoch 0.
    assert loader._distrusted(marker(90)) and loader._distrusted(marker(100))
    assert not loader._distrusted(marker(90, epoch=1))  # retrained after the rollback: trusted
    assert loader._distrusted({"step": 95})  # a marker from before markers carried the epoch


def test_the_run_records_one_rollback_with_the_lowest_step_and_the_latest_epoch():
    state = RunState(MemoryStore(FakeClock()), RunKeys.of("/elastic", "r"))
    assert state.distrust_spec() == ""
    state.record_sdc_rollback(90, 0, "node1", 2, "node0")
    assert state.distrust_spec() == "90@0"
    state.record_sdc_rollback(120, 1, "node3", 0, "node2")
    assert state.distrust_spec() == "90@1"


def test_a_new_attempt_drops_the_checks_of_the_last_one(tmp_path):
    agents = _Agents(tmp_path)
    path = agents.captured(10)
    agents.node0.attach(None)
    [skipped] = agents.events("sdc.replay_skipped")
    assert skipped["reason"] == "its attempt ended before the spare answered" and not path.exists()
    assert agents.node0.ask({"verify": "x"}) == (None, "no in-process workers: no warm spare")
