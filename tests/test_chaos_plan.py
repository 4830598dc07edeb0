"""Fault plans: parsing, one-line validation errors, seeded schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from chaos.cli import main as chaos_main
from chaos.injectors import REGISTRY, HangParams, OutageParams
from chaos.plan import FaultSpec, load_plan, parse_plan
from elastic.common.config import ConfigError

NODES = ["node0", "node1", "node2"]


def test_every_catalogue_fault_is_registered():
    assert set(REGISTRY) == {
        "kill_worker", "kill_agent", "hang_worker", "straggler", "nan", "corrupt_checkpoint", "ckpt_write_error",
        "etcd_outage", "bad_hardware", "kill_during_rendezvous", "kill_during_checkpoint", "etcd_latency", "partition",
        "kill_spare", "kill_during_recovery", "etcd_member_stop", "sdc",
    }


def test_every_registered_fault_is_soaked_or_says_why_not():
    from chaos.soak import CATALOGUE, NOT_SOAKED

    assert not set(CATALOGUE) & set(NOT_SOAKED)
    assert set(CATALOGUE) | set(NOT_SOAKED) == set(REGISTRY)
    assert {"kill_spare", "kill_during_recovery", "etcd_member_stop"} <= set(CATALOGUE)


def test_new_faults_in_the_suites_catalogue_and_their_routes():
    from chaos.cluster_runner import route
    from chaos.suite import standard_scenarios

    scenarios = {s.name: s for s in standard_scenarios(["node0", "node1", "node2", "node3"], 60, 10)}
    spare = scenarios["kill_spare"].faults
    assert [(f.fault, f.target, f.after, f.delay_s) for f in spare] == [
        ("kill_spare", "node1", None, None), ("kill_worker", "node1", 0, 2.0)]
    during = scenarios["kill_during_recovery"].faults
    assert [(f.fault, f.after, f.delay_s) for f in during] == [("kill_worker", None, None),
                                                              ("kill_during_recovery", 0, 0.5)]
    stop = scenarios["etcd_member_stop"].faults
    assert stop[0].target == "etcd" and stop[0].params.duration_s == 10.0 and stop[0].params.member is None
    assert (stop[1].fault, stop[1].after) == ("kill_worker", 0)
    # Who carries each out in a cluster run: the agent through etcd (a kill during a recovery is a
    # kill, posted later), chaos on etcd itself, chaos on a process found in the run's events.
    assert route("kill_worker") == route("kill_during_recovery") == "agent"
    assert route("etcd_member_stop") == route("etcd_outage") == "infra"
    assert route("kill_spare") in ("local", "agent")  # agent once its agents execute it (fault_actions)


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
    ({"random": {"mtbf_s": 5, "seed": 1, "faults": ["kill_during_recovery"]}},
     "random.faults.kill_during_recovery: waits for a run event"),
    ({"faults": [{"fault": "kill_worker", "target": "n", "at_step": 2, "delay_s": 1}]},
     "faults[0].delay_s: counts from the fault named by after"),
    ({"faults": [{"fault": "kill_worker", "target": "n", "at_step": 2},
                 {"fault": "kill_worker", "target": "n", "at_step": 2, "after": 0, "delay_s": -1}]},
     "faults[1].delay_s: expected a number of seconds >= 0"),
    ({"faults": [{"fault": "etcd_member_stop", "at_step": 2, "params": {"member": -1}}]},
     "faults[0].params.member: must be >= 0"),
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


def test_cover_draws_every_fault_once_first_then_by_weight():
    from chaos.plan import RandomPlan

    weights = {"kill_worker": 50.0, "nan": 1.0, "straggler": 1.0, "etcd_outage": 1.0, "kill_spare": 1.0}
    covered = RandomPlan(5.0, 3, weights, max_faults=40, cover=True).schedule(NODES)
    assert {f.fault for f in covered[:5]} == set(weights)  # each kind once, in a seeded order
    assert sum(f.fault == "kill_worker" for f in covered[5:]) > 25  # then the weights rule
    again = RandomPlan(5.0, 3, weights, max_faults=40, cover=True).schedule(NODES)
    assert [(f.fault, f.target, f.at_time_s) for f in covered] == [(f.fault, f.target, f.at_time_s) for f in again]
    plain = RandomPlan(5.0, 3, weights, max_faults=40).schedule(NODES)
    assert [f.at_time_s for f in plain[:5]] != [f.at_time_s for f in covered[:5]] or \
        [f.fault for f in plain[:5]] != [f.fault for f in covered[:5]]


def test_explicit_plan_with_a_delayed_follower_and_a_member_stop():
    plan = parse_plan({"faults": [
        {"fault": "kill_worker", "target": "node1", "at_step": 12},
        {"fault": "kill_during_recovery", "target": "node2", "at_step": 12, "after": 0, "delay_s": 0.5},
        {"fault": "etcd_member_stop", "at_time_s": 30, "params": {"member": 1, "mode": "kill"}},
    ]})
    follow, stop = plan.faults[1], plan.faults[2]
    assert (follow.after, follow.delay_s) == (0, 0.5)
    assert follow.describe() == "kill_during_recovery -> node2 @ #0 + 0.5s"
    assert stop.target == "etcd" and (stop.params.member, stop.params.mode, stop.params.duration_s) == (1, "kill", 10.0)


def test_soak_plan_follows_kills_mid_recovery_and_asks_for_three_etcd_members(tmp_path):
    from chaos.cli import build_parser
    from chaos.cluster_runner import ClusterRunner, ClusterSpec
    from chaos.soak import RECOVERY_KILL_DELAY_S, SPARE_KILL_GAP_S, SoakConfig, _job, plan

    # The command the issue and the README show parses as written (--nodes included).
    args = build_parser().parse_args(["soak", "--config", "examples/tiny.yaml", "--nodes", "4", "--duration", "10m",
                                      "--mtbf", "60s"])
    assert (args.nodes, args.duration, args.mtbf) == (4, "10m", "60s")
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny.yaml"
    cfg = SoakConfig(tmp_path, config=tiny, num_nodes=4, duration_s=600, mtbf_s=60, seed=1)
    job, _ = _job(cfg)
    faults = plan(cfg, job)
    assert plan(cfg, job) == faults  # seeded
    assert len(job.nodes) == 4 and all(0 < (f.at_time_s or 0) <= 600 for f in faults)
    for i, f in enumerate(faults):
        if f.fault == "kill_during_recovery":
            first = faults[f.after]
            assert f.after == i - 1 and first.fault == "kill_worker" and first.at_time_s == f.at_time_s
            assert f.delay_s == RECOVERY_KILL_DELAY_S and f.target in job.nodes
        if f.fault in ("corrupt_checkpoint", "kill_spare"):
            then = faults[i + 1]
            assert (then.fault, then.target, then.after) == ("kill_worker", f.target, i)
            assert then.delay_s == (SPARE_KILL_GAP_S if f.fault == "kill_spare" else None)
    drawn = {f.fault for f in faults if f.after is None or f.fault == "kill_during_recovery"}
    assert len(drawn) >= min(len(faults) // 2, 8)  # the cover: mostly different kinds
    member_stop = [f for f in faults if f.fault == "etcd_member_stop"]
    spec = ClusterSpec(job.config, "r", tmp_path / "run", job.nodes, "4", {})
    assert ClusterRunner(spec, faults).etcd_members == (3 if member_stop else 1)
    assert ClusterRunner(spec, [FaultSpec("etcd_member_stop", "etcd", at_time_s=5.0)]).etcd_members == 3
    operator = ClusterSpec(job.config, "r", tmp_path / "run", job.nodes, "4", {}, etcd_endpoint="127.0.0.1:1")
    assert ClusterRunner(operator, [FaultSpec("etcd_member_stop", "etcd", at_time_s=5.0)]).etcd_members == 1
    short = SoakConfig(tmp_path, config=cfg.config, num_nodes=4, duration_s=180, mtbf_s=20, seed=1,
                       faults=("kill_spare", "kill_during_recovery", "etcd_member_stop", "kill_worker"))
    kinds = {f.fault for f in plan(short, job)}
    assert {"kill_spare", "kill_during_recovery", "etcd_member_stop"} <= kinds


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
