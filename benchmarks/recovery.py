"""Recovery after a fault, several ways side by side in one run: same trainer, same fault, same host.

    python benchmarks/recovery.py --nodes 4 --trainer dit --fault kill_worker --json out.json
    python benchmarks/recovery.py --nodes 4 --workload byo --only torchrun_c10d --only inprocess
    python benchmarks/recovery.py --nodes 4 --workload dit,byo --only torchrun_c10d --only inprocess

``--workload NAME`` measures any registered workload (an entry point in ``elastic.workloads``, e.g.
the ``byo`` example of ``examples/byo`` once installed; put its install directory on PYTHONPATH if it
is not in the venv): ``mlp`` and ``dit`` are ``--trainer``'s; another one runs with its config
class's defaults under the sections of ``examples/mlp-tiny.yaml`` and needs ``steps`` and
``step_sleep`` fields (set from the flags), and the baseline runs its ``entry`` module.  Several
names (``--workload dit,byo``) measure each in turn in one invocation, on the same flags, and report
each one's figures under ``workloads`` with ``ratio_vs_first``: every workload's
``ratio_inprocess_vs_torchrun_c10d`` over the first one's (does a workload get the same fast path?).

Modes (each runs once fault-free, for its reference checksum, and once with the fault):
  torchrun_c10d  plain ``torchrun --rdzv-backend=c10d --max-restarts=3`` per simulated node (the
                 baseline): every worker restarts and resumes from the last disk checkpoint
  runtime_ckpt   this runtime with in-process recovery off: the run's epoch moves, every node
                 restarts through a new torchrun and resumes from the last checkpoint
  inprocess      this runtime's default: healthy workers re-form in-process, the dead worker's
                 slot goes to its node's warm spare, state comes from per-step memory snapshots
  replicas       torchft replica groups (``replicas.enabled``: trainer.ft_train for the MLP, trainer.dit_ft_train
                 for the DiT): the other groups keep training, the restarted group heals from a live peer

``--peer-failure hang`` runs every mode with ``ELASTIC_TEST_PEER_FAILURE=hang``: a collective whose
peer died blocks instead of raising, as NCCL's does, so the in-process mode recovers only through
the pushed fault (plain torchrun's agents do not depend on a collective raising: they restart on
the rendezvous).  ``breakdown.abort_s`` is then the fault's push -> the last survivor unwound.

The in-process mode's fault waits, beyond ``--kill-at``, until every node's warm spare has imported
(7-10 s of 2 shared cores for the DiT), as a fault hours into a run finds them; ``--cold-spares``
measures the fault that lands while they still import.

Faults: ``kill_worker`` SIGKILLs rank 1's worker; ``kill_node`` SIGKILLs the last node whole (agent
or torchrun, and its workers), with an elastic range of nodes-1:nodes so the run goes on without it.
Both land once the run has committed step ``--kill-at``.

Measured per mode, from the trainers' event logs:
  recovery_s       fault -> the next step committed by a worker that restarted or re-formed after it
  steps_lost       steps redone (last step committed before the fault minus the step resumed from)
                   plus steps thrown away (replicas: uncommitted)
  checksum_equal   final weights bitwise equal to the same mode's fault-free run (a lost node changes
                   the world size, and with it the reduction order: expect false there; so does
                   replicas, whose survivors train some steps with fewer groups)
  goodput          steps of the final trajectory x the median step time, over the wall time
  wall_s           launch -> every process exited
Top level: ``ratio_inprocess_vs_torchrun_c10d`` and ``ratio_replicas_vs_torchrun_c10d`` (recovery_s),
``snapshot_step_ratio``: the in-process mode's median step interval (rank 0, step to step, so the
snapshot's copy on the training thread counts) after steps with a snapshot over after steps without,
fault-free, in ``--snapshot-ab-runs`` runs of ``--snapshot-ab-steps`` steps that alternate blocks of
``--snapshot-ab-block`` steps with and without (``agent.inprocess.snapshot_ab_block``), counted from
the step after every node's warm spare has finished importing (details under ``snapshot_overhead``;
``--snapshot-pairs`` adds the older comparison of separate runs); ``inprocess_vs_runtime_ckpt_step_ratio``
(the same interval, in-process mode over in-process off); the load average before and after.  Prints one JSON object; ``--json PATH`` writes it too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from recovery_torchrun import env, make_config, run_c10d_nodes, wait_step  # noqa: E402

from elastic.common.config import ConfigError  # noqa: E402
from elastic.common.events import read_run_events  # noqa: E402
from elastic.run import workloads  # noqa: E402
from elastic.common.procs import descendants  # noqa: E402
from elastic.worker.faultwatch import PEER_FAILURE_ENV  # noqa: E402
from elastic.worker.inprocess import ab_snapshot_step  # noqa: E402

MODES = ("torchrun_c10d", "runtime_ckpt", "inprocess", "replicas")
ENTRY = {"mlp": "trainer.train", "dit": "trainer.dit_train"}
# join_timeout_ms above a DiT step on a loaded host: a healthy group left out of a quorum at the same step
# as the groups that train without it would diverge from them (torchft compares step counts only).
REPLICA_OVERRIDES = {"replicas.enabled": True, "replicas.heartbeat_timeout_ms": 1000, "replicas.join_timeout_ms": 2000}
# The diag screen (before joining, and after a worker_signal failure) is a policy of the runtime
# modes, not part of the recovery mechanism; plain torchrun has none.  Off unless --preflight.
NO_PREFLIGHT = {"agent.preflight.enabled": False}
NO_INPROCESS = {"agent.inprocess.enabled": False}


# -- faults -------------------------------------------------------------------------------------
def _victim(run_dir: Path, args, procs: list[subprocess.Popen], source: str) -> dict:
    if args.mode == "inprocess" and not args.cold_spares:
        _wait_spares_warm(run_dir, args.nodes, procs)
    return wait_step(run_dir, args.kill_at, procs, source=source)


def _wait_spares_warm(run_dir: Path, nodes: int, procs: list[subprocess.Popen], timeout: float = 180.0) -> None:
    """Until every node's spare has imported (a fault hours into a run finds them warm; one 5 s in,
    at --kill-at 40, found them still importing, which the recovery then waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if spare_nodes(run_dir) >= nodes and spares_warm(run_dir) is not None:
            return
        time.sleep(0.2)


