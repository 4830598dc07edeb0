"""Diffusion Transformer (DiT) with adaLN-Zero conditioning.

Shapes (legend): B batch, C latent channels, H = W latent size, p patch size,
N tokens = (H/p)^2, Nl tokens on this context-parallel rank (N / cp), D width,
Hd heads, Dh head dim, P = p*p*C values per patch.

The model works in token space: :meth:`DiT.forward` patchifies the latent,
keeps this rank's contiguous token slice (all of them unless context
parallelism is on), and returns the predicted velocity *as patch tokens*
``[B, Nl, P]``.  The training loss is computed on tokens (a permutation of the
pixels, so the MSE is the same), and :meth:`DiT.unpatchify` turns a full token
set back into ``[B, C, H, W]`` for sampling.

Context parallelism (Ulysses) is switched on by :func:`trainer.parallel.apply_context_parallel`,
which sets ``cp_group`` on the model and its attention modules.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.dit_config import ModelConfig
from trainer.ulysses import ulysses_all_to_all


def patchify(x_BCHW: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, N, p*p*C], tokens in row-major patch order, values (py, px, c)."""
    b, c, h, w = x_BCHW.shape
    x = x_BCHW.reshape(b, c, h // p, p, w // p, p)
    x = x.permute(0, 2, 4, 3, 5, 1)  # B, gh, gw, py, px, C
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens_BNP: torch.Tensor, p: int, c: int) -> torch.Tensor:
    """Inverse of :func:`patchify`."""
    b, n, _ = tokens_BNP.shape
    g = math.isqrt(n)
    x = tokens_BNP.reshape(b, g, g, p, p, c)
    x = x.permute(0, 5, 1, 3, 2, 4)  # B, C, gh, py, gw, px
    return x.reshape(b, c, g * p, g * p)


def sincos_pos_embed_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding [grid*grid, dim]: half the channels per axis."""
    assert dim % 4 == 0
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    coords = torch.arange(grid, dtype=torch.float64)
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")

    def axis(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([axis(gy), axis(gx)], dim=1).float()


def timestep_embedding(t_B: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of continuous t in [0, 1] (scaled by 1000, as for integer DDPM steps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    args = (t_B.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t_B: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(t_B, self.freq_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(emb)


class LabelEmbedder(nn.Module):
    """Class embedding with one extra row: label ``num_classes`` is the null class (CFG)."""

    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.table = nn.Embedding(num_classes + 1, dim)

    def forward(self, y_B: torch.Tensor) -> torch.Tensor:
        return self.table(y_B)


def modulate(x_BND: torch.Tensor, shift_BD: torch.Tensor, scale_BD: torch.Tensor) -> torch.Tensor:
    return x_BND * (1 + scale_BD.unsqueeze(1)) + shift_BD.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.cp_group: dist.ProcessGroup | None = None

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        b, n_local, d = x_BND.shape
        qkv = self.qkv(x_BND).reshape(b, n_local, 3, self.num_heads, self.head_dim)
        if self.cp_group is not None:
            cp = dist.get_world_size(self.cp_group)
            # Sequence-sharded, all heads -> full sequence, heads/cp: split the head axis
            # into cp groups, send group j to cp rank j, concatenate received sequence chunks.
            qkv = qkv.reshape(b, n_local, 3, cp, self.num_heads // cp, self.head_dim)
            qkv = ulysses_all_to_all(qkv, scatter_dim=3, gather_dim=1, group=self.cp_group)
            qkv = qkv.squeeze(3)  # B, N, 3, Hd/cp, Dh
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each B, heads, N, Dh
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2)  # B, N(full or local), heads, Dh
        if self.cp_group is not None:
            cp = dist.get_world_size(self.cp_group)
            n_full = out.shape[1]
            out = out.reshape(b, cp, n_full // cp, out.shape[2], self.head_dim)
            # Back: full sequence, heads/cp -> this rank's sequence chunk, all heads.
            out = ulysses_all_to_all(out.unsqueeze(3), scatter_dim=1, gather_dim=3, group=self.cp_group)
            out = out.squeeze(1)  # B, Nl, cp, Hd/cp, Dh
        return self.proj(out.reshape(b, n_local, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """Pre-norm transformer block; LayerNorm shift/scale and residual gates come from the condition."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, mlp_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x_BND: torch.Tensor, c_BD: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c_BD).chunk(6, dim=-1)
        x = x_BND + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x_BND), shift1, scale1))
        x = x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))
        return x


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch_values: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_values)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x_BND: torch.Tensor, c_BD: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c_BD).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x_BND), shift, scale))


