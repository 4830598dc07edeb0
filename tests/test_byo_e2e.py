"""A trainer from another package (examples/byo): installed with pip, found by its entry point, run by
``elastic-launch --nodes 4``; a worker SIGKILL recovers in-process, bitwise, at most one step lost.
A script without the API (examples/byo/plain_train.py) runs under ``launch.entrypoint`` and recovers
the same kill on the restart path.

The package goes into a directory of this test's own (``pip install --target``) put on the runs'
PYTHONPATH, not into the venv: an installed ``byo`` would change what every other process of the
venv registers (the generated config reference lists every workload), for as long as it stayed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic.common.events import read_run_events
from tests.conftest import REPO_ROOT
from tests.launch_helpers import start_launcher, write_run_config
from tests.test_inprocess_e2e import _assert_in_process, _kill_worker, _steps_lost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = REPO_ROOT / "examples" / "byo"


def pip_install(package: Path, target: Path) -> None:
    """``pip install`` of ``package`` into ``target``, built from a copy (the build leaves files behind)."""
    src = target.parent / f"{package.name}-src"
    shutil.copytree(package, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.insert(4, "--no-build-isolation")  # offline: build with the venv's setuptools
    subprocess.run(cmd, check=True, timeout=180, capture_output=True)


@pytest.fixture(scope="module")
def byo_env(tmp_path_factory, subprocess_env_session) -> dict[str, str]:
    target = tmp_path_factory.mktemp("byo") / "site"
    pip_install(EXAMPLE, target)
    env = dict(subprocess_env_session)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(target)])
    return env


def _config(tmp_path: Path, name: str) -> Path:
    """The shipped example config, shortened, in a run directory of this test."""
    data = yaml.safe_load((EXAMPLE / "byo.yaml").read_text())
    data["run"] = {"id": name, "dir": str(tmp_path / name / "run")}
    data["agent"].update({"term_grace_s": 2, "preflight": {"enabled": False}})
    data["trainer"].update({"steps": 60})
    (tmp_path / name).mkdir()
    path = tmp_path / name / "byo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(config: Path, env: dict, act=None) -> tuple[dict, list[dict], float | None]:
    """``elastic-launch --nodes 4 CONFIG`` (its module), with ``act`` run beside it; (summary, events, act's)."""
    proc = start_launcher(config, env, "--nodes", "4")
    run_dir = Path(yaml.safe_load(config.read_text())["run"]["dir"])
    acted = act(run_dir, proc) if act is not None else None
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    return json.loads((run_dir / "summary.json").read_text()), read_run_events(run_dir), acted


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: the BYO workload's restart path stays in the default suite; in-process recovery is test_inprocess_e2e.py's.
@pytest.mark.soak
def test_the_installed_byo_workload_recovers_a_worker_kill_in_process_bitwise(tmp_path, byo_env):
    baseline, events, _ = _run(_config(tmp_path, "base"), byo_env)
    starts = [e for e in events if e["kind"] == "trainer.start"]
    assert len(starts) == 4 and all(e["data_position"] == 0 for e in starts)  # ByoRun.resumed's field: its loop ran
    summary, events, kill_ts = _run(_config(tmp_path, "kill"), byo_env, _kill_worker("node1", min_step=10))
    _assert_in_process(events, kill_ts)
    assert _steps_lost(events, kill_ts) <= 1
    assert summary["last_step"] == 60 and summary["final_checksum"] == baseline["final_checksum"]


def _wait_progress(path: Path, step: int, proc, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            progress = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or mid-write
            progress = {"step": -1}
        if progress["step"] >= step:
            return progress
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    raise AssertionError(f"{path.name} never reached step {step}")


def test_a_script_without_the_api_runs_under_launch_entrypoint_on_the_restart_path(tmp_path, subprocess_env):
    config = write_run_config(tmp_path, steps=30, run_id="plain", launch={"entrypoint": [str(EXAMPLE / "plain_train.py")]})
    run_dir = tmp_path / "run"
    proc = start_launcher(config, subprocess_env)
    victim = _wait_progress(run_dir / "plain-rank1.json", 8, proc)
    kill_ts = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    events = read_run_events(run_dir)
    assert any(e["kind"] == "agent.epoch_bump" and e["ts"] > kill_ts for e in events)  # every worker restarted
    assert not any(e["kind"] == "trainer.recovered" for e in events)  # no in-process path without the API
    final = json.loads((run_dir / "plain-rank0.json").read_text())
    assert final["step"] == 30 and final["start"] >= 8  # resumed from its own checkpoint
