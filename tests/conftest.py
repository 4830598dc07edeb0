"""Shared fixtures: a real etcd server on a free loopback port."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastic.control.etcd_server import EmbeddedEtcd

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def etcd_server(tmp_path):
    """A fresh single-member etcd per test (starts in ~0.1 s)."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_endpoint(etcd_server) -> str:
    return etcd_server.endpoint


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child processes: this checkout first on PYTHONPATH, the venv's bin on PATH."""
    return _child_env()


@pytest.fixture(scope="session")
def subprocess_env_session() -> dict[str, str]:
    return _child_env()


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, subprocess_env_session) -> dict:
    """One uninterrupted 2-node run of the standard small config; fault runs must match its checksum."""
    import json

    from tests.launch_helpers import start_launcher, write_run_config

    tmp = tmp_path_factory.mktemp("baseline")
    proc = start_launcher(write_run_config(tmp), subprocess_env_session)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    return {"summary": summary, "out": out, "run_dir": tmp / "run"}
