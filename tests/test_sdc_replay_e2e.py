"""Replay verification end to end: real launcher, agents, etcd, torchrun, the DiT, warm spares.

Two nodes of one rank each; every 5 steps each node's spare replays the other node's rank.  A chaos
``sdc`` fault flips one bit of node1's local gradient (before the reduce-scatter: what a GPU that
computes wrong does) at a checked step: node0's agent must name node1, its rank and that step, no
other check may disagree, and the run must roll back to the newest checkpoint before that step and
end bitwise equal to a run with neither the fault nor replay verification.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from elastic.common.events import read_run_events
from elastic.worker.faults import fired_records, write_fault
from tests.launch_helpers import start_launcher, wait_for_event, write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EVERY = 5


def _config(tmp_path: Path, every: int = EVERY) -> Path:
    tmp_path.mkdir(exist_ok=True)
    cfg = write_run_config(tmp_path, nodes="2", launch={"workload": "dit", "nproc_per_node": 1},
                           checkpoint={"interval_steps": 10, "keep_last": 2}, sdc={"replay_every": every})
    data = yaml.safe_load(cfg.read_text())
    data["trainer"] = {"steps": 80, "seed": 0, "global_batch_size": 8, "step_sleep": 0.2,
                       "model": {"preset": "tiny", "input_size": 8, "num_heads": 2}, "data": {"num_samples": 64}}
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def test_a_flipped_bit_in_one_nodes_gradient_is_named_by_the_other_nodes_replay(tmp_path, subprocess_env):
    config = _config(tmp_path)
    run = tmp_path / "run"
    proc = start_launcher(config, subprocess_env)
    # Once both spares replay (a spare imports for seconds first: checks before are skipped), a
    # check step two checks ahead of the run gets the flip.
    for node in ("node0", "node1"):
        wait_for_event(run, lambda e, n=node: e["kind"] == "sdc.verified" and e["source"] == f"agent/{n}",
                       timeout=150, proc=proc)
    now = max(e["step"] for e in read_run_events(run) if e["kind"] == "trainer.step")
    flip_step = (now // EVERY + 2) * EVERY
    write_fault(run, "wrong-gemm", {"kind": "sdc", "node": "node1", "step": flip_step, "at": "local"})
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert json.loads((run / "summary.json").read_text())["last_step"] == 80
    fired = fired_records(run, "sdc")
    assert len(fired) == 1 and fired[0]["fired"]["node"] == "node1" and fired[0]["fired"]["at"] == "local"
    events = read_run_events(run)
    assert not [e for e in events if e["kind"] == "trainer.numerics"]  # silent: no NaN, nothing reported
    suspects = [e for e in events if e["kind"] == "sdc.suspect"]
    assert len(suspects) == 1, suspects
    suspect = suspects[0]
    assert (suspect["node"], suspect["rank"], suspect["step"]) == ("node1", fired[0]["fired"]["rank"], flip_step)
    assert suspect["verifier"] == "node0" and suspect["source"] == "agent/node0"
    assert suspect["units"] and suspect["checksums"] != suspect["replayed"]
    verified = [e for e in events if e["kind"] == "sdc.verified"]
    # Both directions were checked and agreed on the other steps (the first checks may come before
    # the spares are up: skipped, never a false alarm).
    assert {e["verifier"] for e in verified} == {"node0", "node1"}
    assert all(e["node"] != e["verifier"] for e in verified + suspects)
    assert any(e["step"] == flip_step and e["node"] == "node0" for e in verified)  # node0's own step was fine
    # The run rolled back: node1 counted, checkpoints of the flipped step or later not trusted, the
    # newest one before it loaded, and the steps from there trained again without the flip.
    [rollback] = [e for e in events if e["kind"] == "sdc.rollback"]
    assert (rollback["from_step"], rollback["node"]) == (flip_step, "node1")
    summary = json.loads((run / "summary.json").read_text())
    assert [(f["node"], f["failure_kind"], f["step"]) for f in summary["faults"]] == [("node1", "sdc", flip_step)]
    after = [e for e in events if e["ts"] > rollback["ts"]]
    skipped = {e["step"] for e in after if e["kind"] == "checkpoint.skipped_suspect"}
    loaded = [e["step"] for e in after if e["kind"] == "checkpoint.loaded"]
    assert loaded and all(step < flip_step for step in loaded) and all(step >= flip_step for step in skipped)
    # The reference runs without replay verification: checks only read the step (bitwise the same).
    clean = tmp_path / "clean"
    reference = start_launcher(_config(clean, every=0), subprocess_env)
    out, _ = reference.communicate(timeout=240)
    assert reference.returncode == 0, out
    assert (run / "final_checksum.txt").read_text() == (clean / "run" / "final_checksum.txt").read_text()
