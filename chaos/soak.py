"""``chaos soak``: seeded random faults at one long run of the job, and what they cost in goodput.

    chaos soak --config examples/tiny.yaml --nodes 4 --duration 10m --mtbf 60s

One run of the job on separate nodes (faults through etcd, as in the suite) takes faults drawn
from the catalogue at exponential inter-arrival times (mean ``--mtbf``, ``--seed``) for
``--duration``; the first draws go through every kind once before weights apply.  A lost node
is relaunched (``requeue``, what a scheduler does), so the world keeps its size and the final
weights stay comparable: after the soak a fault-free replay of the job that skips the same
batches (a NaN makes the run skip one) must end bitwise equal.  A plan that stops an etcd member
runs against a 3-member etcd (what ``launch.etcd_members: 3`` starts in local mode).

The report (``soak.json``, ``goodput.json``, ``report.html``) gives the run's goodput broken
into startup, recovery, checkpoint, lost work and the rest (they add up to the wall time),
``goodput_excl_startup`` (productive time over the wall time after startup), the same figure of the
fault-free replay (``fault_free``: the baseline, what the job's own steps, saves and snapshots leave on
this host) and their difference (``faults_cost_excl_startup``), ``mttr_s`` (p50 and
p95 of the recovery times of the faults that needed a recovery), faults injected vs recovered,
the cost of each fault kind, and every invariant that broke.  A run that did not end on its own
within ``--timeout-s`` is a hang (``hung``; its replay is not run).  The soak passes only when
nothing hung, every invariant held and the weights equal the replay's.
"""

from __future__ import annotations

import math
import random
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.analysis import Expectation, Invariant, check_run, evidence
from chaos.cluster_runner import ClusterOutcome, ClusterRunner, ClusterSpec
from chaos.plan import FaultSpec, RandomPlan
from chaos.report import plot_timeline, write_json
from chaos.suite import Job, SuiteConfig, child_env, resolve_job, run_scenario, skipped_steps, standby_names
from elastic.common.config import ConfigError
from elastic.common.events import read_run_events
from elastic.run.goodput import compute_goodput

# What a soak fires by default, with weights: every fault the run recovers from at its full size
# (a lost node is relaunched).  kill_during_recovery comes after a kill_worker (see plan()).
CATALOGUE = {"kill_worker": 3.0, "hang_worker": 1.0, "corrupt_checkpoint": 1.0, "nan": 1.0, "straggler": 1.0,
             "etcd_outage": 1.0, "etcd_latency": 1.0, "kill_agent": 1.0, "kill_spare": 1.0,
             "kill_during_recovery": 1.0, "etcd_member_stop": 1.0, "kill_during_checkpoint": 1.0,
             "ckpt_write_error": 1.0}
NOT_SOAKED = {
    "kill_during_rendezvous": "waits for a rendezvous, which a run recovering in-process may never hold again",
    "bad_hardware": "excludes its node for good: the world shrinks and the weights stop being comparable",
    "partition": "needs root and network namespaces (chaos suite --netns runs it)",
    "sdc": "caught only where the job checks for it (replicas with sdc.check_every, 3+ groups; or "
           "sdc.replay_every, at a checked step); elsewhere the flip stays silent by design and the weights stop "
           "matching the replay (--faults sdc draws it; with sdc.check_every: 1 a flip at any step is caught "
           "before it spreads)",
}
"""Registered faults the soak does not draw, and why (every other one is in CATALOGUE)."""
RECOVERY_KILL_DELAY_S = 0.1
"""A kill_during_recovery fires this long after the kill_worker it follows (on any node).  0.5 s
missed the recovery once rounds took one participant per node and faults were pushed (the
spare had joined and trained by then); the agents' 0.25 s look for fault requests adds to it."""
SPARE_KILL_GAP_S = 2.0
"""A spare kill is followed this long after by a kill of the same node's worker."""
# The soak injects failures on purpose: the lemon-node policy would exclude their targets, a
# 30 s hang timeout would make every hang cost a minute, and the restart budgets would run out.
# Agents look for fault requests every 0.25 s, so a kill meant for a recovery lands in it.
# The hang timeout is what a hang costs, less ~1 s of recovery: at 6 s a hang alone put p95 over
# 5 s (seeds 1 and 2: 7.1 s).  3 s is 20 of the tiny DiT's 0.15 s steps, and 2.5x the longest
# silence between two steps in three 10-minute soaks with every fault (1.2 s: the heap freeze
# after a start's 4th step; next 0.94 s, a start's 2nd step); a victim's agent still waits 2x.
# Set it for your own job the same way: well above the longest step-to-step gap it ever shows.
SOAK_SETS = ["agent.max_restarts=1000", "agent.failure.no_progress_restarts=0", "agent.leader.lemon_failures=0",
             "agent.heartbeat.step_timeout_s=3", "agent.chaos.poll_s=0.25"]
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
    standby: int = 1
    """Warm standby nodes beside the job's (``elastic-launch --standby``), in the soak run and its
    replay: a node lost from the fixed-size world is replaced by one in-process, as a production job
    that keeps N+1 nodes would; the lost node's relaunch then waits as the next standby.  0: the lost
    node's own relaunch rejoins (a cold start: 5.6-6.0 s per lost node in three seeds at ada05d8)."""


