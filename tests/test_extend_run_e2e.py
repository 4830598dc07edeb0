"""Never lose progress: a finished run extended with more steps resumes; another config's checkpoints
stop the launch (or the worker) with the differing fields; --fresh moves them aside; a relaunch's
history holds the previous launch's final checksum, and a fresh run dir gets no history at all.

Real launcher, etcd, agents, torchrun and trainers (the MLP through the launcher, the DiT worker in
a gloo group of one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic.common.config import from_dict, to_dict
from elastic.common.events import read_run_events
from elastic.run.schema import RunConfig
from tests.launch_helpers import write_run_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[1]


def _launch(config: Path, env: dict, *args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "launch", str(config), *args], env=env, capture_output=True,
                          text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _starts(run_dir: Path) -> list[tuple[int, bool]]:
    return [(e["step"], e["resumed"]) for e in read_run_events(run_dir)
            if e["kind"] == "trainer.start" and e["source"] == "trainer/rank0"]


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the DiT extension below and test_checkpoint_identity.py's units keep --extend's checks in the default suite.
@pytest.mark.soak
def test_extend_resumes_a_changed_config_stops_and_fresh_moves_aside(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, nodes="1", steps=6, interval=3, step_sleep=0.0)
    run = tmp_path / "run"
    rc, out = _launch(config, subprocess_env)
    assert rc == 0, out
    assert not (run / "history").exists()  # a fresh run dir: nothing to archive, no empty history/0
    first = json.loads((run / "summary.json").read_text())["final_checksum"]

    rc, out = _launch(config, subprocess_env, "--steps", "9")
    assert rc == 0, out
    assert _starts(run) == [(6, True)] and "9/9 steps" in out  # extended, not retrained from step 0
    assert (run / "history" / "0" / "final_checksum.txt").read_text().strip() == first
    assert json.loads((run / "summary.json").read_text())["final_checksum"] not in (None, first)

    rc, out = _launch(config, subprocess_env, "--set", "trainer.dim=8")
    lines = out.strip().splitlines()
    assert rc == 2 and len(lines) == 1, out
    assert lines[0].startswith("elastic-launch: checkpoint mismatch: checkpoint step-00000009 in ")
    assert "trainer.dim: 16 -> 8" in lines[0] and "--fresh" in lines[0]
    assert (run / "checkpoints" / "step-00000009" / "COMMIT").exists()  # nothing touched

    rc, out = _launch(config, subprocess_env, "--set", "trainer.dim=8", "--fresh")
    assert rc == 0, out
    assert (run / "checkpoints.old-0" / "step-00000009" / "COMMIT").exists()  # moved aside, not deleted
    assert "moved the checkpoints of" in out and _starts(run) == [(0, False)]


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


def _dit_worker(tmp_path: Path, run_dir: Path, trainer: dict) -> tuple[int, str]:
    """The DiT trainer's own main (a gloo group of one) on a resolved run file, as the launcher writes it."""
    cfg = from_dict(RunConfig, {"launch": {"workload": "dit"}, "trainer": trainer,
                                "checkpoint": {"interval_steps": 2, "keep_last": 2}})
    cfg.fingerprint = cfg.compute_fingerprint()
    path = tmp_path / f"run-{len(list(tmp_path.glob('run-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("ELASTIC_AGENT_ADDR", None)
    proc = subprocess.run([sys.executable, "-m", "trainer.dit_train", "--config", str(path), "--run-dir", str(run_dir)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stderr


def test_dit_extends_its_run_and_refuses_another_models_checkpoint(tmp_path):
    run = tmp_path / "dit"
    trainer = {"steps": 2, "global_batch_size": 2, "data": {"num_samples": 8}}
    rc, err = _dit_worker(tmp_path, run, trainer)
    assert rc == 0, err
    rc, err = _dit_worker(tmp_path, run, {**trainer, "steps": 4, "step_sleep": 0.01})
    assert rc == 0, err
    starts = [e for e in read_run_events(run) if e["kind"] == "trainer.start"]
    assert [(e["step"], e["resumed"]) for e in starts] == [(0, False), (2, True)]
    rc, err = _dit_worker(tmp_path, run, {**trainer, "model": {"depth": 3}})
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("trainer:")]
    assert len(line) == 1 and line[0].startswith("trainer: checkpoint mismatch: checkpoint step-00000004")
    assert "trainer.model.depth: 2 -> 3" in line[0]
    assert len([e for e in read_run_events(run) if e["kind"] == "trainer.step"]) == 4  # nothing trained over it
