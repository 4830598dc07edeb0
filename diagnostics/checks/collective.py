"""Collective bus bandwidth: all-reduce across local ranks, reported as nccl-tests do.

One process per GPU with NCCL (spawned), or ``cpu_ranks`` processes with gloo
on a CPU-only host (forked, so the children do not re-import torch; they never
touch CUDA).  The ranks meet through a ``FileStore`` in a temporary directory,
so there is no port to race for.  Each rank:

1. all-reduces a rank-dependent integer pattern once and checks the sum exactly
   (a wrong result is a failure whatever the speed);
2. runs warm-up iterations, then times ``iters`` all-reduces of ``nbytes``
   between barriers.

The default GPU message is 1 GiB (``quick_bytes_gpu``), 10 iterations, timed with
CUDA events: the reference busbw is a large-message figure that 256 MiB messages
do not reach.  The slowest rank's time per iteration ``t`` gives ``algbw = nbytes / t`` and
``busbw = algbw * 2 (n - 1) / n`` -- the all-reduce factor of nccl-tests'
PERFORMANCE.md, which makes busbw comparable with the hardware bottleneck's
bandwidth whatever ``n`` is.  The GPU reference is the model's 8-GPU figure
(``allreduce_busbw_gbps``); nodes with fewer GPUs are judged against the same
number (the per-GPU NVLink bound does not depend on ``n``).

Knobs (``collective:``): ``busbw_scale`` multiplies the result, ``corrupt:
true`` makes rank 0 perturb its result before the correctness check.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from typing import Any

from diagnostics.calibration import collective_key
from diagnostics.checks import Check, Context, register
from diagnostics.checks._devices import DeviceTimer, cpu_expected, judge_measurement, spec_for
from diagnostics.report import CheckResult, worst

WARMUP = 2


def allreduce_factor(n: int) -> float:
    """nccl-tests busbw factor for all-reduce: 2(n-1)/n."""
    if n < 1:
        raise ValueError("need at least one rank")
    return 2.0 * (n - 1) / n


def busbw(nbytes: int, seconds: float, n: int) -> float:
    """All-reduce bus bandwidth in GB/s (1e9 bytes/s) for ``nbytes`` per rank in ``seconds``."""
    if seconds <= 0:
        raise ValueError("seconds must be positive")
    return nbytes / seconds * allreduce_factor(n) / 1e9


def _worker(rank: int, world: int, store_path: str, backend: str, nbytes: int, iters: int,
            corrupt: bool, timeout_s: float, results: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    try:
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks only
            torch.set_num_threads(1)
            device = torch.device("cpu")
        else:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            numel = nbytes // 4
            # Correctness: element k of rank r holds (r + 1) * (k % 251); the sum is exact in fp32.
            pattern = torch.arange(numel, device=device, dtype=torch.int64) % 251
            check = (pattern * (rank + 1)).to(torch.float32)
            dist.all_reduce(check)
            if corrupt and rank == 0:
                check[numel // 2] += 1.0
            expected = (pattern * (world * (world + 1) // 2)).to(torch.float32)
            wrong = int((check != expected).sum())
            buf = torch.zeros(numel, device=device, dtype=torch.float32)
            for _ in range(WARMUP):
                dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            timer = DeviceTimer(device)  # CUDA events on the collective's stream; the host clock on gloo
            timer.start()
            for _ in range(iters):
                dist.all_reduce(buf)
            timer.stop()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = timer.seconds()
            results.put({"rank": rank, "seconds": elapsed, "wrong": wrong})
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - sent to the parent as this rank's result
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def run_allreduce(world: int, backend: str, nbytes: int, iters: int, corrupt: bool = False,
                  timeout_s: float = 60.0) -> dict[str, Any]:
    """Run the all-reduce on ``world`` local processes; raises RuntimeError if a rank fails."""
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    tmp = tempfile.mkdtemp(prefix="diag-allreduce-")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world, os.path.join(tmp, "store"), backend, nbytes, iters, corrupt, timeout_s, results))
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        out: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s + 10
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"all-reduce ranks timed out after {timeout_s + 10:.0f} s "
                                   f"(reported: {sorted(out)})")
            try:
                item = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"all-reduce rank exited with code {dead[0].exitcode}") from None
                continue
            out[item["rank"]] = item
        errors = [f"rank {r}: {v['error']}" for r, v in sorted(out.items()) if "error" in v]
        if errors:
            raise RuntimeError("; ".join(errors))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    slowest = max(v["seconds"] for v in out.values())
    per_iter = slowest / iters
    return {
        "ranks": world,
        "backend": backend,
        "bytes": nbytes // 4 * 4,
        "iters": iters,
        "seconds_per_iter": per_iter,
        "algbw_gbps": nbytes // 4 * 4 / per_iter / 1e9,
        "busbw_gbps": busbw(nbytes // 4 * 4, per_iter, world),
        "wrong_elements": sum(v["wrong"] for v in out.values()),
    }


@register
class CollectiveCheck(Check):
    name = "collective"
    description = "all-reduce bus bandwidth across local ranks (NCCL on GPUs, gloo on CPU), nccl-tests busbw"

    def run(self, ctx: Context) -> CheckResult:
        import torch

        t = ctx.thresholds.collective
        knobs = ctx.reader.knobs("collective")
        scale = float(knobs.get("busbw_scale", 1.0))
        corrupt = bool(knobs.get("corrupt", False))
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            world = torch.cuda.device_count()
            if world < 2:
                return self.skip("1 GPU: all-reduce needs >= 2 local ranks")
            if not torch.distributed.is_nccl_available():
                return self.skip("torch built without NCCL")
            backend = "nccl"
            nbytes = t.full_bytes_gpu if ctx.full else t.quick_bytes_gpu
            model, spec = spec_for(torch.device("cuda", 0), ctx.thresholds)
        else:
            world, backend = t.cpu_ranks, "gloo"
            nbytes = t.full_bytes_cpu if ctx.full else t.quick_bytes_cpu
            model, spec = "cpu", ctx.thresholds.cpu
        iters = t.full_iters if ctx.full else t.quick_iters
        r = run_allreduce(world, backend, nbytes, iters, corrupt=corrupt, timeout_s=t.timeout_s)
        r["unscaled_busbw_gbps"] = unscaled = r["busbw_gbps"]
        r["busbw_gbps"] *= scale
        r["algbw_gbps"] *= scale
        expected = spec.allreduce_busbw_gbps if spec else None
        if backend == "gloo":
            expected = cpu_expected(torch.device("cpu"), expected, unscaled, scale)
        speed, text, source = judge_measurement(ctx, "collective", collective_key(r["bytes"], world), model,
                                                r["busbw_gbps"], expected, t)
        reasons = []
        if r["wrong_elements"]:
            reasons.append(f"all-reduce result wrong in {r['wrong_elements']} elements")
        if speed != "pass":
            reasons.append(f"busbw {r['busbw_gbps']:.4g} GB/s {text}")
        verdict = worst([speed, "fail" if r["wrong_elements"] else "pass"])
        r.update(model=model, expected_busbw_gbps=expected, expected_source=source, busbw_scale=scale,
                 factor=allreduce_factor(world))
        return CheckResult(
            name=self.name,
            verdict=verdict,
            value=round(r["busbw_gbps"], 4),
            threshold=text,
            reason="ok" if verdict == "pass" else "; ".join(reasons),
            details=r,
        )
