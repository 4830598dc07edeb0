"""DiT trainer step benchmark; prints one JSON object.

CPU mode (default): full training steps (forward, backward, AdamW) of a small
DiT through the trainer's own code path (FSDP2 over gloo, Ulysses CP), each
variant measured in the same run so they share the machine's load:

* fp32 vs bf16 (FSDP2 MixedPrecisionPolicy) vs FP8-emulated linears, 1 rank;
* cp=1 (1 rank, all tokens) vs cp=2 (2 ranks, half the tokens each, all-to-all).

On CPU, FP8 *emulation* is slower than fp32 by design (quantize + dequantize
+ fp32 matmul); it exists to make the numerics testable.  cp=2 on a CPU host
with few cores measures communication overhead, not a speed-up.

``--ops``: the FP8 layer itself, implementation against implementation, in one run: aten ops
per forward+backward (eager), ``torch.compile`` graph breaks (dynamo's explain) and kernels
generated (inductor, CPU backend), ``_scaled_mm`` calls and any high-precision matmul left, and
the error against an fp64 reference, for ``nn.Linear``, the FP8 layer *before* this change
(``trainer/fp8.py`` at ``--before-rev``, loaded from git), the current one, and torchao's
``Float8Linear`` when torchao is installed (plus a 2-rank FSDP2 + Ulysses cp=2 DiT step with
torchao's layers, to check it fits our parallelism).  See :mod:`benchmarks.fp8_ops`.

``--gpu``: real ``torch._scaled_mm`` FP8 (e4m3, tensorwise and rowwise scales)
against bf16 ``torch.mm`` at DiT-XL/2 GEMM shapes (width 1152, MLP 4608,
256 tokens per 256x256 image), GEMM alone and the full Float8Linear
forward+backward (dynamic scaling included) vs nn.Linear in bf16.  Needs CUDA
with compute capability >= 8.9.

    python benchmarks/bench_trainer.py [--steps 8] [--warmup 2]
    python benchmarks/bench_trainer.py --ops [--no-compile] [--before-rev 678c568]
    python benchmarks/bench_trainer.py --gpu [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.common.config import from_dict
from trainer.dit_config import DiTTrainerConfig

BEFORE_REV = "678c568"
"""The last commit with the FP8 layer before issue 17 (fp32 rowwise backward, unfused, 2 graph breaks)."""

CPU_MODEL = {"preset": "", "input_size": 16, "in_channels": 4, "patch_size": 2, "hidden_dim": 128, "depth": 4,
             "num_heads": 4, "num_classes": 10}
"""64 tokens, width 128 (all linears multiples of 16, so every block linear converts to FP8)."""


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


def _cpu_worker(rank: int, world: int, port: int, variant: dict, args: argparse.Namespace, out_dir: str) -> None:
    from trainer.dit_train import build_model, global_grad_norm
    from trainer.flow import flow_loss, interpolate, velocity_target
    from trainer.fp8 import fp8_stats
    from trainer.parallel import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = from_dict(DiTTrainerConfig, {
        "global_batch_size": args.batch, "model": CPU_MODEL,
        "parallel": {"cp": variant["cp"], "param_dtype": variant["dtype"]},
        "fp8": {"enabled": variant["fp8"], "backend": "emulate"},
    })
    dp, cp = cfg.check_world(world)
    model, _ = build_model(cfg, torch.device("cpu"))
    parallelize(model, cfg.parallel, dp, cp, "cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    b = args.batch // dp
    x0 = torch.randn(b, 4, 16, 16, generator=gen)
    noise = torch.randn(b, 4, 16, 16, generator=gen)
    t, y = torch.rand(b, generator=gen), torch.randint(0, 10, (b,), generator=gen)
    x_t, target = interpolate(x0, noise, t), model.local_tokens(velocity_target(x0, noise))
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = flow_loss(model(x_t, t, y), target)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        global_grad_norm(model)
        optim.step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        step = statistics.median(times)
        tokens = args.batch * cfg.model.num_tokens
        result = {**variant, "world": world, "step_time_s": round(step, 5), "step_time_min_s": round(min(times), 5),
                  "tokens_per_s": round(tokens / step, 1), "fp8_stats": fp8_stats(model) or None}
        Path(out_dir, f"{variant['name']}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_cpu(args: argparse.Namespace) -> dict:
    variants = [
        {"name": "fp32_cp1", "dtype": "float32", "fp8": False, "cp": 1, "world": 1},
        {"name": "bf16_cp1", "dtype": "bfloat16", "fp8": False, "cp": 1, "world": 1},
        {"name": "fp8emu_cp1", "dtype": "float32", "fp8": True, "cp": 1, "world": 1},
        {"name": "fp32_cp2", "dtype": "float32", "fp8": False, "cp": 2, "world": 2},
    ]
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for v in variants:
            world = v.pop("world")
            mp.spawn(_cpu_worker, args=(world, _free_port(), v, args, out_dir), nprocs=world, join=True)
            results.append(json.loads(Path(out_dir, f"{v['name']}.json").read_text()))
    by = {r["name"]: r for r in results}
    base = by["fp32_cp1"]["step_time_s"]
    return {
        "mode": "cpu",
        "model": CPU_MODEL | {"tokens": (16 // 2) ** 2},
        "global_batch_size": args.batch,
        "threads_per_rank": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": results,
        "relative_step_time": {name: round(r["step_time_s"] / base, 3) for name, r in by.items()},
        "note": "CPU: fp8 is emulated (quantize/dequantize + fp32 matmul), slower by design; cp=2 uses 2 "
                "processes on a shared CPU, so it measures all-to-all overhead rather than a speed-up.",
    }


# ---------------------------------------------------------------- GPU mode
def _cuda_time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _measure_shape(m: int, k: int, n: int, dev: torch.device, args: argparse.Namespace) -> dict:
    from torch import nn

    from trainer.fp8 import E4M3, Float8Linear, compute_scale, quantize

    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    t_bf16 = _cuda_time(lambda: torch.mm(a, w.t()), args.warmup, args.iters)
    sa, _ = compute_scale(a, E4M3, rowwise=False)
    sw, _ = compute_scale(w, E4M3, rowwise=False)
    aq, _ = quantize(a, E4M3, sa)
    wq, _ = quantize(w, E4M3, sw)
    inv_a, inv_w = (1.0 / sa).float(), (1.0 / sw).float()
    # b operand column-major: wq is [N, K] row-major, so wq.t() is [K, N] column-major.
    t_fp8 = _cuda_time(lambda: torch._scaled_mm(aq, wq.t(), scale_a=inv_a, scale_b=inv_w,
                                                out_dtype=torch.bfloat16), args.warmup, args.iters)
    sa_r, _ = compute_scale(a, E4M3, rowwise=True)
    sw_r, _ = compute_scale(w, E4M3, rowwise=True)
    aq_r, _ = quantize(a, E4M3, sa_r)
    wq_r, _ = quantize(w, E4M3, sw_r)
    inv_ar, inv_wr = (1.0 / sa_r).float(), (1.0 / sw_r).float().reshape(1, -1)
    t_fp8_row = _cuda_time(lambda: torch._scaled_mm(aq_r, wq_r.t(), scale_a=inv_ar, scale_b=inv_wr,
                                                    out_dtype=torch.bfloat16), args.warmup, args.iters)
    ref = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    lin8 = Float8Linear.from_linear(ref, "tensorwise", use_scaled_mm=True)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def fwd_bwd(layer):
        def step():
            x.grad = None
            layer.weight.grad = None
            layer(x).backward(g)
        return step

    t_lin_bf16 = _cuda_time(fwd_bwd(ref), args.warmup, args.iters)
    t_lin_fp8 = _cuda_time(fwd_bwd(lin8), args.warmup, args.iters)
    return {
        "M": m, "K": k, "N": n,
        "gemm_bf16_ms": round(t_bf16 * 1e3, 4), "gemm_fp8_tensorwise_ms": round(t_fp8 * 1e3, 4),
        "gemm_fp8_rowwise_ms": round(t_fp8_row * 1e3, 4),
        "gemm_bf16_tflops": round(flops / t_bf16 / 1e12, 1), "gemm_fp8_tflops": round(flops / t_fp8 / 1e12, 1),
        "gemm_speedup": round(t_bf16 / t_fp8, 3),
        "linear_fwd_bwd_bf16_ms": round(t_lin_bf16 * 1e3, 4), "linear_fwd_bwd_fp8_ms": round(t_lin_fp8 * 1e3, 4),
        "linear_fwd_bwd_speedup": round(t_lin_bf16 / t_lin_fp8, 3),
    }


def run_gpu(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise SystemExit(f"--gpu needs compute capability >= 8.9 for FP8 _scaled_mm, found {cap}")
    dim, mlp, tokens = 1152, 4608, 256  # DiT-XL/2 on 32x32 latents (256x256 images)
    m = args.batch * tokens
    shapes = {"attn.qkv": (dim, 3 * dim), "attn.proj": (dim, dim), "mlp.fc1": (dim, mlp), "mlp.fc2": (mlp, dim)}
    rows = [{"layer": name, **_measure_shape(m, k, n, dev, args)} for name, (k, n) in shapes.items()]
    return {"mode": "gpu", "device": torch.cuda.get_device_name(dev), "capability": list(cap), "batch": args.batch,
            "tokens_per_image": tokens, "results": rows,
            "note": "linear_fwd_bwd includes dynamic amax/scale/cast per call (no torch.compile fusion)."}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_trainer.py")
    parser.add_argument("--gpu", action="store_true", help="real FP8 _scaled_mm vs bf16 at DiT-XL shapes")
    parser.add_argument("--ops", action="store_true", help="FP8 layer: op count, graph breaks, kernels, numerics")
    parser.add_argument("--before-rev", default=BEFORE_REV, help="git revision of trainer/fp8.py for 'before'")
    parser.add_argument("--no-compile", action="store_true", help="--ops: skip the inductor kernel count")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="CPU: global batch (default 8); GPU: images (32)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--iters", type=int, default=50, help="GPU: timed iterations per measurement")
    args = parser.parse_args(argv)
    if args.ops:
        from benchmarks.fp8_ops import run_ops

        result = run_ops(args.before_rev, compile_kernels=not args.no_compile)
    elif args.gpu:
        args.batch = args.batch or 32
        args.warmup = max(args.warmup, 5)
        result = run_gpu(args)
    else:
        args.batch = args.batch or 8
        result = run_cpu(args)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
