"""Launch -> first committed step: this runtime (with its pre-flight screen) vs plain torchrun.

    python benchmarks/startup.py --nodes 4 --json startup.json

Same trainer, same config, same number of simulated nodes on this host, measured in one run:
  torchrun_c10d    one plain ``torchrun --rdzv-backend=c10d`` per node, no screen (the baseline)
  runtime          ``elastic-launch`` with the default quick screen on every node
  runtime_noscreen ``elastic-launch`` with ``agent.preflight.enabled: false`` (for reference)
Each is run ``--repeats`` times, alternating, and the medians are compared.  The clock starts when
the command is started and stops at the first ``trainer.step`` event (every rank commits step 1
together).  Prints one JSON object with ``ratio_runtime_vs_torchrun`` at the top level; ``--json
PATH`` writes it too.
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

from recovery_torchrun import StepTail, env, make_config, run_c10d_nodes  # noqa: E402

from elastic.common.procs import descendants, terminate_tree  # noqa: E402

ENTRY = {"mlp": "trainer.train", "dit": "trainer.dit_train"}


def first_step(run_dir: Path, started: float, timeout: float = 300, procs: list[subprocess.Popen] = ()) -> float:
    deadline = time.monotonic() + timeout
    tail, first = StepTail(run_dir), None
    while time.monotonic() < deadline:
        steps = [e["ts"] for e in tail.new_steps()]
        first = min([*steps, first] if first is not None else steps, default=None)
        if first is not None:
            return round(first - started, 3)
        if procs and all(p.poll() is not None for p in procs):
            raise RuntimeError(f"{run_dir.name}: every process ended before the first step")
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir.name}: no step within {timeout}s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            terminate_tree(p.pid, descendants(p.pid), grace=3)


def run_torchrun(args, work: Path, name: str) -> float:
    run_dir = work / name
    config = make_config(args, run_dir, name, trainer=args.trainer)
    started = time.time()
    (elapsed, _rcs) = run_c10d_nodes(args, name, config, run_dir, work / f"{name}.log",
                                     lambda procs: (first_step(run_dir, started, procs=procs), _stop(procs))[0],
                                     entry=ENTRY[args.trainer])
    return elapsed


def run_runtime(args, work: Path, name: str, screen: bool) -> float:
    run_dir = work / name
    extra = {} if screen else {"agent.preflight.enabled": False}
    if args.trainer == "dit":
        extra["launch.workload"] = "dit"
    config = make_config(args, run_dir, name, extra, trainer=args.trainer)
    started = time.time()
    with open(work / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch", str(config)], env=env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        return first_step(run_dir, started, procs=[proc])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--trainer", choices=sorted(ENTRY), default="dit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--keep", help="keep run directories here instead of a temporary directory")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    load_before = round(os.getloadavg()[0], 2)
    times: dict[str, list[float]] = {"torchrun_c10d": [], "runtime": [], "runtime_noscreen": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for i in range(args.repeats):
            times["torchrun_c10d"].append(run_torchrun(args, work, f"torchrun-{i}"))
            times["runtime"].append(run_runtime(args, work, f"runtime-{i}", screen=True))
            times["runtime_noscreen"].append(run_runtime(args, work, f"noscreen-{i}", screen=False))
    medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
    report = {
        "benchmark": "startup_to_first_step",
        "setup": {"nodes": args.nodes, "nproc_per_node": 1, "trainer": args.trainer, "repeats": args.repeats,
                  "backend": "gloo/cpu", "cpus": os.cpu_count()},
        "load_avg_1m": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
        "first_step_s": times,
        "first_step_s_median": medians,
        "ratio_runtime_vs_torchrun": round(medians["runtime"] / medians["torchrun_c10d"], 3),
        "ratio_noscreen_vs_torchrun": round(medians["runtime_noscreen"] / medians["torchrun_c10d"], 3),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
