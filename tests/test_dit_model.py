"""DiT model and rectified-flow objective (single process)."""

from __future__ import annotations

import pytest
import torch

from elastic.common.config import from_dict
from trainer.dit import DiT, build_dit, patchify, unpatchify
from trainer.dit_config import ModelConfig
from trainer.flow import (
    euler_sample,
    flow_loss,
    interpolate,
    per_sample_noise,
    sample_seed,
    velocity_target,
)
from trainer.parallel import apply_activation_checkpointing


def tiny(**kw) -> ModelConfig:
    return from_dict(ModelConfig, {"preset": "tiny", **kw})


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero adaLN gates and output layer, so that every parameter gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def test_patchify_round_trip_and_order():
    x = torch.randn(2, 4, 8, 8)
    tokens = patchify(x, 2)
    assert tokens.shape == (2, 16, 16)
    assert torch.equal(unpatchify(tokens, 2, 4), x)
    # token 1 is the patch at rows 0-1, cols 2-3; its first value is pixel (0, 2) of channel 0
    assert tokens[0, 1, 0] == x[0, 0, 0, 2]


def test_forward_shapes_and_adaln_zero_init():
    model = build_dit(tiny(), seed=0)
    x, t, y = torch.randn(3, 4, 8, 8), torch.rand(3), torch.tensor([0, 1, 10])  # 10 = null class
    out = model(x, t, y)
    assert out.shape == (3, 16, 16)
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: the initial model predicts 0
    assert model.unpatchify(out).shape == x.shape
    assert model.y_embedder.table.num_embeddings == 11


def test_same_seed_same_init_and_presets_build():
    a, b = build_dit(tiny(), 3), build_dit(tiny(), 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    s = DiT(from_dict(ModelConfig, {"preset": "S", "input_size": 8, "depth": 1}))
    assert s.blocks[0].attn.qkv.weight.shape == (3 * 384, 384) and s.blocks[0].attn.num_heads == 6


def test_conditioning_changes_output():
    model = build_dit(tiny(), 0)
    randomize(model)
    x = torch.randn(2, 4, 8, 8)
    base = model(x, torch.tensor([0.3, 0.3]), torch.tensor([1, 1]))
    assert not torch.allclose(base, model(x, torch.tensor([0.7, 0.7]), torch.tensor([1, 1])))
    assert not torch.allclose(base, model(x, torch.tensor([0.3, 0.3]), torch.tensor([2, 2])))


def test_activation_checkpointing_same_loss_and_grads():
    ref = build_dit(tiny(), 0)
    randomize(ref)
    ac = build_dit(tiny(), 0)
    ac.load_state_dict(ref.state_dict())
    apply_activation_checkpointing(ac)
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([3, 4])
    flow_loss(ref(x, t, y), torch.zeros(2, 16, 16)).backward()
    flow_loss(ac(x, t, y), torch.zeros(2, 16, 16)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in ac.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name.replace("_checkpoint_wrapped_module.", "")], rtol=0, atol=0)


def test_interpolation_convention_and_velocity():
    x0, noise = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    assert torch.equal(interpolate(x0, noise, torch.zeros(4)), x0)  # t = 0 is data
    assert torch.equal(interpolate(x0, noise, torch.ones(4)), noise)  # t = 1 is noise
    t = torch.tensor([0.1, 0.4, 0.5, 0.9])
    eps = 1e-3
    numeric = (interpolate(x0, noise, t + eps) - interpolate(x0, noise, t - eps)) / (2 * eps)
    torch.testing.assert_close(numeric, velocity_target(x0, noise), atol=1e-3, rtol=1e-3)


def test_euler_sampler_follows_exact_velocity_field():
    # With the true straight-line velocity (noise - x0) Euler integration is exact.
    x0, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    out = euler_sample(lambda x, t, y: noise - x0, noise, None, steps=7)
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
    # CFG combination: v_u + s (v_c - v_u)
    seen = []

    def velocity(x, t, y):
        seen.append(y.clone())
        return torch.where((y == 5).reshape(-1, 1, 1, 1), torch.ones_like(x), torch.zeros_like(x))

    guided = euler_sample(velocity, torch.zeros(1, 4, 8, 8), torch.tensor([0]), steps=2, cfg_scale=3.0, null_class=5)
    # v_cond = 0 (label 0), v_uncond = 1 (null): v = 1 + 3 (0 - 1) = -2; x(0) = 0 - 1 * (-2) = 2
    torch.testing.assert_close(guided, torch.full((1, 4, 8, 8), 2.0))
    assert seen[0].tolist() == [0, 5]


def test_per_sample_noise_depends_only_on_seed_step_index():
    a = per_sample_noise(0, 5, [3, 9], (4, 8, 8), 0.0, 1.0, 0.1)
    b = per_sample_noise(0, 5, [9], (4, 8, 8), 0.0, 1.0, 0.1)
    assert torch.equal(a[0][1], b[0][0]) and torch.equal(a[1][1], b[1][0])
    c = per_sample_noise(0, 6, [9], (4, 8, 8), 0.0, 1.0, 0.1)
    assert not torch.equal(b[0], c[0])
    assert sample_seed(0, 1, 2) != sample_seed(0, 2, 1)


def test_logit_normal_timesteps():
    _, t, drop = per_sample_noise(0, 1, range(2000), (1,), 0.0, 1.0, 0.25)
    assert 0 < float(t.min()) and float(t.max()) < 1
    assert abs(float(t.median()) - 0.5) < 0.03
    logit = torch.log(t / (1 - t))
    assert abs(float(logit.std()) - 1.0) < 0.06
    assert abs(float(drop.float().mean()) - 0.25) < 0.03
    _, t_shift, _ = per_sample_noise(0, 1, range(500), (1,), 1.0, 0.5, 0.0)
    assert float(t_shift.median()) > 0.65  # sigmoid(1) = 0.73


@pytest.mark.timeout(120)
def test_loss_decreases_on_synthetic_data(tmp_path, free_port_env):
    """~100 steps of the real trainer (world 1, in process): the mean loss falls by > 25%."""
    import json

    from elastic.run.schema import RunConfig
    from elastic.worker.session import WorkerSession
    from trainer.dit_train import train

    cfg = from_dict(RunConfig, {
        "launch": {"workload": "dit"},
        "trainer": {"steps": 100, "global_batch_size": 16, "optim": {"lr": 3e-3, "warmup_steps": 10}},
        "checkpoint": {"interval_steps": 0},
    })
    with WorkerSession.open(cfg, tmp_path) as session:
        train(session)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "events" / "trainer-rank0.jsonl").open()
              if '"trainer.step"' in line]
    assert len(losses) == 100
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.75 * first, (first, last)


@pytest.fixture
def free_port_env(monkeypatch):
    from elastic.control.etcd_server import free_port

    port = free_port()
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ELASTIC_AGENT_ADDR", raising=False)


def test_xl_preset_has_dit_xl2_size():
    """DiT-XL/2 on 32x32x4 latents with 1000 classes has about 675M parameters (DiT paper)."""
    with torch.device("meta"):
        model = DiT(from_dict(ModelConfig, {"preset": "XL", "input_size": 32, "num_classes": 1000}))
    count = sum(p.numel() for p in model.parameters())
    assert 670e6 < count < 680e6, count
    assert model.num_tokens == 256 and len(model.blocks) == 28 and model.blocks[0].attn.num_heads == 16