def kill_worker(run_dir: Path, args, procs: list[subprocess.Popen], source: str, node_procs=None) -> float:
    victim = _victim(run_dir, args, procs, source)
    kill_ts = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    return kill_ts


def kill_node(run_dir: Path, args, procs: list[subprocess.Popen], source: str, node_procs=None) -> float:
    """SIGKILL the last node whole: its agent (runtime modes) or torchrun (baseline), and everything below.

    The last one, because the baseline's c10d store lives in the torchrun that started first: losing
    that host ends a c10d run outright (the single point of failure an etcd store does not have)."""
    _victim(run_dir, args, procs, source)
    root = node_procs[-1].pid if node_procs is not None else _agent_pid(run_dir, f"node{args.nodes - 1}")
    tree = [root, *descendants(root)]
    kill_ts = time.time()
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return kill_ts


def _agent_pid(run_dir: Path, node: str) -> int:
    return next(e["pid"] for e in read_run_events(run_dir) if e["source"] == f"agent/{node}" and e["kind"] == "agent.start")


FAULTS = {"kill_worker": kill_worker, "kill_node": kill_node}


# -- runs -----------------------------------------------------------------------------------------
def overrides(args, mode: str) -> dict:
    extra: dict = {} if args.preflight else dict(NO_PREFLIGHT)
    if args.workload == "dit":
        extra.update({"launch.workload": "dit", "trainer.global_batch_size": 12})
    if args.fault == "kill_node":
        extra["launch.nodes"] = f"{args.nodes - 1}:{args.nodes}"
    if mode == "runtime_ckpt":
        extra.update(NO_INPROCESS)
    if mode == "replicas":
        extra.update(REPLICA_OVERRIDES)
    return extra


