"""``chaos soak``: seeded random faults at one long run of the job, and what they cost in goodput.

    chaos soak --config examples/tiny.yaml --duration 10m --mtbf 60s

One run of the job on separate nodes (faults through etcd, as in the suite) takes faults drawn
from the catalogue at exponential inter-arrival times (mean ``--mtbf``, ``--seed``) for
``--duration``.  A lost node is relaunched (``requeue``, what a scheduler does), so the world
keeps its size and the final weights stay comparable: after the soak a fault-free replay of the
job that skips the same batches (a NaN makes the run skip one) must end bitwise equal.

The report (``soak.json``, ``goodput.json``, ``report.html``) gives the run's goodput broken
into startup, recovery, checkpoint, lost work and the rest (they add up to the wall time),
faults injected vs recovered, the cost of each fault kind, and every invariant that broke.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.analysis import Expectation, Invariant, check_run
from chaos.cluster_runner import ClusterRunner, ClusterSpec
from chaos.plan import FaultSpec, RandomPlan
from chaos.report import plot_timeline, write_json
from chaos.suite import Job, SuiteConfig, child_env, resolve_job, run_scenario, skipped_steps
from elastic.common.config import ConfigError
from elastic.common.events import read_run_events
from elastic.run.goodput import compute_goodput

# What a soak fires by default, with weights: faults a node recovers from without leaving the run.
CATALOGUE = {"kill_worker": 3.0, "hang_worker": 1.0, "corrupt_checkpoint": 1.0, "nan": 1.0, "straggler": 1.0,
             "etcd_outage": 1.0, "etcd_latency": 1.0, "kill_agent": 1.0}
# The soak injects failures on purpose: the lemon-node policy would exclude their targets, a
# 30 s hang timeout would make every hang cost a minute, and the restart budgets would run out.
SOAK_SETS = ["agent.max_restarts=1000", "agent.failure.no_progress_restarts=0", "agent.leader.lemon_failures=0",
             "agent.heartbeat.step_timeout_s=6"]
PARTS = ("productive_s", "startup_s", "recovery_s", "checkpoint_s", "lost_s", "other_s")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")


def parse_duration(text: str, flag: str) -> float:
    """``90``, ``90s``, ``10m``, ``1.5h`` -> seconds; ConfigError naming the flag otherwise."""
    match = _DURATION.match(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(flag, f"expected a positive duration like 90s or 10m, got {text!r}")
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[match.group(2)]
    return float(match.group(1)) * scale


@dataclass
class SoakConfig:
    out_dir: Path
    config: Path | None = None
    num_nodes: int | None = None
    steps: int | None = None
    sets: list[str] = field(default_factory=list)
    duration_s: float = 600.0
    mtbf_s: float = 60.0
    seed: int = 7
    faults: tuple[str, ...] = ()
    etcd_endpoint: str | None = None
    timeout_s: float = 2100.0
    start_s: float = 0.0
    """No fault before this many seconds into the run (default: a fifth of the duration, max 60 s)."""


def plan(cfg: SoakConfig, job: Job) -> list[FaultSpec]:
    """The seeded schedule within the duration; a corruption is followed by a kill on the same node
    (a damaged checkpoint only matters when a restart has to load past it)."""
    weights = {name: CATALOGUE.get(name, 1.0) for name in cfg.faults} if cfg.faults else dict(CATALOGUE)
    start = cfg.start_s or min(cfg.duration_s / 5, 60.0)
    draw = RandomPlan(cfg.mtbf_s, cfg.seed, weights, protected=[], max_faults=10_000, start_s=start)
    specs = [f for f in draw.schedule(job.nodes) if (f.at_time_s or 0) <= cfg.duration_s]
    out: list[FaultSpec] = []
    for f in specs:
        out.append(f)
        if f.fault == "corrupt_checkpoint":
            out.append(FaultSpec("kill_worker", f.target, at_time_s=f.at_time_s, after=len(out) - 1))
    return out


def estimated_steps(job: Job, cfg: SoakConfig) -> int:
    """Steps for about ``duration`` of training plus recovery; ``--steps`` sets it exactly."""
    sleep = float(getattr(job.cfg.trainer, "step_sleep", 0.0) or 0.0)
    return max(job.steps, int(cfg.duration_s * 1.1 / (sleep + 0.1)))


def recovered(metric: dict[str, Any], events: list[dict]) -> bool:
    """A fault is recovered when training went on past it: a step by a new worker after a restart,
    or any step after it for a fault that needs none."""
    if not metric.get("took_effect"):
        return False
    if metric.get("restarted"):
        return metric.get("recovery_s") is not None
    ts = metric.get("fault_ts", 0)
    return any(e.get("kind") == "trainer.step" and e["ts"] > ts for e in events)


def per_kind(metrics: list[dict[str, Any]], events: list[dict], wall: float) -> dict[str, dict[str, Any]]:
    step_times = [e["step_time"] for e in events if e.get("kind") == "trainer.step" and e.get("source") == "trainer/rank0"]
    step_s = statistics.median(step_times) if step_times else 0.0
    out: dict[str, dict[str, Any]] = {}
    for m in metrics:
        k = out.setdefault(m["fault"], {"injected": 0, "recovered": 0, "recovery_s": [], "steps_lost": 0,
                                        "cost_s": 0.0})
        k["injected"] += 1
        k["recovered"] += int(recovered(m, events))
        if m.get("recovery_s") is not None:
            k["recovery_s"].append(m["recovery_s"])
        k["steps_lost"] += m.get("steps_lost") or 0
        k["cost_s"] += (m.get("recovery_s") or 0.0) + (m.get("steps_lost") or 0) * step_s
    for k in out.values():
        rec = k.pop("recovery_s")
        k["mean_recovery_s"] = round(statistics.mean(rec), 2) if rec else None
        k["max_recovery_s"] = round(max(rec), 2) if rec else None
        k["cost_s"] = round(k["cost_s"], 2)
        k["goodput_cost"] = round(k["cost_s"] / wall, 4) if wall else None
    return out


def goodput_invariant(goodput: dict[str, Any]) -> Invariant:
    total = sum(goodput.get(p) or 0.0 for p in PARTS)
    negative = [p for p in PARTS if (goodput.get(p) or 0.0) < 0]
    ok = goodput.get("goodput") is not None and not negative and abs(total - goodput["wall_s"]) <= 0.01 + 1e-3 * len(PARTS)
    detail = (f"parts add up to {total:.3f}s of {goodput.get('wall_s')}s wall" if ok else
              f"parts sum {total:.3f}s vs wall {goodput.get('wall_s')}s; negative: {negative}")
    return Invariant("goodput_accounted", ok, detail, [", ".join(f"{p}={goodput.get(p)}" for p in PARTS)])


def _job(cfg: SoakConfig) -> tuple[Job, SuiteConfig]:
    suite = SuiteConfig(cfg.out_dir, config=cfg.config, num_nodes=cfg.num_nodes, steps=cfg.steps,
                        sets=[*SOAK_SETS, *cfg.sets], timeout_s=cfg.timeout_s, etcd_endpoint=cfg.etcd_endpoint)
    job = resolve_job(suite)
    if cfg.steps is None:
        job.steps = suite.steps = estimated_steps(job, cfg)
    return job, suite


def _soak_run(cfg: SoakConfig, job: Job, faults: list[FaultSpec], stamp: str):
    base = cfg.out_dir / "soak"
    n = len(job.nodes)
    spec = ClusterSpec(job.config, f"{job.cfg.run.id}-soak-{stamp}"[:64], base / "run", job.nodes, str(n),
                       child_env(), key_prefix=job.cfg.rendezvous.key_prefix, steps=job.steps,
                       overrides=[*SOAK_SETS, *cfg.sets], etcd_endpoint=cfg.etcd_endpoint, proxy=True,
                       netns=any(f.fault == "partition" for f in faults), token=job.token, interval=job.interval,
                       nproc_per_node=job.cfg.launch.nproc_per_node, requeue=True, timeout_s=cfg.timeout_s)
    entry = {"name": "soak", "run_dir": str(spec.run_dir), "run_id": spec.run_id, "nodes": spec.node_range,
             "plan": [f.describe() for f in faults]}
    return entry, ClusterRunner(spec, faults).run()


def run_soak(cfg: SoakConfig, echo=print) -> dict[str, Any]:
    from chaos.html import write_soak_html

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    job, suite = _job(cfg)
    faults = plan(cfg, job)
    stamp = f"{int(time.time()) % 1000000:06d}"
    echo(f"chaos soak: {job.config.name}, {len(job.nodes)} nodes, {job.steps} steps, {len(faults)} faults over "
         f"{cfg.duration_s:g}s (mtbf {cfg.mtbf_s:g}s, seed {cfg.seed})")
    entry, outcome = _soak_run(cfg, job, faults, stamp)
    run_dir = Path(entry["run_dir"])
    skips = skipped_steps(run_dir, outcome)
    replay_entry, replay_outcome = run_scenario(None, "replay", suite, job, stamp, skips)
    replay = check_run(Path(replay_entry["run_dir"]), Expectation(steps=job.steps, bitwise=False, note="replay"),
                       None, replay_outcome.rc, node_rcs=replay_outcome.node_rcs, wall_s=replay_outcome.wall_s)
    events = read_run_events(run_dir)
    goodput = compute_goodput(events)
    expect = Expectation(steps=job.steps, note="fault-free replay skipping the same batches",
                         extra_invariants=[lambda _e: goodput_invariant(goodput)])
    result = check_run(run_dir, expect, replay["final_checksum"], outcome.rc, node_rcs=outcome.node_rcs,
                       wall_s=outcome.wall_s)
    kinds = per_kind(result["faults"], events, goodput.get("wall_s") or 0.0)
    injected = sum(k["injected"] for k in kinds.values())
    recovered_n = sum(k["recovered"] for k in kinds.values())
    every = Invariant("every_fault_recovered", injected == recovered_n,
                      f"{recovered_n} of {injected} injected faults recovered (training went on past each)")
    result["invariants"].append(every.to_json())
    result["ok"] = result["ok"] and every.ok and replay["ok"] is not False
    report = {"job": str(job.config), "nodes": len(job.nodes), "steps": job.steps, "duration_s": cfg.duration_s,
              "mtbf_s": cfg.mtbf_s, "seed": cfg.seed, "sets": cfg.sets, "planned": len(faults),
              "injected": injected, "recovered": recovered_n, "requeues": outcome.requeues, "skipped_batches": skips,
              "goodput": goodput, "per_kind": kinds, "ok": result["ok"],
              "broken": [i for i in result["invariants"] if not i["ok"]],
              "replay_checksum": replay["final_checksum"], "soak": {**entry, "result": result},
              "replay": {**replay_entry, "result": replay}}
    write_json(report, cfg.out_dir / "soak.json")
    write_json(goodput, cfg.out_dir / "goodput.json")
    plot_timeline([report["soak"]], cfg.out_dir / "timeline.png")
    html = write_soak_html(report, cfg.out_dir / "report.html", cfg.out_dir / "timeline.png")
    for line in summary_lines(report):
        echo(line)
    echo(f"report: {cfg.out_dir / 'soak.json'}  goodput: {cfg.out_dir / 'goodput.json'}  html: {html}")
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    from elastic.run.goodput import format_goodput

    lines = [format_goodput(report["goodput"]),
             f"faults: {report['injected']} injected, {report['recovered']} recovered "
             f"({report['planned']} planned, {report['requeues']} node relaunches)"]
    for kind, k in sorted(report["per_kind"].items()):
        lines.append(f"  {kind:20} {k['recovered']}/{k['injected']} recovered, mean recovery "
                     f"{k['mean_recovery_s'] if k['mean_recovery_s'] is not None else '-'}s, steps lost "
                     f"{k['steps_lost']}, cost {k['cost_s']}s ({(k['goodput_cost'] or 0) * 100:.1f}% of wall)")
    broken = report["broken"]
    lines.append("invariants: every one held" if not broken else
                 "BROKEN: " + "; ".join(f"{i['name']}: {i['detail']}" for i in broken))
    return lines
