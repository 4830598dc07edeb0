"""Parallelism for the DiT: (dp, cp) device mesh, Ulysses context parallelism, FSDP2, activation checkpointing.

Layout: ranks form a ``(dp, cp)`` mesh (cp fastest, so a cp group is adjacent
ranks).  The ranks of one cp group see the same samples and each holds a
contiguous 1/cp slice of the token sequence.  Attention needs every token, so
each attention layer swaps sequence sharding for head sharding with one
all-to-all (Ulysses), runs ordinary SDPA on all tokens for its heads/cp, and
swaps back with a second all-to-all.  Everything else in a DiT block is
token-wise and needs no communication.

Why this is exact: each rank's loss is the mean over its own samples and
tokens, all equal-sized, so the true loss is the mean of the per-rank losses.
The all-to-all's backward routes every attention gradient back to the rank
that produced the input, so summing parameter gradients over the cp group
gives the gradient of the sum of the per-rank losses.  FSDP therefore shards
over the flattened ``dp * cp`` ranks and averages gradients over all of them,
which is the gradient of the global mean loss.

The probe (reference/torch-cpu-probe.md) found that torch's experimental
``context_parallel`` fails on CPU, while gloo ``all_to_all_single`` works; an
``all_gather`` variant is kept for backends without all-to-all (it moves cp
times more data but is equally exact).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.dit import DiT
from trainer.dit_config import ParallelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_mesh(device_type: str, dp: int, cp: int) -> DeviceMesh:
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened dp*cp mesh FSDP shards over."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def apply_context_parallel(model: DiT, group: dist.ProcessGroup | None) -> None:
    """Shard the token sequence of ``model`` over ``group`` (None or size 1 = off)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    cp = dist.get_world_size(group)
    if model.num_tokens % cp:
        raise ValueError(f"cp={cp} does not divide {model.num_tokens} tokens")
    model.cp_group = group
    model.cp_rank = dist.get_rank(group)
    model.cp_size = cp
    for block in model.blocks:
        attn = _inner(block).attn
        if attn.num_heads % cp:
            raise ValueError(f"cp={cp} does not divide {attn.num_heads} heads")
        attn.cp_group = group


def _inner(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)


def apply_activation_checkpointing(model: DiT) -> None:
    """Recompute each block in backward (non-reentrant checkpoint; applied before FSDP)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: DiT, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """fully_shard each block, then the root (embedders, final layer).

    The root does not cast its forward inputs: a cast would round the timestep ``t`` to
    ``param_dtype`` before the sinusoidal embedding (bf16 keeps 8 bits: 0.7 -> 0.69921875, and
    ``t * 1000`` times the highest frequency turns that into a phase error of radians), while
    :mod:`trainer.sample` samples with exact fp32 ``t``.  :meth:`DiT.forward` casts the image
    tokens itself and embeds ``t`` in fp32; the blocks keep casting their own inputs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # The last block's params are needed again first in backward: keep them unsharded.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < last)
    root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    fully_shard(model, mesh=mesh, mp_policy=root_mp)


def parallelize(model: DiT, cfg: ParallelConfig, dp: int, cp: int, device_type: str) -> DeviceMesh | None:
    """Apply, in order: context parallelism, activation checkpointing, FSDP. Returns the mesh."""
    mesh = None
    if dist.is_initialized():
        mesh = build_mesh(device_type, dp, cp)
        apply_context_parallel(model, mesh["cp"].get_group() if cp > 1 else None)
    elif cp > 1:
        raise ValueError("context parallelism needs torch.distributed")
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.fsdp and mesh is not None:
        apply_fsdp(model, fsdp_mesh(mesh), TORCH_DTYPES[cfg.param_dtype], TORCH_DTYPES[cfg.reduce_dtype])
    return mesh