def run_mode(args, work: Path, mode: str, faulty: bool, extra: dict | None = None, tag: str = "") -> dict:
    args.mode = mode
    name = f"{mode}-{'fault' if faulty else 'clean'}{tag}"
    run_dir = work / name
    config = make_config(args, run_dir, f"bench-{name}", {**overrides(args, mode), **(extra or {})}, trainer=args.trainer,
                         base=workload_base(args.workload, work))
    source = "trainer/node1/rank0" if mode == "replicas" else "trainer/rank1"
    fault = FAULTS[args.fault] if faulty else None
    started = time.time()
    if mode == "torchrun_c10d":
        nnodes = f"{args.nodes - 1}:{args.nodes}" if args.fault == "kill_node" else str(args.nodes)
        kill_ts, rc = run_c10d_nodes(args, f"bench-{name}", config, run_dir, work / f"{name}.log",
                                     lambda procs: fault(run_dir, args, procs, source, procs) if fault else None,
                                     entry=workload_entry(args.workload), nnodes=nnodes)
    else:
        kill_ts, rc = run_launcher(config, work / f"{name}.log", run_dir, args, fault, source)
    out = measure(read_run_events(run_dir), kill_ts, started, time.time(), args.nodes) if faulty else \
        clean_measure(read_run_events(run_dir), started, time.time())
    out["rc"] = rc
    out["final_checksum"] = checksum(run_dir)
    if faulty and mode == "inprocess" and out.get("breakdown") and kill_ts is not None:
        # A fault before the spare has imported torch._dynamo makes it finish that import first
        # (~1 s of a DiT worker loss at step 40 here): say which case this run measured.
        out["breakdown"]["spare_warm_at_fault"] = assigned_spare_warm(run_dir, kill_ts)
    return out


def workload_base(name: str, work: Path) -> Path | None:
    """The base config of a workload other than mlp and dit: the sections of ``examples/mlp-tiny.yaml``
    with ``launch.workload`` set and the workload's own trainer defaults (None: mlp and dit keep theirs)."""
    if name in ENTRY:
        return None
    data = yaml.safe_load((REPO / "examples" / "mlp-tiny.yaml").read_text())
    data["launch"]["workload"], data["trainer"] = name, {}
    path = work / f"base-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def workload_entry(name: str) -> str:
    """The module plain torchrun runs for the baseline."""
    return ENTRY.get(name) or workloads.get(name).entry


def run_launcher(config: Path, log_path: Path, run_dir: Path, args, fault, source: str) -> tuple[float | None, int]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch", str(config)], env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        kill_ts = fault(run_dir, args, [proc], source) if fault else None
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return kill_ts, proc.returncode


def checksum(run_dir: Path) -> str | None:
    files = sorted(run_dir.glob("final_checksum*.txt"))
    return files[0].read_text().strip() if files else None


# -- measurement ------------------------------------------------------------------------------------
RANK0 = ("trainer/rank0", "trainer/node0/rank0")


def _median_step(steps: list[dict]) -> float:
    ref = [e["step_time"] for e in steps if e["source"] in RANK0]
    return statistics.median(ref) if ref else 0.0


