"""Invariants and recovery metrics of one chaos run, computed from its run directory alone.

Inputs: the merged events (``events/*.jsonl``, including the ``chaos.inject``
events), ``summary.json`` and the checkpoints left on disk.  Nothing here
trusts the runtime's own verdicts where it can check for itself: checkpoints
are re-hashed against their COMMIT markers, and orphan processes are looked
up in /proc.

Per fault (one ``chaos.inject`` event):

* ``steps_lost``: the newest step any rank reported before the fault minus
  the step the next worker resumed from (0 if no worker restarted);
* ``detection_s``: fault -> first detection event (an agent FAILED state,
  ``agent.hang_detected``, ``agent.rollback``, ``checkpoint.save_failed``,
  ``agent.spare_failed`` for a dead spare, ``sdc.suspect`` for a flipped bit);
* ``recovery_s``: fault -> first ``trainer.step`` of a worker started after
  the fault (None where the fault needs no restart).  A fault that does not
  restart workers by itself (a straggler, a spare kill, an etcd fault) owns
  only the detections and restarts before the next fault: a later kill's
  restart is the kill's, not theirs;

and per run ``goodput``: the step time of the steps that count (the last
execution of each step by rank 0) over the launch's wall time.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.injectors import REGISTRY, checkpoint_root
from elastic.common.events import read_run_events
from elastic.common.procs import alive
from elastic.worker.faults import fired_records

DETECTION_KINDS = ("agent.hang_detected", "agent.rollback", "checkpoint.save_failed", "leader.node_lost",
                   "agent.spare_failed", "sdc.suspect")


@dataclass
class Expectation:
    steps: int
    bitwise: bool = True
    """Final weights must equal the fault-free run's; False where the fault changes the data seen."""
    excluded: set[str] = field(default_factory=set)
    launcher_rc: int | None = 0
    """Expected exit code of elastic-launch; None accepts any."""
    required_events: list[str] = field(default_factory=list)
    """Event kinds that must appear after the first fault (the runtime noticed and reacted)."""
    note: str = ""
    extra_invariants: list = field(default_factory=list)
    """More checks, each ``events -> Invariant`` (e.g. a slow-but-unbroken run under etcd latency)."""


