"""Failure classification: what killed this torchrun attempt.

Inputs, in order of trust: the agent's own verdicts (a hang it detected, a
numerics report it received), the workers' ``@record`` error files, the
worker exit codes and rendezvous errors torchrun printed to its log, and
torchrun's own exit status.  Each class maps to an action in
:class:`~elastic.agent.config.FailurePolicy`.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

from elastic.common.peers import is_peer_lost
from elastic.worker.channel import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_NUMERICS


class FailureKind(str, Enum):
    WORKER_SIGNAL = "worker_signal"            # a worker died from a signal (SIGKILL, SIGSEGV, OOM killer)
    WORKER_ERROR = "worker_error"              # a worker raised (error file present)
    OOM = "oom"                                # a worker ran out of (device) memory
    COLLECTIVE_TIMEOUT = "collective_timeout"  # a collective timed out on this node
    PEER_LOST = "peer_lost"                    # a collective failed because another node went away
    HANG = "hang"                              # a local worker stopped reporting (detected by the agent)
    INIT_TIMEOUT = "init_timeout"              # no first step within the warm-up timeout
    STALL = "stall"                            # local workers blocked on a peer for too long
    NUMERICS = "numerics"                      # NaN/Inf or loss spike reported by the trainer
    RENDEZVOUS_TIMEOUT = "rendezvous_timeout"  # not enough nodes joined in time
    TORCHRUN = "torchrun"                      # torchrun itself died or failed before workers ran
    RECOVERY_FAILED = "recovery_failed"        # in-process re-formation could not continue (falls back)
    CONFIG = "config"                          # the worker cannot run this config (e.g. another config's checkpoint)
    CHECKPOINT = "checkpoint"                  # checkpoint saves kept failing (checkpoint.on_save_failure: stop)


# A failure of one of these classes is a consequence of some other node's failure:
# it does not count against this node's restart budget or its lemon record.
# Nor is a config or storage problem, or a rendezvous that waited in vain for other nodes.
UNCOUNTED = frozenset({FailureKind.PEER_LOST, FailureKind.STALL, FailureKind.RECOVERY_FAILED,
                       FailureKind.CONFIG, FailureKind.CHECKPOINT, FailureKind.RENDEZVOUS_TIMEOUT})

_TIMEOUT = ("Timed out waiting", "timed out", "Timeout", "DistBackendError: [../third_party/gloo")
_OOM = ("OutOfMemoryError", "CUDA out of memory", "std::bad_alloc", "Cannot allocate memory")
_EXITCODE_RE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_WORKER_LINE_RE = re.compile(r"^trainer: (.+)$", re.MULTILINE)
_STOPPING = {EXIT_CONFIG: FailureKind.CONFIG, EXIT_CHECKPOINT: FailureKind.CHECKPOINT}


def worker_exit_codes(torchrun_log: str) -> list[int]:
    """Worker exit codes from torchrun's failure summary ("exitcode  : -9")."""
    return [int(m) for m in _EXITCODE_RE.findall(torchrun_log)]


def classify(attempt_dir: Path, torchrun_rc: int | None, torchrun_log: str = "",
             numerics_reported: bool = False) -> tuple[FailureKind, str]:
    """(kind, one-line detail) for a torchrun attempt that exited with failure."""
    codes = worker_exit_codes(torchrun_log)
    if numerics_reported or EXIT_NUMERICS in codes:
        return FailureKind.NUMERICS, "trainer reported bad numerics"
    if "RendezvousTimeoutError" in torchrun_log:
        return FailureKind.RENDEZVOUS_TIMEOUT, "rendezvous timed out waiting for enough nodes"
    stopping = next((stop for c in codes if (stop := stopping_failure(c, torchrun_log)) is not None), None)
    if stopping is not None:
        return stopping
    messages = []
    for err in sorted(attempt_dir.glob("**/error.json")):
        try:
            messages.append(err.read_text(errors="replace"))
        except OSError:
            continue
    if messages:
        text = "\n".join(messages)
        if any(m in text for m in _OOM):
            return FailureKind.OOM, "worker out of memory"
        if all(is_peer_lost(t) for t in messages):
            return FailureKind.PEER_LOST, "collective failed: a peer went away"
        if any(m in text for m in _TIMEOUT):
            return FailureKind.COLLECTIVE_TIMEOUT, "collective timed out"
        return FailureKind.WORKER_ERROR, _first_error_line(text)
    if torchrun_rc is not None and torchrun_rc < 0:
        return FailureKind.TORCHRUN, f"torchrun killed by signal {-torchrun_rc}"
    negative = [c for c in codes if c < 0]
    if negative:
        return FailureKind.WORKER_SIGNAL, f"worker killed by signal {-negative[0]}"
    if codes:
        return FailureKind.WORKER_ERROR, f"worker exited with code {codes[0]}"
    return FailureKind.WORKER_SIGNAL, f"torchrun exited with {torchrun_rc}"


def stopping_failure(rc: int, log: str) -> tuple[FailureKind, str] | None:
    """A worker exit code that means "restarting cannot help" (config, failing saves), with the
    worker's own line from ``log``; None for any other code."""
    if rc not in _STOPPING:
        return None
    return _STOPPING[rc], worker_line(log) or f"worker exited with code {rc}"


def worker_line(torchrun_log: str) -> str:
    """The last one-line message a worker printed (``trainer: ...``), or ""."""
    found = _WORKER_LINE_RE.findall(torchrun_log)
    return found[-1].strip() if found else ""


def _first_error_line(text: str) -> str:
    match = re.search(r'"message":\s*"([^"\\]{0,200})', text)
    return match.group(1) if match else "worker raised"
