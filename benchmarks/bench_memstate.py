"""Load time of the same checkpoint from the agents' memory vs from disk, in one run (gloo/CPU, FSDP2).

    python benchmarks/bench_memstate.py [--world 2] [--mb 100] [--repeats 5] [--dir /tmp/bench-memstate]

The parent process plays the node agents: it starts one
:class:`~elastic.checkpoint.memstate.MemStateServer` per rank ("one node per rank") and
``--world`` rank processes.  Each rank builds an FSDP2 stack of 2048x2048
linears (about ``--mb`` MB of fp32 parameters, ~3x that with AdamW state),
takes one step and saves it once with the memory cache on, so the disk and
the memory hold the very same checkpoint.  Then, ``--repeats`` times each,
every rank loads it into a freshly initialised model:

* ``memory``: from its own node's cache (the restart-on-a-surviving-node case);
* ``memory_swapped``: each rank asks the *other* node's cache, as after a
  restart that changed rank placement, so the entries are swapped between
  ranks over gloo before loading;
* ``disk_warm``: the disk path (COMMIT marker, sha256 of every file, DCP
  load), files in the page cache (as right after a save);
* ``disk_cold``: the disk path after evicting the checkpoint files from the
  page cache (``posix_fadvise(DONTNEED)``).

Times are the slowest rank's wall time of ``load_latest``; printed as one
JSON object with medians and every sample, plus whether every load gave
bitwise the same parameters and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
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
MODES = ("memory", "memory_swapped", "disk_warm", "disk_cold")


def _launch(args: argparse.Namespace) -> int:
    from elastic.checkpoint.memstate import MemStateServer
    from elastic.common.env import MEMSTATE_ADDR_ENV, MEMSTATE_TOKEN_ENV

    servers = [MemStateServer(max_bytes=64 << 30) for _ in range(args.world)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    try:
        for rank in range(args.world):
            peer = servers[(rank + 1) % args.world]
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                       BENCH_PEER_ADDR=peer.addr, BENCH_PEER_TOKEN=peer.token, **servers[rank].worker_env())
            assert MEMSTATE_ADDR_ENV in env and MEMSTATE_TOKEN_ENV in env
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))
        return max(p.wait() for p in procs)
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(args.dir, ignore_errors=True)


def _evict(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager
    from elastic.checkpoint.config import MemoryCacheConfig
    from elastic.common.events import EventLog, read_events
    from elastic.checkpoint.memclient import MemStateClient

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    num_layers = max(1, round(args.mb * 1e6 / ((DIM * DIM + DIM) * 4)))
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    root = Path(args.dir) / "ckpt"

    class App(Stateful):
        def __init__(self, seed: int) -> None:
            torch.manual_seed(seed)
            self.model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(num_layers)])
            for layer in self.model:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

        def state_dict(self):
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd) -> None:
            set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        def digest(self) -> str:
            h = hashlib.sha256()
            for p in self.model.parameters():
                h.update(p.to_local().detach().numpy().tobytes())
            for st in self.optim.state.values():
                for key in sorted(st):
                    h.update(st[key].to_local().numpy().tobytes() if hasattr(st[key], "to_local")
                             else st[key].numpy().tobytes())
            return h.hexdigest()

    def manager(memory: bool, client: MemStateClient | None = None) -> CheckpointManager:
        cfg = CheckpointConfig(keep_last=1, memory=MemoryCacheConfig(enabled=memory))
        return CheckpointManager(cfg, root, "bench", EventLog(root.parent / f"ev-{rank}.jsonl", "bench"), group,
                                 memory_client=client)

    app = App(seed=0)
    app.model(torch.randn(4, DIM)).sum().backward()
    app.optim.step()
    saver = manager(memory=True)
    saver.save(1, {"app": app})
    saver.close()
    want = app.digest()
    del app
    peer = MemStateClient(os.environ["BENCH_PEER_ADDR"], os.environ["BENCH_PEER_TOKEN"])
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    sources: dict[str, set[str]] = {mode: set() for mode in MODES}
    breakdown: dict[str, dict] = {}
    bitwise = True
    for _ in range(args.repeats):
        for mode in MODES:
            fresh = App(seed=1)
            mgr = manager(memory=mode.startswith("memory"), client=peer if mode == "memory_swapped" else None)
            if mode == "disk_cold":
                if rank == 0:
                    _evict(root)
                dist.barrier(group=group)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            loaded = mgr.load_latest({"app": fresh})
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            mgr.close()
            times[mode].append(float(elapsed))
            bitwise &= loaded is not None and fresh.digest() == want
            last = [e for e in read_events([root.parent / f"ev-{rank}.jsonl"]) if e["kind"] == "checkpoint.loaded"]
            sources[mode].add(last[-1]["loaded_from"] + ("+exchanged" if last[-1].get("exchanged") else ""))
            breakdown[mode] = {k: v for k, v in last[-1].items() if k.endswith("_s")}
    ok = torch.tensor([1 if bitwise else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    state_bytes = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
    if rank == 0:
        medians = {mode: round(statistics.median(v), 4) for mode, v in times.items()}
        print(json.dumps({
            "world": world, "layers": num_layers, "checkpoint_bytes": state_bytes, "repeats": args.repeats,
            "load_s_median": medians,
            "speedup_vs_disk_warm": round(medians["disk_warm"] / medians["memory"], 2),
            "speedup_vs_disk_cold": round(medians["disk_cold"] / medians["memory"], 2),
            "load_s": {mode: [round(t, 4) for t in v] for mode, v in times.items()},
            "loaded_from": {mode: sorted(v) for mode, v in sources.items()},
            "rank0_last_load_event_s": breakdown,
            "bitwise_equal": bool(ok.item()),
            "verify_on_load": True,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }, indent=1))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench_memstate")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 parameter megabytes (whole model)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/bench-memstate", help="work directory (removed at the end)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return _launch(args)
    _rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
