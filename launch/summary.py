"""The launcher's end-of-run summary (``summary.json`` and the lines printed after a run).

Built from the run's events alone (plus the checkpoint directory for what is durable), so that
it says, for every run, *why* it ended the way it did:

* ``stop_reasons``: each node's own line for why it stopped (gave up, was excluded, was stopped
  with the run), e.g. ``etcd at 10.0.0.5:2379 is unreachable ...`` or ``node2 lost at step 7 ...``;
* ``faults``: one record per fault (``run.fault`` events, written once per fault through a
  compare-and-swap in etcd) naming the node that failed or was lost; ``restarts`` counts
  restarts per fault, not per surviving agent;
* ``failed_saves``, ``last_durable_step`` and ``unsaved_steps``: a run whose newest steps are in
  no committed checkpoint does not look like a clean success (exit code 3 and a warning line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic.checkpoint.identity import committed_dirs, read_marker
from elastic.common.events import read_run_events
from elastic.run.goodput import compute_goodput, format_goodput
from elastic.run.schema import RunConfig

EXIT_UNSAVED = 3
"""Training ended but its newest steps are in no committed checkpoint (failed saves)."""
_LEAVING = ("GAVE_UP", "EXCLUDED", "STOPPED")


def summarize(cfg: RunConfig, run_dir: Path, nodes: dict[str, int | None], wall_s: float,
              stop_signal: int | None) -> dict[str, Any]:
    events = read_run_events(run_dir)
    steps = [e for e in events if e["kind"] == "trainer.step"]
    failures = [e for e in events if e["kind"] == "agent.state" and e.get("state") == "FAILED"]
    commits = [e for e in events if e["kind"] == "checkpoint.committed" and e["source"] == "trainer/rank0"]
    checksum_file = run_dir / "final_checksum.txt"
    excluded = {_node(e): e.get("reason") for e in events if e["kind"] == "agent.state" and e.get("state") == "EXCLUDED"}
    last_step = max((e["step"] for e in steps), default=0)
    summary = {
        "run_id": cfg.run.id,
        "run_dir": str(run_dir),
        "nodes": dict(nodes),
        "wall_s": round(wall_s, 2),
        "steps_target": cfg.trainer_steps(),
        "last_step": last_step,
        "step_events": len(steps),
        "failures": [{"node": e["source"], "failure_kind": e.get("failure_kind"), "rc": e.get("rc"),
                      "action": e.get("action"), "detail": e.get("detail"), "counted": e.get("counted", True)}
                     for e in failures],
        "faults": [{k: e.get(k) for k in ("epoch", "node", "failure_kind", "step", "detail", "by")}
                   for e in events if e["kind"] == "run.fault"],
        "stop_reasons": stop_reasons(events, nodes),
        "excluded": excluded,
        "hangs_detected": sum(1 for e in events if e["kind"] == "agent.hang_detected"),
        "trajectory_changed": trajectory_changes(events),
        "rollbacks": sum(1 for e in events if e["kind"] == "agent.rollback"),
        **restart_counts(events),
        "checkpoints_committed": sorted({e["step"] for e in commits}),
        **durability(cfg, run_dir, events, last_step),
        "final_checksum": checksum_file.read_text().strip() if checksum_file.exists() else None,
        "interrupted_by_signal": stop_signal,
        "goodput": compute_goodput(events),
    }
    return summary


def _node(event: dict[str, Any]) -> str:
    return event["source"].split("/", 1)[1]


def trajectory_changes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In-process recoveries that did not restore every rank's state bitwise (one per generation):
    from there on the run is not the fault-free run, and the summary says so."""
    seen: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "trainer.recovered" and e.get("bitwise") is False:
            seen.setdefault(int(e.get("gen", 0)), {"gen": e.get("gen"), "step": e.get("step"),
                                                   "reason": e.get("trajectory_changed")})
    return [seen[g] for g in sorted(seen)]


def restart_counts(events: list[dict[str, Any]]) -> dict[str, int]:
    """Restarts per fault: every agent that restarts for one fault names the same ``fault`` id."""
    restarts = [e for e in events if e["kind"] == "agent.restart"]
    ids = {e.get("fault") or f"{e['source']}@{e['ts']}" for e in restarts}
    counted = {e.get("fault") or f"{e['source']}@{e['ts']}" for e in restarts if e.get("counted")}
    return {"restarts": len(ids), "restarts_counted": len(counted)}


