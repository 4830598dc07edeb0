"""The checkpoint's staging (FlatStager): a training-safe copy, DCP's tree as DCP's own stager makes it,
in one buffer kept between saves.

One gloo rank with the DiT under FSDP2, as the flagship trainer saves it: the staged copy must equal
DCP's default staging (keys, DTensor specs, bytes, every other value), stay what it was when the
training goes on, and a checkpoint saved through it must load back bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.staging import FlatStager
from elastic.checkpoint.statedict import same_tree
from elastic.common.config import from_dict
from trainer.dit import build_dit
from trainer.dit_config import ModelConfig, ParallelConfig
from trainer.parallel import parallelize

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank(monkeypatch):
    from elastic.control.etcd_server import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("cpu:gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained_dit() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_dit(from_dict(ModelConfig, {"preset": "tiny"}), 0)
    parallelize(model, from_dict(ParallelConfig, {}), dp=1, cp=1, device_type="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optim)
    return model, optim


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    out = model(torch.randn(2, 4, 8, 8), torch.tensor([0.3, 0.6]), torch.tensor([1, 2]))
    out.float().pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(model, optim) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"app": {"model": model_sd, "optim": optim_sd, "step": 1, "data": {"order": [3, 1, 2]}}}


def test_the_staged_tree_is_what_dcps_own_stager_makes(one_rank):
    model, optim = _trained_dit()
    state = _state(model, optim)
    ours = FlatStager().stage(state)
    theirs = DefaultStager(StagingOptions(False, False, False, False)).stage(state)
    assert same_tree(ours, theirs)
    weight = next(iter(ours["app"]["model"].values()))
    assert isinstance(weight, DTensor) and weight.placements == next(iter(state["app"]["model"].values())).placements


def test_the_staged_copy_stays_while_training_goes_on(one_rank):
    model, optim = _trained_dit()
    state = _state(model, optim)
    stager = FlatStager()
    staged = stager.stage(state)
    before = {k: v.to_local().clone() for k, v in staged["app"]["model"].items()}
    _step(model, optim)  # the live weights change...
    state["app"]["data"]["order"].append(9)  # ...and so does a list the state shares with the trainer
    assert all(torch.equal(staged["app"]["model"][k].to_local(), before[k]) for k in before)
    assert staged["app"]["data"]["order"] == [3, 1, 2]


def test_the_buffer_is_kept_between_saves_and_remade_for_new_shapes(one_rank):
    model, optim = _trained_dit()
    stager = FlatStager()
    first = stager.stage(_state(model, optim))
    ptr = next(iter(first["app"]["model"].values())).to_local().data_ptr()
    second = stager.stage(_state(model, optim))
    assert next(iter(second["app"]["model"].values())).to_local().data_ptr() == ptr
    third = stager.stage({"other": torch.zeros(5)})
    assert torch.equal(third["other"], torch.zeros(5))


def test_a_checkpoint_staged_this_way_loads_back_bitwise(one_rank, tmp_path):
    model, optim = _trained_dit()
    manager = CheckpointManager(from_dict(CheckpointConfig, {"interval_steps": 1}), tmp_path / "ckpt")
    try:
        manager.save(1, _state(model, optim))
        _step(model, optim)  # trains on while save 1 persists
        manager.save(2, _state(model, optim))  # reuses the buffer once save 1 is committed
        saved = {k: v.to_local().clone() for k, v in get_state_dict(model, optim)[0].items()}
        _step(model, optim)  # and on, while save 2 persists from the staged copy
        manager.wait()
        model_sd, optim_sd = get_state_dict(model, optim)
        loaded = {"app": {"model": model_sd, "optim": optim_sd, "step": 0, "data": {"order": []}}}
        step, _ = manager.load_latest(loaded)
    finally:
        manager.close()
    assert step == 2
    assert all(torch.equal(loaded["app"]["model"][k].to_local(), saved[k]) for k in saved)
    assert loaded["app"]["step"] == 1 and loaded["app"]["data"]["order"] == [3, 1, 2]