def soaked(cfg: SoakConfig) -> dict[str, float]:
    """The fault kinds this soak draws from, with weights (``--faults`` or the catalogue)."""
    weights = {name: CATALOGUE.get(name, 1.0) for name in cfg.faults} if cfg.faults else dict(CATALOGUE)
    if cfg.etcd_endpoint:
        weights.pop("etcd_member_stop", None)  # an operator's etcd is not ours to take members from
    if not weights:
        raise ConfigError("--faults", "no fault left to draw (etcd_member_stop needs the etcd chaos starts)")
    return weights


def plan(cfg: SoakConfig, job: Job) -> list[FaultSpec]:
    """The seeded schedule within the duration.  A corruption and a spare kill are each followed by
    a kill of the same node's worker (a damaged checkpoint only matters when a restart has to load
    past it, a dead spare when a worker death needs it); a kill during a recovery comes after a
    kill_worker, on a node of its own draw."""
    start = cfg.start_s or min(cfg.duration_s / 5, 60.0)
    draw = RandomPlan(cfg.mtbf_s, cfg.seed, soaked(cfg), protected=[], max_faults=10_000, start_s=start,
                      cover=True)
    specs = [f for f in draw.schedule(job.nodes) if (f.at_time_s or 0) <= cfg.duration_s]
    second = random.Random(cfg.seed * 7919 + 1)  # the follow-up kills' nodes: the draw above stays as it was
    out: list[FaultSpec] = []
    for f in specs:
        if f.fault == "kill_during_recovery":
            out.append(FaultSpec("kill_worker", f.target, at_time_s=f.at_time_s))
            out.append(FaultSpec(f.fault, second.choice(job.nodes), at_time_s=f.at_time_s, params=f.params,
                                 after=len(out) - 1, delay_s=RECOVERY_KILL_DELAY_S))
            continue
        out.append(f)
        if f.fault == "corrupt_checkpoint":
            out.append(FaultSpec("kill_worker", f.target, at_time_s=f.at_time_s, after=len(out) - 1))
        if f.fault == "kill_spare":
            out.append(FaultSpec("kill_worker", f.target, at_time_s=f.at_time_s, after=len(out) - 1,
                                 delay_s=SPARE_KILL_GAP_S))
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
    for m in metrics:
        if "during_recovery" in m:  # a kill meant for a recovery: did it land in one?
            k = out[m["fault"]]
            k["during_recovery"] = k.get("during_recovery", 0) + int(bool(m["during_recovery"]))
    for k in out.values():
        rec = k.pop("recovery_s")
        k["mean_recovery_s"] = round(statistics.mean(rec), 2) if rec else None
        k["max_recovery_s"] = round(max(rec), 2) if rec else None
        k["cost_s"] = round(k["cost_s"], 2)
        k["goodput_cost"] = round(k["cost_s"] / wall, 4) if wall else None
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1), interpolating linearly between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 3)