@dataclass
class Invariant:
    name: str
    ok: bool
    detail: str
    evidence: list[str] = field(default_factory=list)
    """The event lines (or files) the verdict rests on, for the report."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "evidence": self.evidence[:8]}


def evidence(events: list[dict], limit: int = 4) -> list[str]:
    """Short one-line renderings of events: ``+12.3s agent/node1 agent.hang_detected verdict=culprit``."""
    out = []
    for e in events[:limit]:
        extra = " ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("ts", "source", "kind", "pid"))
        out.append(f"{time.strftime('%H:%M:%S', time.localtime(e.get('ts', 0)))} {e.get('source')} "
                   f"{e.get('kind')} {extra}"[:240])
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def verify_committed(root: Path) -> dict[int, str | None]:
    """step -> None if its COMMIT verifies (every listed file present with its sha256), else why not."""
    out: dict[int, str | None] = {}
    for path in sorted(root.glob("step-*")):
        marker_path = path / "COMMIT"
        if not marker_path.is_file():
            continue
        step = int(path.name.split("-")[1])
        try:
            marker = json.loads(marker_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            out[step] = f"unreadable COMMIT ({exc})"
            continue
        problem = None
        for name, info in marker.get("files", {}).items():
            # COMMIT lists {"sha256", "bytes"} per file (older markers: the digest alone).
            digest = info["sha256"] if isinstance(info, dict) else info
            file = path / name
            if not file.is_file():
                problem = f"missing {name}"
                break
            h = hashlib.sha256()
            with open(file, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != digest:
                problem = f"checksum mismatch in {name}"
                break
        out[step] = problem
    return out


def _after(events: list[dict], ts: float, kind: str | tuple[str, ...]) -> list[dict]:
    kinds = (kind,) if isinstance(kind, str) else kind
    return [e for e in events if e.get("kind") in kinds and e.get("ts", 0) > ts]


FILE_FAULTS = ("nan", "straggler", "ckpt_write_error", "sdc")


def fault_metrics(events: list[dict], inject: dict, prev_ts: float | None = None,
                  next_ts: float | None = None, run_dir: Path | None = None) -> dict[str, Any]:
    """One fault's metrics; ``prev_ts`` / ``next_ts``: when the faults injected before and after it were;
    ``run_dir``: where a silent fault's record is (an ``sdc`` flip leaves no event)."""
    ts = _effective_ts(events, inject, run_dir)
    if ts is None:
        # A planted fault the runtime never acted on: there is nothing to measure (and the
        # first start of the run is not a "restart" caused by it).
        return {"fault": inject["fault"], "target": inject["target"], "pids": inject.get("pids", []),
                "injected_at_step": inject.get("step"), "took_effect": False, "restarted": False,
                "resume_step": None, "steps_lost": None, "recovery_s": None, "detection_s": None,
                "detected_by": None}
    steps = [e for e in events if e.get("kind") == "trainer.step"]
    before = max((e["step"] for e in steps if e["ts"] <= ts), default=0)
    starts = _after(events, ts, "trainer.start")
    kind = REGISTRY.get(inject["fault"])
    until = next_ts if next_ts is not None and kind is not None and not kind.restarts_workers else math.inf
    starts = [e for e in starts if e["ts"] <= until]
    detections = [e for e in events if ts < e.get("ts", 0) <= until and (
        e.get("kind") in DETECTION_KINDS or (e.get("kind") == "agent.state" and e.get("state") == "FAILED"))]
    out: dict[str, Any] = {
        "fault": inject["fault"], "target": inject["target"], "pids": inject.get("pids", []),
        "injected_at_step": inject.get("step"), "took_effect": True, "fault_ts": ts, "last_step_before": before,
        "restarted": bool(starts), "resume_step": None, "steps_lost": 0, "recovery_s": None,
        "detection_s": round(detections[0]["ts"] - ts, 3) if detections else None,
        "detected_by": detections[0]["kind"] + (f"/{detections[0].get('state')}" if detections[0].get("state") else "")
        if detections else None,
    }
    if inject["fault"] == "kill_during_recovery" and prev_ts is not None:
        # It hit a recovery when no worker started after the fault before it had trained a step yet
        # (the survivors' last steps before that fault may be reported after it: they do not count).
        joined = {e["pid"] for e in events if e.get("kind") == "trainer.start" and prev_ts < e["ts"] <= ts}
        out["during_recovery"] = not any(prev_ts < e["ts"] <= ts and e["pid"] in joined for e in steps)
    if starts:
        first = starts[0]
        out["resume_step"] = first.get("step")
        out["steps_lost"] = max(before - int(first.get("step", 0)), 0)
        new_pids = {e["pid"] for e in starts}
        after = [e for e in steps if e["ts"] > first["ts"] and e["pid"] in new_pids]
        if after:
            out["recovery_s"] = round(after[0]["ts"] - ts, 3)
            out["recovered_ts"] = after[0]["ts"]
            out["recovered_step"] = after[0]["step"]
    return out


def _effective_ts(events: list[dict], inject: dict, run_dir: Path | None = None) -> float | None:
    """When the fault took effect, or None if it never did.

    A file fault takes effect when a worker reports ``fault.fired`` for its
    file; planted bad hardware when its node is excluded; anything else at
    the injection itself.
    """
    ts = inject.get("injected_ts", inject["ts"])
    detail = inject.get("detail", {})
    if inject["fault"] == "sdc":
        flip = _sdc_flip(run_dir, detail)
        return flip["ts"] if flip else None
    if inject["fault"] in FILE_FAULTS:
        name = Path(detail.get("file", "")).name
        fired = [e for e in events if e.get("kind") == "fault.fired" and e.get("file") == name]
        return fired[0]["ts"] if fired else None
    if inject["fault"] == "bad_hardware":
        hit = [e for e in events if e.get("source") == f"agent/{detail.get('node')}" and e.get("ts", 0) >= ts
               and e.get("kind") == "agent.state" and e.get("state") == "EXCLUDED"]
        return hit[0]["ts"] if hit else None
    return ts


def goodput(events: list[dict], wall_s: float) -> tuple[float, float]:
    """(productive step seconds, goodput): the last execution of each step by rank 0 over wall time."""
    last: dict[int, float] = {}
    for e in events:
        if e.get("kind") == "trainer.step" and e.get("source") == "trainer/rank0":
            last[e["step"]] = float(e.get("step_time", 0.0))
    productive = sum(last.values())
    return productive, (productive / wall_s if wall_s > 0 else 0.0)


