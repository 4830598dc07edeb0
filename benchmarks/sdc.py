"""Replay verification (``sdc.replay_every``): what it costs a step, and how fast it names a flip.

    python benchmarks/sdc.py --nodes 4 --trainer dit --json out.json
    python benchmarks/sdc.py --nodes 4 --trainer dit --seeds 10 --every 1 10 100

Cost (``replay_step_ratio`` per setting of ``--every``): one fault-free run per setting with
``sdc.replay_ab_block`` set, so checks run in alternate blocks of steps of the *same* run and both
sides of the comparison share the host's load (separate runs drifted 0.93-1.29 apart here, far more
than the effect: ``benchmarks/recovery.py``'s snapshot measurement).  The figure is rank 0's mean
step-to-step interval in blocks with checks over blocks without, counted once every warm spare has
imported (the spares replay, and until they have imported they take CPU unevenly) and leaving out
the first two steps of each block (a replay spills into the steps after its check).  The mean, not
the median: a check costs its step and the ones beside it, not the typical step.  The baseline is
the blocks without checks, in the same run.

Detection (``detection``): ``--seeds`` runs with ``replay_every`` = ``--detect-every`` and the chaos
``sdc`` fault at ``at: local`` (one bit of one rank's own gradient, before the reduce-scatter: what a
GPU that computes wrong does), on a node and a checked step both drawn from the seed, planted once
every spare has imported.  Per run: whether ``sdc.suspect`` named that node, rank and step, the
latency in steps (suspect's step minus the flip's) and seconds (flip -> suspect event), whether the
run rolled back and ended bitwise equal to a fault-free run of the same config.  A flip on a step
that is not checked is never found by replay (the next checks replay from the same wrong weights and
agree): the flips land on checked steps by design, and the JSON says so.

``--replay-nodes K`` (``sdc.replay_nodes``) checks K nodes per check instead of every node, in both
parts; a flip then lands on a rank that is checked at its step (drawn from the same sampling).

Prints one JSON object (``--json PATH`` writes it too), with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import NO_PREFLIGHT, checksum, load_avg, spare_nodes, spares_warm  # noqa: E402
from recovery_torchrun import env, make_config  # noqa: E402

from elastic.common.events import read_run_events  # noqa: E402
from elastic.sdc.replay import checked_nodes, checked_step  # noqa: E402
from elastic.worker.faults import fired_records, write_fault  # noqa: E402
from trainer.dit_config import DiTTrainerConfig  # noqa: E402

RANK0 = "trainer/rank0"
TRAINER_SEED = DiTTrainerConfig().seed  # the DiT's seed (the config leaves it alone): it seeds the sampling


def launch(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "launch", str(config)], env=env(), stdout=fh,
                                stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 1200) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def config(args, work: Path, name: str, extra: dict) -> tuple[Path, Path]:
    run_dir = work / name
    base = {**NO_PREFLIGHT, "launch.workload": "dit", "trainer.global_batch_size": 12,
            "sdc.replay_nodes": args.replay_nodes}
    return make_config(args, run_dir, f"sdc-{name}", {**base, **extra}, trainer="dit"), run_dir


# -- cost --------------------------------------------------------------------------------------------
def block_intervals(events: list[dict], block: int, after_ts: float) -> dict[str, list[float]]:
    """Rank 0's step-to-step intervals in blocks with checks ("on") and without ("off")."""
    ts = {e["step"]: e["ts"] for e in events if e["kind"] == "trainer.step" and e["source"] == RANK0}
    split: dict[str, list[float]] = {"on": [], "off": []}
    for step in sorted(ts):
        if step + 1 not in ts or ts[step] < after_ts or (step - 1) % block < 2:
            continue
        on = ((step - 1) // block) % 2 == 0
        split["on" if on else "off"].append(ts[step + 1] - ts[step])
    return split


def cost(args, work: Path, every: int) -> dict:
    block = max(every, args.block)
    steps = args.warmup + 2 * block * args.block_pairs
    cfg, run_dir = config(args, work, f"cost-{every}", {"sdc.replay_every": every, "sdc.replay_ab_block": block,
                                                       "trainer.steps": steps})
    t0 = time.time()
    rc = finish(launch(cfg, work / f"cost-{every}.log"))
    events = read_run_events(run_dir)
    warm = spares_warm(run_dir)  # None: a spare never finished importing, and nothing is counted
    split = block_intervals(events, block, warm if warm is not None else float("inf"))
    on, off = split["on"], split["off"]
    kinds = [e["kind"] for e in events]
    replays = [e["replay_s"] for e in events if e["kind"] == "sdc.verified" and e.get("replay_s") is not None]
    return {"replay_every": every, "ab_block": block, "steps": steps, "rc": rc, "spares_warm": warm is not None,
            "replay_step_ratio": round(statistics.fmean(on) / statistics.fmean(off), 4) if on and off else None,
            "mean_interval_on_s": round(statistics.fmean(on), 5) if on else None,
            "mean_interval_off_s": round(statistics.fmean(off), 5) if off else None,
            "intervals": {"on": len(on), "off": len(off)},
            "verified": kinds.count("sdc.verified"), "skipped": kinds.count("sdc.replay_skipped"),
            "suspects": kinds.count("sdc.suspect"),
            "replay_s_median": round(statistics.median(replays), 4) if replays else None,
            "wall_s": round(time.time() - t0, 1)}


# -- detection ---------------------------------------------------------------------------------------
def wait_warm(run_dir: Path, proc: subprocess.Popen, nodes: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if spare_nodes(run_dir) >= nodes and spares_warm(run_dir):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before its spares were warm (rc {proc.returncode})")
        time.sleep(0.2)
    raise TimeoutError("spares not warm")


def newest_step(run_dir: Path) -> int:
    return max((e["step"] for e in read_run_events(run_dir) if e["kind"] == "trainer.step"), default=0)


def detect_once(args, work: Path, seed: int, reference: str | None) -> dict:
    rng = random.Random(seed)
    cfg, run_dir = config(args, work, f"detect-{seed}", {"sdc.replay_every": args.detect_every})
    proc = launch(cfg, work / f"detect-{seed}.log")
    wait_warm(run_dir, proc, args.nodes)
    now = newest_step(run_dir)
    checks = [s for s in range(now + 3, args.steps - 2 * args.detect_every) if checked_step(s, args.detect_every)]
    node, step, spec = flip_target(args, rng, checks)
    if step is not None:
        write_fault(run_dir, f"bench-sdc-{seed}", {"kind": "sdc", "step": step, "at": "local", **spec})
    rc = finish(proc)
    events = read_run_events(run_dir)
    fired = [r["fired"] for r in fired_records(run_dir, "sdc")]
    node = node or (fired[0]["node"] if fired else None)
    suspects = [e for e in events if e["kind"] == "sdc.suspect"]
    out = {"seed": seed, "node": node, "flip_step": step, "rc": rc, "fired": bool(fired)}
    if not fired or not suspects:
        return {**out, "detected": False, "named_right": False}
    first = suspects[0]
    out.update(detected=True, suspects=len(suspects),
               named_right=(first["node"], first["rank"], first["step"]) == (node, fired[0]["rank"], step),
               latency_steps=first["step"] - step, latency_s=round(first["ts"] - fired[0]["ts"], 3),
               arbitrated=first.get("arbitrated"), arbiter=first.get("arbiter"),
               rolled_back=any(e["kind"] == "sdc.rollback" for e in events),
               resumed_from=[e["step"] for e in events if e["kind"] == "checkpoint.loaded" and e["ts"] > first["ts"]
                             and e["source"] == RANK0],
               bitwise=checksum(run_dir) == reference if reference else None)
    return out


def flip_target(args, rng: random.Random, checks: list[int]) -> tuple[str | None, int | None, dict]:
    """(node named, step, the fault's target) for one flip: a node other than node0 and a checked step.
    With ``--replay-nodes`` sampling, a (step, rank) pair whose rank is checked then (one rank per node
    here, so the rank is the node's index in the world; the node is read from the fired record)."""
    if 0 < args.replay_nodes < args.nodes:
        pairs = [(s, i) for s in checks
                 for i in checked_nodes(s // args.detect_every, args.nodes, args.replay_nodes, TRAINER_SEED) if i]
        if not pairs:
            return None, None, {}
        step, rank = rng.choice(sorted(pairs))
        return None, step, {"rank": rank}
    node = f"node{rng.randrange(1, args.nodes)}"
    return node, (rng.choice(checks) if checks else None), {"node": node}


def detection(args, work: Path) -> dict:
    cfg, run_dir = config(args, work, "detect-clean", {"sdc.replay_every": args.detect_every})
    finish(launch(cfg, work / "detect-clean.log"))
    reference = checksum(run_dir)
    runs = [detect_once(args, work, seed, reference) for seed in range(args.seeds)]
    named = [r for r in runs if r.get("named_right")]
    return {"replay_every": args.detect_every, "runs": runs, "detected": f"{len(named)}/{len(runs)}",
            "within_replay_every": sum(1 for r in named if r["latency_steps"] <= args.detect_every),
            "bitwise": sum(1 for r in runs if r.get("bitwise")),
            "flip_steps": "checked steps only: replay finds a flip only at a checked step (see the docstring)",
            "latency_s_median": round(statistics.median([r["latency_s"] for r in named]), 3) if named else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--trainer", choices=["dit"], default="dit", help="the workload that replays (dit)")
    p.add_argument("--every", type=int, nargs="*", default=[1, 10, 100],
                   help="replay_every settings to cost (none: detection only)")
    p.add_argument("--block", type=int, default=20, help="steps per on/off block (at least replay_every)")
    p.add_argument("--block-pairs", type=int, default=3, help="on/off block pairs per cost run")
    p.add_argument("--warmup", type=int, default=100, help="steps before the blocks count (spares import)")
    p.add_argument("--seeds", type=int, default=3, help="detection runs (0: none)")
    p.add_argument("--detect-every", type=int, default=10)
    p.add_argument("--replay-nodes", type=int, default=0,
                   help="sdc.replay_nodes: nodes checked per check (0: every node)")
    p.add_argument("--steps", type=int, default=160, help="steps of each detection run")
    p.add_argument("--interval", type=int, default=10, help="disk checkpoint interval")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--keep", help="keep run directories here instead of a temporary directory")
    p.add_argument("--json", dest="json_path", help="also write the JSON object to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {"nodes": args.nodes, "trainer": args.trainer, "replay_nodes": args.replay_nodes,
                    "load_avg_before": load_avg()}
    with tempfile.TemporaryDirectory(prefix="bench-sdc-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report["cost"] = [cost(args, work, every) for every in args.every]
        report["replay_step_ratio"] = {str(c["replay_every"]): c["replay_step_ratio"] for c in report["cost"]}
        if args.seeds:
            report["detection"] = detection(args, work)
    report["load_avg_after"] = load_avg()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
