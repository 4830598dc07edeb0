"""Recovery time after a worker SIGKILL: this runtime vs plain torchrun (c10d rendezvous).

Both sides run the same trainer (``trainer.train``), the same config, the same
number of simulated nodes on this host (one torchrun per node, gloo/CPU), and
get the same fault: SIGKILL of one worker once it has reported step ``--kill-at``.

    python benchmarks/recovery_torchrun.py --nodes 4 --repeats 2

Measured per trial, from the trainers' own event logs:
  recovery_s   SIGKILL -> first training step completed by a restarted worker
  steps_lost   last step reported before the kill - step the restart resumed from
  total_s      wall time of the whole run
Baseline: ``torchrun --rdzv-backend=c10d --max-restarts=N`` (torchrun's own
restart loop; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which restarted
gloo workers cannot rendezvous). Prints one JSON object.
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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.control.etcd_server import free_port  # noqa: E402
from elastic.common.events import read_run_events  # noqa: E402
from elastic.common.procs import descendants, terminate_tree  # noqa: E402
from elastic.run.schema import dump_run_file, load_run_file  # noqa: E402
from elastic.common.config import override  # noqa: E402

T = TypeVar("T")


def make_config(args, run_dir: Path, run_id: str, extra: dict | None = None, trainer: str = "mlp",
                base: Path | None = None) -> Path:
    """The benchmark's run config; ``extra`` adds dotted overrides (e.g. replica-group mode); ``base``
    replaces the trainer's example file (another workload's)."""
    cfg = load_run_file(base or REPO / "examples" / ("tiny.yaml" if trainer == "dit" else "mlp-tiny.yaml"))
    for key, value in {
        "run.id": run_id, "run.dir": str(run_dir), "launch.nodes": str(args.nodes),
        "trainer.steps": args.steps, "trainer.step_sleep": args.step_sleep,
        "checkpoint.interval_steps": args.interval, "agent.term_grace_s": 2, **(extra or {}),
    }.items():
        cfg = override(cfg, key, value)
    cfg.fingerprint = cfg.compute_fingerprint()
    path = run_dir.parent / f"{run_id}.yaml"
    dump_run_file(cfg, path)
    return path


def env() -> dict[str, str]:
    e = dict(os.environ)
    # This checkout first; what the caller had after it (where a workload of another package is installed).
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = "1"
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return e


def wait_step(run_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 300,
              source: str = "trainer/rank1") -> dict:
    deadline = time.monotonic() + timeout
    tail = StepTail(run_dir)
    while time.monotonic() < deadline:
        for e in tail.new_steps():
            if e["source"] == source and e["step"] >= step and e.get("committed", True):
                return e
        if all(p.poll() is not None for p in procs):
            raise RuntimeError("run ended before the kill step")
        time.sleep(0.05)
    raise TimeoutError("kill step not reached")


class StepTail:
    """The trainers' event files, read from where the last look stopped.

    Why not :func:`read_run_events` on every poll: it parses every event file from the start, and
    the runtime writes many more (launcher, agents) than plain torchrun -- polling every 50 ms,
    the observer itself cost the measured side CPU on the same two cores.
    """

    def __init__(self, run_dir: Path) -> None:
        self.events = run_dir / "events"
        self.offsets: dict[Path, int] = {}

    def new_steps(self) -> list[dict]:
        """The ``trainer.step`` events written since the last call."""
        return [e for path in sorted(self.events.glob("trainer-*.jsonl")) for e in self._new_steps(path)]

    def _new_steps(self, path: Path) -> list[dict]:
        with open(path, "rb") as fh:
            fh.seek(self.offsets.get(path, 0))
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offsets[path] = self.offsets.get(path, 0) + len(complete)
        return [json.loads(line) for line in complete.splitlines() if b'"trainer.step"' in line]


def measure(run_dir: Path, kill_ts: float, victim_pid: int, started: float, ended: float) -> dict:
    events = read_run_events(run_dir)
    before = [e for e in events if e["kind"] == "trainer.step" and e["ts"] <= kill_ts]
    old_pids = {e["pid"] for e in events if e["kind"] == "trainer.start" and e["ts"] <= kill_ts}
    after = sorted((e for e in events if e["kind"] == "trainer.step" and e["ts"] > kill_ts
                    and e["pid"] not in old_pids), key=lambda e: e["ts"])
    resumed = [e for e in events if e["kind"] == "trainer.start" and e["ts"] > kill_ts]
    last_step = max(e["step"] for e in events if e["kind"] == "trainer.step")
    out = {
        "completed": last_step,
        "total_s": round(ended - started, 3),
        "recovery_s": round(after[0]["ts"] - kill_ts, 3) if after else None,
        "steps_lost": (max(e["step"] for e in before) - min(e["step"] for e in resumed)) if resumed else None,
        "restarted_workers": len({e["pid"] for e in resumed}),
    }
    checksum = run_dir / "final_checksum.txt"
    out["final_checksum"] = checksum.read_text().strip() if checksum.exists() else None
    return out


def kill_worker(run_dir: Path, args, procs) -> tuple[float, int]:
    victim = wait_step(run_dir, args.kill_at, procs)
    kill_ts = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    return kill_ts, victim["pid"]


def run_runtime(args, work: Path, trial: int) -> dict:
    run_dir = work / f"runtime-{trial}"
    config = make_config(args, run_dir, f"bench-rt-{trial}")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "launch", str(config)], env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_ts, pid = kill_worker(run_dir, args, [proc])
    proc.wait(timeout=600)
    result = measure(run_dir, kill_ts, pid, started, time.time())
    result["rc"] = proc.returncode
    return result


def run_c10d_nodes(args, run_id: str, config: Path, run_dir: Path, log_path: Path,
                   inject: Callable[[list[subprocess.Popen]], T], entry: str = "trainer.train",
                   nnodes: str | None = None) -> tuple[T, list[int]]:
    """The baseline: one plain ``torchrun --rdzv-backend=c10d`` (its own restart loop) per node.

    ``inject(procs)`` waits for the fault point and injects the fault; then every node is waited
    for, and none is left behind if anything fails. Returns what ``inject`` returned and the
    nodes' exit codes.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or args.nodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           "--rdzv-conf=last_call_timeout=1", "--max-restarts=3", "--monitor-interval=0.1",
           "--local-addr=127.0.0.1", "-m", entry, "--config", str(config), "--run-dir", str(run_dir)]
    with open(log_path, "wb") as log:
        procs = [subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                 for _ in range(args.nodes)]
    try:
        injected = inject(procs)
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                terminate_tree(p.pid, descendants(p.pid), grace=2)
    return injected, [p.returncode for p in procs]


