"""The standard chaos suite against a job: a fault-free baseline, then one scenario per fault kind.

``chaos suite --config job.yaml`` runs the operator's own job (any workload, e.g. the DiT of
``examples/tiny.yaml``, FP8 and cp=2 included via ``--set``); without ``--config`` a small
built-in MLP job.  Every scenario is a real run of separate nodes against one etcd, faults
delivered through etcd to the target node's agent (:mod:`chaos.cluster_runner`), and is sized
from the job: with checkpoint interval I, faults land around step 2I (a committed checkpoint
before and after).  Final weights are compared bitwise with the job's own fault-free baseline
where the fault cannot change the data seen (kills, hangs, etcd faults, checkpoint damage: the
run resumes from a commit and replays the same batches); after a NaN the run skips a batch, so
it is compared with a fault-free *replay* that skips the same batches; a lost or excluded node
changes the world size, so there only finite weights are checked, and the detail says so (the
baseline is not run when no chosen scenario compares with it: ``--only partition``).

A scenario the job cannot run (a shrink the global batch does not divide, a partition without
network namespaces) is listed as skipped with the reason, never silently dropped.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.analysis import Expectation, check_run
from chaos.cluster_runner import ClusterOutcome, ClusterRunner, ClusterSpec
from chaos.injectors import REGISTRY
from chaos.plan import FaultSpec
from chaos.report import format_table, plot_timeline, write_json
from elastic.common.config import ConfigError, from_dict
from elastic.common.events import read_run_events
from elastic.run.schema import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK = ("kill_worker", "corrupt_checkpoint")


@dataclass
class Scenario:
    name: str
    faults: list[FaultSpec]
    expect: Expectation
    shrink: bool = False
    """Runs elastic as ``N-1:N`` (a node may be lost for good)."""
    sets: list[str] = field(default_factory=list)
    """Extra ``--set`` items (short timeouts the scenario needs)."""
    proxy: bool = False
    netns: bool = False
    replay: bool = False
    """Compare with a fault-free replay that skips the batches this run skipped."""
    skipped: str = ""
    uncovered: str = ""
    """Why the job cannot pass this scenario at all (no SDC detection): reported failed, not run."""


def _spec(fault: str, target: str, at_step: int | None = None, at_time_s: float | None = None,
          after: int | None = None, delay_s: float | None = None, **params: Any) -> FaultSpec:
    return FaultSpec(fault, target, at_step, at_time_s, from_dict(REGISTRY[fault].Params, params), after, delay_s)


def standard_scenarios(nodes: list[str], steps: int, interval: int, check_every: int = 0,
                       replay_every: int = 0) -> list[Scenario]:
    """One scenario per fault kind, sized from the job's checkpoint interval, step count and SDC checks."""
    first, last = nodes[1], nodes[-1]
    ckpt = interval * 2  # a step with a committed checkpoint before it and after it
    # A step the agreement check covers before the next step's gradients are shared (kept bitwise);
    # under replay verification, a checked step in the second half (the spares have imported by then).
    flip = -(-ckpt // check_every) * check_every if check_every else ckpt
    at, rank = "shard", {"rank": 0}  # a replica group's rank 0
    if replay_every and not check_every:
        # In one world node1's ranks are not rank 0: any of them will do.
        flip, at, rank = -(-max(ckpt, steps // 2) // replay_every) * replay_every, "local", {}

    def ex(**kw: Any) -> Expectation:
        return Expectation(steps=steps, **kw)

    fast_hang = ["agent.heartbeat.step_timeout_s=4"]
    return [
        Scenario("kill_worker", [_spec("kill_worker", first, at_step=ckpt - 2)], ex()),
        Scenario("corrupt_checkpoint",
                 [_spec("corrupt_checkpoint", first, at_step=ckpt + 1, min_step=ckpt),
                  _spec("kill_worker", first, at_step=ckpt + 1, after=0)], ex(),
                 # In-process recovery resumes from the per-step memory snapshot and never reads the disk:
                 # the damaged commit only matters on the restart path, which is what this tests.
                 sets=["agent.inprocess.enabled=false"]),
        Scenario("kill_during_checkpoint", [_spec("kill_during_checkpoint", first, min_step=ckpt)], ex()),
        Scenario("kill_during_rendezvous",
                 [_spec("kill_worker", nodes[0], at_step=interval + 1),
                  _spec("kill_during_rendezvous", first, at_step=0)], ex()),
        Scenario("etcd_outage", [_spec("etcd_outage", "etcd", at_step=interval + 2, duration_s=3.0)], ex()),
        Scenario("etcd_latency", [_spec("etcd_latency", "etcd", at_step=interval, latency_s=0.3, duration_s=10.0)],
                 ex(), proxy=True),
        Scenario("hang_worker", [_spec("hang_worker", first, at_step=interval + 2)],
                 ex(required_events=["agent.hang_detected"]), sets=fast_hang),
        Scenario("straggler", [_spec("straggler", first, at_step=interval, delay_s=0.3, num_steps=4)],
                 ex(required_events=["fault.fired"])),
        Scenario("nan", [_spec("nan", nodes[0], at_time_s=0, step=ckpt + 1)],
                 ex(required_events=["fault.fired", "trainer.numerics"],
                    note="compared with a fault-free replay that skips the same batches"), replay=True),
        Scenario("ckpt_write_error", [_spec("ckpt_write_error", nodes[0], at_time_s=0, step=ckpt)],
                 ex(required_events=["checkpoint.save_failed"])),
        # Silent: passes only when the flip is named (the sdc_detected invariant) and healed bitwise.
        Scenario("sdc", [_spec("sdc", first, at_time_s=0, step=flip, at=at, **rank)],
                 ex(required_events=["sdc.suspect"], note=f"one bit of node1's gradient ({at}) flipped"),
                 # One flip on one step is seen only if node1 is checked then: every node is, for this run
                 # (a job with sdc.replay_nodes samples nodes per check; the detection path is the same).
                 sets=["sdc.replay_nodes=0"] if replay_every and not check_every else []),
        # A dead spare must be noticed and replaced before the node's next worker death needs one.
        Scenario("kill_spare", [_spec("kill_spare", first, at_step=interval + 2),
                                _spec("kill_worker", first, at_step=interval + 2, after=0, delay_s=2.0)], ex()),
        Scenario("kill_during_recovery", [_spec("kill_worker", first, at_step=interval + 2),
                                          _spec("kill_during_recovery", last, at_step=interval + 2, after=0,
                                                delay_s=0.5)], ex()),
        # A 3-member etcd (chaos starts one for this plan) loses a member across a worker kill.
        Scenario("etcd_member_stop", [_spec("etcd_member_stop", "etcd", at_step=interval + 2, duration_s=10.0),
                                      _spec("kill_worker", first, at_step=interval + 2, after=0, delay_s=1.0)],
                 ex()),
        Scenario("kill_agent", [_spec("kill_agent", last, at_step=interval + 2)],
                 ex(bitwise=False, launcher_rc=None, note="the world shrinks to the surviving nodes"), shrink=True),
        Scenario("bad_hardware", [_spec("bad_hardware", last, at_time_s=0)],
                 ex(bitwise=False, excluded={last}, launcher_rc=None,
                    note="the excluded node leaves a smaller world"), shrink=True),
        Scenario("partition", [_spec("partition", last, at_step=interval + 2, duration_s=8.0)],
                 ex(bitwise=False, launcher_rc=None, note="the world shrinks while the node is cut off, then grows"),
                 shrink=True, netns=True,
                 # In-process recovery is off here: its workers refuse a memory cache that is not on loopback
                 # (memclient), and a node in a namespace reaches its agent at the namespace's address.
                 sets=["agent.lease_ttl_s=4", "agent.heartbeat.step_timeout_s=6", "agent.pg_timeout_s=15",
                       "agent.inprocess.enabled=false"]),
    ]


@dataclass
class SuiteConfig:
    out_dir: Path
    config: Path | None = None
    """The operator's job; None: the built-in MLP job."""
    num_nodes: int | None = None
    """Nodes per run; default: the job's launch.nodes (its maximum)."""
    steps: int | None = None
    sets: list[str] = field(default_factory=list)
    """``--set KEY=VALUE`` for every run of the suite (baseline included)."""
    only: tuple[str, ...] = ()
    timeout_s: float = 300.0
    jobs: int = 1
    etcd_endpoint: str | None = None
    netns: bool | None = None
    """Run the partition scenario (needs root and ``ip``); None: when this host allows it."""
    standby: int = 0
    """Warm standby nodes beside the job's (``elastic-launch --standby``; the soak's replay has the soak's)."""


@dataclass
class Job:
    """The job the suite runs, resolved once: its config file and what the scenarios are sized from."""

    config: Path
    cfg: RunConfig
    nodes: list[str]
    steps: int
    interval: int
    token: str | None = field(default=None, repr=False)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def write_config(path: Path, run_dir: Path, num_nodes: int = 3, steps: int = 20, interval: int = 4,
                 step_sleep: float = 0.1) -> Path:
    """The built-in job: the small MLP workload."""
    data = {
        "run": {"id": "chaos", "dir": str(run_dir)},
        "launch": {"nodes": str(num_nodes), "nproc_per_node": 1},
        "agent": {"max_restarts": 3, "term_grace_s": 2},
        "checkpoint": {"interval_steps": interval, "keep_last": 2},
        "trainer": {"steps": steps, "batch_size": 8, "dim": 16, "depth": 2, "lr": 0.01, "step_sleep": step_sleep},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def resolve_job(cfg: SuiteConfig, extra_sets: list[str] = (), nodes_flag: str | None = None) -> Job:
    from launch.cli import build_parser, resolve_config

    config = cfg.config or write_config(cfg.out_dir / "builtin-job.yaml", cfg.out_dir / "builtin",
                                        num_nodes=cfg.num_nodes or 3)
    argv = [str(config)] + [a for item in [*cfg.sets, *extra_sets] for a in ("--set", item)]
    if cfg.steps is not None:
        argv += ["--steps", str(cfg.steps)]
    if nodes_flag or cfg.num_nodes:
        argv += ["--nodes", nodes_flag or str(cfg.num_nodes)]
    run = resolve_config(build_parser().parse_args(argv))
    interval, steps = run.checkpoint.interval_steps, run.trainer_steps()
    if steps is None:
        raise ConfigError("--steps", "the job's trainer section names no step count; give --steps")
    if steps < 2 * interval + 2:
        raise ConfigError("--steps", f"the suite needs at least {2 * interval + 2} steps (two checkpoint intervals "
                                     f"of {interval} and a step after), the job has {steps}")
    nodes = [f"node{i}" for i in range(run.launch.max_nodes)]
    if len(nodes) < 2:
        raise ConfigError("--nodes", "the suite needs at least 2 nodes")
    return Job(Path(config).resolve(), run, nodes, steps, interval, run.security.token(path="security"))


def _applicable(scenario: Scenario, cfg: SuiteConfig, job: Job) -> str:
    """Why the scenario cannot run against this job here ("" when it can)."""
    if scenario.shrink:
        if len(job.nodes) < 3 and scenario.name != "partition":
            return "needs 3 nodes (the world shrinks by one and must still be a world)"
        try:
            resolve_job(cfg, scenario.sets, f"{len(job.nodes) - 1}:{len(job.nodes)}")
        except ConfigError as exc:
            return f"the job cannot shrink to {len(job.nodes) - 1} nodes: {exc}"
    if scenario.netns:
        from chaos.netns import available

        why = available()
        if cfg.netns is False or why:
            return why or "network namespaces not requested (--netns)"
    if scenario.name == "etcd_outage" and cfg.etcd_endpoint:
        scenario.proxy = True  # the operator's etcd is not ours to stop: blackhole it at the proxy
    if scenario.name == "etcd_member_stop" and cfg.etcd_endpoint:
        return "stops a member of the 3-member etcd chaos starts; the operator's etcd is not ours to stop"
    return ""


def sdc_uncovered(cfg: RunConfig, nodes: int) -> str:
    """Why this job cannot catch a silent flip ("" when it can): the sdc scenario then fails, unrun."""
    if cfg.sdc.replay and not cfg.replicas.enabled:
        return ""  # the config check made sure it can run (in-process, a warm spare, a workload that replays)
    if not cfg.replicas.enabled or not cfg.sdc.agreement:
        return ("not covered: the job has no SDC detection (it needs sdc.replay_every > 0, or replicas.enabled "
                "with sdc.check_every > 0)")
    if nodes < 3:
        return f"not covered: {nodes} replica groups hold no majority to name a suspect by (needs 3)"
    return ""


def _run_id(job: Job, name: str, stamp: str) -> str:
    return f"{job.cfg.run.id}-{name}-{stamp}"[:64]


def run_scenario(scenario: Scenario | None, name: str, cfg: SuiteConfig, job: Job, stamp: str,
                 skip_ranges: list[tuple[int, int]] = ()) -> tuple[dict[str, Any], ClusterOutcome]:
    base = cfg.out_dir / name
    shutil.rmtree(base, ignore_errors=True)  # a scenario starts from nothing (no checkpoints to resume)
    n = len(job.nodes)
    spec = ClusterSpec(job.config, _run_id(job, name, stamp), base / "run", job.nodes,
                       f"{n - 1}:{n}" if scenario and scenario.shrink else str(n), child_env(),
                       key_prefix=job.cfg.rendezvous.key_prefix, steps=job.steps,
                       overrides=[*cfg.sets, *(scenario.sets if scenario else [])], etcd_endpoint=cfg.etcd_endpoint,
                       proxy=bool(scenario and scenario.proxy), netns=bool(scenario and scenario.netns),
                       token=job.token, interval=job.interval, nproc_per_node=job.cfg.launch.nproc_per_node,
                       skip_ranges=list(skip_ranges), timeout_s=cfg.timeout_s, standby=standby_names(cfg.standby))
    t0 = time.monotonic()
    outcome = ClusterRunner(spec, scenario.faults if scenario else []).run()
    entry = {"name": name, "run_dir": str(spec.run_dir), "run_id": spec.run_id, "nodes": spec.node_range,
             "plan": [f.describe() for f in (scenario.faults if scenario else [])], "timed_out": outcome.timed_out,
             "elapsed_s": round(time.monotonic() - t0, 1), "node_rcs": outcome.node_rcs,
             "skip_ranges": outcome.skip_ranges}
    return entry, outcome


def standby_names(count: int) -> list[str]:
    return [f"standby{i}" for i in range(count)]


def skipped_steps(run_dir: Path, outcome: ClusterOutcome) -> list[tuple[int, int]]:
    """Batches the run skipped: the agents' rollback ranges (etcd) and the guard's own skips (events)."""
    steps = {s for lo, hi in outcome.skip_ranges for s in range(lo, hi + 1)}
    # A guard skip counts only if it survived: a step redone after a restart ran clean (the fault
    # fires once), so the last execution of each step by rank 0 decides.
    last: dict[int, bool] = {}
    for e in read_run_events(run_dir):
        if e.get("kind") == "trainer.step" and e.get("source") == "trainer/rank0":
            last[int(e["step"])] = bool(e.get("skipped"))
    steps |= {step for step, skipped in last.items() if skipped}
    return [(s, s) for s in sorted(steps)]


def check(entry: dict[str, Any], outcome: ClusterOutcome, expect: Expectation,
          reference: str | None) -> dict[str, Any]:
    result = check_run(Path(entry["run_dir"]), expect, reference, outcome.rc, node_rcs=outcome.node_rcs,
                       wall_s=outcome.wall_s)
    return {**entry, "result": result}


def _choose(cfg: SuiteConfig, job: Job, quick: bool) -> tuple[list[Scenario], list[Scenario]]:
    scenarios = standard_scenarios(job.nodes, job.steps, job.interval, job.cfg.sdc.check_every,
                                   job.cfg.sdc.replay_every)
    wanted = cfg.only or (QUICK if quick else tuple(s.name for s in scenarios))
    unknown = sorted(set(wanted) - {s.name for s in scenarios})
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r} (known: {', '.join(s.name for s in scenarios)})")
    chosen = [s for s in scenarios if s.name in wanted]
    for s in chosen:
        s.skipped = _applicable(s, cfg, job)
        if s.name == "sdc" and not s.skipped:
            s.uncovered = sdc_uncovered(job.cfg, len(job.nodes))
    return [s for s in chosen if not s.skipped], [s for s in chosen if s.skipped]


def uncovered_result(s: Scenario) -> dict[str, Any]:
    """A scenario the job cannot pass, reported as failed with the reason (never as passed or skipped)."""
    inv = {"name": "sdc_detected", "ok": False, "detail": s.uncovered, "evidence": []}
    return {"name": s.name, "run_dir": None, "plan": [f.describe() for f in s.faults], "timed_out": False,
            "elapsed_s": 0.0, "node_rcs": {}, "skip_ranges": [], "reference": None, "not_covered": s.uncovered,
            "result": {"ok": False, "invariants": [inv], "faults": [], "launcher_rc": None, "last_step": 0,
                       "restarts": None, "final_checksum": None, "wall_s": 0.0, "productive_s": 0.0,
                       "goodput": 0.0}}


def needs_baseline(runnable: list[Scenario]) -> bool:
    """The fault-free run is only a reference: skipped when no chosen scenario compares weights with it."""
    return any(s.expect.bitwise for s in runnable)


def _launch_all(cfg: SuiteConfig, job: Job, runnable: list[Scenario], stamp: str, echo) -> dict[str, tuple]:
    jobs: list[tuple[Scenario | None, str]] = [(None, "baseline")] * needs_baseline(runnable) \
        + [(s, s.name) for s in runnable]
    done: dict[str, tuple] = {}
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        futures = {name: pool.submit(run_scenario, scenario, name, cfg, job, stamp) for scenario, name in jobs}
        for name, future in futures.items():
            done[name] = future.result()
            echo(f"  {name}: nodes rc={done[name][1].node_rcs} in {done[name][0]['elapsed_s']}s")
    return done


def _reference(s: Scenario, done: dict[str, tuple], baseline: str | None, cfg: SuiteConfig, job: Job,
               stamp: str, echo) -> tuple[str | None, dict[str, Any] | None]:
    """The checksum a scenario's weights must equal: the baseline's, or a replay's that skips the same batches."""
    if not s.replay:
        return baseline, None
    entry, outcome = done[s.name]
    skips = skipped_steps(Path(entry["run_dir"]), outcome)
    if not skips:
        return baseline, None
    replay_entry, replay_outcome = run_scenario(None, f"{s.name}-replay", cfg, job, stamp, skips)
    echo(f"  {s.name}-replay (fault-free, skipping {skips}): nodes rc={replay_outcome.node_rcs}")
    checked = check(replay_entry, replay_outcome, Expectation(steps=job.steps, bitwise=False,
                                                             note="fault-free replay"), None)
    return checked["result"]["final_checksum"], checked


def run_suite(cfg: SuiteConfig, quick: bool = False, echo=print) -> dict[str, Any]:
    """Baseline + scenarios (``cfg.jobs`` at a time), the checks, then JSON, timeline, HTML and the table."""
    from chaos.html import write_suite_html

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    job = resolve_job(cfg)
    chosen, skipped = _choose(cfg, job, quick)
    runnable, uncovered = [s for s in chosen if not s.uncovered], [s for s in chosen if s.uncovered]
    stamp = f"{int(time.time()) % 1000000:06d}"
    t0 = time.monotonic()
    echo(f"chaos suite: {job.config.name} ({job.cfg.workload().name if job.cfg.workload() else 'custom'}), "
         f"{'baseline + ' if needs_baseline(runnable) else ''}{len(runnable)} scenarios on {len(job.nodes)} nodes, {job.steps} steps, checkpoint every "
         f"{job.interval}; {len(skipped)} skipped" + (f", {len(uncovered)} not covered" if uncovered else ""))
    done = _launch_all(cfg, job, runnable, stamp, echo)
    results, replays, reference = [], [], None
    if "baseline" in done:
        base = check(*done["baseline"], Expectation(steps=job.steps, bitwise=False, note="reference run"), None)
        reference = base["result"]["final_checksum"]
        results.append(base)
    for s in runnable:
        ref, replay = _reference(s, done, reference, cfg, job, stamp, echo)
        replays += [replay] if replay else []
        results.append({**check(*done[s.name], s.expect, ref), "reference": "replay" if replay else "baseline"})
    for s in uncovered:
        echo(f"  {s.name}: {s.uncovered}")
        results.append(uncovered_result(s))
    failed = [r["name"] for r in results if not r["result"]["ok"]]
    report = {"job": str(job.config), "workload": job.cfg.workload().name if job.cfg.workload() else "custom",
              "nodes": len(job.nodes), "steps": job.steps, "checkpoint_interval": job.interval, "sets": cfg.sets,
              "etcd": cfg.etcd_endpoint or "chaos-started (loopback)", "jobs": cfg.jobs,
              "baseline_checksum": reference, "failed": failed,
              "ok": not failed and (reference is not None or not needs_baseline(runnable)),
              "skipped": [{"name": s.name, "reason": s.skipped} for s in skipped], "replays": replays,
              "elapsed_s": round(time.monotonic() - t0, 1), "scenarios": results}
    write_json(report, cfg.out_dir / "report.json")
    plot_timeline([r for r in results if r["run_dir"]], cfg.out_dir / "timeline.png")  # a run to draw
    html = write_suite_html(report, cfg.out_dir / "report.html", cfg.out_dir / "timeline.png")
    echo(format_table(results))
    for s in skipped:
        echo(f"skipped {s.name}: {s.skipped}")
    echo(f"suite {'passed' if report['ok'] else 'FAILED: ' + ', '.join(failed)} in {report['elapsed_s']}s; "
         f"report: {cfg.out_dir / 'report.json'}  html: {html}  timeline: {cfg.out_dir / 'timeline.png'}")
    return report
