"""The DiT built on the meta device for a world re-formed in-process (trainer.dit_train): no storage
until it is materialised, the fp8 conversion decided for the real device, the buffers outside the
state dict recomputed, and a first start still initialised from the seed.  The sharded build
restored from snapshots is checked in tests/test_reshard_p2p.py (real gloo worlds)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from elastic.common.config import from_dict
from trainer.dit_config import DiTTrainerConfig
from trainer.dit_train import build_model, materialize, restores_from_memory
from trainer.fp8 import Float8Linear


def _cfg(**extra) -> DiTTrainerConfig:
    return from_dict(DiTTrainerConfig, {"model": {"preset": "tiny"}, **extra}, "trainer")


def test_the_meta_build_has_no_storage_and_the_same_fp8_layers_for_the_real_device():
    cfg = _cfg(fp8={"enabled": True, "backend": "auto"})
    built, names = build_model(cfg, torch.device("cpu"))
    meta, meta_names = build_model(cfg, torch.device("cpu"), on_meta=True)
    assert {p.device.type for p in meta.parameters()} == {"meta"} and meta.pos_embed.is_meta
    assert meta_names == names and names
    kinds = {n: (type(m), getattr(m, "use_scaled_mm", None)) for n, m in built.named_modules()}
    assert {n: (type(m), getattr(m, "use_scaled_mm", None)) for n, m in meta.named_modules()} == kinds
    assert any(kind is Float8Linear for kind, _ in kinds.values())


def test_a_materialised_model_loaded_with_the_state_dict_is_bitwise_the_built_one():
    cfg = _cfg()
    built, _ = build_model(cfg, torch.device("cpu"))
    meta, _ = build_model(cfg, torch.device("cpu"), on_meta=True)
    materialize(meta, torch.device("cpu"))
    assert torch.equal(meta.pos_embed, built.pos_embed)  # not in the state dict: recomputed
    meta.load_state_dict(built.state_dict())
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t, y = torch.tensor([0.2, 0.9]), torch.tensor([1, 3])
    with torch.no_grad():
        assert torch.equal(meta(x, t, y), built(x, t, y))


def test_a_first_start_initialises_from_the_seed_whatever_ran_before():
    cfg = _cfg()
    first, _ = build_model(cfg, torch.device("cpu"))
    torch.manual_seed(123)  # the global RNG does not reach the initial weights
    again, _ = build_model(cfg, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))


def test_only_a_world_re_formed_in_process_builds_on_meta():
    assert not restores_from_memory(SimpleNamespace(inproc=None))
    assert not restores_from_memory(SimpleNamespace(inproc=SimpleNamespace(plan=None)))  # first start, gen 0
    assert restores_from_memory(SimpleNamespace(inproc=SimpleNamespace(plan=object())))