def run_torchrun(args, work: Path, trial: int) -> dict:
    run_dir = work / f"torchrun-{trial}"
    config = make_config(args, run_dir, f"bench-tr-{trial}")
    started = time.time()
    (kill_ts, pid), rcs = run_c10d_nodes(args, f"bench-tr-{trial}", config, run_dir, work / f"torchrun-{trial}.log",
                                         lambda procs: kill_worker(run_dir, args, procs))
    result = measure(run_dir, kill_ts, pid, started, time.time())
    result["rc"] = rcs
    return result


def summarize(trials: list[dict]) -> dict:
    rec = [t["recovery_s"] for t in trials if t["recovery_s"] is not None]
    return {
        "recovery_s_median": round(statistics.median(rec), 3) if rec else None,
        "recovery_s_all": rec,
        "steps_lost_all": [t["steps_lost"] for t in trials],
        "total_s_all": [t["total_s"] for t in trials],
        "completed_all": [t["completed"] for t in trials],
        "trials": trials,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--keep", help="keep run directories here instead of a temporary directory")
    p.add_argument("--only", choices=["runtime", "torchrun"], help="measure one side only")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        runtime = [run_runtime(args, work, i) for i in range(args.repeats)] if args.only != "torchrun" else []
        baseline = [run_torchrun(args, work, i) for i in range(args.repeats)] if args.only != "runtime" else []
    a, b = summarize(runtime), summarize(baseline)
    report = {
        "benchmark": "recovery_after_worker_sigkill",
        "setup": {"nodes": args.nodes, "nproc_per_node": 1, "steps": args.steps, "ckpt_interval": args.interval,
                  "kill_at_step": args.kill_at, "step_sleep_s": args.step_sleep, "backend": "gloo/cpu",
                  "cpus": os.cpu_count()},
        "this_runtime": a,
        "torchrun_c10d": b,
        "ratio_recovery_runtime_over_torchrun": (round(a["recovery_s_median"] / b["recovery_s_median"], 3)
                                                 if a["recovery_s_median"] and b["recovery_s_median"] else None),
        "same_final_weights": len({t["final_checksum"] for t in runtime + baseline}) == 1,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
