"""A run directory on a full filesystem: one line naming the path and the cause, exit 2, never a
traceback.  A real tmpfs, mounted in a private mount namespace (``unshare``); skipped where the
kernel does not allow one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]


def _in_small_tmpfs(mount: Path, size: str, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    mount.mkdir()
    script = f'mount -t tmpfs -o size={size} none "$1" && shift && exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mount), *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=90)


@pytest.fixture(autouse=True)
def _needs_mount_namespaces(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs none {tmp_path}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")


def test_launch_on_a_full_run_dir_says_where_and_why(tmp_path, subprocess_env):
    mount = tmp_path / "small"
    argv = [sys.executable, "-m", "launch", str(REPO / "examples" / "mlp-tiny.yaml"), "--nodes", "1",
            "--run-dir", str(mount / "run")]
    proc = _in_small_tmpfs(mount, "8m", argv, subprocess_env)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"elastic-launch: run dir error: {mount / 'run'}: only ")
    assert "MiB free; the embedded etcd needs 80 MiB (it preallocates a 64 MiB write-ahead log" in lines[0]


def test_etcd_that_cannot_write_its_wal_names_the_cause(tmp_path, subprocess_env):
    mount = tmp_path / "small"
    code = ("import sys; from elastic.control.etcd_server import EmbeddedEtcd, EtcdServerError\n"
            f"e = EmbeddedEtcd(data_dir='{mount}/etcd', log_path='{tmp_path}/etcd.log')\n"
            "try:\n    e.start()\nexcept EtcdServerError as exc:\n    print(exc)\nfinally:\n    e.stop()\n")
    proc = _in_small_tmpfs(mount, "8m", [sys.executable, "-c", code], subprocess_env)
    assert proc.returncode == 0, proc.stderr
    assert f"etcd (data dir {mount}/etcd) exited with code" in proc.stdout
    assert "failed to create WAL; no space left on device" in proc.stdout
