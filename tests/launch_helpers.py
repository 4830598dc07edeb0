"""Helpers for end-to-end tests that run the real launcher, agents, etcd and torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from elastic.common.events import read_run_events
from elastic.common.procs import alive

Event = dict


def write_run_config(tmp_path: Path, nodes: str = "2", steps: int = 16, interval: int = 4,
                     step_sleep: float = 0.05, run_id: str = "t", **sections) -> Path:
    """A small run config; ``sections`` merge into (or add) top-level sections."""
    cfg = {
        "run": {"id": run_id, "dir": str(tmp_path / "run")},
        "launch": {"nodes": nodes, "nproc_per_node": 1},
        # Pre-flight screening is covered by its own tests; the other runs skip its seconds.
        "agent": {"max_restarts": 3, "term_grace_s": 2, "preflight": {"enabled": False}},
        "checkpoint": {"interval_steps": interval, "keep_last": 2},
        "trainer": {"steps": steps, "batch_size": 8, "dim": 16, "depth": 2, "lr": 0.01, "step_sleep": step_sleep},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_launcher(config: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "launch", str(config), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_event(run_dir: Path, predicate: Callable[[Event], bool], timeout: float,
                   proc: subprocess.Popen | None = None) -> Event:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_run_events(run_dir):
            if predicate(event):
                return event
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited (rc={proc.returncode}) before the event:\n{proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"no matching event within {timeout}s")


def run_pids(run_dir: Path) -> dict[str, set[int]]:
    """Every process the run reported: launcher, etcd, agents, torchrun, trainers."""
    pids: dict[str, set[int]] = {"launcher": set(), "etcd": set(), "agent": set(), "torchrun": set(), "trainer": set(),
                                 "spare": set()}
    for e in read_run_events(run_dir):
        source = e.get("source", "")
        if source == "launcher":
            pids["launcher"].add(e["pid"])
            if e["kind"] == "launcher.etcd_started":
                pids["etcd"].add(e["etcd_pid"])
            if e["kind"] == "launcher.agent_started":
                pids["agent"].add(e["agent_pid"])
        elif source.startswith("agent/"):
            pids["agent"].add(e["pid"])
            if e.get("torchrun_pid"):
                pids["torchrun"].add(e["torchrun_pid"])
            if e.get("spare_pid"):  # a warm spare (in-process recovery)
                pids["spare"].add(e["spare_pid"])
        elif source.startswith("trainer/"):
            pids["trainer"].add(e["pid"])
    for group in pids.values():
        group.discard(0)
    return pids


def wait_all_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive; return the survivors."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return set()
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


def kill_quietly(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_node(run_dir: Path, node: str) -> float:
    """SIGKILL a simulated node at once: its agent and everything below it (workers, spare).

    Returns the time of the kill (wall clock, as in the events)."""
    from elastic.common.procs import descendants

    agent = next(e["pid"] for e in read_run_events(run_dir) if e["source"] == f"agent/{node}"
                 and e["kind"] == "agent.start")
    tree = [agent, *descendants(agent)]
    kill_ts = time.time()
    kill_quietly(set(tree))
    return kill_ts


def worker_pid(run_dir: Path, node: str, local_rank: int = 0) -> int:
    """The pid of a node's worker once the agent has adopted its workers (torchrun retired)."""
    retired = next(e for e in read_run_events(run_dir) if e["source"] == f"agent/{node}"
                   and e["kind"] == "agent.torchrun_retired")
    return int(retired["workers"][str(local_rank)])
