"""End to end: `chaos suite --quick` and `chaos run` on real local launches (etcd, agents, torchrun, gloo).

The quick suite is a fault-free baseline plus two scenarios on 2 nodes:
kill_worker (SIGKILL node1's worker mid-run) and corrupt_checkpoint (flip
bytes in the newest committed checkpoint, then kill a worker so that the
restart has to reject it and resume from the one before).  Both must finish
with weights bitwise equal to the baseline.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.launch_helpers import write_run_config

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_quick_suite_kill_worker_and_corrupt_checkpoint(tmp_path, subprocess_env):
    out = tmp_path / "suite"
    proc = subprocess.run([sys.executable, "-m", "chaos", "suite", "--nodes", "2", "--quick", "--steps", "16",
                           "--jobs", "3", "--out", str(out)],
                          env=subprocess_env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert list(by_name) == ["baseline", "kill_worker", "corrupt_checkpoint"]
    for name, scenario in by_name.items():
        failed = [i for i in scenario["result"]["invariants"] if not i["ok"]]
        assert not failed, (name, failed)
    names = {s: {i["name"] for i in by_name[s]["result"]["invariants"]} for s in by_name}
    assert {"completed", "checkpoints_intact", "no_orphans", "excluded_nodes"} <= names["baseline"]
    assert "weights_bitwise_equal" in names["kill_worker"]
    assert {"weights_bitwise_equal", "corrupt_checkpoint_skipped"} <= names["corrupt_checkpoint"]

    kill = by_name["kill_worker"]["result"]["faults"][0]
    assert kill["fault"] == "kill_worker" and kill["restarted"]
    assert kill["resume_step"] == 4  # the newest committed checkpoint before the kill at step >= 6
    assert kill["steps_lost"] == kill["last_step_before"] - 4 >= 2
    assert 0 < kill["recovery_s"] < 120 and kill["detection_s"] < kill["recovery_s"]
    assert by_name["kill_worker"]["result"]["final_checksum"] == report["baseline_checksum"]

    corrupt, killed = by_name["corrupt_checkpoint"]["result"]["faults"]
    assert corrupt["fault"] == "corrupt_checkpoint" and killed["fault"] == "kill_worker"
    assert killed["resume_step"] == 4  # step 8 was corrupted, so the restart fell back to step 4

    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    table = proc.stdout
    assert "scenario" in table and "steps_lost" in table
    for name in by_name:
        assert any(line.startswith(name) and "PASS" in line for line in table.splitlines()), table


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
