"""Fault plans: parsing, one-line validation errors, seeded schedules."""

from __future__ import annotations

import pytest
import yaml

from chaos.cli import main as chaos_main
from chaos.injectors import REGISTRY, HangParams, OutageParams
from chaos.plan import load_plan, parse_plan
from elastic.common.config import ConfigError

NODES = ["node0", "node1", "node2"]


def test_every_catalogue_fault_is_registered():
    assert set(REGISTRY) == {
        "kill_worker", "kill_agent", "hang_worker", "straggler", "nan", "corrupt_checkpoint", "ckpt_write_error",
        "etcd_outage", "bad_hardware", "kill_during_rendezvous", "kill_during_checkpoint", "etcd_latency", "partition",
    }


def test_explicit_plan_parses_with_typed_params(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"faults": [
        {"fault": "kill_worker", "target": "node1", "at_step": 6},
        {"fault": "etcd_outage", "at_time_s": 4, "params": {"duration_s": 2, "mode": "kill"}},
        {"fault": "hang_worker", "target": "rank0", "at_step": 3, "params": {"resume_after_s": 1.5}},
        {"fault": "nan", "target": "rank0", "at_time_s": 0, "params": {"step": 9}},
    ]}))
    plan = load_plan(path)
    kinds = [(f.fault, f.target, f.at_step, f.at_time_s) for f in plan.faults]
    assert kinds == [("kill_worker", "node1", 6, None), ("etcd_outage", "etcd", None, 4.0),
                     ("hang_worker", "rank0", 3, None), ("nan", "rank0", None, 0.0)]
    assert plan.faults[1].params == OutageParams(duration_s=2.0, mode="kill")
    assert plan.faults[2].params == HangParams(resume_after_s=1.5)
    assert plan.faults[3].before_launch and not plan.faults[0].before_launch


@pytest.mark.parametrize("data, message", [
    ({"faults": [{"fault": "kill_wrker", "target": "node1", "at_step": 3}]},
     "faults[0].fault: unknown fault 'kill_wrker' (known: bad_hardware,"),
    ({"faults": [{"fault": "kill_worker", "at_step": 3}]}, "faults[0].target: required"),
    ({"faults": [{"fault": "kill_worker", "target": "node1"}]}, "faults[0]: needs exactly one of at_step, at_time_s"),
    ({"faults": [{"fault": "kill_worker", "target": "node1", "at_step": 2, "at_time_s": 1}]},
     "faults[0]: needs exactly one of"),
    ({"faults": [{"fault": "kill_worker", "target": "n", "at_step": -1}]},
     "faults[0].at_step: expected an integer >= 0"),
    ({"faults": [{"fault": "kill_worker", "target": "n", "at_step": 1}, {"fault": "etcd_outage", "at_step": 2,
                                                                         "params": {"duration_s": "x"}}]},
     "faults[1].params.duration_s: expected a number, got str 'x'"),
    ({"faults": [{"fault": "etcd_outage", "at_step": 2, "params": {"duration_s": 0}}]},
     "faults[0].params.duration_s: must be > 0"),
    ({"faults": [{"fault": "hang_worker", "target": "n", "at_step": 2, "params": {"resume": 1}}]},
     "faults[0].params.resume: unknown key (known keys: resume_after_s)"),
    ({"faults": [{"fault": "kill_worker", "target": "n", "at_step": 2, "when": 1}]}, "faults[0].when: unknown key"),
    ({"faults": [{"fault": "kill_worker", "target": "node1", "at_time_s": 0}]},
     "faults[0].at_time_s: kill_worker needs running processes"),
    ({"random": {"seed": 1, "faults": ["kill_worker"]}}, "random.mtbf_s: required"),
    ({"random": {"mtbf_s": 5, "faults": ["kill_worker"]}}, "random.seed: required"),
    ({"random": {"mtbf_s": 5, "seed": 1, "faults": {"kill_worker": 0}}}, "random.faults.kill_worker: weight must be"),
    ({"random": {"mtbf_s": 5, "seed": 1, "faults": ["kill_during_checkpoint"]}},
     "random.faults.kill_during_checkpoint: waits for a run event"),
    ({"random": {"mtbf_s": 5, "seed": 1, "faults": ["nan"], "params": {"kill_worker": {}}}},
     "random.params.kill_worker: params for a fault the plan does not draw"),
    ({"random": {"mtbf_s": 5, "seed": 1, "faults": ["straggler"], "params": {"straggler": {"delay": 1}}}},
     "random.params.straggler.delay: unknown key"),
    ({"faultz": []}, "faultz: unknown key (known keys: faults, random)"),
    ({}, "the plan has no faults"),
])
def test_validation_errors_are_one_line_naming_the_field(data, message):
    with pytest.raises(ConfigError) as err:
        parse_plan(data)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(message), text


RANDOM = {"random": {"mtbf_s": 10, "seed": 42, "faults": {"kill_worker": 3, "hang_worker": 1, "etcd_outage": 1},
                     "protected": ["node0"], "max_faults": 12, "start_s": 5,
                     "params": {"etcd_outage": {"duration_s": 1.5}}}}


def test_random_schedule_is_deterministic_for_a_seed():
    first = parse_plan(RANDOM).schedule(NODES)
    again = parse_plan(RANDOM).schedule(NODES)
    assert [(f.fault, f.target, f.at_time_s, f.params) for f in first] == \
           [(f.fault, f.target, f.at_time_s, f.params) for f in again]
    other = parse_plan({"random": {**RANDOM["random"], "seed": 43}}).schedule(NODES)
    assert [(f.fault, f.target, f.at_time_s) for f in other] != [(f.fault, f.target, f.at_time_s) for f in first]


def test_random_schedule_respects_protection_count_and_params():
    faults = parse_plan(RANDOM).schedule(NODES)
    assert len(faults) == 12
    times = [f.at_time_s for f in faults]
    assert times == sorted(times) and times[0] > 5
    assert all(f.target != "node0" for f in faults)
    assert {f.target for f in faults if f.fault == "etcd_outage"} <= {"etcd"}
    assert all(f.params.duration_s == 1.5 for f in faults if f.fault == "etcd_outage")
    assert {f.fault for f in faults} <= {"kill_worker", "hang_worker", "etcd_outage"}


def test_random_inter_arrival_mean_tracks_mtbf():
    plan = parse_plan({"random": {"mtbf_s": 4, "seed": 7, "faults": ["kill_worker"], "max_faults": 2000}})
    times = [f.at_time_s for f in plan.schedule(NODES)]
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert 3.6 < sum(gaps) / len(gaps) < 4.4  # exponential with mean mtbf_s, not a constant sleep
    assert min(gaps) < 0.5 and max(gaps) > 12  # and really spread like one


def test_protecting_every_target_is_an_error():
    plan = parse_plan({"random": {"mtbf_s": 5, "seed": 1, "faults": ["kill_worker"], "protected": NODES}})
    with pytest.raises(ConfigError, match="random.protected: protects every target"):
        plan.schedule(NODES)


def test_cli_plan_error_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("faults:\n  - {fault: kill_worker, target: node1, at_step: 1, params: {x: 1}}\n")
    rc = chaos_main(["run", str(path), "--", "elastic-launch", "examples/tiny.yaml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("chaos: error: faults[0].params.x: unknown key"), err


def test_cli_run_needs_a_launch_command(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("faults: [{fault: kill_worker, target: node1, at_step: 1}]\n")
    assert chaos_main(["run", str(path)]) == 2
    assert "give the launch after --" in capsys.readouterr().err
