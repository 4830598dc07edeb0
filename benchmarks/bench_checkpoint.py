"""Checkpoint stall benchmark: async vs sync save of the same FSDP2 state, on gloo/CPU.

    python benchmarks/bench_checkpoint.py [--world 2] [--mb 300] [--dir /tmp/bench-ckpt] [--hf-probe]

Starts ``--world`` ranks (processes) itself.  The model is a stack of
2048x2048 linears with about ``--mb`` MB of fp32 parameters; with AdamW the
saved state is about 3x that.  Measured on rank 0, printed as one JSON object:

* ``blocking_s``: time inside ``save()`` for a sync save (``async_save=False``:
  stage + write + commit) and for an async save (stage only), and their ratio;
* ``step_s``: training step time with no checkpoint in flight (baseline) and
  for the steps that ran while an async save was persisting, and their ratio;
* ``persist_s`` / ``bytes`` of the async saves (from ``checkpoint.committed``).

The baseline is measured in the same run.  Every rank runs the same fixed
number of steps after each save (deciding by "is the save done?" could make
ranks disagree and hang FSDP); whether a step overlapped the persist is only
recorded, never used for control flow.

``--hf-probe`` also saves the model weights once through DCP's
``HuggingFaceStorageWriter(save_distributed=True)`` and once through this
project's writer, loads each into a freshly initialised model, and reports
save time and whether the round trip is bitwise; then tries the optimizer
state through the HF writer and reports what happens on load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIM = 2048


def _launch(args: argparse.Namespace) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    shutil.rmtree(args.dir, ignore_errors=True)
    return max(codes)


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
    from elastic.common.events import EventLog, read_events

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_start = os.getloadavg()[0]
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    num_layers = max(1, round(args.mb * 1e6 / ((DIM * DIM + DIM) * 4)))
    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(num_layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = build(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    class App(Stateful):
        def state_dict(self):
            msd, osd = get_state_dict(model, optim)
            return {"model": msd, "optim": osd}

        def load_state_dict(self, sd):
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    x = torch.randn(args.batch, DIM)

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        dist.barrier()  # step time = slowest rank
        return time.perf_counter() - t0

    root = Path(args.dir)
    events_path = root / f"events-rank{rank}.jsonl"
    events = EventLog(events_path, f"bench/rank{rank}")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    sync_mgr = CheckpointManager(CheckpointConfig(keep_last=1, async_save=False), root / "sync", events=events, group=group)
    async_cfg = CheckpointConfig(keep_last=1, writer_nice=args.writer_nice)
    async_mgr = CheckpointManager(async_cfg, root / "async", events=events, group=group)
    state = {"app": App()}

    for _ in range(2):
        step()  # warm-up, creates optimizer state
    baseline = [step() for _ in range(args.steps)]

    sync_block = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        sync_mgr.save(100 + i, state)
        sync_block.append(time.perf_counter() - t0)
        step()

    async_block, during, after = [], [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        async_mgr.save(200 + i, state)
        async_block.append(time.perf_counter() - t0)
        inflight = async_mgr._inflight  # observed only; never steers control flow
        for _ in range(args.steps):
            was_running = inflight is not None and not inflight.done()
            elapsed = step()
            (during if was_running else after).append(elapsed)
        async_mgr.wait()

    report = {}
    if args.hf_probe:
        report["hf_probe"] = _hf_probe(root, model, optim, build, rank)
    sync_mgr.close()
    async_mgr.close()
    dist.barrier()
    if rank == 0:
        committed = [e for e in read_events([events_path]) if e["kind"] == "checkpoint.committed"]
        async_commits = [e for e in committed if e["step"] >= 200]
        base = statistics.median(baseline)
        during_med = statistics.median(during) if during else None
        report = {
            "world_size": world,
            "param_mb": round(sum(p.numel() for p in model.parameters()) * 4 / 1e6, 1),
            "saved_mb_total": round(statistics.median(e["bytes"] for e in async_commits) / 1e6, 1),
            "omp_threads": torch.get_num_threads(),
            "writer_nice": args.writer_nice,
            "host_load_avg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "blocking_s": {
                "sync_save": [round(v, 3) for v in sync_block],
                "async_save": [round(v, 3) for v in async_block],
                "async_over_sync_ratio": round(statistics.median(async_block) / statistics.median(sync_block), 3),
            },
            "step_s": {
                "no_checkpoint_median": round(base, 4),
                "during_persist_median": None if during_med is None else round(during_med, 4),
                "during_persist_steps": len(during),
                "during_over_baseline_ratio": None if during_med is None else round(during_med / base, 3),
                "after_persist_median": round(statistics.median(after), 4) if after else None,
            },
            "async_persist_s": [round(e["persist_s"], 3) for e in async_commits],
            **report,
        }
        print(json.dumps(report, indent=1), flush=True)
    dist.destroy_process_group()


def _hf_probe(root: Path, model, optim, build, rank: int) -> dict:
    """Model weights through DCP's HF writer vs this project's writer; then the optimizer via HF."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from elastic.checkpoint.format import SafetensorsShardReader, SafetensorsShardWriter

    def full(model_) -> dict:
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in get_model_state_dict(model_).items()}

    want = full(model)
    out = {}
    for name, make_writer, make_reader in (
        ("hf", lambda p: HuggingFaceStorageWriter(str(p), save_distributed=True), lambda p: HuggingFaceStorageReader(str(p))),
        ("ours", lambda p: SafetensorsShardWriter(p, 0, rank), lambda p: SafetensorsShardReader(p)),
    ):
        path = root / f"probe-{name}"
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(get_model_state_dict(model), storage_writer=make_writer(path))
        save_s = time.perf_counter() - t0
        fresh = build(1)
        target = get_model_state_dict(fresh)
        dcp.load(target, storage_reader=make_reader(path))
        fresh.load_state_dict(target)
        got = full(fresh)
        out[f"{name}_model_only"] = {
            "save_s": round(save_s, 3),
            "bitwise_round_trip": all(torch.equal(got[k], want[k]) for k in want),
        }
        del fresh
    path = root / "probe-hf-optim"
    try:
        dcp.save(get_optimizer_state_dict(model, optim), storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))
        target = get_optimizer_state_dict(model, optim)
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(path)))
        out["hf_optimizer_state"] = "loaded"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        out["hf_optimizer_state"] = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
    dist.barrier()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench_checkpoint")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", type=float, default=300.0, help="fp32 parameter megabytes")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="steps measured per phase")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/bench-ckpt")
    parser.add_argument("--hf-probe", action="store_true")
    parser.add_argument("--writer-nice", type=int, default=10, help="CheckpointConfig.writer_nice for the async saves")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        shutil.rmtree(args.dir, ignore_errors=True)
        return _launch(args)
    _rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
