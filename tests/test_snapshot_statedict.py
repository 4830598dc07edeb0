"""The per-step snapshot's cheap state dict is DCP's ``get_state_dict`` tree, or DCP's own answer.

One gloo rank with the DiT under FSDP2 (the flagship trainer's layout): after real optimizer steps
the cheap tree must equal DCP's in keys, tensor kinds, shapes and bytes, and every other value
(the learning rate that the trainer changes each step included); where it could differ, DCP's is used.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastic.checkpoint.snapshot import capture, restore, snapshot_nbytes, snapshot_state_dicts
from elastic.checkpoint.statedict import SnapshotStateDict, same_tree
from elastic.common.config import from_dict
from trainer.data import GlobalSampler
from trainer.dit import build_dit
from trainer.dit_config import ModelConfig, NumericsConfig, ParallelConfig
from trainer.dit_train import TrainState
from trainer.numerics import NumericsGuard
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


def _dit() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_dit(from_dict(ModelConfig, {"preset": "tiny"}), 0)
    parallelize(model, from_dict(ParallelConfig, {}), dp=1, cp=1, device_type="cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, lr: float) -> None:
    out = model(torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.6]), torch.tensor([1, 2]))
    out.float().pow(2).mean().backward()
    for group in optim.param_groups:
        group["lr"] = lr
    optim.step()
    optim.zero_grad(set_to_none=True)


def test_the_cheap_tree_is_dcps_after_every_step(one_rank):
    model, optim = _dit()
    cheap = SnapshotStateDict(model, optim)
    for step, lr in enumerate((1e-3, 5e-4, 2e-4)):
        _step(model, optim, lr)
        got = cheap()
        assert cheap.fast is True  # checked against DCP on the first call, cheap from then on
        assert same_tree(got, get_state_dict(model, optim)), f"differs from DCP after step {step}"
        assert got[1]["param_groups"][0]["lr"] == lr


def test_a_cheap_tree_that_differs_from_dcps_is_never_used(one_rank, monkeypatch):
    model, optim = _dit()
    _step(model, optim, 1e-3)
    real = SnapshotStateDict._cheap

    def renamed(self):  # what a wrapper that renames parameters would do to the cheap tree
        model_sd, optim_sd = real(self)
        return {f"wrapped.{k}": v for k, v in model_sd.items()}, optim_sd

    monkeypatch.setattr(SnapshotStateDict, "_cheap", renamed)
    cheap = SnapshotStateDict(model, optim)
    for _ in range(2):
        assert same_tree(cheap(), get_state_dict(model, optim))
        assert cheap.fast is False


def test_same_tree_tells_values_types_and_layouts_apart():
    a = {"w": torch.ones(2), "betas": (0.9, 0.99), "n": 1}
    assert same_tree(a, {"w": torch.ones(2), "betas": (0.9, 0.99), "n": 1})
    assert not same_tree(a, {"w": torch.zeros(2), "betas": (0.9, 0.99), "n": 1})
    assert not same_tree(a, {"w": torch.ones(2), "betas": [0.9, 0.99], "n": 1})
    assert not same_tree(a, {"w": torch.ones(2, dtype=torch.float64), "betas": (0.9, 0.99), "n": 1})
    assert not same_tree(a, {"w": torch.ones(2), "betas": (0.9, 0.99), "n": 1.0})
    assert not same_tree(a, {"w": torch.ones(2), "betas": (0.9, 0.99)})


def test_a_snapshot_of_the_cheap_tree_restores_the_dit_bitwise(one_rank):
    model, optim = _dit()
    sampler = GlobalSampler(64, 8, 0, True)
    state = {"app": TrainState(model, optim, sampler, NumericsGuard(from_dict(NumericsConfig, {})))}
    _step(model, optim, 1e-3)
    snap = capture(state, 1, 0, 0, 1)
    want = snapshot_state_dicts(state)["app"]
    fresh_model, fresh_optim = _dit()
    fresh = {"app": TrainState(fresh_model, fresh_optim, GlobalSampler(64, 8, 0, True),
                               NumericsGuard(from_dict(NumericsConfig, {})))}
    restore(fresh, [snap], 0, 1)
    assert same_tree(fresh["app"].state_dict(), want)


def test_sizing_a_fresh_optimizer_leaves_its_trajectory_alone(one_rank):
    """The snapshot cap's check before training reads the state for its sizes only: a fresh
    optimizer stays fresh (DCP would count a zero-lr step in Adam's state and shift every update)."""
    torch.manual_seed(0)
    sized_model, sized_optim = _dit()
    torch.manual_seed(0)
    plain_model, plain_optim = _dit()
    state = {"app": TrainState(sized_model, sized_optim, GlobalSampler(64, 8, 0, True), NumericsGuard(
        from_dict(NumericsConfig, {})))}
    nbytes = snapshot_nbytes(state)
    assert not sized_optim.state
    assert nbytes >= sum(p.to_local().numel() * 4 for p in sized_model.parameters())
    for model, optim in ((sized_model, sized_optim), (plain_model, plain_optim)):
        torch.manual_seed(1)
        _step(model, optim, 1e-3)
        _step(model, optim, 1e-3)
    assert same_tree(get_state_dict(sized_model, sized_optim), get_state_dict(plain_model, plain_optim))
    assert snapshot_nbytes(state) > nbytes  # now with Adam's two moments