def check_run(run_dir: Path, expect: Expectation, baseline_checksum: str | None, launcher_rc: int,
              extra_pids: set[int] | None = None, orphan_wait_s: float = 20.0,
              node_rcs: dict[str, int | None] | None = None, wall_s: float | None = None) -> dict[str, Any]:
    """All invariants and metrics of one run, as a JSON-able dict.

    ``node_rcs`` and ``wall_s`` come from the runner when the nodes were separate launchers (they
    share the run directory, so no one ``summary.json`` speaks for the run); else from the summary.
    """
    run_dir = Path(run_dir)
    events = read_run_events(run_dir)
    summary = _summary(run_dir, events, node_rcs, wall_s)
    injects = [e for e in events if e.get("kind") == "chaos.inject"]
    missed = [e for e in events if e.get("kind") == "chaos.not_injected"]
    failed = [e for e in missed if e.get("trigger_reached", True)]
    inv: list[Invariant] = []

    detail = f"{len(injects)} injected"
    if failed:
        detail += f"; due but not injected: {[(m['fault'], m['reason']) for m in failed]}"
    if len(missed) > len(failed):
        detail += f"; {len(missed) - len(failed)} scheduled after the run ended"
    inv.append(Invariant("faults_injected", not failed, detail, evidence(injects + missed, 8)))
    done = [e for e in events if e.get("kind") == "trainer.done"]
    last_step = summary.get("last_step", 0)
    rc_ok = expect.launcher_rc is None or launcher_rc == expect.launcher_rc
    inv.append(Invariant("completed", bool(done) and last_step >= expect.steps and rc_ok,
                         f"last_step={last_step}/{expect.steps}, trainer.done={len(done)}, launcher rc={launcher_rc}"
                         + ("" if rc_ok else f" (expected {expect.launcher_rc})"), evidence(done[-2:])))

    verdicts = verify_committed(checkpoint_root(run_dir))
    bad = {s: why for s, why in verdicts.items() if why}
    leftovers = sorted(p.name for p in checkpoint_root(run_dir).glob(".step-*"))
    inv.append(Invariant("checkpoints_intact", bool(verdicts) and not bad and not leftovers,
                         f"committed {sorted(verdicts)} verify" if verdicts and not bad and not leftovers else
                         f"bad={bad} leftover_tmp={leftovers} committed={sorted(verdicts)}",
                         [f"step {s}: {'sha256 of every listed file matches COMMIT' if not why else why}"
                          for s, why in sorted(verdicts.items())][-4:]))
    for e in injects:
        if e["fault"] == "sdc":
            inv.append(_sdc_caught(run_dir, events, e))
        if e["fault"] == "corrupt_checkpoint":
            inv.append(_corruption_handled(events, e))
        if e["fault"] == "partition":
            inv.append(_partition_healed(events, e))

    checksum = summary.get("final_checksum")
    if expect.bitwise:
        ok = checksum is not None and checksum == baseline_checksum
        inv.append(Invariant("weights_bitwise_equal", ok, f"final {str(checksum)[:12]} vs fault-free "
                                                          f"{str(baseline_checksum)[:12]}",
                             [f"final_checksum.txt: {checksum}", f"fault-free run:     {baseline_checksum}"]))
    else:
        losses = _final_losses(events)
        finite = bool(losses) and all(math.isfinite(v) for v in losses.values())
        inv.append(Invariant("weights_finite", finite and checksum is not None,
                             f"not compared bitwise ({expect.note or 'fault changes the data seen'}); "
                             f"{len(losses)} final-step losses finite={finite}, "
                             f"checksum={'yes' if checksum else 'no'}"))

    excluded = {e["source"].split("/", 1)[1] for e in events
                if e.get("kind") == "agent.state" and e.get("state") == "EXCLUDED"}
    excluded |= {n for n, rc in summary.get("nodes", {}).items() if rc == 93}
    for e in events:
        if e.get("kind") == "chaos.exclusions":  # the etcd records, as the runner saw them
            excluded |= set(e.get("nodes", []))
    inv.append(Invariant("excluded_nodes", excluded == set(expect.excluded),
                         f"excluded {sorted(excluded)}, expected {sorted(expect.excluded)}",
                         evidence([e for e in events if e.get("kind") == "agent.state" and e.get("state") == "EXCLUDED"])))

    if expect.required_events:
        first = min((e.get("injected_ts", e["ts"]) for e in injects), default=0.0)
        seen = {k: _after(events, first, k) for k in expect.required_events}
        inv.append(Invariant("runtime_reacted", all(seen.values()),
                             ", ".join(f"{k}: {'seen' if v else 'never emitted'}" for k, v in seen.items()),
                             [line for found in seen.values() for line in evidence(found, 1)]))

    pids = {int(e.get("pid", 0)) for e in events if e.get("source") != "chaos"}
    for e in events:
        for key in ("etcd_pid", "agent_pid", "torchrun_pid"):
            if e.get(key):
                pids.add(int(e[key]))
    pids |= extra_pids or set()
    pids.discard(0)
    survivors = _wait_gone(pids, orphan_wait_s)
    inv.append(Invariant("no_orphans", not survivors,
                         f"{len(pids)} processes seen, all gone" if not survivors else f"alive: {sorted(survivors)}"))

    times = sorted(e.get("injected_ts", e["ts"]) for e in injects)

    def neighbours(e: dict) -> tuple[float | None, float | None]:
        t = e.get("injected_ts", e["ts"])
        return max((x for x in times if x < t), default=None), min((x for x in times if x > t), default=None)

    metrics = [fault_metrics(events, e, *neighbours(e), run_dir=run_dir) for e in injects]
    inert = [f"{m['fault']}->{m['target']}" for m in metrics if not m["took_effect"]]
    inv.insert(1, Invariant("faults_took_effect", not inert,
                            "every injected fault took effect" if not inert else
                            f"planted but never acted on by the runtime: {inert}"))
    wall = float(summary.get("wall_s") or 0.0)
    productive, gp = goodput(events, wall)
    if expect.extra_invariants:
        inv += [check(events) for check in expect.extra_invariants]
    return {
        "ok": all(i.ok for i in inv),
        "invariants": [i.to_json() for i in inv],
        "faults": metrics,
        "launcher_rc": launcher_rc,
        "last_step": last_step,
        "restarts": summary.get("restarts"),
        "final_checksum": checksum,
        "wall_s": wall,
        "productive_s": round(productive, 3),
        "goodput": round(gp, 4),
    }


