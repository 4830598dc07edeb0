"""Rectified-flow (flow matching) objective and Euler sampler.

Convention: t = 0 is data, t = 1 is noise, on the straight line

    x_t = (1 - t) * x0 + t * eps,        eps ~ N(0, I)

The model predicts the velocity dx_t/dt = eps - x0 and is trained with the
MSE to it.  Training timesteps are logit-normal: t = sigmoid(mean + std * z),
z ~ N(0, 1), which puts more weight on the middle of the path.  Sampling
integrates dx/dt = v(x, t) from t = 1 (pure noise) down to t = 0 with Euler
steps on a uniform grid.

Per-sample randomness (noise, t, label dropout) comes from a generator seeded
by (seed, step, global sample index) alone.  A sample therefore gets the same
noise whichever rank, data-parallel size or restart processes it, and no RNG
state has to be carried across checkpoints for the objective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit generator seed from (seed, step, index) (splitmix64-style mixing)."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def per_sample_noise(
    seed: int,
    step: int,
    indices: Sequence[int],
    shape: Sequence[int],
    t_logit_mean: float,
    t_logit_std: float,
    class_dropout_prob: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise [B, *shape], t [B], drop_label [B] bool) for the given global sample indices."""
    noises, ts, drops = [], [], []
    for index in indices:
        gen = torch.Generator().manual_seed(sample_seed(seed, step, int(index)))
        noises.append(torch.randn(*shape, generator=gen))
        z = torch.randn((), generator=gen)
        ts.append(torch.sigmoid(t_logit_mean + t_logit_std * z))
        drops.append(torch.rand((), generator=gen) < class_dropout_prob)
    return torch.stack(noises), torch.stack(ts), torch.stack(drops)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise, with t broadcast over the non-batch dims."""
    t = t_B.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def flow_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (pred may be bf16 under mixed precision)."""
    return torch.mean((pred.float() - target.float()) ** 2)


@torch.no_grad()
def euler_sample(
    velocity: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    noise: torch.Tensor,
    labels: torch.Tensor | None,
    steps: int,
    cfg_scale: float = 1.0,
    null_class: int | None = None,
) -> torch.Tensor:
    """Integrate from t=1 (noise) to t=0 (data) with ``steps`` Euler steps.

    ``velocity(x, t, y)`` returns v in the shape of x.  With ``cfg_scale != 1``
    and labels, the guided velocity is v_uncond + s * (v_cond - v_uncond).
    """
    x = noise.clone()
    b = x.shape[0]
    grid = torch.linspace(1.0, 0.0, steps + 1)
    guided = labels is not None and null_class is not None and cfg_scale != 1.0
    for i in range(steps):
        t_now, t_next = float(grid[i]), float(grid[i + 1])
        t_B = torch.full((b,), t_now, dtype=torch.float32, device=x.device)
        if guided:
            assert labels is not None and null_class is not None
            both = velocity(torch.cat([x, x]), torch.cat([t_B, t_B]), torch.cat([labels, torch.full_like(labels, null_class)]))
            v_cond, v_uncond = both.chunk(2)
            v = v_uncond + cfg_scale * (v_cond - v_uncond)
        else:
            v = velocity(x, t_B, labels)
        x = x + (t_next - t_now) * v.to(x.dtype)
    return x
