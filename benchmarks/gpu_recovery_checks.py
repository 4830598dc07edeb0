"""The one-GPU checks of the recovery path's GPU side (issue 28), run by ``benchmarks/gpu_validate.py``.

Each check returns a dict; on a host without CUDA, gpu_validate records it under ``skipped`` with the
reason instead of running it.  Sized to take about 3 minutes together on one H200:

* :func:`snapshot_copy`: per-step snapshot copies of 16 MB / 47 MB / 1.9 GB shards beside a running
  matmul loop: today's blocking copy into a pageable buffer on the default stream against the pinned
  buffer on a side stream (``Packed.fill_async``): copy time, overlap fraction, matmul slowdown;
* :func:`nccl_abort`: a one-rank NCCL group with queued work aborted: time to abort, and GPU memory
  after each of five re-inits (it must not grow);
* :func:`fsdp_rebuild`: a one-GPU FSDP2 DiT rebuilt as the recovery does it (old model and optimizer
  dropped, a new one built and restored from the step's snapshot): peak memory with the failed
  step's references alive vs released, and 3 steps after the restore bitwise equal to 3 steps of a
  run without the fault;
* :func:`spare_cost`: a warm spare (torch imported) from its slot's assignment to its first step:
  CUDA context, NCCL init, model build, first step, in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = {"16MB": 16 * 10**6, "47MB": 47 * 10**6, "1.9GB": 19 * 10**8}


def _matmul_loop(device: torch.device, iters: int) -> Any:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def loop() -> None:
        for _ in range(iters):
            torch.mm(a, a)
    return loop


def _timed(device: torch.device, work: Any) -> float:
    """Seconds from the first enqueue to the device finishing ``work`` (all streams)."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def snapshot_copy(device: torch.device) -> dict[str, Any]:
    from elastic.checkpoint.snapshot import Packed

    out: dict[str, Any] = {}
    for label, nbytes in SHARD_BYTES.items():
        sources = [torch.randn(nbytes // 4 // 4, device=device) for _ in range(4)]  # four fp32 tensors
        layout = tuple((t.dtype, tuple(t.shape)) for t in sources)
        old, new = Packed(layout), Packed(layout, pinned=True)
        loop = _matmul_loop(device, 40 if nbytes < 10**9 else 200)
        _timed(device, loop)  # warm-up: kernels, clocks
        loop_s = _timed(device, loop)
        row: dict[str, Any] = {"matmul_loop_ms": round(loop_s * 1e3, 2)}
        for name, copy in (("pageable_default_stream", lambda: old.fill(sources)),
                           ("pinned_side_stream", lambda: new.fill_async(sources))):
            copy_s = _timed(device, copy)
            both_s = _timed(device, lambda: (loop(), copy()))
            row[name] = {"copy_ms": round(copy_s * 1e3, 2), "with_matmul_ms": round(both_s * 1e3, 2),
                         "overlap_fraction": round(max(0.0, min(1.0, 1 - (both_s - loop_s) / copy_s)), 3),
                         "matmul_slowdown": round(both_s / loop_s, 3)}
        row["bitwise"] = bool(torch.equal(old.flat, new.flat))
        out[label] = row
        del sources, old, new
        torch.cuda.empty_cache()
    out["ok"] = all(r["bitwise"] for r in out.values() if isinstance(r, dict))
    return out


def nccl_abort(device: torch.device) -> dict[str, Any]:
    """Assumes the default group is up (gpu_validate's one-rank NCCL group)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    x = torch.randn(64 * 2**20, device=device)
    rounds = []
    for _ in range(5):
        group = dist.new_group([0], backend="nccl")
        for _ in range(50):
            dist.all_reduce(x, group=group, async_op=True)  # queued, not waited for
            torch.mm(x[: 4096 * 4096].view(4096, 4096), x[: 4096 * 4096].view(4096, 4096))
        start = time.perf_counter()
        _abort_process_group(group)
        abort_s = time.perf_counter() - start
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        rounds.append({"abort_ms": round(abort_s * 1e3, 2), "allocated_mib": torch.cuda.memory_allocated(device) >> 20,
                       "device_used_mib": (total - free) >> 20})
    grew = rounds[-1]["device_used_mib"] - rounds[0]["device_used_mib"]
    return {"rounds": rounds, "device_used_growth_mib": grew, "ok": grew < 256}


def _dit(device: torch.device, preset: str = "B") -> tuple[Any, Any, Any]:
    from elastic.common.config import from_dict
    from trainer.dit_config import DiTTrainerConfig
    from trainer.dit_train import build_model
    from trainer.parallel import parallelize

    cfg = from_dict(DiTTrainerConfig, {"global_batch_size": 8, "model": {"preset": preset, "input_size": 32},
                                       "parallel": {"param_dtype": "float32"}})
    torch.manual_seed(0)
    model, _ = build_model(cfg, device)
    parallelize(model, cfg.parallel, 1, 1, device.type)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg


def _step(model: Any, optim: Any, device: torch.device, seed: int) -> tuple[Any, float]:
    from trainer.flow import flow_loss, interpolate, velocity_target

    gen = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(8, 4, 32, 32, generator=gen), torch.randn(8, 4, 32, 32, generator=gen)
    t, y = torch.rand(8, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    x_t, target = interpolate(x0, noise, t).to(device), model.local_tokens(velocity_target(x0, noise)).to(device)
    loss = flow_loss(model(x_t, t.to(device), y.to(device)), target)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return loss, float(loss.detach())


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from elastic.checkpoint.statedict import SnapshotStateDict

    return {"app": SnapshotStateDict(model, optim)}


def _peak_mib(device: torch.device, reset: bool = False) -> int:
    """The device's peak allocated memory (0 on a CPU dry run of the logic)."""
    if device.type != "cuda":
        return 0
    peak = torch.cuda.max_memory_allocated(device) >> 20
    if reset:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def fsdp_rebuild(device: torch.device, preset: str = "B") -> dict[str, Any]:
    """Uses the default (one-rank) group.  The restore is the recovery's: ``snapshot.restore`` of the
    step's capture into a freshly built FSDP2 model and optimizer (DCP's state-dict API)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elastic.checkpoint.snapshot import capture, restore
    from elastic.worker.determinism import set_deterministic

    if device.type == "cuda":
        set_deterministic()  # bitwise equality after the restore needs deterministic kernels

    def full_run() -> list[float]:
        model, optim, _ = _dit(device, preset)
        return [_step(model, optim, device, seed)[1] for seed in range(6)]

    reference = full_run()
    out: dict[str, Any] = {"model": f"DiT-{preset} (32x32 latents), fp32, one-rank FSDP2", "reference_losses": reference}
    for keep_refs in (True, False):
        _peak_mib(device, reset=True)
        model, optim, _ = _dit(device, preset)
        for seed in range(3):
            _step(model, optim, device, seed)
        msd, osd = get_state_dict(model, optim)
        snap = capture({"model": msd, "optim": osd}, 3, 0, 0, 1)
        if snap.ready is not None:
            snap.ready.synchronize()
        failed_loss, _ = _step(model, optim, device, 99)  # the failed step: its graph's outputs alive
        held = (model, optim, failed_loss) if keep_refs else None
        del model, optim, failed_loss, msd, osd
        base = _peak_mib(device, reset=True)
        new_model, new_optim, _ = _dit(device, preset)
        msd, osd = get_state_dict(new_model, new_optim)
        state = {"model": msd, "optim": osd}
        restore(state, [snap], 0, 1)
        set_state_dict(new_model, new_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        after = [_step(new_model, new_optim, device, seed)[1] for seed in range(3, 6)]
        key = "failed_step_refs_alive" if keep_refs else "failed_step_refs_released"
        out[key] = {"peak_rebuild_mib": _peak_mib(device), "peak_before_mib": base,
                    "losses_after_restore": after, "bitwise_equal": after == reference[3:]}
        del held, new_model, new_optim, state, msd, osd, snap
    out["ok"] = out["failed_step_refs_released"]["bitwise_equal"] and out["failed_step_refs_alive"]["bitwise_equal"]
    return out


_SPARE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
from benchmarks.gpu_recovery_checks import _dit, _step
t = {}
start = time.perf_counter()  # the slot's assignment: torch is imported (a warm spare)
torch.cuda.set_device(0); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t["cuda_context_s"] = time.perf_counter() - start
mark = time.perf_counter()
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(torch.ones(1, device="cuda")); torch.cuda.synchronize()
t["nccl_init_s"] = time.perf_counter() - mark
mark = time.perf_counter()
model, optim, _ = _dit(torch.device("cuda", 0)); torch.cuda.synchronize()
t["build_s"] = time.perf_counter() - mark
mark = time.perf_counter()
_step(model, optim, torch.device("cuda", 0), 0); torch.cuda.synchronize()
t["first_step_s"] = time.perf_counter() - mark
t["assignment_to_first_step_s"] = time.perf_counter() - start
dist.destroy_process_group()
print(json.dumps({k: round(v, 3) for k, v in t.items()}))
"""


def spare_cost() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _SPARE, str(REPO)], capture_output=True, text=True, timeout=300,
                          check=False, cwd=REPO)
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.strip()[-800:]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "ok": True}


CHECKS = ("snapshot_copy", "nccl_abort", "fsdp_rebuild", "spare_cost")


def run_all(device: torch.device, result: dict[str, Any], section: Any) -> None:
    """Run every check into ``result`` (through gpu_validate's ``section``), or record why not."""
    if device.type != "cuda":
        reason = "no CUDA device (torch.cuda.is_available() is False)"
        result["skipped"].update({name: reason for name in CHECKS})
        return
    section(result, "snapshot_copy", snapshot_copy, device)
    section(result, "nccl_abort", nccl_abort, device)
    section(result, "fsdp_rebuild", fsdp_rebuild, device)
    section(result, "spare_cost", spare_cost)
