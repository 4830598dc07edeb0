"""Silent data corruption, the fast parts: the bit flip, the majority verdict, the fault file, config, chaos wiring."""

from __future__ import annotations

import json
import math

import pytest
import torch

from elastic.common.config import ConfigError, from_dict
from elastic.common.events import EventLog, read_run_events
from elastic.run.schema import RunConfig
from elastic.sdc.agreement import judge, shard_checksum
from elastic.sdc.flip import FlipError, flip_bit, flip_in_grads
from elastic.worker.faults import FaultHooks, fired_records, write_fault


# -- the flip ---------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def _popcount(x: int) -> int:
    return bin(x & 0xFFFFFFFF).count("1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_flip_changes_exactly_one_bit_and_stays_finite(dtype):
    gen = torch.Generator().manual_seed(3)
    for scale in (1e-30, 1e-3, 1.0, 1e4):
        grad = (torch.randn(257, generator=gen) * scale).to(dtype)
        if dtype == torch.float16:
            grad = grad.clamp(-6e4, 6e4)
        before = grad.clone()
        for element in (0, 128, 256):
            for bit in (None, 0, 3):
                grad.copy_(before)
                flip = flip_bit(grad, element, bit)
                diff = (_bits(grad) ^ _bits(before)).tolist()
                assert [i for i, d in enumerate(diff) if d] == [element]
                assert _popcount(diff[element]) == 1
                assert torch.isfinite(grad).all() and math.isfinite(flip.after)
                assert flip.before == float(before[element]) and flip.after == float(grad[element])


def test_the_default_bit_is_the_top_of_the_mantissa_and_others_are_refused():
    t = torch.tensor([1.0, -3.0])
    assert flip_bit(t, 0).bit == 22 and t[0].item() == 1.5  # fp32: 1.0 -> 1.5, finite, large enough to matter
    assert flip_bit(t, 1).after == -2.0
    with pytest.raises(FlipError, match="bit 23 is outside the torch.float32 mantissa"):
        flip_bit(t, 0, 23)  # the exponent: could make an Inf, which the NaN guard would see
    with pytest.raises(FlipError, match="element 2 outside a shard of 2"):
        flip_bit(t, 2)
    with pytest.raises(FlipError, match="cannot flip a bit of a torch.int64"):
        flip_bit(torch.zeros(2, dtype=torch.int64), 0)


def test_flip_in_grads_hits_the_largest_gradient_of_the_chosen_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    flip = flip_in_grads(list(model.parameters()), index=2)
    changed = [i for i, (p, g) in enumerate(zip(model.parameters(), grads)) if not torch.equal(p.grad, g)]
    assert changed == [2] and flip.param == 2
    assert flip.element == int(grads[2].view(-1).abs().argmax())
    assert flip.before != 0.0 and flip.after != flip.before
    with pytest.raises(FlipError, match="no gradient shard"):
        flip_in_grads([torch.nn.Parameter(torch.zeros(2))])


# -- the checksum and the verdict ------------------------------------------------------------------
def test_shard_checksum_sees_one_flipped_bit():
    params = [torch.randn(8, 8), torch.randn(5)]
    same = [p.clone() for p in params]
    assert shard_checksum(params) == shard_checksum(same)
    flip_bit(same[1], 4, 0)  # the lowest mantissa bit: the smallest change there is
    assert shard_checksum(params) != shard_checksum(same)
    assert 0 <= shard_checksum(params) < 2**32  # fits an int64 slot, sums of slots stay exact


def test_all_groups_agree():
    verdict = judge([[7, 9], [7, 9], [7, 9]])
    assert verdict.agree and verdict.majority == {0: 7, 1: 9} and not verdict.suspects


def test_the_minority_group_is_the_suspect_on_the_rank_that_differs():
    verdict = judge([[7, 9], [7, 4], [7, 9], [7, 9]])
    assert not verdict.agree
    assert verdict.suspects == {1: [1]} and verdict.majority == {0: 7, 1: 9} and verdict.no_majority == []


def test_two_faults_in_two_groups_on_different_ranks_name_both():
    verdict = judge([[1, 2], [5, 2], [1, 6]])
    assert verdict.suspects == {1: [0], 2: [1]} and verdict.majority == {0: 1, 1: 2}


@pytest.mark.parametrize("matrix", [[[1], [2]], [[1], [1], [2], [2]], [[1], [2], [3]]])
def test_without_a_strict_majority_nobody_is_named(matrix):
    verdict = judge(matrix)
    assert not verdict.agree and verdict.suspects == {} and verdict.no_majority == [0]


def test_a_ragged_matrix_is_refused():
    with pytest.raises(ValueError, match="every group must give 2 checksums"):
        judge([[1, 2], [1]])


# -- the fault file: fires once, on one rank, silently ---------------------------------------------
def test_an_sdc_fault_fires_once_on_one_rank_and_leaves_only_its_record(tmp_path):
    write_fault(tmp_path, "sdc", {"kind": "sdc", "node": "node1", "step": 6})
    events = EventLog(tmp_path / "events" / "trainer.jsonl", "trainer/rank0")
    other_node = FaultHooks(tmp_path, 0, events, node="node0")
    rank0, rank1 = FaultHooks(tmp_path, 0, events, node="node1"), FaultHooks(tmp_path, 1, events, node="node1")
    assert other_node.sdc(6) is None and rank0.sdc(5) is None
    fault = rank0.sdc(6)
    assert fault is not None and fault.path.suffix == ".fired"
    assert rank1.sdc(6) is None  # one rank's shard, not every rank's
    rank0.sdc_fired(fault, 6, {"param": 0, "element": 3, "bit": 22, "before": 1.0, "after": 1.5})
    assert read_run_events(tmp_path) == []  # silent: no fault.fired, nothing the runtime could key on
    [record] = fired_records(tmp_path, "sdc")
    assert record["file"] == "sdc.json" and record["fired"]["node"] == "node1"
    assert (record["fired"]["step"], record["fired"]["rank"], record["fired"]["after"]) == (6, 0, 1.5)
    assert FaultHooks(tmp_path, 0, events, node="node1").sdc(6) is None  # a replayed step 6 runs clean
    write_fault(tmp_path, "local", {"kind": "sdc", "node": "node1", "step": 8, "at": "local"})
    assert rank0.sdc(8) is None  # the shard seam never takes a local flip, nor the other way round
    assert rank0.sdc(8, at="local") is not None


def test_silent_fault_flips_a_real_gradient_where_the_file_says(tmp_path):
    from types import SimpleNamespace

    from elastic.api import silent_fault

    write_fault(tmp_path, "sdc", {"kind": "sdc", "rank": 0, "step": 3, "bit": 20})
    model = torch.nn.Linear(6, 2)
    model(torch.randn(4, 6)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    session = SimpleNamespace(hooks=FaultHooks(tmp_path, 0, EventLog(None, "t"), node="node0"))
    silent_fault(session, 2, model)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    silent_fault(session, 3, model)
    diff = (model.weight.grad.view(torch.int32) ^ before[0].view(torch.int32)).view(-1).tolist()
    assert [_popcount(d) for d in diff if d] == [1] and torch.equal(model.bias.grad, before[1])
    fired = fired_records(tmp_path, "sdc")[0]["fired"]
    assert fired["bit"] == 20 and fired["param"] == 0


# -- config ------------------------------------------------------------------------------------------
def _replicas(**sdc) -> dict:
    return {"launch": {"nodes": "3", "workload": "dit"}, "replicas": {"enabled": True}, "sdc": sdc}


def test_sdc_config_defaults_off_and_refuses_what_cannot_run():
    assert RunConfig().sdc.check_every == 0 and not RunConfig().sdc.agreement
    assert from_dict(RunConfig, _replicas(check_every=5)).sdc.agreement
    cases = {
        r"^sdc\.check_every: must be >= 0 \(0: off\), got -1$": _replicas(check_every=-1),
        r"^sdc\.check_every: compares replica groups: needs replicas\.enabled$":
            {"launch": {"workload": "dit"}, "sdc": {"check_every": 2}},
        r"^sdc\.check_every: workload 'mlp' has no cross-replica agreement check":
            {"launch": {"nodes": "3"}, "replicas": {"enabled": True}, "sdc": {"check_every": 2}},
        r"^sdc\.every: unknown key": _replicas(every=2),
        r"^sdc\.replay_every: must be >= 0 \(0: off\), got -2$": {"launch": {"workload": "dit"}, "sdc": {"replay_every": -2}},
        r"^sdc\.replay_every: replays a rank of one world; replica-group mode has sdc\.check_every$":
            _replicas(replay_every=5),
        r"^sdc\.replay_every: replays on the node's warm spare: needs agent\.inprocess\.enabled and "
        r"agent\.inprocess\.spare$":
            {"launch": {"workload": "dit"}, "agent": {"inprocess": {"spare": False}}, "sdc": {"replay_every": 5}},
        r"^sdc\.replay_every: workload 'mlp' cannot replay a rank's step \(the dit workload can\)$":
            {"sdc": {"replay_every": 5}},
    }
    assert from_dict(RunConfig, {"launch": {"workload": "dit"}, "sdc": {"replay_every": 10}}).sdc.replay
    for message, data in cases.items():
        with pytest.raises(ConfigError, match=message):
            from_dict(RunConfig, data)


# -- chaos wiring -----------------------------------------------------------------------------------
def test_the_agents_sdc_action_writes_a_node_restricted_file(tmp_path):
    from elastic.agent.fault_actions import ACTIONS, BadRequest, NodeView

    view = NodeView("node2", tmp_path, tmp_path / "ckpt", step=9)
    done = ACTIONS["sdc"](view, {"step": 14, "rank": 1})
    assert done["spec"] == {"kind": "sdc", "step": 14, "rank": 1, "node": "node2"}
    assert json.loads(open(done["file"]).read())["node"] == "node2"
    assert ACTIONS["sdc"](view, {})["spec"]["step"] == 11  # a future step when none is named
    with pytest.raises(BadRequest, match="params.bit: expected an integer"):
        ACTIONS["sdc"](view, {"bit": "high"})
    assert ACTIONS["sdc"](view, {"step": 14, "at": "local"})["spec"]["at"] == "local"
    assert ACTIONS["sdc"](view, {"step": 14, "at": "replay"})["spec"]["at"] == "replay"
    with pytest.raises(BadRequest, match="params.at: expected 'shard', 'local' or 'replay', got 'gemm'"):
        ACTIONS["sdc"](view, {"at": "gemm"})


def test_chaos_inject_takes_the_step_as_a_flag():
    from chaos.inject_cmd import _with_step

    assert _with_step({"rank": 0}, 40) == {"rank": 0, "step": 40}
    assert _with_step({"step": 40}, None) == {"step": 40}
    with pytest.raises(ConfigError, match=r"^--step: 41 disagrees with --param step=40$"):
        _with_step({"step": 40}, 41)


def test_the_suite_flips_on_a_checked_step_and_reports_an_uncovered_job_as_failed():
    from chaos.suite import sdc_uncovered, standard_scenarios, uncovered_result

    nodes = ["node0", "node1", "node2"]
    for every, step in ((0, 20), (3, 21), (5, 20), (1, 20)):
        [sdc] = [s for s in standard_scenarios(nodes, 40, 10, every) if s.name == "sdc"]
        [fault] = sdc.faults
        assert (fault.target, fault.params.step, fault.params.rank) == ("node1", step, 0)
        assert sdc.expect.bitwise and sdc.expect.required_events == ["sdc.suspect"]
    plain = from_dict(RunConfig, {"launch": {"nodes": "3", "workload": "dit"}})
    checked = from_dict(RunConfig, _replicas(check_every=2))
    assert "no SDC detection" in sdc_uncovered(plain, 3)
    assert "no majority" in sdc_uncovered(checked, 2)
    assert sdc_uncovered(checked, 3) == ""
    replayed = from_dict(RunConfig, {"launch": {"nodes": "2", "workload": "dit"}, "sdc": {"replay_every": 7}})
    assert sdc_uncovered(replayed, 2) == ""  # two nodes suffice: each one's spare replays the other's rank
    [sdc] = [s for s in standard_scenarios(nodes, 40, 10, replay_every=7) if s.name == "sdc"]
    [fault] = sdc.faults  # a checked step in the second half (the spares have imported), local to the rank
    assert (fault.params.step, fault.params.at, fault.params.rank) == (21, "local", None) and sdc.expect.bitwise
    assert sdc.sets == ["sdc.replay_nodes=0"]  # node1 is checked on the flipped step even if the job samples nodes
    [sdc] = [s for s in standard_scenarios(nodes, 40, 10) if s.name == "sdc"]
    sdc.uncovered = sdc_uncovered(plain, 3)
    result = uncovered_result(sdc)
    assert not result["result"]["ok"] and result["not_covered"].startswith("not covered:")
    assert result["result"]["invariants"][0]["name"] == "sdc_detected"


def test_repeated_suspects_make_the_node_a_lemon(etcd_endpoint, monkeypatch, tmp_path):
    from elastic.control.keys import RunKeys
    from elastic.control.leader import ClusterPolicy, LeaderConfig
    from elastic.control.runstate import RunState
    from elastic.control.store import EtcdStore
    from trainer.agreement import FAILURE_KIND, record_failure

    monkeypatch.setenv("ELASTIC_ETCD_ENDPOINT", etcd_endpoint)
    monkeypatch.setenv("ELASTIC_RUN_PREFIX", "/t/runs/sdc")
    events = EventLog(tmp_path / "events" / "e.jsonl", "trainer/node1/rank0")
    state = RunState(EtcdStore(etcd_endpoint), RunKeys("/t/runs/sdc"))
    excluded: list[str] = []
    policy = ClusterPolicy(LeaderConfig(lemon_failures=3), lambda node, reason, ttl: excluded.append(node),
                           EventLog(None, "leader"))
    for i in range(3):
        assert policy.evaluate_lemons(state.failures()) == []
        record_failure("node1", 0, events)
        assert len(state.failures()["node1"]) == i + 1
    assert policy.evaluate_lemons(state.failures()) == ["node1"] and excluded == ["node1"]
    kinds = {json.loads(kv.value)["kind"] for kv in state.store.get_prefix(state.keys.failures)}
    assert kinds == {FAILURE_KIND}
    assert read_run_events(tmp_path) == []  # no store error


def _write_fired(run_dir, name: str, fired: dict) -> None:
    (run_dir / "faults").mkdir(parents=True, exist_ok=True)
    (run_dir / "faults" / f"{name}.fired").write_text(json.dumps({"kind": "sdc", "step": fired["step"],
                                                                  "fired": fired}))


def test_the_sdc_invariant_wants_the_flipped_node_named(tmp_path):
    from chaos.analysis import _effective_ts, _sdc_caught

    inject = {"kind": "chaos.inject", "fault": "sdc", "target": "node1", "ts": 10.0, "injected_ts": 10.0,
              "detail": {"file": str(tmp_path / "faults" / "chaos-node1-sdc-20.json")}}
    assert not _sdc_caught(tmp_path, [], inject).ok  # never fired: nothing to detect
    assert _effective_ts([], inject, tmp_path) is None
    _write_fired(tmp_path, "chaos-node1-sdc-20", {"step": 20, "rank": 0, "node": "node1", "ts": 50.0})
    assert _effective_ts([], inject, tmp_path) == 50.0

    def suspect(node: str, step: int, rank: int = 0) -> dict:
        return {"kind": "sdc.suspect", "ts": 51.0, "source": f"trainer/{node}/rank0", "node": node, "rank": rank,
                "ranks": [rank], "step": step, "checksum": 1, "majority": 2}

    assert _sdc_caught(tmp_path, [suspect("node1", 20)], inject).ok
    assert _sdc_caught(tmp_path, [suspect("node1", 22)], inject).ok  # a later check's step
    wrong = _sdc_caught(tmp_path, [suspect("node2", 20)], inject)
    assert not wrong.ok and "wrong node" in wrong.detail
    assert not _sdc_caught(tmp_path, [suspect("node1", 20, rank=1)], inject).ok
    assert not _sdc_caught(tmp_path, [suspect("node1", 18)], inject).ok  # named before it happened
    tie = _sdc_caught(tmp_path, [{"kind": "sdc.no_majority", "ts": 51.0, "source": "x"}], inject)
    assert not tie.ok and "no strict majority" in tie.detail
    replayed = {"kind": "sdc.suspect", "ts": 51.0, "source": "agent/node2", "source_check": "replay", "node": "node1",
                "rank": 0, "step": 20, "verifier": "node2", "units": ["blocks.1"], "checksums": {}, "replayed": {}}
    caught = _sdc_caught(tmp_path, [replayed], inject)
    assert caught.ok and "replayed on node2's spare: blocks.1 differ" in caught.detail


def _group(tmp_path, node: str, check_every: int = 2):
    from types import SimpleNamespace

    from elastic.sdc.config import SdcConfig
    from trainer.agreement import AgreementCheck

    session = SimpleNamespace(rank=0, world=1, epoch=0,
                              events=EventLog(tmp_path / "events" / f"trainer-{node}.jsonl", f"trainer/{node}/rank0"))
    return AgreementCheck(SdcConfig(check_every=check_every), session, node)


def test_checks_are_due_on_their_steps_but_never_the_last_nor_alone(tmp_path):
    check = _group(tmp_path, "node0", check_every=5)
    assert [s for s in range(0, 31) if check.due(s, 30, 3)] == [5, 10, 15, 20, 25]
    assert not check.due(10, 30, 1)  # a lone group has nobody to compare with
    assert not _group(tmp_path, "node0", check_every=0).due(10, 30, 3)


def test_the_suspect_group_names_itself_with_both_checksums(tmp_path, monkeypatch):
    from elastic.sdc.agreement import judge
    from trainer.agreement import CheckOutcome

    monkeypatch.delenv("ELASTIC_ETCD_ENDPOINT", raising=False)  # no etcd here: the lemon record is skipped
    verdict = judge([[11, 22], [11, 99], [11, 22]])
    for node, own in (("node0", 0), ("node1", 1), ("node2", 2)):
        _group(tmp_path, node)._report(CheckOutcome(6, verdict, own))
    events = read_run_events(tmp_path)
    checked = [e for e in events if e["kind"] == "sdc.checked"]
    assert len(checked) == 3 and all(not e["agree"] and e["suspects"] == [1] for e in checked)
    [suspect] = [e for e in events if e["kind"] == "sdc.suspect"]
    assert suspect["source"] == "trainer/node1/rank0"
    assert (suspect["node"], suspect["rank"], suspect["step"]) == ("node1", 1, 6)
    assert (suspect["checksum"], suspect["majority"]) == (99, 22)
    assert CheckOutcome(6, verdict, 1).suspect and not CheckOutcome(6, verdict, 0).suspect


def test_two_groups_that_disagree_say_there_is_no_majority(tmp_path):
    from elastic.sdc.agreement import judge
    from trainer.agreement import CheckOutcome

    check = _group(tmp_path, "node0")
    check._report(CheckOutcome(4, judge([[5], [5]]), 0))
    check._report(CheckOutcome(6, judge([[5], [7]]), 0))
    events = read_run_events(tmp_path)
    [tie] = [e for e in events if e["kind"] == "sdc.no_majority"]
    assert tie["step"] == 6 and tie["checksums"] == [[5], [7]] and tie["last_agreed_step"] == 4
    assert tie["action"].startswith("report only")
    assert not [e for e in events if e["kind"] == "sdc.suspect"]