def _median_interval(steps: list[dict]) -> float:
    """Rank 0's median time from one committed step's event to the next: unlike ``step_time`` it
    includes what runs between steps on the training thread (a snapshot's copy, a save's staging)."""
    ts = sorted(e["ts"] for e in steps if e["source"] in RANK0)
    return statistics.median(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 1 else 0.0


def clean_measure(events: list[dict], started: float, ended: float) -> dict:
    steps = [e for e in events if e["kind"] == "trainer.step" and e.get("committed", True)]
    done = [e["snapshot"] for e in events if e["kind"] == "trainer.done" and e.get("snapshot")]
    return {"median_step_s": round(_median_step(steps), 5), "median_interval_s": round(_median_interval(steps), 5),
            "wall_s": round(ended - started, 2), "completed": max((e["step"] for e in steps), default=0),
            **({"snapshot_costs_rank0": done[0]} if done else {})}


def snapshot_overhead(args, work: Path) -> dict:
    """What per-step snapshots cost a step, fault-free, in the in-process mode.

    Interleaved (the figure): ``--snapshot-ab-runs`` runs with ``agent.inprocess.snapshot_ab_block``
    set, so snapshots are on and off in alternate blocks of steps of the *same* run: both sides share
    the host's load (its drift between runs -- a spare importing torch, another process -- moved
    separate runs by more than the effect: pairs of runs measured 0.93-1.29).  Rank 0's step-to-step
    intervals after a step with a snapshot over those after one without, pooled over the runs.
    Optional ``--snapshot-pairs``: separate runs with snapshots off and on, alternating."""
    out: dict = {"method": "interleaved" if args.snapshot_ab_runs else "pairs"}
    if args.snapshot_ab_runs:
        out["interleaved"] = interleaved(args, work)
    if args.snapshot_pairs:
        out["pairs"] = separate_pairs(args, work)
    key = "interleaved" if args.snapshot_ab_runs else "pairs"
    out["ratio"] = out[key]["ratio"] if key in out else None
    return out


def interleaved(args, work: Path) -> dict:
    block = args.snapshot_ab_block
    runs, on, off = [], [], []
    for i in range(args.snapshot_ab_runs):
        run_dir = work / f"inprocess-clean-ab{i}"
        run = run_mode(args, work, "inprocess", False, {"agent.inprocess.snapshot_ab_block": block,
                                                         "trainer.steps": args.snapshot_ab_steps}, tag=f"-ab{i}")
        events = read_run_events(run_dir)
        warm = spares_warm(run_dir)
        split = ab_intervals(events, block, after_ts=warm or 0.0)
        on += split["on"]
        off += split["off"]
        runs.append({"on_interval_s": _median(split["on"]), "off_interval_s": _median(split["off"]),
                     "ratio": _ratio(split["on"], split["off"]), "intervals": [len(split["on"]), len(split["off"])],
                     "from_step": first_step_after(events, warm), "spares_warm": warm is not None,
                     "completed": run["completed"], "snapshot_costs_rank0": run.get("snapshot_costs_rank0")})
    return {"block_steps": block, "steps": args.snapshot_ab_steps, "runs": runs, "on_interval_s": _median(on),
            "off_interval_s": _median(off), "ratio": _ratio(on, off)}


def assigned_spare_warm(run_dir: Path, kill_ts: float) -> bool | None:
    """Whether the spare that took the dead worker's slot had finished warming by the fault (None: no
    spare took a slot, e.g. after a node loss)."""
    for log in run_dir.glob("torchrun/*/*/spare-*.log"):
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        if any(line.get("spare") == "assigned" for line in lines):
            return any(line.get("spare") == "warm" and line.get("ts", kill_ts + 1) <= kill_ts for line in lines)
    return None


def spare_logs(run_dir: Path) -> list[Path]:
    """The spares' logs (not their zygote's: ``spare-zygote-*.log`` stays empty unless it fails)."""
    return [p for p in run_dir.glob("torchrun/*/*/spare-*.log") if not p.name.startswith("spare-zygote-")]


def _started_ms(log: Path) -> int:
    """``spare-<ms>.log``: when the agent started that spare."""
    return int(log.stem.rsplit("-", 1)[-1])


def spare_nodes(run_dir: Path) -> int:
    """How many nodes have started a spare."""
    return len({log.parts[-3] for log in spare_logs(run_dir)})


def spares_warm(run_dir: Path) -> float | None:
    """When the last node's spare finished importing (its ``"warm"`` line) and, with the spare zygote
    (``agent.inprocess.spare_fork``), the last zygote was ready (``agent.spare_zygote_ready``: it
    imports the same beside the node's first spare); None if a spare never did.

    Each agent starts its spare once training runs; until it has imported torch, the trainer and
    torch._dynamo (7-10 s of 2 shared cores here, ~60-80 DiT steps) it takes CPU from the
    ranks unevenly, and an A/A run (no snapshots on either side) read 1.005 and 1.058.  (Until this
    read the zygote's log too, whose missing ``"warm"`` line made every run since the zygote count
    nothing.)"""
    warm = []
    newest: dict[Path, Path] = {}  # per node and attempt: the spare it holds now (a spare still importing
    for log in sorted(spare_logs(run_dir), key=_started_ms):  # when the zygote was ready gave way to a fork)
        newest[log.parent] = log
    for log in newest.values():
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        marks = [line["ts"] for line in lines if line.get("spare") == "warm" and "ts" in line]
        if not marks:
            return None
        warm.append(marks[0])
    zygotes = [e["ts"] for e in read_run_events(run_dir) if e["kind"] == "agent.spare_zygote_ready"]
    return max(warm + zygotes) if warm else None


def first_step_after(events: list[dict], ts: float | None) -> int | None:
    steps = [e["step"] for e in events if e["kind"] == "trainer.step" and e["source"] in RANK0
             and (ts is None or e["ts"] >= ts)]
    return min(steps) if steps else None


def ab_intervals(events: list[dict], block: int, after_ts: float = 0.0) -> dict[str, list[float]]:
    """Rank 0's intervals from step s's event to s+1's, split by whether s was snapshotted (its copy
    runs right after s, its push beside s+1).  Left out: the first on/off cycle (it holds the first
    step and the snapshot tree's one-time check against DCP's) and every step before ``after_ts``
    (the spares' imports: :func:`spares_warm`)."""
    ts = {e["step"]: e["ts"] for e in events if e["kind"] == "trainer.step" and e["source"] in RANK0
          and e.get("committed", True)}
    split: dict[str, list[float]] = {"on": [], "off": []}
    for step in sorted(ts):
        if step > 2 * block and step + 1 in ts and ts[step] >= after_ts:
            split["on" if ab_snapshot_step(step, block) else "off"].append(ts[step + 1] - ts[step])
    return split


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 5) if values else None


