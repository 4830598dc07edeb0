"""End to end: `chaos suite` against the user's job, and `chaos run` on a local launch.

The quick suite runs ``examples/tiny.yaml`` (the DiT workload) as separate nodes against one
etcd: a fault-free baseline, then kill_worker (a SIGKILL delivered through etcd to node1's agent
at step 2I-2) and corrupt_checkpoint (node1's agent damages its shard of the newest commit, then
kills its worker, so the restart has to reject that commit and resume from the one before).
(that scenario turns in-process recovery off: the snapshot path never reads the disk).
Both must end with weights bitwise equal to the baseline, and the suite writes JSON, a timeline
and a self-contained HTML report next to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch_helpers import write_run_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _suite(out: Path, env: dict, *args: str, timeout: int = 800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chaos", "suite", "--config", str(REPO / "examples" / "tiny.yaml"),
                           "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _failed(report: dict) -> dict:
    return {s["name"]: [i for i in s["result"]["invariants"] if not i["ok"]] for s in report["scenarios"]
            if not s["result"]["ok"]}


@pytest.mark.timeout(900)
def test_quick_suite_against_the_tiny_dit_job(tmp_path, subprocess_env):
    out = tmp_path / "suite"
    # Steps 28 with the job's checkpoint interval 10: faults land around step 20.
    proc = _suite(out, subprocess_env, "--nodes", "2", "--quick", "--steps", "28",
                  "--set", "agent.preflight.enabled=false")
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0 and report["ok"], (_failed(report), proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["workload"] == "dit" and report["checkpoint_interval"] == 10 and report["steps"] == 28
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert list(by_name) == ["baseline", "kill_worker", "corrupt_checkpoint"]
    names = {s: {i["name"] for i in by_name[s]["result"]["invariants"]} for s in by_name}
    assert {"completed", "checkpoints_intact", "no_orphans", "excluded_nodes"} <= names["baseline"]
    assert {"weights_bitwise_equal", "corrupt_checkpoint_skipped"} <= names["corrupt_checkpoint"]

    kill = by_name["kill_worker"]["result"]["faults"][0]
    assert kill["fault"] == "kill_worker" and kill["restarted"] and kill["injected_at_step"] >= 18
    # In-process recovery resumes from the newest per-step snapshot; a restart from the step-10 commit.
    assert 10 <= kill["resume_step"] <= kill["last_step_before"]
    assert 0 < kill["detection_s"] < kill["recovery_s"]
    # Delivered through etcd: the agent of node1 executed it and said so.
    chaos_events = [json.loads(line) for line in
                    (Path(by_name["kill_worker"]["run_dir"]) / "events" / "chaos.jsonl").read_text().splitlines()]
    inject = next(e for e in chaos_events if e["kind"] == "chaos.inject")
    assert inject["by"] == "agent/node1" and inject["pids"] == kill["pids"]

    corrupt, killed = by_name["corrupt_checkpoint"]["result"]["faults"]
    assert corrupt["fault"] == "corrupt_checkpoint" and killed["resume_step"] == 10  # step 20 was damaged

    html = (out / "report.html").read_text()
    assert "every invariant held" in html and "data:image/png;base64," in html
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    for name in by_name:
        assert any(line.startswith(name) and "PASS" in line for line in proc.stdout.splitlines()), proc.stdout


# Long tier (pytest -m soak): FP8 + cp=2 under the launcher is test_dit_e2e.py's test_cp2_and_fp8_run_end_to_end,
# a worker kill on the DiT job is the quick suite's and test_inprocess_e2e.py's (cp=2 there too).
@pytest.mark.soak
@pytest.mark.timeout(700)
def test_kill_worker_with_fp8_and_context_parallel(tmp_path, subprocess_env):
    """cp=2 over the two nodes (one rank each), FP8 linears: the same recovery, bitwise."""
    out = tmp_path / "suite"
    proc = _suite(out, subprocess_env, "--nodes", "2", "--only", "kill_worker", "--steps", "24",
                  "--set", "trainer.fp8.enabled=true", "--set", "trainer.parallel.cp=2",
                  "--set", "agent.preflight.enabled=false")
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0 and report["ok"], (_failed(report), proc.stdout[-3000:], proc.stderr[-3000:])
    start = next(json.loads(line) for line in
                 (Path(report["scenarios"][1]["run_dir"]) / "events" / "trainer-rank0.jsonl").read_text().splitlines()
                 if '"trainer.start"' in line)
    assert start["cp"] == 2 and start["fp8_layers"] > 0


# Long tier (pytest -m soak): the plan path shares the scenario runner with the suite tests above;
# plan validation against the launch is test_launch_refusals.py's.
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_chaos_run_with_a_plan_file(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="2", steps=16, interval=4, step_sleep=0.1)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"faults": [
        {"fault": "kill_during_checkpoint", "target": "rank1", "at_step": 6, "params": {"min_step": 8}},
    ]}))
    proc = subprocess.run([sys.executable, "-m", "chaos", "run", str(plan), "--", "elastic-launch", str(config)],
                          env=subprocess_env, capture_output=True, text=True, timeout=280)
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    failed = [i for i in report["result"]["invariants"] if not i["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout, proc.stderr)
    events = [json.loads(line) for line in (run_dir / "events" / "chaos.jsonl").read_text().splitlines()]
    inject = next(e for e in events if e["kind"] == "chaos.inject")
    assert inject["source"] == "chaos" and inject["fault"] == "kill_during_checkpoint"
    assert inject["detail"]["checkpoint_step"] == 8 and inject["pids"]
    # The kill landed inside the save: the victim never reported step 8 committed.
    victim = inject["pids"][0]
    trainer = [json.loads(line) for line in (run_dir / "events" / "trainer-rank1.jsonl").read_text().splitlines()]
    assert not [e for e in trainer if e["pid"] == victim and e["kind"] == "checkpoint.committed" and e["step"] == 8]
    fault = report["result"]["faults"][0]
    assert fault["restarted"] and fault["resume_step"] in (4, 8)
    assert (run_dir / "chaos" / "timeline.png").exists()


def _sdc_suite(out: Path, env: dict, config: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "chaos", "suite", "--config", str(REPO / "examples" / config),
                           "--out", str(out), "--only", "sdc", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    return proc, json.loads((out / "report.json").read_text())


@pytest.mark.timeout(60)
def test_the_sdc_scenario_fails_honestly_on_a_job_that_cannot_catch_a_flip(tmp_path, subprocess_env):
    proc, report = _sdc_suite(tmp_path / "suite", subprocess_env, "tiny.yaml")
    assert proc.returncode == 1 and not report["ok"] and report["failed"] == ["sdc"], proc.stdout
    [sdc] = report["scenarios"]
    assert sdc["run_dir"] is None and "no SDC detection" in sdc["not_covered"]  # not run: nothing to prove
    assert [i["name"] for i in sdc["result"]["invariants"] if not i["ok"]] == ["sdc_detected"]
    assert "not covered" in proc.stdout


# Long tier (pytest -m soak): tests/test_sdc_replicas.py runs the same detection and heal in ~25 s.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_the_sdc_scenario_on_the_replica_dit_job(tmp_path, subprocess_env):
    proc, report = _sdc_suite(tmp_path / "suite", subprocess_env, "dit-replicas.yaml", "--steps", "30",
                              "--set", "sdc.check_every=5", "--set", "replicas.min_replicas=3")
    assert proc.returncode == 0 and report["ok"], (_failed(report), proc.stdout[-3000:], proc.stderr[-3000:])
    sdc = {s["name"]: s for s in report["scenarios"]}["sdc"]
    invariants = {i["name"]: i for i in sdc["result"]["invariants"]}
    assert invariants["sdc_detected"]["ok"] and "node1 rank 0 at step 20" in invariants["sdc_detected"]["detail"]
    assert invariants["weights_bitwise_equal"]["ok"]
    assert sdc["result"]["faults"][0]["detected_by"] == "sdc.suspect"
