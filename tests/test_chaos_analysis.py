"""Recovery metrics and invariants computed from a hand-written run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

from chaos.analysis import Expectation, check_run, fault_metrics, goodput
from chaos.report import format_table, plot_timeline

T0 = 1_000.0
P = 9_000_000  # pids above any kernel's pid_max: never alive, so the orphan check has nothing to find


def ev(ts, kind, source, pid, **fields):
    return {"ts": T0 + ts, "mono": ts, "kind": kind, "source": source, "pid": pid, **fields}


def killed_run() -> list[dict]:
    """Rank 0 steps 1..7 (pid 10), killed at t=8 after step 7; resumed from 4 by pid 20, steps 5..10."""
    events = [ev(0, "launcher.start", "launcher", P + 1),
              ev(0.5, "trainer.start", "trainer/rank0", P + 10, step=0)]
    events += [ev(1 + s, "trainer.step", "trainer/rank0", P + 10, step=s, loss=1.0 / s, step_time=0.5)
               for s in range(1, 8)]
    events += [ev(8.0, "chaos.inject", "chaos", P + 99, fault="kill_worker", target="node0", pids=[P + 10],
                  step=7, detail={}, injected_ts=T0 + 8.0),
               ev(9.0, "agent.state", "agent/node0", P + 2, state="FAILED"),
               ev(15.0, "trainer.start", "trainer/rank0", P + 20, step=4, resumed=True)]
    events += [ev(16 + s, "trainer.step", "trainer/rank0", P + 20, step=s, loss=1.0 / s, step_time=0.25)
               for s in range(5, 11)]
    events.append(ev(27, "trainer.done", "trainer/rank0", P + 20, step=10, checksum="c"))
    return events


def test_fault_metrics_from_events():
    events = killed_run()
    m = fault_metrics(events, events[9])
    assert m["last_step_before"] == 7 and m["resume_step"] == 4 and m["steps_lost"] == 3
    assert m["detection_s"] == 1.0 and m["detected_by"] == "agent.state/FAILED"
    assert m["recovery_s"] == 13.0 and m["recovered_step"] == 5  # kill at 8, first new step at 21


def test_goodput_counts_each_step_once_at_its_last_execution():
    events = killed_run()
    productive, gp = goodput(events, wall_s=30.0)
    # steps 1..4 from the first worker (0.5 s each), 5..10 from the second (0.25 s each);
    # the first worker's 5..7 were lost and do not count
    assert math.isclose(productive, 4 * 0.5 + 6 * 0.25)
    assert math.isclose(gp, productive / 30.0)


def write_run(tmp_path: Path, events: list[dict], summary: dict) -> Path:
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    with open(run / "events" / "all.jsonl", "w") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_check_run_fails_the_invariants_that_do_not_hold(tmp_path):
    events = killed_run()
    run = write_run(tmp_path, events, {"last_step": 10, "final_checksum": "different", "wall_s": 30.0,
                                       "nodes": {"node0": 0, "node1": 93}})
    result = check_run(run, Expectation(steps=10, bitwise=True), "baseline", launcher_rc=0, orphan_wait_s=0.1)
    verdicts = {i["name"]: i["ok"] for i in result["invariants"]}
    assert verdicts["completed"] and verdicts["faults_injected"] and verdicts["no_orphans"]
    assert not verdicts["weights_bitwise_equal"]
    assert not verdicts["checkpoints_intact"]  # no committed checkpoint at all is not "intact"
    assert not verdicts["excluded_nodes"]  # node1 exited 93 but nobody expected an exclusion
    assert not result["ok"]
    table = format_table([{"name": "kill", "result": result}])
    assert "kill" in table and "FAIL" in table and "weights_bitwise_equal" in table
    png = plot_timeline([{"name": "kill", "run_dir": str(run), "result": result}], tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_nan_step_that_was_rolled_back_does_not_fail_finiteness(tmp_path):
    events = killed_run()
    events.insert(9, ev(7.5, "trainer.step", "trainer/rank0", P + 10, step=8, loss=float("nan"), step_time=0.5))
    run = write_run(tmp_path, events, {"last_step": 10, "final_checksum": "c", "wall_s": 30.0, "nodes": {}})
    result = check_run(run, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    finite = next(i for i in result["invariants"] if i["name"] == "weights_finite")
    assert finite["ok"], finite
    events.append(ev(26.5, "trainer.step", "trainer/rank0", P + 20, step=10, loss=float("inf"), step_time=0.2))
    run2 = write_run(tmp_path / "b", events, {"last_step": 10, "final_checksum": "c", "wall_s": 30.0, "nodes": {}})
    result = check_run(run2, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    assert not next(i for i in result["invariants"] if i["name"] == "weights_finite")["ok"]


def test_a_fault_due_but_not_injected_fails_one_scheduled_after_the_end_does_not(tmp_path):
    late = ev(28, "chaos.not_injected", "chaos", P + 99, fault="kill_worker", target="node1",
              trigger_reached=False, reason="the run ended before its trigger")
    run = write_run(tmp_path, killed_run() + [late], {"last_step": 10, "wall_s": 30.0, "nodes": {}})
    result = check_run(run, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    injected = next(i for i in result["invariants"] if i["name"] == "faults_injected")
    assert injected["ok"] and "1 scheduled after the run ended" in injected["detail"]
    due = dict(late, trigger_reached=True, reason="no live worker for 'node1'")
    run2 = write_run(tmp_path / "b", killed_run() + [due], {"last_step": 10, "wall_s": 30.0, "nodes": {}})
    result = check_run(run2, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    injected = next(i for i in result["invariants"] if i["name"] == "faults_injected")
    assert not injected["ok"] and "no live worker" in injected["detail"]


def test_a_planted_fault_that_never_fired_is_reported_and_not_measured(tmp_path):
    planted = ev(-1, "chaos.inject", "chaos", P + 99, fault="nan", target="rank0", pids=[], step=0,
                 detail={"file": "/x/faults/chaos-nan-9.json"}, injected_ts=T0 - 1)
    events = [planted] + [e for e in killed_run() if e["kind"] != "chaos.inject"]
    run = write_run(tmp_path, events, {"last_step": 10, "wall_s": 30.0, "nodes": {}})
    result = check_run(run, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    took = next(i for i in result["invariants"] if i["name"] == "faults_took_effect")
    assert not took["ok"] and "nan->rank0" in took["detail"]
    (metrics,) = result["faults"]
    assert metrics["took_effect"] is False and metrics["steps_lost"] is None and metrics["recovery_s"] is None
    fired = ev(8.0, "fault.fired", "trainer/rank0", P + 10, fault="nan_loss", step=8, rank=0, file="chaos-nan-9.json")
    run2 = write_run(tmp_path / "b", events + [fired], {"last_step": 10, "wall_s": 30.0, "nodes": {}})
    result = check_run(run2, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    (metrics,) = result["faults"]
    assert metrics["took_effect"] and metrics["fault_ts"] == T0 + 8.0 and metrics["resume_step"] == 4


def test_a_corruption_no_load_read_is_unproven_unless_recovery_was_in_process(tmp_path):
    corrupt = ev(7.5, "chaos.inject", "chaos", P + 99, fault="corrupt_checkpoint", target="node0", pids=[], step=7,
                 detail={"checkpoint_step": 4}, injected_ts=T0 + 7.5)
    summary = {"last_step": 10, "final_checksum": "c", "wall_s": 30.0, "nodes": {}}
    run = write_run(tmp_path, killed_run() + [corrupt], summary)
    result = check_run(run, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    verdict = next(i for i in result["invariants"] if i["name"] == "corrupt_checkpoint_skipped")
    assert not verdict["ok"] and "proved nothing" in verdict["detail"]
    recovered = ev(14.0, "trainer.recovered", "trainer/rank0", P + 10, path="inprocess", step=7, world_size=2)
    run2 = write_run(tmp_path / "b", killed_run() + [corrupt, recovered], summary)
    result = check_run(run2, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
    verdict = next(i for i in result["invariants"] if i["name"] == "corrupt_checkpoint_skipped")
    assert verdict["ok"] and "in-process" in verdict["detail"], verdict


def test_a_corruption_superseded_before_any_load_is_not_a_missed_skip(tmp_path):
    """Soak seed 1 (2026-12-05): step 920 corrupted, recovered in-process, then a disk restore at
    step 2280 long after 920 was rotated out: that load could never have chosen 920."""
    corrupt = ev(7.5, "chaos.inject", "chaos", P + 99, fault="corrupt_checkpoint", target="node0", pids=[], step=7,
                 detail={"checkpoint_step": 4}, injected_ts=T0 + 7.5)
    summary = {"last_step": 10, "final_checksum": "c", "wall_s": 30.0, "nodes": {}}

    def verdict_with(*loads: int) -> dict:
        events = killed_run() + [corrupt] + [ev(9.0 + i * 0.1, "checkpoint.loaded", "trainer/rank0", P + 10, step=s,
                                                path=f"/c/step-{s}") for i, s in enumerate(loads)]
        run = write_run(tmp_path / "-".join(map(str, loads)), events, summary)
        result = check_run(run, Expectation(steps=10, bitwise=False), None, launcher_rc=0, orphan_wait_s=0.1)
        return next(i for i in result["invariants"] if i["name"] == "corrupt_checkpoint_skipped")

    newer = verdict_with(8)
    assert newer["ok"] and "newer step(s) [8]" in newer["detail"], newer
    assert not verdict_with(4)["ok"]  # the damaged step itself loaded
    older = verdict_with(8, 2)  # a load passed over it without saying so
    assert not older["ok"] and "not reported as skipped" in older["detail"], older
