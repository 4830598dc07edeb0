"""elastic.api, the trainers' public surface: the built-in trainers use it and nothing private, and its
own pieces (the Stateful, the NaN guard) work on a one-rank gloo group."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic import api
from elastic.control.etcd_server import free_port

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]
TRAINERS = ("train.py", "dit_train.py", "ft_train.py", "dit_ft_train.py")


def _elastic_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module and node.module.startswith("elastic")}


@pytest.mark.parametrize("name", TRAINERS)
def test_the_built_in_trainers_reach_the_worker_only_through_the_api(name):
    private = {m for m in _elastic_imports(REPO / "trainer" / name)
               if m.startswith(("elastic.worker", "elastic.checkpoint"))}
    assert private == set(), f"trainer/{name} imports {private}; use elastic.api"


def test_the_byo_example_uses_the_api_and_the_torch_free_registration_modules_only():
    byo = REPO / "examples" / "byo" / "elastic_byo"
    assert _elastic_imports(byo / "train.py") == {"elastic.api", "elastic_byo.config"}
    registration = _elastic_imports(byo / "workload.py") | _elastic_imports(byo / "config.py")
    assert registration == {"elastic.run.workloads", "elastic.common.config", "elastic_byo.config"}


def test_every_exported_name_exists():
    assert all(hasattr(api, name) for name in api.__all__)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("cpu:gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Position:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]


def _state(seed: int) -> api.TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return api.TrainState(model, optim, data=_Position())


def test_train_state_round_trips_model_optimizer_and_data_position(one_rank):
    src, dst = _state(0), _state(1)
    src.step, src.data.position = 7, 56
    dst.load_state_dict(src.state_dict())
    assert dst.step == 7 and dst.data.position == 56
    assert torch.equal(dst.model.weight, src.model.weight)
    assert src.snapshot_state_dict().keys() == {"model", "optim", "step", "data"}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def emit(self, kind: str, **fields) -> None:
        self.calls.append((kind, fields))

    def report_numerics(self, step: int, reason: str) -> None:
        self.calls.append(("report", step, reason))


def test_nan_guard_passes_a_finite_loss_and_rolls_back_a_nan(one_rank):
    rec = _Recorder()
    session = SimpleNamespace(events=rec, agent=rec)
    api.nan_guard(session, 3, torch.tensor(0.5))
    assert rec.calls == []
    with pytest.raises(api.NumericsRollback) as err:
        api.nan_guard(session, 4, torch.tensor(float("nan")))
    assert err.value.step == 4 and ("report", 4, "non-finite loss") in rec.calls


def test_loop_defaults_leave_the_optional_hooks_empty():
    loop = api.Loop()
    assert loop.extra() == {} and loop.resumed(3, None) == {} and loop.done_fields() == {}