def _ratio(on: list[float], off: list[float]) -> float | None:
    return round(statistics.median(on) / statistics.median(off), 4) if on and off else None


def separate_pairs(args, work: Path) -> dict:
    """Fault-free runs with snapshots off, then on, alternating: ratio of the median step intervals."""
    pairs = []
    for i in range(args.snapshot_pairs):
        off = run_mode(args, work, "inprocess", False, {"agent.inprocess.snapshots": False}, tag=f"-nosnap{i}")
        on = run_mode(args, work, "inprocess", False, tag=f"-snap{i}")
        pairs.append({"off_interval_s": off["median_interval_s"], "on_interval_s": on["median_interval_s"],
                      "off_step_s": off["median_step_s"], "on_step_s": on["median_step_s"],
                      "ratio": round(on["median_interval_s"] / off["median_interval_s"], 4),
                      "capture_ms_median_rank0": on.get("snapshot_costs_rank0", {}).get("capture_ms_median"),
                      "push_ms_median_rank0": on.get("snapshot_costs_rank0", {}).get("push_ms_median")})
    return {"pairs": pairs, "ratio": round(statistics.median(p["ratio"] for p in pairs), 3) if pairs else None}


def measure(events: list[dict], kill_ts: float, started: float, ended: float, nodes: int) -> dict:
    steps = sorted((e for e in events if e["kind"] == "trainer.step"), key=lambda e: e["ts"])
    committed = [e for e in steps if e.get("committed", True)]
    last_before = max(e["step"] for e in committed if e["ts"] <= kill_ts)
    # Workers that (re)started or re-formed after the fault; their first committed step after that ends
    # recovery.  A survivor re-forms in the same process, so a step it committed after the kill but before
    # it noticed (the dead rank had already done its part of that step's collectives) does not count.
    came_back = [e for e in events if e["kind"] in ("trainer.start", "trainer.recovered") and e["ts"] > kill_ts]
    back_at: dict[int, float] = {}
    for e in came_back:
        back_at[e["pid"]] = min(back_at.get(e["pid"], e["ts"]), e["ts"])
    after = [e for e in committed if e["ts"] > kill_ts
             and (e["ts"] > back_at.get(e["pid"], float("inf")) or e.get("participants", nodes) < nodes)]
    resumed = min((e["step"] for e in came_back if e.get("mode") != "replicas"), default=None)
    discarded = {e["step"] for e in steps if not e.get("committed", True) and e["ts"] > kill_ts}
    redone = (last_before - resumed) if resumed is not None else 0
    wall = ended - started
    median = _median_step(committed)
    paths = sorted({e.get("path", "restart") for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts})
    return {
        "recovery_s": round(after[0]["ts"] - kill_ts, 3) if after else None,
        **({"breakdown": breakdown(events, kill_ts, after[0]["ts"])} if after else {}),
        "steps_lost": redone + len(discarded),
        "last_step_before_fault": last_before,
        "resumed_from": resumed,
        "goodput": round(len({e["step"] for e in committed}) * median / wall, 4) if wall > 0 else None,
        "median_step_s": round(median, 5),
        "wall_s": round(wall, 2),
        "completed": max((e["step"] for e in committed), default=0),
        "restarted_processes": len({e["pid"] for e in events if e["kind"] == "trainer.start" and e["ts"] > kill_ts}),
        "recovered_in_process": paths == ["inprocess"],
    }


