"""Where replay verification's files live and how a spare answers (importable without torch: the
agent reads the answers).

``<run>/sdc/replay-<step>-r<rank>.pt``: what the capturing rank saved for a spare (weights, batch);
``<run>/sdc/replay-<step>-r<rank>.replayed.json``: the spare's answer (checksums, or an error);
``<run>/sdc/replay-<step>-r<rank>.arbitrated.json``: the answer of the arbiter's spare, when the first
replay disagreed with the rank (another node's spare replays the same input).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
