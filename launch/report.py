"""The run report's picture: rank 0's loss over time with restarts and faults marked.

Written by the launcher at the end of every run as ``<run_dir>/loss.png``
next to ``summary.json`` and the events.  The loss is what the trainer
reported (``trainer.step`` events of rank 0); each worker process is its
own line, so a restart shows as a new line starting at its resume point.
Marked on the time axis: restarts (``agent.restart``: green dashed, grey dotted when caused by a peer),
injected faults (``chaos.inject``, red) and detections (a failed attempt, a
hang, a rollback, a failed checkpoint save: orange triangles).

The fault and detection markers are shared with the chaos timeline
(:mod:`chaos.report`), so both pictures mark the same events the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic.common.events import read_run_events

DETECTIONS = ("agent.hang_detected", "agent.rollback", "checkpoint.save_failed")
LOSS_PNG = "loss.png"


def run_start(events: list[dict[str, Any]]) -> float:
    """Time zero of a run's plots: the launcher's start (else the first event)."""
    return next((e["ts"] for e in events if e.get("kind") == "launcher.start"), events[0]["ts"] if events else 0.0)


def rank0_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("kind") == "trainer.step" and e.get("source") == "trainer/rank0"]


def detections(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("kind") in DETECTIONS
            or (e.get("kind") == "agent.state" and e.get("state") == "FAILED")]


def mark_faults(ax, events: list[dict[str, Any]], start: float) -> None:
    """Injected faults as red vertical lines, detections as orange triangles at the bottom."""
    for i, e in enumerate(e for e in events if e.get("kind") == "chaos.inject"):
        x = e.get("injected_ts", e["ts"]) - start
        ax.axvline(x, color="red", lw=1.2, label="fault" if i == 0 else None)
        ax.annotate(e.get("fault", "fault"), (x, 0.02), xycoords=ax.get_xaxis_transform(), color="red",
                    fontsize=7, rotation=90, va="bottom", ha="right" if i % 2 == 0 else "left")
    det = detections(events)
    if det:
        ax.plot([e["ts"] - start for e in det], [0.03] * len(det), "v", color="orange", label="detected",
                transform=ax.get_xaxis_transform())


def mark_restarts(ax, events: list[dict[str, Any]], start: float) -> None:
    """A node's own failure restarts green dashed; restarts caused by a peer grey dotted."""
    labelled: set[str] = set()
    for e in (e for e in events if e.get("kind") == "agent.restart"):
        reason = str(e.get("reason"))
        own = bool(e.get("counted")) or reason != "peer"
        ax.axvline(e["ts"] - start, color="green" if own else "grey", lw=1, ls="--" if own else ":",
                   label=None if reason in labelled else f"restart ({reason})")
        labelled.add(reason)


def plot_loss(run_dir: str | Path, path: str | Path | None = None, title: str = "") -> Path | None:
    """Draw the loss curve of a run directory; None when rank 0 reported no loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    events = read_run_events(run_dir)
    steps = [e for e in rank0_steps(events) if isinstance(e.get("loss"), (int, float))]
    if not steps:
        return None
    start = run_start(events)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, pid in enumerate(dict.fromkeys(e["pid"] for e in steps)):
        mine = [e for e in steps if e["pid"] == pid]
        ax.plot([e["ts"] - start for e in mine], [e["loss"] for e in mine], ".-", ms=3, lw=1, color="tab:blue",
                label="rank 0 loss" if i == 0 else None)
    mark_restarts(ax, events, start)
    mark_faults(ax, events, start)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("loss")
    n_restarts = sum(1 for e in events if e.get("kind") == "agent.restart")
    ax.set_title(title or f"{run_dir.name}: {len(steps)} steps reported, last step {steps[-1]['step']}, "
                 f"{n_restarts} restarts", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    out = Path(path) if path is not None else run_dir / LOSS_PNG
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