def breakdown(events: list[dict], kill_ts: float, first_step_ts: float) -> dict | None:
    """Where an in-process recovery's time went, from the workers' events (seconds after the kill):
    the first survivor's notice, each phase's slowest rank (teardown of the old process groups, the
    etcd generation round, new process groups, model/FSDP build, restore from memory), the last
    rank's ``trainer.recovered``, then the first committed step."""
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts and e.get("phases")]
    if not recovered:
        return None
    noticed = [e["ts"] for e in events if e["kind"] == "trainer.peer_lost" and e["ts"] > kill_ts]
    phases: dict[str, float] = {}
    for e in recovered:
        for name, value in e["phases"].items():
            phases[name] = max(phases.get(name, 0.0), value)
    last = max(e["ts"] for e in recovered)
    pushed = [e["ts"] for e in events if e["kind"] == "agent.fault_pushed" and e["ts"] > kill_ts]
    unwound = [e["fault_to_unwound_s"] for e in recovered if e.get("fault_to_unwound_s") is not None]
    return {"noticed_s": round(min(noticed) - kill_ts, 3) if noticed else None,
            "pushed_s": round(min(pushed) - kill_ts, 3) if pushed else None,
            "abort_s": round(max(unwound), 3) if unwound else None,
            "unwound_by": sorted({e["unwound_by"] for e in recovered if e.get("unwound_by")}),
            "phases_slowest_rank_s": {k: round(v, 3) for k, v in phases.items()},
            "all_recovered_s": round(last - kill_ts, 3),
            "first_step_after_recovered_s": round(first_step_ts - last, 3),
            "spare_joined": any(e["kind"] == "trainer.start" and e["ts"] > kill_ts for e in events)}


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--trainer", choices=sorted(ENTRY), default="mlp")
    p.add_argument("--workload", help="any registered workload by name (mlp, dit, byo, ...); default: --trainer's")
    p.add_argument("--fault", choices=sorted(FAULTS), default="kill_worker")
    p.add_argument("--steps", type=int, default=0, help="default: 300 (mlp), 120 (dit)")
    p.add_argument("--interval", type=int, default=10, help="disk checkpoint interval")
    p.add_argument("--kill-at", type=int, default=0, help="default: 100 (mlp), 40 (dit)")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--preflight", action="store_true", help="keep the agents' diag screens on")
    p.add_argument("--cold-spares", action="store_true",
                   help="in-process mode: fault at --kill-at even while the warm spares still import "
                        "(default: wait until every spare is warm, as hours into a run)")
    p.add_argument("--peer-failure", choices=("raise", "hang"), default="raise",
                   help="hang: collectives whose peer died block (NCCL's behaviour) instead of raising (gloo's)")
    p.add_argument("--keep", help="keep run directories here instead of a temporary directory")
    p.add_argument("--only", choices=MODES, action="append")
    p.add_argument("--snapshot-ab-runs", type=int, default=3,
                   help="fault-free in-process runs with snapshots in alternate blocks, for snapshot_step_ratio "
                        "(0: skip)")
    p.add_argument("--snapshot-ab-block", type=int, default=10, help="steps per block of those runs")
    p.add_argument("--snapshot-ab-steps", type=int, default=0,
                   help="steps of each of those runs (default: 400 (mlp), 300 (dit): the comparison starts once "
                        "every warm spare has imported, ~80 steps in)")
    p.add_argument("--snapshot-pairs", type=int, default=0,
                   help="also: pairs of separate fault-free runs with snapshots off / on")
    p.add_argument("--json", dest="json_path", help="also write the JSON object to this file")
    args = p.parse_args(argv)
    args.workload = args.workload or args.trainer
    if args.workload in ENTRY:
        args.trainer = args.workload
    else:
        try:
            workloads.get(args.workload)
        except ConfigError as exc:  # an unknown name: the list of registered ones
            p.error(str(exc))
    mlp = args.workload == "mlp"  # another workload is timed as the DiT is
    args.steps = args.steps or (300 if mlp else 120)
    args.kill_at = args.kill_at or (100 if mlp else 40)
    args.snapshot_ab_steps = args.snapshot_ab_steps or (400 if mlp else 300)
    return args


