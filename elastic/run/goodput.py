"""Goodput accounting from a run's event log.

goodput = productive step time / wall time, where a step is productive only
if its result survived: a step that was redone after a restart (it ran past
the checkpoint the run later resumed from) is lost work, however long it
took.  The rest of the wall time is broken down as

  startup      launcher start -> first step of the run begins
  recovery     last step before a failure -> first step of the restarted
               workers begins (detection, teardown, rendezvous, process
               start, checkpoint load); when no step followed (the run gave
               up, e.g. a fixed-size run waiting for a lost node), until the
               agents gave up or the run ended
  checkpoint   time training was blocked in checkpoint saves (staging for
               async saves; the whole save for synchronous ones)
  lost         step time of steps that were later redone
  other        the remainder (step-loop overhead, shutdown)

Rank 0's trainer events are the reference timeline: every rank of a
synchronous job advances together.  In replica-group mode it is rank 0 of
the group with the most committed steps (one that never restarted).
"""

from __future__ import annotations

from typing import Any


def compute_goodput(events: list[dict[str, Any]]) -> dict[str, Any]:
    events = sorted(events, key=lambda e: e["ts"])
    launcher = [e for e in events if e.get("source") == "launcher"]
    rank0 = [e for e in events if e.get("source") == _reference_source(events)]
    # Replica-group mode reports thrown-away step attempts too (committed=False): not productive.
    steps = [e for e in rank0 if e["kind"] == "trainer.step" and e.get("committed", True)]
    if not events:
        return {"goodput": None}
    t_start = launcher[0]["ts"] if launcher else events[0]["ts"]
    t_end = events[-1]["ts"]
    wall = max(t_end - t_start, 1e-9)

    # The last execution of each step number is the one whose result survived.
    last_exec: dict[int, int] = {}
    for i, e in enumerate(steps):
        last_exec[e["step"]] = i
    kept = set(last_exec.values())
    productive = sum(e["step_time"] for i, e in enumerate(steps) if i in kept)
    lost = sum(e["step_time"] for i, e in enumerate(steps) if i not in kept)

    startup = (steps[0]["ts"] - steps[0]["step_time"] - t_start) if steps else wall

    # Recovery gaps: around each trainer.start after the first, from the last step before it to
    # the beginning of the first step after it.  Two restarts with no step between them share one
    # gap, so gaps are counted once each.
    starts = [e for e in rank0 if e["kind"] == "trainer.start"]
    gaps: set[tuple[float, float]] = set()
    for start in starts[1:]:
        before = [e for e in steps if e["ts"] <= start["ts"]]
        after = [e for e in steps if e["ts"] > start["ts"]]
        if before and after:
            gaps.add((before[-1]["ts"], after[0]["ts"] - after[0]["step_time"]))
    recovery = sum(max(hi - lo, 0.0) for lo, hi in gaps)
    recovery += _unrecovered(events, steps, t_end)

    # Checkpoint time blocking training; a save inside a recovery gap (the last one before a
    # failure) is already part of that gap and is not counted twice.
    checkpoint = 0.0
    pending: dict[int, float] = {}
    for e in rank0:
        if e["kind"] == "checkpoint.save_start":
            pending[e["step"]] = e["ts"]
        elif e["kind"] == "checkpoint.staged" and "blocking_s" in e:
            began = pending.pop(e["step"], e["ts"] - float(e["blocking_s"]))
            checkpoint += _outside(began, began + float(e["blocking_s"]), gaps)
        elif e["kind"] == "checkpoint.committed" and e["step"] in pending:
            began = pending.pop(e["step"])
            checkpoint += _outside(began, e["ts"], gaps)

    parts = {"productive_s": productive, "startup_s": startup, "recovery_s": recovery,
             "checkpoint_s": checkpoint, "lost_s": lost}
    parts["other_s"] = max(wall - sum(parts.values()), 0.0)
    out = {"goodput": round(productive / wall, 4), "wall_s": round(wall, 3)}
    out.update({k: round(v, 3) for k, v in parts.items()})
    out["steps_kept"] = len(kept)
    out["steps_redone"] = len(steps) - len(kept)
    out["restarts"] = max(len(starts) - 1, 0)
    return out


def _outside(lo: float, hi: float, gaps: set[tuple[float, float]]) -> float:
    """Length of [lo, hi] not covered by any of the (disjoint) ``gaps``."""
    covered = sum(max(min(hi, g_hi) - max(lo, g_lo), 0.0) for g_lo, g_hi in gaps)
    return max(hi - lo - covered, 0.0)


_FAILURE_KINDS = ("agent.restart", "agent.hang_detected", "agent.torchrun_exit")


def _unrecovered(events: list[dict[str, Any]], steps: list[dict[str, Any]], t_end: float) -> float:
    """A failure after the last step that no step followed: the time from that step until the agents
    gave up (or the run ended) was spent trying to recover."""
    if not steps:
        return 0.0
    last = steps[-1]["ts"]
    after = [e for e in events if e["ts"] > last]
    if any(e["kind"] == "trainer.done" for e in after):
        return 0.0
    failed = [e for e in after if e["kind"] in _FAILURE_KINDS and (e["kind"] != "agent.torchrun_exit" or e.get("rc"))]
    if not failed:
        return 0.0
    gave_up = [e["ts"] for e in after if e["kind"] == "agent.state" and e.get("state") in ("GAVE_UP", "STOPPED")]
    return (max(gave_up) if gave_up else t_end) - last


def _reference_source(events: list[dict[str, Any]]) -> str:
    """``trainer/rank0``; in replica-group mode (``trainer/<group>/rank0``) the group that committed most."""
    counts: dict[str, int] = {}
    for e in events:
        source = e.get("source", "")
        if e["kind"] == "trainer.step" and e.get("committed", True) and source.startswith("trainer/") \
                and source.endswith("/rank0"):
            counts[source] = counts.get(source, 0) + 1
    if "trainer/rank0" in counts or not counts:
        return "trainer/rank0"
    return max(counts, key=lambda source: counts[source])


def format_goodput(g: dict[str, Any]) -> str:
    if g.get("goodput") is None:
        return "goodput: n/a"
    return (f"goodput {g['goodput'] * 100:.1f}% of {g['wall_s']:.1f}s: productive {g['productive_s']:.1f}s, "
            f"startup {g['startup_s']:.1f}s, recovery {g['recovery_s']:.1f}s, checkpoint {g['checkpoint_s']:.1f}s, "
            f"lost {g['lost_s']:.1f}s, other {g['other_s']:.1f}s")
