"""FP8 linear implementations side by side, in one run (``bench_trainer.py --ops``).

For ``nn.Linear`` (the baseline), the FP8 layer before issue 17 (``trainer/fp8.py`` at a git
revision), the current layer, and torchao's ``Float8Linear`` (when installed), per recipe:

* ``aten_ops`` / ``compute_ops``: aten ops of one forward+backward in eager mode, all of them
  and without the view-like ones (t, view, slice, detach, ...).  For torchao only the ops at its
  tensor-subclass level are seen (a dispatch mode does not see the plain ops a subclass runs
  inside its own dispatch, e.g. its ``_scaled_mm``), so its counts are lower bounds and its
  GEMMs show as ``subclass_mm``;
* ``scaled_mm`` / ``high_precision_mm``: FP8 GEMMs, and matmuls left in bf16/fp32 (a fallback);
* ``graph_breaks``: ``torch._dynamo.explain`` of the forward (dynamo traces the autograd
  function's forward and backward together);
* ``compiled_kernels``: kernels inductor generates for the compiled forward+backward (CPU
  backend, so C++ loops, not Triton: a relative figure, not a GPU prediction);
* ``rel_err_*``: relative Frobenius error of Y, dX, dW against an fp64 reference.

All layers run the real ``_scaled_mm`` code path (torch's CPU kernel) in bf16, the trainer's
``param_dtype``.  The torchao entry also runs three training steps of the DiT on 2 ranks with
FSDP2 + Ulysses cp=2 (gloo) next to the current layer, to show whether it fits our parallelism.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
M, K, N = 256, 256, 512
"""Tokens x in x out of the measured layer (multiples of 16, as every converted DiT linear)."""
VIEW_OPS = {"t", "view", "_unsafe_view", "unsqueeze", "squeeze", "slice", "detach", "expand", "permute",
            "transpose", "alias", "reshape", "as_strided", "select", "_reshape_alias", "split", "chunk"}
MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"}
RECIPES = ("tensorwise", "rowwise")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.matmul_dtypes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS and type(args[0]) not in (torch.Tensor, nn.Parameter):
            name = f"{name}[{type(args[0]).__name__}]"  # a tensor subclass's op: FP8 inside, not counted as bf16
        self.ops[name] += 1
        if name in MATMULS:
            self.matmul_dtypes.add(str(args[0].dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


def load_before(rev: str) -> tuple[Any | None, str]:
    """``trainer/fp8.py`` as of ``rev``, imported under another name; (None, why) if unavailable."""
    try:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:trainer/fp8.py"], capture_output=True,
                              text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"git show {rev}:trainer/fp8.py failed: {exc}"
    path = Path(tempfile.mkdtemp(prefix="fp8-before-")) / "fp8_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("fp8_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, rev


def torchao_config(recipe: str) -> Any:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe) if recipe != "tensorwise" else Float8LinearConfig()
    return dataclasses.replace(config, emulate=False)  # the CPU _scaled_mm kernel, like the others


def import_torchao() -> str | None:
    """None when torchao imports, else why not (its CUDA extensions warn on a CPU torch: silenced)."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao not installed ({exc})"
    return None


def implementations(before: Any | None, with_torchao: bool) -> dict[str, Callable[[nn.Linear, str], nn.Module]]:
    from trainer.fp8 import Float8Linear

    impls: dict[str, Callable[[nn.Linear, str], nn.Module]] = {}
    if before is not None:
        impls["before"] = lambda ref, recipe: before.Float8Linear.from_linear(ref, recipe, True)
    impls["current"] = lambda ref, recipe: Float8Linear.from_linear(ref, recipe, True)
    if with_torchao:
        from torchao.float8 import convert_to_float8_training

        def ao(ref: nn.Linear, recipe: str) -> nn.Module:
            wrapper = nn.Sequential(_clone(ref))
            convert_to_float8_training(wrapper, config=torchao_config(recipe))
            return wrapper[0]

        impls["torchao"] = ao
    return impls


def _clone(ref: nn.Linear) -> nn.Linear:
    new = nn.Linear(ref.in_features, ref.out_features, dtype=ref.weight.dtype)
    new.load_state_dict(ref.state_dict())
    return new


