"""The agent's side of the spare zygote (:mod:`elastic.worker.zygote`): warm spares in milliseconds.

A :class:`SpareFactory` is one zygote process per node and attempt, started beside the attempt's
first spare (which is started as before: the zygote imports at a low priority and is not ready
for seconds).  Once the zygote says ``ready``, :meth:`SpareFactory.fork` returns a
:class:`ForkedSpare`: the agent's child (re-parented to it, a subreaper), with a stdin pipe and a
log as a started spare has, so the rest of the agent treats both alike.  Whenever the zygote is not
ready, unforkable, dead or slow to answer, ``fork`` returns None and the agent starts a spare the
old way: the zygote can only make a replacement sooner, never make one fail.

Why not ``multiprocessing``'s forkserver: its children are the server's, not the agent's, so their
exit status would reach the agent second-hand; here ``waitpid`` in the agent stays the one source of
how a process ended (``elastic.common.procs.reap``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from elastic.common.procs import UNKNOWN_EXIT, NotOurChild, reap
from elastic.worker.zygote import ZYGOTE_FD_ENV

FORK_TIMEOUT_S = 2.0
"""The longest the agent's loop waits for one fork (a few milliseconds measured)."""


class ForkedSpare:
    """A forked spare as the agent holds a started one (``subprocess.Popen``'s subset it uses)."""

    def __init__(self, pid: int, stdin_fd: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = reap(self.pid)
            except NotOurChild:
                self.returncode = UNKNOWN_EXIT
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 10.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.returncode


class SpareFactory:
    """One zygote; :meth:`fork` a warm spare from it once it is ready (else None)."""

    def __init__(self, entrypoint: list[str], env: dict[str, str], log_dir: Path) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"spare-zygote-{int(time.time() * 1000)}.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "elastic.worker.spare", *entrypoint],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**env, ZYGOTE_FD_ENV: str(theirs.fileno())},
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = ours
        self.state = "importing"
        """``importing``, ``ready``, ``unforkable`` (more than one thread after its imports) or ``gone``."""
        self.hello: dict = {}  # the zygote's first message (its import time, its threads)
        self.error = ""
        self.announced = False  # the agent said it is ready (agent.spare_zygote_ready)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> bool:
        """Ready to fork (reads the zygote's first message without waiting for it)."""
        if self.state == "importing":
            self._read_hello()
        if self.state in ("importing", "ready") and self.proc.poll() is not None:
            self._gone(f"the zygote exited {self.proc.returncode}")
        return self.state == "ready"

    def _read_hello(self) -> None:
        try:
            msg = self.sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._gone(f"the zygote's socket: {exc}")
            return
        if not msg:
            self._gone("the zygote closed its socket")
            return
        self.hello = json.loads(msg)
        self.state = "ready" if self.hello.get("zygote") == "ready" else "unforkable"

    def fork(self, env: dict[str, str], log_path: Path) -> ForkedSpare | None:
        """A new warm spare with ``env`` and its output in ``log_path``; None (``error`` says why)
        when the zygote cannot give one now."""
        if not self.ready():
            return None
        r, w = os.pipe()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            pid = self._request(env, [r, log])
        finally:
            os.close(r)
            os.close(log)
        if pid is None:
            os.close(w)
            return None
        return ForkedSpare(pid, w)

    def _request(self, env: dict[str, str], fds: list[int]) -> int | None:
        try:
            self.sock.settimeout(FORK_TIMEOUT_S)
            socket.send_fds(self.sock, [json.dumps({"env": env}).encode()], fds)
            reply = json.loads(self.sock.recv(4096) or b"{}")
        except (OSError, ValueError) as exc:  # a zygote too slow to answer is not trusted again
            self._gone(f"fork request: {type(exc).__name__}: {exc}")
            return None
        if "pid" not in reply:
            self.error = str(reply.get("error", "no pid in the zygote's reply"))
            return None
        return int(reply["pid"])

    def _gone(self, why: str) -> None:
        self.state, self.error = "gone", why
        self.close()

    def close(self) -> None:
        """Close the socket (a zygote that reads its end exits 0) and make sure it is gone."""
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
