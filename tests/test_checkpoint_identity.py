"""Never lose progress, at the checkpoint level (single process, no process group): the fingerprint
covers what changes the meaning of saved state and nothing else, another config's checkpoint stops
the load with the differing fields, --fresh moves checkpoints aside, and failed saves in a row are
acted on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic.checkpoint.identity import basis_diff, move_aside, newest_marker
from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager, CheckpointMismatch
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage
from elastic.common.config import from_dict, override
from elastic.common.events import EventLog, read_events
from elastic.run.schema import RunConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _cfg(workload: str = "mlp", **trainer) -> RunConfig:
    return from_dict(RunConfig, {"launch": {"workload": workload}, "trainer": trainer})


@pytest.mark.parametrize("workload, neutral, meaningful", [
    ("mlp", {"steps": 50, "step_sleep": 0.3}, {"dim": 64}),
    ("dit", {"steps": 50, "step_sleep": 0.3, "flow": {"sample_steps": 4, "cfg_scale": 2.0}},
     {"model": {"depth": 3}}),
])
def test_fingerprint_ignores_run_length_and_pacing_only(workload, neutral, meaningful):
    base = _cfg(workload)
    assert _cfg(workload, **neutral).compute_fingerprint() == base.compute_fingerprint()
    assert _cfg(workload, **meaningful).compute_fingerprint() != base.compute_fingerprint()
    more_ranks = override(base, "launch.nproc_per_node", 4)  # the loader reshards: not a different state
    assert more_ranks.compute_fingerprint() == base.compute_fingerprint()
    assert "steps" not in base.fingerprint_basis()["trainer"]


def test_fingerprint_of_another_workload_differs():
    assert _cfg("mlp").compute_fingerprint() != _cfg("dit").compute_fingerprint()


def _save(root, cfg: RunConfig, step: int, storage=None, events=None) -> CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    mgr = CheckpointManager(CheckpointConfig(async_save=False, **({"max_consecutive_failures": 2} if storage else {})),
                            root, cfg.compute_fingerprint(), events or EventLog(None, "t"),
                            storage=storage, fingerprint_basis=cfg.fingerprint_basis())
    mgr.save(step, {"model": model.state_dict()})
    return mgr


def test_another_configs_checkpoint_stops_the_load_naming_the_fields(tmp_path):
    old = _cfg("mlp", dim=16, steps=8)
    _save(tmp_path, old, 8).close()
    extended = _cfg("mlp", dim=16, steps=40)
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, extended.compute_fingerprint(), EventLog(None, "t"),
                            fingerprint_basis=extended.fingerprint_basis())
    target = {"model": nn.Linear(4, 3).state_dict()}
    assert mgr.load_latest(target)[0] == 8  # a longer run resumes its checkpoints
    changed = _cfg("mlp", dim=32, depth=2, steps=8)
    mgr = CheckpointManager(CheckpointConfig(), tmp_path, changed.compute_fingerprint(), EventLog(None, "t"),
                            fingerprint_basis=changed.fingerprint_basis())
    with pytest.raises(CheckpointMismatch) as info:
        mgr.load_latest(target)
    line = str(info.value)
    assert "step-00000008" in line and "trainer.dim: 16 -> 32" in line and "trainer.depth: 3 -> 2" in line
    assert "--fresh" in line and "\n" not in line


def test_move_aside_never_deletes(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, _cfg("mlp"), 4).close()
    assert move_aside(root) == tmp_path / "checkpoints.old-0" and not root.exists()
    _save(root, _cfg("mlp"), 4).close()
    assert move_aside(root) == tmp_path / "checkpoints.old-1"
    assert newest_marker(tmp_path / "checkpoints.old-0")[1]["step"] == 4


def test_basis_diff_names_nested_and_missing_fields():
    assert basis_diff({"trainer": {"model": {"depth": 2}, "a": 1}}, {"trainer": {"model": {"depth": 3}}}) == [
        "trainer.a: 1 -> -", "trainer.model.depth: 2 -> 3"]


def test_failed_saves_in_a_row_stop_or_warn(tmp_path):
    failing = {8, 12, 16}
    storage = FaultInjectingStorage(LocalStorage(), lambda step: step in failing)
    events_path = tmp_path / "events.jsonl"
    events = EventLog(events_path, "trainer/rank0")
    mgr = _save(tmp_path / "ck", _cfg("mlp"), 4, storage, events)
    state = {"model": nn.Linear(4, 3).state_dict()}
    for step in (8, 12):
        mgr.save(step, state)
        assert mgr.failing() is None  # the streak is agreed at the start of the next save
    mgr.save(16, state)
    line = mgr.failing()
    assert line is not None and "2 checkpoint saves failed in a row (steps 8, 12" in line and "ENOSPC" in line
    assert "last committed step: 4" in line
    mgr.config.on_save_failure = "warn"
    assert mgr.failing() is None
    assert [e["failed_steps"] for e in read_events([events_path]) if e["kind"] == "checkpoint.failing"] == [[8, 12]]
    failing.clear()
    mgr.save(20, state)
    mgr.save(24, state)
    assert mgr.failed_in_a_row == [] and mgr.failing() is None  # a commit ends the streak
    mgr.close()
