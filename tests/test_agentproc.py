"""The launcher forks its agents: each is its own session named elastic-agent, writes to its
own log, and leaves through its own exit; never through the launcher's teardown or exit handlers."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import elastic.agent.main
from elastic.common.exits import EXIT_CONFIG
from launch.agentproc import ForkedProc, agent_argv, fork_agent, start_agent

ARGV = agent_argv("run-a", "node7", "127.0.0.1:1", Path("/nonexistent/run"), Path("/nonexistent/c.yaml"), "127.0.0.1")


def _record(out: Path, code: int):
    def main(argv):
        facts = {
            "own_session": os.getsid(0) == os.getpid(),
            "name": Path("/proc/self/comm").read_text().strip(),
            "environ": Path("/proc/self/environ").read_bytes(),
            "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "argv": argv,
        }
        out.write_text(repr(facts))
        print("hello from the agent", flush=True)
        return code

    return main


def test_a_forked_agent_is_its_own_session_with_the_agent_command_line(tmp_path, monkeypatch):
    out, log = tmp_path / "facts", tmp_path / "agent.log"
    monkeypatch.setattr(elastic.agent.main, "main", _record(out, 7))
    proc = fork_agent(ARGV, log)
    assert proc.wait(timeout=10) == 7
    facts = eval(out.read_text())  # noqa: S307 (our own repr)
    assert facts["own_session"] and facts["sigterm_default"]
    assert facts["argv"] == ARGV
    assert facts["name"] == "elastic-agent"
    assert Path(f"/proc/{os.getpid()}/environ").read_bytes() == facts["environ"]  # untouched: tools read it
    assert "hello from the agent" in log.read_text()


def test_a_crashing_forked_agent_never_runs_the_launchers_exit_handlers(tmp_path, monkeypatch):
    marker, log = tmp_path / "launcher-atexit-ran", tmp_path / "agent.log"
    me = os.getpid()

    def launcher_exit() -> None:
        if os.getpid() != me:
            marker.write_text(str(os.getpid()))

    def crash(argv):
        raise RuntimeError("agent blew up")

    monkeypatch.setattr(elastic.agent.main, "main", crash)
    atexit.register(launcher_exit)
    try:
        assert fork_agent(ARGV, log).wait(timeout=10) == 1
    finally:
        atexit.unregister(launcher_exit)
    assert "RuntimeError: agent blew up" in log.read_text()
    assert not marker.exists()


def test_forked_proc_waits_with_a_timeout_and_reports_the_killing_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic.agent.main, "main", lambda argv: time.sleep(30))
    proc = fork_agent(ARGV, tmp_path / "agent.log")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    proc.kill()  # a dead agent: nothing to signal, no error


def test_a_launcher_with_another_thread_execs_its_agents(tmp_path):
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        proc, how = start_agent(ARGV, tmp_path / "agent.log", fork=True)
    finally:
        stop.set()
    assert how == "exec" and not isinstance(proc, ForkedProc)
    assert proc.wait(timeout=30) == EXIT_CONFIG  # the real agent: its config file does not exist
    assert "config error" in (tmp_path / "agent.log").read_text()