def _summary(run_dir: Path, events: list[dict], node_rcs: dict[str, int | None] | None,
             wall_s: float | None) -> dict[str, Any]:
    """What the checks need from ``summary.json``, from the events and files themselves when the
    runner knows the nodes (several launchers share one run directory)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() and node_rcs is None else {}
    if node_rcs is None:
        return summary
    checksum = run_dir / "final_checksum.txt"
    return {"nodes": node_rcs, "wall_s": wall_s,
            "last_step": max((e["step"] for e in events if e.get("kind") == "trainer.step"), default=0),
            "final_checksum": checksum.read_text().strip() if checksum.exists() else None,
            "restarts": sum(1 for e in events if e.get("kind") == "agent.restart")}


def _partition_healed(events: list[dict], inject: dict) -> Invariant:
    """The cut-off node was noticed, the link came back, and the node trained again afterwards."""
    node, ts = inject["target"], inject.get("injected_ts", inject["ts"])
    lost = [e for e in _after(events, ts, "leader.node_lost") if node in e.get("nodes", [])]
    healed = [e for e in _after(events, ts, "chaos.healed") if e.get("target") == node]
    back = [e for e in _after(events, healed[0]["ts"], "trainer.start") if e.get("node") == node] if healed else []
    ok = bool(lost) and bool(healed) and bool(back)
    detail = (f"{node}: lost after {lost[0]['ts'] - ts:.1f}s (lease expiry), healed after "
              f"{healed[0]['ts'] - ts:.1f}s, training again {back[0]['ts'] - healed[0]['ts']:.1f}s after the heal"
              if ok else f"{node}: detected={bool(lost)} healed={bool(healed)} rejoined={bool(back)}")
    return Invariant("partition_detected_and_healed", ok, detail, evidence(lost[:1] + healed[:1] + back[:1]))


def _sdc_flip(run_dir: Path | None, detail: dict) -> dict | None:
    """What an injected ``sdc`` fault flipped (its ``.fired`` record), or None if it never fired."""
    if run_dir is None:
        return None
    name = Path(detail.get("file", "")).name
    fired = [r["fired"] for r in fired_records(run_dir, "sdc") if r["file"] == name]
    return fired[0] if fired else None


def _sdc_caught(run_dir: Path, events: list[dict], inject: dict) -> Invariant:
    """The flip was named: an ``sdc.suspect`` for its node and rank, at its step or a later check's."""
    flip = _sdc_flip(run_dir, inject.get("detail", {}))
    if flip is None:
        return Invariant("sdc_detected", False, "the flip never fired (no .fired record): nothing to detect")
    where = f"{flip['node']} rank {flip['rank']} at step {flip['step']}"
    suspects = [e for e in events if e.get("kind") == "sdc.suspect" and e.get("ts", 0) >= flip["ts"]]
    named = [e for e in suspects if e.get("node") == flip["node"] and e.get("step", -1) >= flip["step"]
             and flip["rank"] in e.get("ranks", [e.get("rank")])]
    if named:
        e = named[0]
        return Invariant("sdc_detected", True, f"flip in {where} named at the check of step {e['step']} "
                                               f"({_suspect_detail(e)})", evidence(named[:1]))
    if suspects:
        return Invariant("sdc_detected", False, f"flip in {where}; the wrong node was named: "
                                                f"{[(e.get('node'), e.get('rank')) for e in suspects]}",
                         evidence(suspects))
    missing = [e for e in events if e.get("kind") == "sdc.no_majority"]
    why = "no strict majority of groups (sdc.no_majority)" if missing else "no sdc.suspect event"
    return Invariant("sdc_detected", False, f"flip in {where} not named: {why}", evidence(missing))


