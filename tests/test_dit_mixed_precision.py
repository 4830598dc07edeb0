"""Mixed precision keeps the conditioning exact: ``t`` reaches the timestep embedding in fp32.

FSDP2's root MixedPrecisionPolicy casts forward inputs by default, which rounded ``t`` to bf16
before the sinusoidal embedding (0.7 -> 0.69921875; at the embedding's highest frequency,
``t * 1000`` rad, that is a phase error of 0.78 rad) while sampling uses exact fp32 ``t``.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from elastic.common.config import from_dict
from trainer.dit import build_dit, timestep_embedding
from trainer.dit_config import ModelConfig, ParallelConfig
from trainer.parallel import parallelize

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("cpu:gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_timestep_reaches_the_embedding_in_fp32_under_bf16_fsdp(one_rank):
    model = build_dit(from_dict(ModelConfig, {"preset": "tiny"}), 0)
    parallelize(model, from_dict(ParallelConfig, {"param_dtype": "bfloat16"}), dp=1, cp=1, device_type="cpu")
    seen: list[torch.Tensor] = []
    model.t_embedder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    t = torch.tensor([0.7, 0.123456789], dtype=torch.float32)
    out = model(torch.randn(2, 4, 8, 8), t, torch.tensor([1, 2]))
    assert out.dtype == torch.bfloat16  # the blocks do run in bf16
    (t_seen,) = seen
    assert t_seen.dtype == torch.float32
    assert torch.equal(t_seen, t)  # bitwise: not 0.69921875
    # What the rounding would have cost: the highest-frequency phase moves by ~0.78 rad.
    exact, rounded = timestep_embedding(t, 256), timestep_embedding(t.bfloat16(), 256)
    assert (exact - rounded).abs().max() > 0.5
