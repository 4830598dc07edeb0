"""Shared fixtures: a real etcd server on a free loopback port."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastic.etcd_server import EmbeddedEtcd

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


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child processes: this checkout first on PYTHONPATH, the venv's bin on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
