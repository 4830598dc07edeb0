"""The chaos report: JSON for machines, a PNG timeline and a terminal table for people.

The timeline shows, per scenario, every step rank 0 reported (step vs seconds
since the launch started; a restarted worker shows as the line falling back
to its resume step), each injected fault (red line), each detection (agent
FAILED, hang detected, rollback: orange triangle) and each recovery (first
step of a restarted worker: green dot).  Goodput is in each panel's title.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic.common.events import read_run_events
from launch.report import DETECTIONS, mark_faults, rank0_steps, run_start

__all__ = ["DETECTIONS", "format_table", "plot_timeline", "write_json"]


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return path


def format_table(scenarios: list[dict[str, Any]]) -> str:
    """One row per scenario: verdict, invariants failed, steps lost, recovery, goodput, wall."""
    header = ("scenario", "result", "faults", "steps_lost", "recovery_s", "goodput", "wall_s", "failed invariants")
    rows = [header]
    for s in scenarios:
        res = s.get("result", {})
        faults = res.get("faults", [])
        lost = ",".join("n/a" if f["steps_lost"] is None else str(f["steps_lost"]) for f in faults) or "-"
        rec = ",".join("-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}" for f in faults) or "-"
        failed = [i["name"] for i in res.get("invariants", []) if not i["ok"]]
        verdict = "PASS" if res.get("ok") else ("XFAIL" if s.get("pending") else "FAIL")
        rows.append((s["name"], verdict, str(len(faults)), lost, rec, f"{res.get('goodput', 0):.3f}",
                     f"{res.get('wall_s', 0):.1f}", ", ".join(failed) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_timeline(scenarios: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(scenarios), 1)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.4 * n), squeeze=False)
    for ax, s in zip(axes[:, 0], scenarios):
        _panel(ax, s)
    axes[-1, 0].set_xlabel("seconds since launch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _panel(ax, scenario: dict[str, Any]) -> None:
    events = read_run_events(scenario["run_dir"])
    res = scenario.get("result", {})
    start = run_start(events)
    steps = rank0_steps(events)
    # One line per worker process: a restart starts a new line at its resume step.
    for i, pid in enumerate(dict.fromkeys(e["pid"] for e in steps)):
        mine = [e for e in steps if e["pid"] == pid]
        ax.plot([e["ts"] - start for e in mine], [e["step"] for e in mine], ".-", ms=3, lw=1, color="tab:blue",
                label="rank 0 steps" if i == 0 else None)
    mark_faults(ax, events, start)
    rec = [f for f in res.get("faults", []) if f.get("recovered_ts")]
    if rec:
        ax.plot([f["recovered_ts"] - start for f in rec], [f["recovered_step"] for f in rec], "o",
                color="green", label="recovered")
    ax.set_xlim(left=0)
    verdict = "PASS" if res.get("ok") else "FAIL"
    ax.set_title(f"{scenario['name']}: {verdict}, goodput {res.get('goodput', 0):.3f}", fontsize=9)
    ax.set_ylabel("step")
    ax.legend(fontsize=6, loc="upper left")
