"""Refusals that need no run: one line naming the path, field or target, exit 2, nothing started
(the CLIs run in-process; a launch that got past the check would be a test failure)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_real_launch(monkeypatch):
    import launch.local

    class _Refuse:
        def __init__(self, *args, **kwargs) -> None:
            raise AssertionError("the CLI accepted the input and tried to launch")

    monkeypatch.setattr(launch.local, "Launcher", _Refuse)
    monkeypatch.setattr("chaos.runner.ChaosRunner", _Refuse)


def _run(main, argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue().splitlines()


@pytest.mark.parametrize("where, cause", [
    ("/proc/nope", "cannot create the run directory: No such file or directory"),
    ("FILE", "exists and is not a directory"),
    ("FILE/sub", "cannot create the run directory: Not a directory"),
])
def test_an_unusable_run_dir_is_one_line_naming_it(tmp_path, where, cause):
    from launch.cli import main

    (tmp_path / "f").write_text("x")
    path = where.replace("FILE", str(tmp_path / "f"))
    code, lines = _run(main, ["--run-dir", path, str(REPO / "examples" / "mlp-tiny.yaml")])
    assert code == 2 and lines == [f"elastic-launch: run dir error: {path}: {cause}"]


def test_dit_node_range_refusal_names_the_trainer_field():
    from launch.cli import main

    code, lines = _run(main, ["--nodes", "3:4", str(REPO / "examples" / "tiny.yaml")])
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("elastic-launch: config error: trainer.global_batch_size: must be divisible by dp 3")


def test_chaos_run_checks_the_plans_targets_before_running(tmp_path):
    from chaos.cli import main

    plan = tmp_path / "plan.yaml"
    launch = ["--", "elastic-launch", str(REPO / "examples" / "mlp-tiny.yaml"), "--nodes", "3",
              "--run-dir", str(tmp_path / "run")]
    plan.write_text(yaml.safe_dump({"faults": [{"fault": "kill_worker", "target": "node1", "at_step": 3},
                                               {"fault": "kill_worker", "target": "node9", "at_step": 5}]}))
    code, lines = _run(main, ["run", str(plan), *launch])
    assert code == 2 and lines == ["chaos: error: faults[1].target: 'node9' is not a node of this launch "
                                   "(nodes: node0, node1, node2)"]
    plan.write_text(yaml.safe_dump({"faults": [{"fault": "nan", "target": "rank7", "at_step": 3}]}))
    code, lines = _run(main, ["run", str(plan), *launch])
    assert code == 2 and lines == ["chaos: error: faults[0].target: rank7 does not exist: this launch has at most "
                                   "3 ranks (rank0..rank2)"]


def test_interval_zero_is_documented_as_final_checkpoint_only():
    from elastic.checkpoint.config import CheckpointConfig
    from elastic.common.config import from_dict

    assert from_dict(CheckpointConfig, {"interval_steps": 0}).interval_steps == 0
    source = (REPO / "elastic" / "checkpoint" / "config.py").read_text()
    doc = source.split("interval_steps: int", 1)[1].split('"""')[1]
    assert "only the final checkpoint" in doc
    assert "checkpoint.interval_steps: 0" in (REPO / "docs" / "operations.md").read_text()
