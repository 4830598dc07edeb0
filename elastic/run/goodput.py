"""Goodput accounting from a run's event log.

goodput = productive step time / wall time, where a step is productive only
if its result survived: a step that was redone after a restart (it ran past
the checkpoint the run later resumed from) is lost work, however long it
took.  The rest of the wall time is broken down as

  startup      launcher start -> first step of the run begins
  recovery     last step before a failure -> first step after it begins:
               a restart (detection, teardown, rendezvous, process start,
               checkpoint load) or an in-process recovery (the survivors
               re-form in their processes, a warm spare takes the dead slot,
               state comes from memory); when no step followed (the run gave
               up, e.g. a fixed-size run waiting for a lost node), until the
               agents gave up or the run ended.  Failures that share a gap
               (two workers killed at once, a restart killed again) count once
  checkpoint   time training was blocked in checkpoint saves (staging for
               async saves; the whole save for synchronous ones)
  lost         step time of steps that were later redone
  other        the remainder (step-loop overhead, shutdown)

Rank 0's trainer events are the reference timeline: every rank of a
synchronous job advances together.  When rank 0's process was lost with its
node and the run went on without it (a survivor became rank 0 but keeps its
first rank's event source), the timeline of the rank that reported the most
steps.  In replica-group mode it is rank 0 of the group with the most
committed steps (one that never restarted).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

Gap = tuple[float, float]

# Where the reference rank meets a failure it recovers from in its own process: it reports the lost
# peer, then the re-formed world it restored (or that the re-formation failed: a restart follows).
_INPROCESS_KINDS = ("trainer.peer_lost", "trainer.recovered", "trainer.recovery_failed")


def compute_goodput(events: list[dict[str, Any]]) -> dict[str, Any]:
    events = sorted(events, key=lambda e: e["ts"])
    launcher = [e for e in events if e.get("source") == "launcher"]
    reference = _reference_source(events)
    rank0 = [e for e in events if e.get("source") == reference]
    # Replica-group mode reports thrown-away step attempts too (committed=False): not productive.
    steps = [e for e in rank0 if e["kind"] == "trainer.step" and e.get("committed", True)]
    if not events:
        return {"goodput": None}
    t_start = launcher[0]["ts"] if launcher else events[0]["ts"]
    t_end = _run_end(events)
    wall = max(t_end - t_start, 1e-9)

    # The last execution of each step number is the one whose result survived.
    last_exec: dict[int, int] = {}
    for i, e in enumerate(steps):
        last_exec[e["step"]] = i
    kept = set(last_exec.values())
    productive = sum(e["step_time"] for i, e in enumerate(steps) if i in kept)
    lost = sum(e["step_time"] for i, e in enumerate(steps) if i not in kept)

    startup = (steps[0]["ts"] - steps[0]["step_time"] - t_start) if steps else wall

    starts = [e for e in rank0 if e["kind"] == "trainer.start"]
    recoveries = [e for e in rank0 if e["kind"] in _INPROCESS_KINDS]
    gaps = _recovery_gaps(steps, [e["ts"] for e in starts[1:] + recoveries])
    gave_up = _unrecovered(events, steps, t_end)
    if gave_up is not None:
        gaps = _merge([*gaps, gave_up])
    recovery = sum(hi - lo for lo, hi in gaps)

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
    # A warm spare that took rank 0's slot starts a process too, but it is an in-process recovery
    # (its trainer.start names the generation it joined), not a restart.
    out["restarts"] = sum(1 for e in starts[1:] if "gen" not in e)
    out["inprocess_recoveries"] = sum(1 for e in recoveries if e["kind"] == "trainer.recovered")
    return out


def _run_end(events: list[dict[str, Any]]) -> float:
    """The run's last event of its own.  A chaos harness's bookkeeping once the nodes are gone (its
    final etcd reads, ``chaos.exclusions``, ``chaos.end``: 2.8-3.8 s in a soak) is not the run's
    time: counted, it was "other" in both the soak and its fault-free replay."""
    own = [e["ts"] for e in events if not str(e.get("source", "")).startswith("chaos")]
    return own[-1] if own else events[-1]["ts"]


def _recovery_gaps(steps: list[dict[str, Any]], failures: list[float]) -> list[Gap]:
    """For each failure time, the end of the last step before it -> the beginning of the first step
    after it; merged, so that failures with no step between them (two workers killed at once, a
    restart killed again, the lost peer and the recovery it led to) count once."""
    ends = [e["ts"] for e in steps]
    gaps = []
    for ts in failures:
        i = bisect_right(ends, ts)
        if 0 < i < len(steps):
            gaps.append((ends[i - 1], steps[i]["ts"] - steps[i]["step_time"]))
    return _merge(gaps)


def _merge(gaps: list[Gap]) -> list[Gap]:
    """Sorted, disjoint intervals covering ``gaps`` (empty ones dropped)."""
    merged: list[Gap] = []
    for lo, hi in sorted(g for g in gaps if g[1] > g[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _outside(lo: float, hi: float, gaps: list[Gap]) -> float:
    """Length of [lo, hi] not covered by any of the (disjoint) ``gaps``."""
    covered = sum(max(min(hi, g_hi) - max(lo, g_lo), 0.0) for g_lo, g_hi in gaps)
    return max(hi - lo - covered, 0.0)


_FAILURE_KINDS = ("agent.restart", "agent.hang_detected", "agent.torchrun_exit", "trainer.peer_lost")


def _unrecovered(events: list[dict[str, Any]], steps: list[dict[str, Any]], t_end: float) -> Gap | None:
    """A failure after the last step that no step followed: the time from that step until the agents
    gave up (or the run ended) was spent trying to recover."""
    if not steps:
        return None
    last = steps[-1]["ts"]
    after = [e for e in events if e["ts"] > last]
    if any(e["kind"] == "trainer.done" for e in after):
        return None
    failed = [e for e in after if e["kind"] in _FAILURE_KINDS and (e["kind"] != "agent.torchrun_exit" or e.get("rc"))]
    if not failed:
        return None
    gave_up = [e["ts"] for e in after if e["kind"] == "agent.state" and e.get("state") in ("GAVE_UP", "STOPPED")]
    return last, (max(gave_up) if gave_up else t_end)


def _reference_source(events: list[dict[str, Any]]) -> str:
    """``trainer/rank0``, or the plain rank that reported more steps (rank 0 was lost with its node);
    in replica-group mode (``trainer/<group>/rank0``) the group that committed most."""
    counts: dict[str, int] = {}
    for e in events:
        source = e.get("source", "")
        if e["kind"] == "trainer.step" and e.get("committed", True) and source.startswith("trainer/"):
            counts[source] = counts.get(source, 0) + 1
    plain = [source for source in counts if source.count("/") == 1]
    if plain:
        return max(plain, key=lambda source: (counts[source], source == "trainer/rank0"))
    groups = [source for source in counts if source.endswith("/rank0")]
    return max(groups, key=lambda source: counts[source]) if groups else "trainer/rank0"


def format_goodput(g: dict[str, Any]) -> str:
    if g.get("goodput") is None:
        return "goodput: n/a"
    return (f"goodput {g['goodput'] * 100:.1f}% of {g['wall_s']:.1f}s: productive {g['productive_s']:.1f}s, "
            f"startup {g['startup_s']:.1f}s, recovery {g['recovery_s']:.1f}s, checkpoint {g['checkpoint_s']:.1f}s, "
            f"lost {g['lost_s']:.1f}s, other {g['other_s']:.1f}s")
