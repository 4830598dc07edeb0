"""The node screen: ``diag burnin`` in a child process, judged into one :class:`ScreenResult`.

Used before a node joins (pre-flight), when an excluded node asks to come back, and after a
failure whose action is ``rescreen``.  It touches no agent state: it runs the screen, records
the verdict (event, ``diag/<node>`` in etcd) and returns it; the agent decides what it means.
Bad readings for tests and chaos come from ``<run_dir>/faults/diag-<node>.yaml`` when present.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.agent.config import PreflightConfig
from elastic.common.events import EventLog
from elastic.common.procs import child_preexec
from elastic.control.runstate import RunState
from elastic.control.store import StoreError


@dataclass(frozen=True)
class ScreenResult:
    passed: bool
    reason: str = ""  # why it failed ("" when it passed)
    report: Path | None = None


class Screener:
    def __init__(self, config: PreflightConfig, node_id: str, run_dir: Path, endpoint: str, state: RunState,
                 events: EventLog) -> None:
        self.config = config
        self.node_id = node_id
        self.run_dir = run_dir
        self.endpoint = endpoint
        self.state = state
        self.events = events

    def command(self, report_path: Path) -> list[str]:
        cfg = self.config
        cmd = [sys.executable, "-m", "diagnostics.cli", "burnin", f"--{cfg.mode}", "--json", str(report_path),
               "--etcd-endpoint", self.endpoint, "--ckpt-dir", str(self.run_dir)]
        if cfg.checks:
            cmd += ["--checks", ",".join(cfg.checks)]
        if cfg.thresholds:
            cmd += ["--config", cfg.thresholds]
        inject = self.run_dir / "faults" / f"diag-{self.node_id}.yaml"
        if inject.exists():
            cmd += ["--inject", str(inject)]
        return cmd

    def worker_spec(self) -> dict:
        """The pre-flight screen as local rank 0 of the first workers runs it (elastic.worker.screen)."""
        cfg = self.config
        inject = self.run_dir / "faults" / f"diag-{self.node_id}.yaml"
        return {"impl": "diag", "mode": cfg.mode, "checks": list(cfg.checks), "thresholds": cfg.thresholds,
                "inject": str(inject) if inject.exists() else "", "etcd_endpoint": self.endpoint,
                "ckpt_dir": str(self.run_dir),
                "report": str(self.run_dir / "diag" / f"{self.node_id}-{int(time.time() * 1000)}.json")}

    def recorded(self, verdict: dict) -> ScreenResult:
        """Record a verdict the worker reported (event, ``diag/<node>``) like a screen run here."""
        passed, reason = bool(verdict.get("passed")), str(verdict.get("reason", ""))
        self.events.emit("agent.screen", why="pre-flight, in the first worker", passed=passed, rc=0 if passed else 1,
                         reason="" if passed else reason, report=verdict.get("report", ""),
                         duration_s=verdict.get("duration_s"), first_step_wait_s=verdict.get("wait_s"))
        try:
            self.state.put_diag(self.node_id, {"passed": passed, "reason": reason, "ts": time.time(),
                                               "why": "pre-flight"})
        except StoreError:
            pass
        return ScreenResult(passed, "" if passed else f"pre-flight screen failed: {reason}")

    def screen(self, why: str) -> ScreenResult:
        report_path = self.run_dir / "diag" / f"{self.node_id}-{int(time.time() * 1000)}.json"
        report_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        rc, tail = self._run(self.command(report_path))
        reason = "; ".join(_failed_checks(report_path)) or (tail[0] if tail else f"diag exited {rc}")
        passed = rc == 0
        self.events.emit("agent.screen", why=why, passed=passed, rc=rc, reason=reason if not passed else "",
                         report=str(report_path), duration_s=round(time.monotonic() - started, 3))
        try:
            self.state.put_diag(self.node_id, {"passed": passed, "rc": rc, "reason": reason, "ts": time.time(),
                                               "why": why})
        except StoreError:
            pass
        return ScreenResult(passed, "" if passed else f"pre-flight screen failed: {reason}", report_path)

    def _run(self, cmd: list[str]) -> tuple[int | None, list[str]]:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.config.timeout_s,
                                  preexec_fn=child_preexec(signal.SIGKILL))
        except subprocess.TimeoutExpired:
            return None, [f"screen did not finish within {self.config.timeout_s:g}s"]
        return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-1:]


def _failed_checks(report_path: Path) -> list[str]:
    try:
        checks = json.loads(report_path.read_text()).get("checks", [])
        return [f"{c['name']}: {c['reason']}" for c in checks if c.get("verdict") == "fail"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return []
