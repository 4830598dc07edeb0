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


def test_replay_nodes_cycles_through_every_node_in_order_then_shuffled():
    from elastic.sdc.replay import checked_nodes

    assert checked_nodes(3, 4, 0, seed=1) == checked_nodes(3, 4, 9, seed=1) == frozenset(range(4))
    first = [checked_nodes(k, 10, 3, seed=1) for k in range(1, 5)]  # a cycle: ceil(10 / 3) checks
    assert [sorted(n) for n in first] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 9]]  # the last wraps
    for cycle in range(1, 30):
        checks = [checked_nodes(cycle * 4 + k, 10, 3, seed=1) for k in range(1, 5)]
        assert all(len(n) == 3 for n in checks) and frozenset().union(*checks) == frozenset(range(10))
    later = [sorted(checked_nodes(k, 10, 3, seed=1)) for k in range(5, 40)]
    assert later != [sorted(checked_nodes(k, 10, 3, seed=2)) for k in range(5, 40)]
    assert len({tuple(n) for n in later}) > 4  # not the first cycle's pattern over and over


@pytest.mark.parametrize("nodes,local,per_check", [(4, 1, 1), (5, 2, 2), (3, 8, 1), (6, 2, 4)])
def test_replay_nodes_checks_that_many_nodes_each_with_a_capturer_on_another(nodes, local, per_check):
    world = nodes * local
    seen: set[int] = set()
    for step in range(10, 10 * (2 * nodes + 1), 10):
        checked = {r for r in range(world) if roles(step, 10, r, world, local, seed=1, per_check=per_check)[0]}
        captures = {roles(step, 10, r, world, local, seed=1, per_check=per_check)[1]: r for r in range(world)}
        captures.pop(None, None)
        assert len(checked) == per_check and len({r // local for r in checked}) == per_check
        assert set(captures) == checked and all(c // local != t // local for t, c in captures.items())
        seen |= {r // local for r in checked}
    assert seen == set(range(nodes))  # every node checked within two cycles


def test_replay_nodes_is_validated_and_sets_how_many_checks_cover_every_node():
    from elastic.common.config import ConfigError
    from elastic.sdc.config import SdcConfig

    with pytest.raises(ConfigError, match=r"^replay_nodes: must be >= 0 \(0: every node\), got -1$"):
        SdcConfig(replay_nodes=-1)
    assert [SdcConfig(replay_nodes=n).node_cycle(64) for n in (0, 1, 8, 10, 64, 100)] == [1, 64, 8, 7, 1, 1]


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
    # What a checkpoint's COMMIT marker is judged by: node0 verified node1's rank through step 10.
    assert agents.state.sdc_verified_through(nodes=1, epoch=0) == 10
    assert agents.state.sdc_verified_through(nodes=2, epoch=0) is None


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


# -- arbitration: a third node's spare replays a check whose first replay disagreed -----------------
class _Three(_Agents):
    """node1's rank 1 is checked, node0 verifies, node2 arbitrates (its requests come from the store,
    as its run signals' watch would hand them over)."""

    def __init__(self, tmp_path: Path, nodes: tuple[str, ...] = ("node0", "node1", "node2")) -> None:
        super().__init__(tmp_path)
        self.node0.nodes = lambda: list(nodes)
        self.node2 = ReplayChecks("node2", self.state, EventLog(tmp_path / "events" / "agent-node2.jsonl", "agent/node2"),
                                  clock=self.clock)
        self.arbiter_asked: list[dict] = []
        self.arbiter_pid: int | None = 300
        self.node2.ask = lambda request: (self.arbiter_asked.append(request) or (self.arbiter_pid, "")) \
            if self.arbiter_pid else (None, "no warm spare on this node")
        self.node2.spare = lambda: self.arbiter_pid
        self.node2.requests = self._request
        self.verdicts: dict[str, list[dict]] = {"node0": [], "node2": []}
        self.node0.on_suspect = self.verdicts["node0"].append
        self.node2.on_suspect = self.verdicts["node2"].append

    def _request(self):
        kv = self.state.store.get(self.state.keys.sdc_arbitrate("node2"))
        return (kv.mod_revision, json.loads(kv.value)) if kv is not None else None

    def mismatch(self, step: int = 10) -> Path:
        """node0's spare disagrees with rank 1 at ``step``: node0 asks node2 to arbitrate."""
        self.checked(step)
        path = self.captured(step)
        write_result(path, {"step": step, "rank": 1, "checksums": WRONG, "replay_s": 0.2})
        self.node0.poll()
        return path

    def arbitrate(self, sums: dict) -> None:
        self.node2.poll()
        write_result(Path(self.arbiter_asked[-1]["verify"]), {"step": 10, "rank": 1, "checksums": sums,
                                                               "replay_s": 0.3}, arbiter=True)
        self.node2.poll()


WRONG = {**SUMS, "blocks.0": 23}


def test_a_mismatch_is_arbitrated_by_a_third_node_and_two_replays_against_the_rank_name_it(tmp_path):
    agents = _Three(tmp_path)
    path = agents.mismatch()
    [mismatch] = agents.events("sdc.mismatch")
    assert (mismatch["node"], mismatch["verifier"], mismatch["arbiter"]) == ("node1", "node0", "node2")
    assert agents.events("sdc.suspect") == [] and path.exists()  # kept for the arbiter's replay
    agents.arbitrate(WRONG)
    assert agents.arbiter_asked == [{"verify": str(path), "arbiter": True}]
    [suspect] = agents.events("sdc.suspect")
    assert (suspect["node"], suspect["role"], suspect["rank"], suspect["step"]) == ("node1", "rank", 1, 10)
    assert (suspect["arbitrated"], suspect["arbiter"], suspect["verifier"]) == (True, "node2", "node0")
    assert suspect["units"] == ["blocks.0"] and suspect["arbitrated_sums"] == WRONG
    assert [v["rollback"] for v in agents.verdicts["node2"]] == [True] and agents.verdicts["node0"] == []
    agents.clock.advance(1)
    agents.node0.poll()  # the verifier reads the verdict and lets the input go; judges nothing itself
    assert agents.node0.asked == {} and not path.exists() and agents.verdicts["node0"] == []


def test_an_arbiter_that_agrees_with_the_rank_names_the_verifier_and_nothing_is_rolled_back(tmp_path):
    agents = _Three(tmp_path)
    agents.mismatch()
    agents.arbitrate(SUMS)
    [suspect] = agents.events("sdc.suspect")
    assert (suspect["node"], suspect["role"], suspect["rollback"]) == ("node0", "verifier", False)
    assert agents.verdicts["node2"][0]["node"] == "node0"


def test_three_different_answers_roll_back_and_blame_nobody(tmp_path):
    agents = _Three(tmp_path)
    agents.mismatch()
    agents.arbitrate({**SUMS, "": 99})
    assert agents.events("sdc.suspect") == []
    [inconclusive] = agents.events("sdc.inconclusive")
    assert (inconclusive["node"], inconclusive["arbiter"]) == ("node1", "node2")
    [verdict] = agents.verdicts["node2"]
    assert verdict["role"] is None and verdict["rollback"] and verdict["count"] is False


def test_without_an_arbiter_the_verifier_judges_alone_and_says_why(tmp_path):
    agents = _Three(tmp_path, nodes=("node0", "node1"))
    agents.mismatch()
    [suspect] = agents.events("sdc.suspect")
    assert (suspect["node"], suspect["arbitrated"], suspect["arbitration"]) == \
        ("node1", False, "no third node in the run to arbitrate")


def test_an_arbiter_that_cannot_replay_or_stays_silent_leaves_the_verifier_to_judge(tmp_path):
    agents = _Three(tmp_path)
    agents.arbiter_pid = None
    path = agents.mismatch()
    agents.node2.poll()  # no spare: it answers "skipped" through the same key
    agents.clock.advance(1)
    agents.node0.poll()
    [suspect] = agents.events("sdc.suspect")
    assert suspect["arbitration"] == "node2 could not arbitrate: no warm spare on this node"
    assert suspect["node"] == "node1" and not path.exists()

    agents = _Three(tmp_path / "silent")
    agents.mismatch()
    agents.clock.advance(11)  # node2 never looks (its agent is stopped)
    agents.node0.poll()
    [suspect] = agents.events("sdc.suspect")
    assert suspect["arbitration"] == "no verdict from node2 within 10s"


def test_an_arbiter_that_cannot_read_the_input_says_so(tmp_path):
    agents = _Three(tmp_path)
    path = agents.mismatch()
    moved = path.rename(path.with_suffix(".elsewhere"))  # another host: the run directory not shared
    agents.node2.poll()
    [skipped] = agents.events("sdc.replay_skipped")
    assert skipped["arbitration"] and "not readable on node2" in skipped["reason"]
    moved.rename(path)
    agents.clock.advance(1)
    agents.node0.poll()
    assert "not readable on node2" in agents.events("sdc.suspect")[0]["arbitration"]


def test_a_suspect_carries_its_ranks_last_verified_step(tmp_path):
    agents = _Three(tmp_path, nodes=("node0", "node1"))
    agents.checked(10)
    path = agents.captured(10)
    write_result(path, {"step": 10, "rank": 1, "checksums": SUMS, "replay_s": 0.2})
    agents.node0.poll()
    agents.mismatch(step=20)
    [suspect] = agents.events("sdc.suspect")
    assert (suspect["step"], suspect["verified_step"]) == (20, 10)


def test_the_rollback_record_names_the_node_to_rescreen():
    state = RunState(MemoryStore(FakeClock()), RunKeys.of("/elastic", "r"))
    state.record_sdc_rollback(11, 0, "node1", 1, "node2", rescreen=True)
    assert state.sdc_rollback()["rescreen"] is True and state.distrust_spec() == "11@0"


# -- what the verdict does: the supervisor's side on the in-memory store ------------------------------
def _supervisor(tmp_path: Path, min_nodes: int | None):
    import threading
    from types import SimpleNamespace

    from elastic.agent.config import AgentConfig
    from elastic.agent.failures import ProgressGuard
    from elastic.agent.records import NodeRecords
    from elastic.agent.scopes import RunScope
    from elastic.agent.supervise import Supervisor

    state = RunState(MemoryStore(FakeClock()), RunKeys.of("/elastic", "r"))
    events = EventLog(tmp_path / "events" / "agent-node0.jsonl", "agent/node0")
    spec = SimpleNamespace(nnodes="3", run_id="r")
    sup = Supervisor("node0", AgentConfig(), state, events, SimpleNamespace(run_dir=tmp_path), None,
                     RunScope(spec, state, events), NodeRecords(state, "node0", events, lambda: None),
                     ProgressGuard(0), threading.Event(), lambda: "running")
    sup.min_nodes = min_nodes
    for node in ("node0", "node1", "node2"):
        state.put_heartbeat(node, {"epoch": 0})
    return sup, state


VERDICT = {"node": "node1", "rank": 1, "step": 40, "verifier": "node2", "arbiter": "node0", "arbitrated": True,
           "units": ["blocks.0"], "verified_step": 30}


def test_a_wrong_rank_in_an_elastic_run_is_excluded_and_the_run_distrusts_what_followed_its_last_verified_step(tmp_path):
    sup, state = _supervisor(tmp_path, min_nodes=2)
    sup.sdc_rollback({**VERDICT, "role": "rank", "rollback": True}, epoch=0)
    assert state.distrust_spec() == "31@0" and state.sdc_rollback()["rescreen"] is True
    assert state.exclusions.get("node1")["by"] == "sdc/node0" and state.epoch() == 1
    assert [f["node"] for f in state.faults()] == ["node1"] and list(state.failures()) == ["node1"]
    [rollback] = [e for e in read_run_events(tmp_path) if e["kind"] == "sdc.rollback"]
    assert (rollback["from_step"], rollback["detected_step"], rollback["verified_step"]) == (31, 40, 30)


def test_a_fixed_size_run_keeps_the_suspect_and_a_wrong_verifier_rolls_nothing_back(tmp_path):
    sup, state = _supervisor(tmp_path, min_nodes=None)
    sup.sdc_rollback({**VERDICT, "role": "rank", "rollback": True, "verified_step": None}, epoch=0)
    assert state.exclusions.get("node1") is None and state.distrust_spec() == "40@0"  # never verified: from the step
    sup, state = _supervisor(tmp_path / "verifier", min_nodes=2)
    sup.sdc_rollback({**VERDICT, "node": "node2", "role": "verifier", "rollback": False}, epoch=0)
    assert state.sdc_rollback() is None and state.epoch() == 0
    assert state.exclusions.get("node2") is not None and [f["node"] for f in state.faults()] == ["node2"]


def test_an_elastic_run_at_its_minimum_keeps_the_suspect_and_nobody_is_blamed_when_no_two_agree(tmp_path):
    sup, state = _supervisor(tmp_path, min_nodes=3)
    sup.sdc_rollback({**VERDICT, "role": "rank", "rollback": True}, epoch=0)
    assert state.exclusions.get("node1") is None
    assert [e["reason"] for e in read_run_events(tmp_path) if e["kind"] == "sdc.kept"] == \
        ["the run needs 3 nodes and has 3"]
    sup, state = _supervisor(tmp_path / "none", min_nodes=2)
    sup.sdc_rollback({**VERDICT, "role": None, "rollback": True, "count": False}, epoch=0)
    assert state.faults() == [] and state.exclusions.all() == {} and state.distrust_spec() == "31@0"
    assert state.sdc_rollback()["rescreen"] is False and state.epoch() == 1


def test_min_nodes_reads_an_elastic_range_only():
    from elastic.agent.node import _min_nodes

    assert (_min_nodes("3:4"), _min_nodes("4"), _min_nodes("4:4")) == (3, None, None)


def test_a_new_attempt_reads_the_arbiters_verdict_before_judging_alone(tmp_path):
    """The arbiter's rollback bumps the epoch: the verifier's attempt may end before it read the
    verdict; the verdict it then finds is the only one (measured: a second ``sdc.suspect`` otherwise)."""
    agents = _Three(tmp_path)
    agents.mismatch()
    agents.arbitrate(WRONG)
    agents.node0.attach(None)
    assert len(agents.events("sdc.suspect")) == 1 and agents.verdicts["node0"] == []
    agents = _Three(tmp_path / "unanswered")
    agents.mismatch()
    agents.node0.attach(None)
    [suspect] = agents.events("sdc.suspect")
    assert suspect["arbitration"] == "its attempt ended before the arbiter answered"


def test_a_silent_arbiter_is_asked_again_and_takes_the_check_once(tmp_path):
    """Measured: an arbiter's watch handed a request over seconds late, once never; the verifier puts
    the same request again (a new revision) while it waits, over an unanswered record only."""
    agents = _Three(tmp_path)
    agents.mismatch()
    key = agents.state.keys.sdc_arbitrate("node2")
    first = agents.state.store.get(key).mod_revision
    agents.clock.advance(2.1)
    agents.node0.poll()
    record = json.loads(agents.state.store.get(key).value)
    assert record["nudge"] == 1 and agents.state.store.get(key).mod_revision > first
    agents.node2.poll()
    agents.clock.advance(2.1)
    agents.node0.poll()  # nudged again: node2 has it in hand already and does not replay it twice
    agents.node2.poll()
    assert len(agents.arbiter_asked) == 1
    agents.arbitrate(WRONG)
    agents.clock.advance(2.1)
    agents.node0.poll()
    assert json.loads(agents.state.store.get(key).value)["verdict"]["suspect"] == "node1"  # not overwritten
    assert len(agents.events("sdc.suspect")) == 1 and agents.node0.asked == {}


def test_what_is_unanswered_when_the_run_ends_is_said(tmp_path):
    agents = _Three(tmp_path)
    agents.captured(10)
    agents.mismatch(step=20)
    assert agents.node0.busy()
    agents.node0.end_of_run()
    [skipped] = agents.events("sdc.replay_skipped")
    assert (skipped["step"], skipped["reason"]) == (10, "the run ended before the replay answered")
    [suspect] = agents.events("sdc.suspect")
    assert suspect["arbitration"] == "the run ended before node2 answered" and not agents.node0.busy()


def test_a_suspect_after_the_run_finished_is_a_fault_not_a_rollback(tmp_path):
    sup, state = _supervisor(tmp_path, min_nodes=None)
    sup.run_ended = True
    sup.sdc_rollback({**VERDICT, "role": "rank", "rollback": True}, epoch=0)
    assert state.sdc_rollback() is None and state.epoch() == 0 and [f["node"] for f in state.faults()] == ["node1"]
    [after] = [e for e in read_run_events(tmp_path) if e["kind"] == "sdc.after_end"]
    assert "at or before step 30" in after["detail"]


def test_the_agent_that_rolls_the_run_back_leaves_its_epoch_at_once_and_counts_no_death_after_it(tmp_path):
    """Its own watch says so a round trip later: meanwhile a worker of its own that dies (its peers
    stopped theirs for the new epoch) is the move's consequence, not this node's fault (CI, loaded:
    the arbiter counted a worker_signal, then a worker_error, after its own rollback)."""
    from types import SimpleNamespace

    from elastic.agent.attempt import Outcome

    sup, state = _supervisor(tmp_path, min_nodes=None)
    sup.metrics = SimpleNamespace(run_dir=tmp_path, tick=lambda: None)
    attempt = SimpleNamespace(running=False, poll=lambda: -9, dir=tmp_path, number=1, runtime_s=lambda: 1.0)
    sup.signals = SimpleNamespace(current=lambda: SimpleNamespace(epoch=0, excluded=None, stop=None))
    assert not sup.moved_on(0) and sup._poll_run(attempt, 0) is None
    sup.sdc_rollback({**VERDICT, "role": "rank", "rollback": True}, epoch=0)
    assert sup.moved_on(0) and not sup.moved_on(1)
    assert sup._poll_run(attempt, 0).outcome == Outcome.PEER_RESTART  # the watch still says epoch 0
    assert sup._exited(attempt, 0).outcome == Outcome.PEER_RESTART
    assert [e["epoch"] for e in read_run_events(tmp_path) if e["kind"] == "agent.failed_after_move"] == [0]