def mttr(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """p50 / p95 of fault -> first step of the re-formed run, over the faults that needed a recovery
    (workers restarted or replaced after them); ``n`` says how many."""
    times = [m["recovery_s"] for m in metrics if m.get("restarted") and m.get("recovery_s") is not None]
    return {"p50": percentile(times, 0.5), "p95": percentile(times, 0.95), "n": len(times)}


def goodput_excl_startup(goodput: dict[str, Any]) -> float | None:
    """Productive time over the wall time after startup: what the faults cost, the start not counted."""
    wall, startup, productive = (goodput.get(k) for k in ("wall_s", "startup_s", "productive_s"))
    if wall is None or startup is None or productive is None or wall - startup <= 0:
        return None
    return round(productive / (wall - startup), 4)


def fault_free(run_dir: Path) -> dict[str, Any]:
    """The fault-free replay's goodput (the baseline measured in the same soak): the same job, steps
    and skipped batches without a fault, so ``goodput_excl_startup`` there is what this job's steps,
    saves and snapshots leave of the wall time on this host before any fault costs anything."""
    goodput = compute_goodput(read_run_events(run_dir))
    if goodput.get("goodput") is None:
        return {}
    return {"goodput_excl_startup": goodput_excl_startup(goodput), "goodput": goodput}


def faults_cost(goodput: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """What the faults cost: the fault-free replay's ``goodput_excl_startup`` minus the soak's."""
    soak, free = goodput_excl_startup(goodput), baseline.get("goodput_excl_startup")
    return None if soak is None or free is None else round(free - soak, 4)


def hang_invariant(timeout_s: float, runs: dict[str, ClusterOutcome | None]) -> Invariant:
    """Every run ended on its own: one still going at its timeout (or a launcher still there a
    minute after the run finished) is a hang, the worst result a runtime can give."""
    hung = {name: o for name, o in runs.items() if o is not None and o.hung}
    if not hung:
        return Invariant("no_hang", True, f"{' and '.join(n for n, o in runs.items() if o)} ended on their own")
    why = [f"{name}: " + (f"still running after {timeout_s:g}s" if o.timed_out else
                          "finished, but a launcher was still running a minute later")
           + f" (launcher rc at stop: {o.node_rcs})" for name, o in hung.items()]
    return Invariant("no_hang", False, "HUNG: " + "; ".join(why))


def goodput_invariant(goodput: dict[str, Any]) -> Invariant:
    total = sum(goodput.get(p) or 0.0 for p in PARTS)
    negative = [p for p in PARTS if (goodput.get(p) or 0.0) < 0]
    ok = goodput.get("goodput") is not None and not negative and abs(total - goodput["wall_s"]) <= 0.01 + 1e-3 * len(PARTS)
    detail = (f"parts add up to {total:.3f}s of {goodput.get('wall_s')}s wall" if ok else
              f"parts sum {total:.3f}s vs wall {goodput.get('wall_s')}s; negative: {negative}")
    return Invariant("goodput_accounted", ok, detail, [", ".join(f"{p}={goodput.get(p)}" for p in PARTS)])


def _job(cfg: SoakConfig) -> tuple[Job, SuiteConfig]:
    suite = SuiteConfig(cfg.out_dir, config=cfg.config, num_nodes=cfg.num_nodes, steps=cfg.steps,
                        sets=[*SOAK_SETS, *cfg.sets], timeout_s=cfg.timeout_s, etcd_endpoint=cfg.etcd_endpoint,
                        standby=cfg.standby)
    job = resolve_job(suite)
    if cfg.steps is None:
        job.steps = suite.steps = estimated_steps(job, cfg)
    return job, suite


def _soak_run(cfg: SoakConfig, job: Job, faults: list[FaultSpec], stamp: str) -> tuple[dict, ClusterOutcome]:
    base = cfg.out_dir / "soak"
    # A soak starts from nothing, as a suite's scenario does: an earlier soak's run directory would be
    # resumed from its checkpoints, and its 3-member etcd's data directory kept the new members from
    # forming a cluster (a second `chaos soak` to the same --out failed after 30 s on etcd's health).
    shutil.rmtree(base, ignore_errors=True)
    n = len(job.nodes)
    spec = ClusterSpec(job.config, f"{job.cfg.run.id}-soak-{stamp}"[:64], base / "run", job.nodes, str(n),
                       child_env(), key_prefix=job.cfg.rendezvous.key_prefix, steps=job.steps,
                       overrides=[*SOAK_SETS, *cfg.sets], etcd_endpoint=cfg.etcd_endpoint, proxy=True,
                       netns=any(f.fault == "partition" for f in faults), token=job.token, interval=job.interval,
                       nproc_per_node=job.cfg.launch.nproc_per_node, requeue=True, timeout_s=cfg.timeout_s,
                       standby=standby_names(cfg.standby))
    runner = ClusterRunner(spec, faults)
    entry = {"name": "soak", "run_dir": str(spec.run_dir), "run_id": spec.run_id, "nodes": spec.node_range,
             "plan": [f.describe() for f in faults], "etcd_members": runner.etcd_members}
    outcome = runner.run()
    entry.update(timed_out=outcome.timed_out, lingered=outcome.lingered, node_rcs=outcome.node_rcs)
    return entry, outcome


def run_soak(cfg: SoakConfig, echo=print) -> dict[str, Any]:
    from chaos.html import write_soak_html

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    job, suite = _job(cfg)
    faults = plan(cfg, job)
    stamp = f"{int(time.time()) % 1000000:06d}"
    echo(f"chaos soak: {job.config.name}, {len(job.nodes)} nodes, {job.steps} steps, {len(faults)} faults over "
         f"{cfg.duration_s:g}s (mtbf {cfg.mtbf_s:g}s, seed {cfg.seed})")
    for f in faults:
        echo(f"  planned {f.describe()}")
    entry, outcome = _soak_run(cfg, job, faults, stamp)
    run_dir = Path(entry["run_dir"])
    skips = skipped_steps(run_dir, outcome)
    baseline: dict[str, Any] = {}
    if outcome.hung:
        # A hung run has no final weights to compare: the verdict is in, and a replay costs a run.
        replay_entry, replay_outcome = {"name": "replay", "skipped": "the soak run hung"}, None
        replay: dict[str, Any] = {"ok": None, "final_checksum": None, "invariants": []}
    else:
        replay_entry, replay_outcome = run_scenario(None, "replay", suite, job, stamp, skips)
        replay = check_run(Path(replay_entry["run_dir"]), Expectation(steps=job.steps, bitwise=False, note="replay"),
                           None, replay_outcome.rc, node_rcs=replay_outcome.node_rcs, wall_s=replay_outcome.wall_s)
        baseline = fault_free(Path(replay_entry["run_dir"]))
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
                      f"{recovered_n} of {injected} injected faults recovered (training went on past each)",
                      evidence([e for e in events if e.get("kind") in ("chaos.inject", "chaos.not_injected")], 8))
    hang = hang_invariant(cfg.timeout_s, {"soak": outcome, "replay": replay_outcome})
    replayed = [Invariant(f"replay_{i['name']}", False, i["detail"], i.get("evidence", []))
                for i in replay["invariants"] if not i["ok"]]
    result["invariants"] += [inv.to_json() for inv in [hang, every, *replayed]]
    result["ok"] = result["ok"] and hang.ok and every.ok and replay["ok"] is not False
    drawn = {f.fault for f in faults}
    report = {"job": str(job.config), "nodes": len(job.nodes), "steps": job.steps, "duration_s": cfg.duration_s,
              "mtbf_s": cfg.mtbf_s, "seed": cfg.seed, "sets": cfg.sets, "etcd_members": entry["etcd_members"],
              "standby": cfg.standby,
              "planned": len(faults), "injected": injected, "recovered": recovered_n, "requeues": outcome.requeues,
              "refused_nodes": outcome.refused,
              "skipped_batches": skips, "hung": not hang.ok, "goodput": goodput,
              "recoveries_not_bitwise": sum(1 for e in events if e.get("kind") == "trainer.recovered"
                                            and e.get("bitwise") is False),
              "goodput_excl_startup": goodput_excl_startup(goodput), "mttr_s": mttr(result["faults"]),
              "fault_free": baseline, "faults_cost_excl_startup": faults_cost(goodput, baseline),
              "per_kind": kinds, "not_drawn": sorted(set(soaked(cfg)) - drawn), "ok": result["ok"],
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

    g, m = report["goodput"], report["mttr_s"]
    excl = report["goodput_excl_startup"]
    lines = [format_goodput(g),
             f"goodput_excl_startup {excl if excl is not None else '-'} (productive {g.get('productive_s')}s of "
             f"{round((g.get('wall_s') or 0) - (g.get('startup_s') or 0), 2)}s after startup)",
             *_baseline_lines(report),
             f"mttr_s p50 {_s(m['p50'])} p95 {_s(m['p95'])} over {m['n']} faults that needed a recovery",
             "hung: no (every run ended on its own)" if not report["hung"] else
             "hung: YES -- " + next((i["detail"] for i in report["broken"] if i["name"] == "no_hang"), "see soak.json"),
             f"faults: {report['injected']} injected, {report['recovered']} recovered "
             f"({report['planned']} planned, {report['requeues']} node relaunches, etcd members "
             f"{report.get('etcd_members', 1)})"]
    for node, rc in sorted((report.get("refused_nodes") or {}).items()):
        lines.append(f"  {node} refused by the run on relaunch (exit {rc}: its code, config or token differs); "
                     "not relaunched again")
    for kind, k in sorted(report["per_kind"].items()):
        mid = f", {k['during_recovery']} of them mid-recovery" if "during_recovery" in k else ""
        lines.append(f"  {kind:20} {k['recovered']}/{k['injected']} recovered{mid}, mean recovery "
                     f"{k['mean_recovery_s'] if k['mean_recovery_s'] is not None else '-'}s, steps lost "
                     f"{k['steps_lost']}, cost {k['cost_s']}s ({(k['goodput_cost'] or 0) * 100:.1f}% of wall)")
    if report.get("recoveries_not_bitwise"):
        lines.append(f"  {report['recoveries_not_bitwise']} rank recoveries reported a restored state that is not "
                     "bitwise the pre-fault one (trainer.recovered bitwise=false)")
    if report.get("not_drawn"):
        lines.append(f"  not drawn this time: {', '.join(report['not_drawn'])}")
    broken = report["broken"]
    lines.append("invariants: every one held" if not broken else
                 "BROKEN: " + "; ".join(f"{i['name']}: {i['detail']}" for i in broken))
    return lines


def _baseline_lines(report: dict[str, Any]) -> list[str]:
    free = (report.get("fault_free") or {}).get("goodput_excl_startup")
    if free is None:
        return []
    return [f"fault-free replay: goodput_excl_startup {free} (this job's ceiling on this host); the faults cost "
            f"{report.get('faults_cost_excl_startup')}"]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:g}s"
