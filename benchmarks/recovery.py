"""Recovery after a worker SIGKILL, three ways side by side in one run, same trainer workload and fault.

    python benchmarks/recovery.py --nodes 4

  (a) torchrun_c10d   plain ``torchrun --rdzv-backend=c10d --max-restarts=3`` per simulated node;
                      every worker restarts and resumes from the last DCP checkpoint (baseline)
  (b) runtime_ckpt    this runtime (elastic-launch, etcd rendezvous): the failed node's agent
                      bumps the run epoch, every node restarts and resumes from the last checkpoint
  (c) replicas        this runtime in replica-group mode (torchft 0.2.0): one replica group per
                      node; the failed group restarts alone and heals from a live peer, the
                      others keep training with a smaller quorum

The workload is the MLP of ``trainer.train`` (``trainer.ft_train`` for (c): same model, same
batches, same optimizer); ``--nodes`` simulated nodes with one worker each, gloo on CPU.  The
fault: SIGKILL of the worker of node 1 once it has committed step ``--kill-at``.

Measured per mode, from the trainers' event logs:
  recovery_s         SIGKILL -> the next committed step of the run (any worker still or again training)
  progress_s         SIGKILL -> the first committed step numbered past the last one before the kill
  steps_lost         steps whose work was redone (resumed from an older checkpoint) or thrown away
                     (a survivor's uncommitted step) because of the fault
  goodput            committed useful step time / wall time: steps of the final trajectory x the
                     run's median step time, over launch -> exit
  wall_s             launch -> every process exited
Prints one JSON object, with the ratios (c)/(a) and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from recovery_torchrun import env, make_config, run_c10d_nodes, wait_step

from elastic.common.events import read_run_events

REPLICA_OVERRIDES = {"replicas.enabled": True,
                     "replicas.heartbeat_timeout_ms": 1000, "replicas.join_timeout_ms": 500}
# The diag screen (before joining, and again after a worker_signal failure) is a policy of both
# runtime modes, not part of the recovery mechanism; plain torchrun has none.  Off unless --preflight.
NO_PREFLIGHT = {"agent.preflight.enabled": False}


def _kill(run_dir: Path, args, procs: list[subprocess.Popen], source: str) -> tuple[float, dict]:
    victim = wait_step(run_dir, args.kill_at, procs, source=source)
    kill_ts = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    return kill_ts, victim


def run_c10d(args, work: Path) -> dict:
    run_dir = work / "torchrun_c10d"
    config = make_config(args, run_dir, "bench-a")
    started = time.time()
    (kill_ts, victim), rcs = run_c10d_nodes(args, "bench-a", config, run_dir, work / "torchrun_c10d.log",
                                            lambda procs: _kill(run_dir, args, procs, "trainer/rank1"))
    out = measure(read_run_events(run_dir), kill_ts, victim, started, time.time(), reference="trainer/rank0",
                  nodes=args.nodes)
    out["rc"] = rcs
    return out


def run_launcher(args, work: Path, name: str, extra: dict | None, victim_source: str, reference: str) -> dict:
    run_dir = work / name
    config = make_config(args, run_dir, f"bench-{name}", extra)
    started = time.time()
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch", str(config)], env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        kill_ts, victim = _kill(run_dir, args, [proc], victim_source)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    out = measure(read_run_events(run_dir), kill_ts, victim, started, time.time(), reference=reference,
                  nodes=args.nodes)
    out["rc"] = proc.returncode
    checksums = sorted(run_dir.glob("final_checksum*.txt"))
    out["final_checksums"] = {p.name: p.read_text().strip()[:16] for p in checksums}
    return out


def measure(events: list[dict], kill_ts: float, victim: dict, started: float, ended: float, reference: str,
            nodes: int) -> dict:
    steps = sorted((e for e in events if e["kind"] == "trainer.step"), key=lambda e: e["ts"])
    committed = [e for e in steps if e.get("committed", True)]
    before = [e for e in committed if e["ts"] <= kill_ts]
    last_before = max(e["step"] for e in before)
    # A fresh process (restart) started after the kill: the step it resumed from tells the redo.
    restarted = [e for e in events if e["kind"] == "trainer.start" and e["ts"] > kill_ts]
    new_pids = {e["pid"] for e in restarted}
    # The run trains again once a restarted worker commits, or (replica groups) once a quorum
    # without the dead group commits; a step the old quorum finished just after the kill is neither.
    after = [e for e in committed if e["ts"] > kill_ts
             and (e["pid"] in new_pids or e.get("participants", nodes) < nodes)]
    resumed_from = min((e["step"] for e in restarted if e.get("mode") != "replicas"), default=None)
    discarded = {e["step"] for e in steps if not e.get("committed", True) and e["ts"] > kill_ts}
    redone = (last_before - resumed_from) if resumed_from is not None else 0
    ref = [e for e in committed if e["source"] == reference]
    # Each committed step number once: a redone step counts once, and so does a step every
    # replica group committed together (their work is one data-parallel step).
    trajectory = {e["step"] for e in committed}
    median_step = statistics.median(e["step_time"] for e in ref) if ref else 0.0
    wall = ended - started
    progress = next((e for e in after if e["step"] > last_before), None)
    # (A survivor may heal too: torchft commits per group, so one group can be a step ahead.)
    healed = [e for e in events if e["kind"] == "trainer.healed" and e["pid"] in new_pids]
    return {
        "recovery_s": round(after[0]["ts"] - kill_ts, 3) if after else None,
        "progress_s": round(progress["ts"] - kill_ts, 3) if progress else None,
        "steps_lost": redone + len(discarded),
        "steps_redone": redone,
        "steps_discarded": len(discarded),
        "last_step_before_kill": last_before,
        "goodput": round(len(trajectory) * median_step / wall, 4) if wall > 0 else None,
        "median_step_s": round(median_step, 4),
        "wall_s": round(wall, 2),
        "completed": max((e["step"] for e in committed), default=0),
        "restarted_processes": len({e["pid"] for e in restarted}),
        "rejoined_by_healing_at_step": healed[0]["to_step"] if healed else None,
    }


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--interval", type=int, default=10, help="checkpoint interval of (a) and (b)")
    p.add_argument("--kill-at", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--preflight", action="store_true", help="keep the agents' diag screens on in (b) and (c)")
    p.add_argument("--keep", help="keep run directories here instead of a temporary directory")
    p.add_argument("--only", choices=["torchrun_c10d", "runtime_ckpt", "replicas"], action="append")
    args = p.parse_args()
    modes = args.only or ["torchrun_c10d", "runtime_ckpt", "replicas"]
    screen = {} if args.preflight else NO_PREFLIGHT
    load_before = load_avg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery3-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            if mode == "torchrun_c10d":
                results[mode] = run_c10d(args, work)
            elif mode == "runtime_ckpt":
                results[mode] = run_launcher(args, work, mode, {**screen}, "trainer/rank1", "trainer/rank0")
            else:
                results[mode] = run_launcher(args, work, mode, {**REPLICA_OVERRIDES, **screen},
                                             "trainer/node1/rank0", "trainer/node0/rank0")
    a, c = results.get("torchrun_c10d"), results.get("replicas")
    report = {
        "benchmark": "recovery_three_ways",
        "setup": {"nodes": args.nodes, "nproc_per_node": 1, "steps": args.steps, "ckpt_interval": args.interval,
                  "kill_at_step": args.kill_at, "step_sleep_s": args.step_sleep, "backend": "gloo/cpu",
                  "cpus": os.cpu_count(), "torchft": _torchft_version(),
                  "preflight_screens": args.preflight},
        "load_avg_1m": {"before": load_before, "after": load_avg()},
        **results,
    }
    if a and c and a["recovery_s"] and c["recovery_s"]:
        report["replicas_over_c10d"] = {
            "recovery_s": round(c["recovery_s"] / a["recovery_s"], 3),
            "progress_s": round(c["progress_s"] / a["progress_s"], 3) if a["progress_s"] and c["progress_s"] else None,
            "goodput": round(c["goodput"] / a["goodput"], 3) if a["goodput"] else None,
        }
        report["target_met"] = {"recovery_le_half_of_c10d": c["recovery_s"] <= 0.5 * a["recovery_s"],
                                "steps_lost_le_1": c["steps_lost"] <= 1}
    print(json.dumps(report, indent=1))
    return 0


def _torchft_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