def main(argv: list[str] | None = None) -> int:
    names = _workload_list(argv)
    if len(names) > 1:
        return compare(argv or sys.argv[1:], names)
    args = parse_args(argv)
    if args.peer_failure == "hang":
        os.environ[PEER_FAILURE_ENV] = "hang"  # every launched process inherits it (recovery_torchrun.env)
    modes = list(args.only or MODES)
    load_before = load_avg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            clean = run_mode(args, work, mode, faulty=False)
            result = run_mode(args, work, mode, faulty=True)
            result["checksum_equal"] = bool(result["final_checksum"]) and result["final_checksum"] == clean["final_checksum"]
            result["fault_free"] = clean
            results[mode] = result
        measured = "inprocess" in modes and (args.snapshot_ab_runs or args.snapshot_pairs)
        overhead = snapshot_overhead(args, work) if measured else None
    report = {
        "benchmark": "recovery",
        "setup": {"nodes": args.nodes, "nproc_per_node": 1, "trainer": args.workload, "workload": args.workload,
                  "fault": args.fault,
                  "steps": args.steps, "ckpt_interval": args.interval, "kill_at_step": args.kill_at,
                  "step_sleep_s": args.step_sleep, "backend": "gloo/cpu", "cpus": os.cpu_count(),
                  "preflight_screens": args.preflight, "peer_failure": args.peer_failure,
                  "spares_warm_at_fault": not args.cold_spares},
        "load_avg_1m": {"before": load_before, "after": load_avg()},
        **results,
    }
    report.update(ratios(results))
    if overhead is not None:
        report["snapshot_overhead"] = overhead
        report["snapshot_step_ratio"] = overhead["ratio"]
    _emit(report, args.json_path)
    return 0


def _emit(report: dict, json_path: str | None) -> None:
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def _workload_list(argv: list[str] | None) -> list[str]:
    """The names of ``--workload a,b``: one (or none) for a plain run."""
    return [n for n in (_flag(argv if argv is not None else sys.argv[1:], "--workload") or "").split(",") if n]


def compare(argv: list[str], names: list[str]) -> int:
    """Each workload's run of the same flags, one after the other (never two at once: the cores
    are shared), its report under ``workloads``; ``ratio_vs_first`` compares their recoveries."""
    load_before = load_avg()
    rest = _drop(_drop(argv, "--workload"), "--json")
    reports: dict[str, dict] = {}
    for name in names:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            main([*rest, "--workload", name])
        reports[name] = json.loads(out.getvalue())
    first = reports[names[0]].get("ratio_inprocess_vs_torchrun_c10d")
    ratio_vs_first = {n: round(r["ratio_inprocess_vs_torchrun_c10d"] / first, 3)
                      for n, r in reports.items() if first and r.get("ratio_inprocess_vs_torchrun_c10d")}
    _emit({"benchmark": "recovery", "workloads": reports, "ratio_vs_first": ratio_vs_first,
           "load_avg_1m": {"before": load_before, "after": load_avg()}}, _flag(argv, "--json"))
    return 0


def _drop(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if not skip and a != flag and not a.startswith(flag + "="):
            out.append(a)
        skip = a == flag
    return out


def _flag(argv: list[str], flag: str) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(flag, default=None)
    return vars(pre.parse_known_args(argv)[0])[flag.lstrip("-").replace("-", "_")]


def ratios(results: dict[str, dict]) -> dict:
    out: dict = {}
    a, i, r = results.get("torchrun_c10d"), results.get("inprocess"), results.get("runtime_ckpt")
    if a and i and a.get("recovery_s") and i.get("recovery_s"):
        out["ratio_inprocess_vs_torchrun_c10d"] = round(i["recovery_s"] / a["recovery_s"], 3)
    replicas = results.get("replicas")
    if a and replicas and a.get("recovery_s") and replicas.get("recovery_s"):
        out["ratio_replicas_vs_torchrun_c10d"] = round(replicas["recovery_s"] / a["recovery_s"], 3)
    if i and r and r["fault_free"]["median_interval_s"]:
        # The whole default path's cost in steady state (snapshots, agent supervision) over in-process off.
        out["inprocess_vs_runtime_ckpt_step_ratio"] = round(
            i["fault_free"]["median_interval_s"] / r["fault_free"]["median_interval_s"], 3)
    return out


if __name__ == "__main__":
    sys.exit(main())