def _inputs(dtype: torch.dtype) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ref = nn.Linear(K, N).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(N, K, generator=gen) * K**-0.5)
        ref.bias.copy_(torch.randn(N, generator=gen) * 0.1)
    return ref, torch.randn(M, K, generator=gen).to(dtype), torch.randn(M, N, generator=gen).to(dtype)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def measure(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, ref: nn.Linear, compile_kernels: bool) -> dict:
    xa = x.clone().requires_grad_(True)
    with _CountOps() as count:
        y = layer(xa)
        y.backward(g)
    x64 = x.double().requires_grad_(True)
    w64 = ref.weight.detach().double().requires_grad_(True)
    y64 = x64 @ w64.t() + ref.bias.detach().double()
    y64.backward(g.double())
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x.clone().requires_grad_(True))
    row = {
        "aten_ops": sum(count.ops.values()),
        "compute_ops": sum(n for op, n in count.ops.items() if op not in VIEW_OPS),
        "scaled_mm": count.ops["_scaled_mm"],
        "high_precision_mm": sum(count.ops[op] for op in MATMULS),
        "subclass_mm": sum(n for op, n in count.ops.items() if "[" in op),
        "high_precision_mm_dtypes": sorted(count.matmul_dtypes),
        "graph_breaks": explained.graph_break_count,
        "graphs": explained.graph_count,
        "rel_err_y": round(_rel(y.detach(), y64.detach()), 5),
        "rel_err_dx": round(_rel(xa.grad, x64.grad), 5),
        "rel_err_dw": round(_rel(layer.weight.grad, w64.grad), 5),
    }
    if compile_kernels:
        row["compiled_kernels"] = _compiled_kernels(layer, x, g)
    return row


def _compiled_kernels(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> int | str:
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    metrics.reset()
    try:
        compiled = torch.compile(layer)
        compiled(x.clone().requires_grad_(True)).backward(g)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the other rows still run
        return f"compile failed: {type(exc).__name__}: {str(exc)[:200]}"
    return int(metrics.generated_kernel_count)


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


def _fit_worker(rank: int, world: int, port: int, impl: str, recipe: str, out_dir: str) -> None:
    """Three DiT training steps with FSDP2 over 2 ranks and Ulysses cp=2, FP8 from ``impl``."""
    import torch.distributed as dist

    from benchmarks.bench_trainer import CPU_MODEL
    from elastic.common.config import from_dict
    from trainer.dit import build_dit
    from trainer.dit_config import DiTTrainerConfig
    from trainer.flow import flow_loss
    from trainer.fp8 import _matches, convert_to_fp8
    from trainer.parallel import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo", rank=rank, world_size=world)
    cfg = from_dict(DiTTrainerConfig, {"global_batch_size": 2, "model": CPU_MODEL,
                                       "parallel": {"cp": 2, "param_dtype": "bfloat16"},
                                       "fp8": {"enabled": True, "recipe": recipe, "backend": "scaled_mm"}})
    model = build_dit(cfg.model, 0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # off the adaLN-Zero init, so the FP8 blocks shape the loss from the first step
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    include, exclude = cfg.fp8.include, cfg.fp8.exclude
    if impl == "torchao":
        import_torchao()
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=torchao_config(recipe),
                                   module_filter_fn=lambda mod, fqn: _matches(fqn, include, exclude)
                                   and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    else:
        convert_to_fp8(model, include, exclude, recipe, "scaled_mm")
    parallelize(model, cfg.parallel, 1, 2, "cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 4, 16, 16, generator=gen), torch.rand(2, generator=gen)
    y, target = torch.tensor([1, 2]), model.local_tokens(torch.randn(2, 4, 16, 16, generator=gen))
    losses = []
    for _ in range(3):
        loss = flow_loss(model(x, t, y), target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(float(avg))
    if rank == 0:
        Path(out_dir, f"{impl}-{recipe}.json").write_text(json.dumps({"losses": losses}))
    dist.destroy_process_group()


def fsdp_cp_fit(impls: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for impl in impls:
            for recipe in RECIPES:
                key = f"{impl}/{recipe}"
                try:
                    mp.spawn(_fit_worker, args=(2, _free_port(), impl, recipe, out_dir), nprocs=2, join=True)
                    out[key] = json.loads(Path(out_dir, f"{impl}-{recipe}.json").read_text())
                except Exception as exc:  # noqa: BLE001 - a misfit is the finding
                    out[key] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
    return out


def run_ops(before_rev: str, compile_kernels: bool = True) -> dict[str, Any]:
    before, before_note = load_before(before_rev)
    no_torchao = import_torchao()
    ref, x, g = _inputs(torch.bfloat16)
    rows = [{"impl": "nn.Linear", "recipe": "-", **measure(_clone(ref), x, g, ref, compile_kernels)}]
    for name, make in implementations(before, no_torchao is None).items():
        for recipe in RECIPES:
            rows.append({"impl": name, "recipe": recipe, **measure(make(ref, recipe), x, g, ref, compile_kernels)})
    fit = fsdp_cp_fit(["current"] + (["torchao"] if no_torchao is None else []))
    return {
        "mode": "ops",
        "shape": {"M": M, "K": K, "N": N, "dtype": "bfloat16"},
        "torch": torch.__version__,
        "torchao": _torchao_version() if no_torchao is None else no_torchao,
        "before": before_note if before is not None else f"skipped: {before_note}",
        "results": rows,
        "fsdp2_cp2_fit": fit,
        "note": "CPU run: op and kernel counts and errors are exact; no GPU time is measured here. "
                "torchao's count includes its tensor-subclass level.",
    }


def _torchao_version() -> str:
    import torchao

    return str(torchao.__version__)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(run_ops(sys.argv[1] if len(sys.argv) > 1 else "678c568"), indent=1))