def stop_reasons(events: list[dict[str, Any]], nodes: dict[str, int | None]) -> dict[str, str]:
    """Each node that did not finish: its agent's last word on why (GAVE_UP / EXCLUDED / STOPPED)."""
    reasons: dict[str, str] = {}
    for e in events:
        if e["kind"] == "agent.state" and e.get("state") in _LEAVING and e["source"].startswith("agent/"):
            why = e.get("reason") or (f"signal {e['signal']}" if e.get("signal") else e["state"].lower())
            reasons[_node(e)] = f"{e['state'].lower()}: {why}"
    lost = {e["node"]: e for e in events if e["kind"] == "run.fault" and e.get("failure_kind") == "node_lost"}
    for node, rc in nodes.items():
        if rc in (0, None) or node in reasons:
            continue
        if node in lost:
            reasons[node] = f"lost at step {lost[node].get('step')}: {lost[node].get('detail')} (agent rc {rc})"
        else:
            reasons[node] = f"agent exited with {rc} without saying why (see logs/agent-{node}.log)"
    return {n: reasons[n] for n in sorted(reasons) if nodes.get(n) != 0}


def durability(cfg: RunConfig, run_dir: Path, events: list[dict[str, Any]], last_step: int) -> dict[str, Any]:
    """Failed saves (not committed later), the newest committed step of this config, the steps past it."""
    committed = {e["step"] for e in events if e["kind"] == "checkpoint.committed"}
    failed: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "checkpoint.save_failed" and e["step"] not in committed:
            failed.setdefault(e["step"], {"step": e["step"], "error": e.get("error"), "errno": e.get("errno")})
    durable = last_durable_step(cfg, run_dir)
    saving = any(e["kind"] == "checkpoint.save_start" for e in events)
    unsaved = max(last_step - (durable or 0), 0) if saving else 0
    return {"failed_saves": [failed[s] for s in sorted(failed)], "last_durable_step": durable,
            "unsaved_steps": unsaved}


def last_durable_step(cfg: RunConfig, run_dir: Path) -> int | None:
    """The newest committed checkpoint on disk written by this config (any launch of the run)."""
    fingerprint = cfg.fingerprint or cfg.compute_fingerprint()
    for step, path in committed_dirs(cfg.checkpoint.root(run_dir)):
        marker = read_marker(path)
        if marker is not None and marker.get("fingerprint") in (fingerprint, "", None):
            return step
    return None


def format_summary(summary: dict[str, Any]) -> str:
    if summary.get("node_lost"):
        agents = ", ".join(f"{n} (signal {-rc})" for n, rc in summary["nodes"].items())
        return (f"run {summary['run_id']}: this node was lost while the run goes on: agent {agents}; "
                f"the run's summary is written by the launchers that finish it ({summary['run_dir']})")
    lines = [
        f"run {summary['run_id']}: {summary['last_step']}/{summary['steps_target']} steps "
        f"in {summary['wall_s']:.1f}s, {summary['restarts']} restarts "
        f"({summary['restarts_counted']} counted failures)",
        "nodes: " + ", ".join(f"{n}=rc{rc}" for n, rc in summary["nodes"].items()),
        *[f"  {node} {reason}" for node, reason in summary["stop_reasons"].items()],
        *[f"fault: {_fault_line(f)}" for f in summary["faults"]],
        *[f"NOT BITWISE from step {t['step']}: {t['reason']}" for t in summary.get("trajectory_changed", [])],
        *(["excluded: " + ", ".join(f"{n} ({r})" for n, r in summary["excluded"].items())]
          if summary["excluded"] else []),
        f"checkpoints: {summary['checkpoints_committed']}",
        *_durability_lines(summary),
        format_goodput(summary["goodput"]),
        f"final checksum: {summary['final_checksum']}",
        f"run dir: {summary['run_dir']}",
    ]
    return "\n".join(lines)


def _fault_line(fault: dict[str, Any]) -> str:
    at = f" at step {fault['step']}" if fault.get("step") is not None else ""
    return f"{fault['node']} {fault['failure_kind']}{at} (epoch {fault['epoch']}, seen by {fault['by']}): {fault['detail']}"


def _durability_lines(summary: dict[str, Any]) -> list[str]:
    failed = summary["failed_saves"]
    lines = []
    if failed:
        errors = sorted({f["errno"] or f["error"] for f in failed})
        lines.append(f"failed saves: steps {', '.join(str(f['step']) for f in failed)} ({'; '.join(errors)})")
    if summary["unsaved_steps"]:
        lines.append(f"UNSAVED: {summary['unsaved_steps']} steps after the last durable checkpoint "
                     f"(step {summary['last_durable_step']}) are in no committed checkpoint")
    return lines