class DiT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.hidden_dim is not None and cfg.depth is not None and cfg.num_heads is not None
        self.cfg = cfg
        dim = cfg.hidden_dim
        self.patch_size = cfg.patch_size
        self.in_channels = cfg.in_channels
        self.num_tokens = cfg.num_tokens
        self.patch_values = cfg.patch_size * cfg.patch_size * cfg.in_channels
        self.null_class = cfg.num_classes
        self.x_embedder = nn.Linear(self.patch_values, dim)  # == Conv2d(kernel=stride=p) on patches
        self.t_embedder = TimestepEmbedder(dim)
        self.y_embedder = LabelEmbedder(cfg.num_classes, dim) if cfg.num_classes > 0 else None
        self.register_buffer("pos_embed", self._pos_table(), persistent=False)
        self.blocks = nn.ModuleList(DiTBlock(dim, cfg.num_heads, cfg.mlp_dim) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(dim, self.patch_values)
        # Context parallelism: this rank owns tokens [cp_rank * Nl, (cp_rank + 1) * Nl).
        self.cp_group: dist.ProcessGroup | None = None
        self.cp_rank = 0
        self.cp_size = 1
        self.reset_parameters()

    def _pos_table(self) -> torch.Tensor:
        assert self.cfg.hidden_dim is not None
        return sincos_pos_embed_2d(self.cfg.hidden_dim, self.cfg.input_size // self.cfg.patch_size)

    def reset_buffers(self) -> None:
        """Compute the buffers that are not in the state dict (``pos_embed``) into their storage.

        A model built on the meta device and materialised with ``to_empty`` (only its local
        shards: :func:`trainer.dit_train.materialize`) has garbage there, and a restore fills only
        what the state dict holds.  Computed on the CPU as at construction, then copied: the
        same bits as a model built directly."""
        with torch.device("cpu"), torch.no_grad():
            self.pos_embed.copy_(self._pos_table())

    def reset_parameters(self) -> None:
        """DiT initialisation: xavier linears, N(0, 0.02) embeddings, adaLN-Zero (gates and output = 0)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.table.weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def local_token_range(self) -> tuple[int, int]:
        n_local = self.num_tokens // self.cp_size
        return self.cp_rank * n_local, (self.cp_rank + 1) * n_local

    def local_tokens(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """This rank's patch tokens of an image-shaped tensor (inputs and loss targets)."""
        lo, hi = self.local_token_range()
        return patchify(x_BCHW, self.patch_size)[:, lo:hi]

    def forward(self, x_BCHW: torch.Tensor, t_B: torch.Tensor, y_B: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity prediction for this rank's tokens, [B, Nl, P]."""
        lo, hi = self.local_token_range()
        tokens = self.local_tokens(x_BCHW).to(self.x_embedder.weight.dtype)
        x = self.x_embedder(tokens) + self.pos_embed[lo:hi].to(tokens.dtype)
        c = self.t_embedder(t_B)
        if self.y_embedder is not None:
            if y_B is None:
                y_B = torch.full_like(t_B, self.null_class, dtype=torch.long)
            c = c + self.y_embedder(y_B)
        for block in self.blocks:
            x = block(x, c)
        # Linear on a 3-D input returns a view of its 2-D result; FSDP2 warns about view outputs
        # of the root module (an in-place op on them would skip its backward hook).  The output is
        # only P values per token, so a copy is cheap and keeps the logs clean.
        return self.final_layer(x, c).clone()

    def unpatchify(self, tokens_BNP: torch.Tensor) -> torch.Tensor:
        return unpatchify(tokens_BNP, self.patch_size, self.in_channels)


def build_dit(cfg: ModelConfig, seed: int) -> DiT:
    """Same initial weights on every rank (seeded before construction)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DiT(cfg)
