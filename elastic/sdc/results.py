"""Where replay verification's files live and how a spare answers (importable without torch: the
agent reads the answers).

``<run>/sdc/replay-<step>-r<rank>.pt``: what the capturing rank saved for a spare (weights, batch);
``<run>/sdc/replay-<step>-r<rank>.replayed.json``: the spare's answer (checksums, or an error);
``<run>/sdc/replay-<step>-r<rank>.arbitrated.json``: the answer of the arbiter's spare, when the first
replay disagreed with the rank (another node's spare replays the same input).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

OFF_PATH_NICE = 19
"""The niceness of replay verification's work off the training thread: a spare's replay of a check,
a rank's checksums and input files.  It shares the node's CPUs with the ranks and must yield to them
(measured, 4-node DiT on 2 cores, 15 on/off block pairs: ``replay_step_ratio`` at ``replay_every:
10`` 1.043 and 1.052 before, 1.038 and 1.039 with all three niced; ``SCHED_IDLE`` instead gave
1.044 and 1.045, no better, so the plain niceness stays; docs/benchmarks.md)."""


def nice_this_thread(niceness: int = OFF_PATH_NICE) -> None:
    """Lower the calling thread's priority (Linux niceness is per thread); where that is not
    permitted the work runs at the process's priority."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)

REPLAY_DIR = "sdc"


def inputs_path(run_dir: Path, step: int, rank: int) -> Path:
    return run_dir / REPLAY_DIR / f"replay-{step:08d}-r{rank}.pt"


def result_path(inputs: Path, arbiter: bool = False) -> Path:
    return inputs.with_suffix(".arbitrated.json" if arbiter else ".replayed.json")


def write_result(inputs: Path, result: dict[str, Any], arbiter: bool = False) -> None:
    """The spare's answer beside the check's input, atomically (the agent polls for it)."""
    final = result_path(inputs, arbiter)
    tmp = final.with_name(f".{final.name}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(final)


def read_result(inputs: Path, arbiter: bool = False) -> dict[str, Any] | None:
    """The spare's answer, or None while there is none (or it is being written)."""
    try:
        return json.loads(result_path(inputs, arbiter).read_text())
    except (OSError, ValueError):
        return None