def _suspect_detail(e: dict) -> str:
    """How the suspect was told apart: the replica groups' majority, or a spare's replay."""
    if e.get("source_check") == "replay":
        how = f"arbitrated by {e.get('arbiter')}" if e.get("arbitrated") else f"not arbitrated: {e.get('arbitration')}"
        return (f"replayed on {e.get('verifier')}'s spare: {', '.join(u or '<root>' for u in e.get('units', []))} "
                f"differ; {how}")
    return f"checksum {e.get('checksum')} vs majority {e.get('majority')}"


def _corruption_handled(events: list[dict], inject: dict) -> Invariant:
    step = inject["detail"]["checkpoint_step"]
    ts = inject.get("injected_ts", inject["ts"])
    recommit = [e["ts"] for e in _after(events, ts, "checkpoint.committed") if e["step"] == step]
    until = min(recommit) if recommit else math.inf
    loads = [e for e in _after(events, ts, "checkpoint.loaded") if e["ts"] < until]
    skipped = [e for e in _after(events, ts, "checkpoint.skipped_corrupt") if e["step"] == step]
    if any(e["step"] == step for e in loads):
        return Invariant("corrupt_checkpoint_skipped", False, f"step {step} was loaded after its corruption")
    if not loads and _after(events, ts, "trainer.recovered"):
        # In-process recovery restores from memory and never reads the damaged commit (a soak mixes
        # faults on the default path); the suite's corrupt_checkpoint scenario takes the disk path.
        return Invariant("corrupt_checkpoint_skipped", True,
                         f"step {step} never read: the recovery after it was in-process, from memory")
    if not loads:
        return Invariant("corrupt_checkpoint_skipped", False,
                         f"no load happened while step {step} was corrupt: the check proved nothing")
    if all(e["step"] > step for e in loads):
        # A newer commit came first (a soak's corruption, then minutes of training before a disk
        # restore): the damaged step was never the newest when a load chose, so none could take it.
        return Invariant("corrupt_checkpoint_skipped", True,
                         f"step {step} never a load's choice: the loads after it read newer step(s) "
                         f"{sorted({e['step'] for e in loads})}", evidence(loads[:1]))
    if not skipped:
        return Invariant("corrupt_checkpoint_skipped", False, f"step {step} not reported as skipped")
    return Invariant("corrupt_checkpoint_skipped", True,
                     f"step {step} rejected ({skipped[0].get('reason')}); loaded {sorted({e['step'] for e in loads})}",
                     evidence(skipped[:1] + loads[:1]))


def _final_losses(events: list[dict]) -> dict[int, float]:
    """Rank 0's losses as reported by the worker that finished (a rolled-back NaN step is not among them).

    In replica-group mode every group's rank 0 (``trainer/<group>/rank0``) counts, committed attempts only
    (an attempt undone after a lost peer or a failed agreement check trained nothing)."""
    finishers = {e["pid"] for e in events if e.get("kind") == "trainer.done" and _rank0(e.get("source", ""))}
    return {e["step"]: float(e.get("loss", math.nan)) for e in events
            if e.get("kind") == "trainer.step" and e.get("pid") in finishers and e.get("committed", True)}


def _rank0(source: str) -> bool:
    parts = source.split("/")
    return parts[0] == "trainer" and parts[-1] == "rank0" and len(parts) in (2, 3)


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)
