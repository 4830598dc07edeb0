"""Start one agent process: forked from the launcher when that is safe, else its own interpreter.

Why fork: ``python -m elastic.agent`` spends ~0.27 s of CPU importing (requests, etcd3gw,
prometheus_client, our config dataclasses) before it can start torchrun.  With N simulated nodes
on one host the N imports run at once: at 4 nodes on 2 cores the agents started torchrun 0.55 s
after the launcher had etcd up, about 7% of launch -> first step.  The launcher has already
imported most of those modules for its own use; after importing the rest once, a fork starts an
agent in a few milliseconds, and on a real node it takes the agent's import off the start of
every launch as well.

When forking is not safe the agent is exec'd as before (``start="exec"`` in
``launcher.agent_started``):
- another thread exists in the launcher (a lock it held would be copied held into the child);
- after the launcher has opened etcd clients (respawns): the child would share their sockets.

The child never returns into the launcher's frames: whatever the agent does, it leaves through
``os._exit`` after running its own exit handlers, so the launcher's ``finally`` blocks (teardown,
stopping etcd) and atexit handlers never run in an agent.

How to find a forked agent: its process name is ``elastic-agent`` (``ps -e``, ``top``,
``pgrep elastic-agent``) and its pid and node are in the ``launcher.agent_started`` event; its
command line stays the launcher's.  Rewriting the command line (setproctitle) was rejected: a
title longer than the launcher's own command line overwrites the process's environment block,
and ``/proc/PID/environ`` is how operators and Slurm tooling tell which job a process serves.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from elastic.common.procs import child_preexec, set_parent_death_signal, set_process_name

AGENT_MODULE = "elastic.agent"
PROCESS_NAME = "elastic-agent"


class ForkedProc:
    """The part of :class:`subprocess.Popen` the launcher uses, for a child made by ``os.fork``."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the exit status is gone
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def agent_argv(run_id: str, node_id: str, endpoint: str, run_dir: Path, config_path: Path,
               local_addr: str) -> list[str]:
    return ["--run-id", run_id, "--node-id", node_id, "--etcd-endpoint", endpoint, "--run-dir", str(run_dir),
            "--config", str(config_path), "--local-addr", local_addr]


def can_fork() -> bool:
    return hasattr(os, "fork") and threading.active_count() == 1


def start_agent(argv: list[str], log_path: Path, fork: bool) -> tuple[subprocess.Popen[bytes] | ForkedProc, str]:
    """Start the agent with ``argv``, output to ``log_path``; returns the process and how it started."""
    if fork and can_fork():
        return fork_agent(argv, log_path), "fork"
    return exec_agent(argv, log_path), "exec"


def exec_agent(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        # Own session: a terminal Ctrl-C reaches only the launcher, which then stops the
        # agents in order instead of every process receiving SIGINT at once.
        return subprocess.Popen([sys.executable, "-m", AGENT_MODULE, *argv], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=child_preexec(signal.SIGTERM))


def fork_agent(argv: list[str], log_path: Path) -> ForkedProc:
    import elastic.agent.main  # noqa: F401  (imported once here, not once per agent)

    sys.stdout.flush()
    sys.stderr.flush()  # buffered launcher output must not be written a second time by the child
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _run_child(argv, log_path, parent)  # never returns
    return ForkedProc(pid, [sys.executable, "-m", AGENT_MODULE, *argv])


def _run_child(argv: list[str], log_path: Path, parent: int) -> None:
    code = 1
    try:
        _become_agent(argv, log_path, parent)
        from elastic.agent.main import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # the agent's own crash: report it, never unwind into the launcher
        traceback.print_exc()
    finally:
        _leave(code)


def _become_agent(argv: list[str], log_path: Path, parent: int) -> None:
    """What Popen(start_new_session, preexec_fn, stdout=log) and a fresh interpreter would give."""
    os.setsid()
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the death signal was armed
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    atexit._clear()  # the launcher's handlers are not the agent's
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The launcher's sys.stdout may not write to fd 1 (a terminal UI, a test's capture).
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    set_process_name(PROCESS_NAME)


def _leave(code: int) -> None:
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)
