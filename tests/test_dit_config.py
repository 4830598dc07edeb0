"""DiTTrainerConfig: presets, validation errors that name the field, torch-free import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic.common.config import ConfigError, from_dict, to_dict
from trainer.dit_config import MODEL_PRESETS, DiTTrainerConfig

FIXTURE = Path(__file__).parent / "fixtures" / "dit_tiny.yaml"


def build(data: dict) -> DiTTrainerConfig:
    return from_dict(DiTTrainerConfig, data, "trainer")


def test_defaults_and_presets():
    cfg = build({})
    assert (cfg.model.hidden_dim, cfg.model.depth, cfg.model.num_heads) == MODEL_PRESETS["tiny"]
    assert cfg.model.num_tokens == 16
    xl = build({"model": {"preset": "XL", "input_size": 32, "patch_size": 2}})
    assert (xl.model.hidden_dim, xl.model.depth, xl.model.num_heads) == (1152, 28, 16)
    assert xl.model.num_tokens == 256
    # an explicit size overrides the preset's
    wide = build({"model": {"preset": "tiny", "hidden_dim": 64}})
    assert wide.model.hidden_dim == 64 and wide.model.depth == 2


def test_round_trip_through_to_dict():
    cfg = build({"model": {"preset": "S"}, "parallel": {"cp": 2}, "fp8": {"enabled": True}})
    assert build(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"model": {"hidden_dim": 33}}, "trainer.model.hidden_dim"),  # not divisible by 2 heads
        ({"model": {"hidden_dim": 30}}, "trainer.model.num_heads"),  # head dim 15 is odd
        ({"model": {"preset": "", "hidden_dim": 32, "depth": 2}}, "trainer.model.num_heads"),
        ({"model": {"preset": "XXL"}}, "trainer.model.preset"),
        ({"model": {"patch_size": 3}}, "trainer.model.patch_size"),
        ({"model": {"class_dropout_prob": 1.0}}, "trainer.model.class_dropout_prob"),
        ({"parallel": {"cp": 3}}, "trainer.parallel.cp"),  # 16 tokens
        ({"parallel": {"cp": 4}}, "trainer.parallel.cp"),  # 2 heads
        ({"parallel": {"param_dtype": "float8"}}, "trainer.parallel.param_dtype"),
        ({"parallel": {"dp": 3}}, "trainer.global_batch_size"),  # 8 % 3
        ({"fp8": {"enabled": True}, "model": {"hidden_dim": 40, "num_heads": 2}}, "trainer.fp8.enabled"),
        ({"numerics": {"action": "ignore"}}, "trainer.numerics.action"),
        ({"numerics": {"spike_min_history": 100}}, "trainer.numerics.spike_min_history"),
        ({"optim": {"lr": 0}}, "trainer.optim.lr"),
        ({"data": {"kind": "safetensors"}}, "trainer.data.path"),
        ({"steps": 0}, "trainer.steps"),
        ({"step_sleep": -1}, "trainer.step_sleep"),
        ({"modle": {}}, "trainer.modle"),
    ],
)
def test_validation_errors_name_the_field(data, path):
    with pytest.raises(ConfigError) as info:
        build(data)
    assert info.value.path == path, str(info.value)
    assert str(info.value).startswith(path + ":")


def test_check_world():
    cfg = build({"parallel": {"cp": 2}, "global_batch_size": 4})
    assert cfg.check_world(4) == (2, 2)
    assert cfg.check_world(2) == (1, 2)
    with pytest.raises(ConfigError) as info:
        cfg.check_world(3)
    assert info.value.path == "parallel.cp"
    fixed = build({"parallel": {"dp": 2}, "global_batch_size": 4})
    with pytest.raises(ConfigError) as info:
        fixed.check_world(4)
    assert info.value.path == "parallel.dp"
    big = build({"global_batch_size": 6})
    with pytest.raises(ConfigError) as info:
        big.check_world(4)
    assert info.value.path == "global_batch_size"


def test_fixture_yaml_is_a_valid_trainer_section():
    data = yaml.safe_load(FIXTURE.read_text())
    assert data["launch"]["workload"] == "dit"
    assert set(data) >= {"run", "launch", "checkpoint", "trainer", "fingerprint"}
    cfg = build(data["trainer"])
    assert cfg.model.preset == "tiny"


def test_importable_without_torch():
    code = "import sys, trainer.dit_config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1], timeout=30)


def test_fixture_validates_as_a_run_config_with_the_dit_trainer_section():
    """The launcher reads the trainer section with the workload's config class."""
    from elastic.run.schema import RunConfig

    dit_run_config = RunConfig
    cfg = from_dict(dit_run_config, yaml.safe_load(FIXTURE.read_text()))
    assert isinstance(cfg.trainer, DiTTrainerConfig) and cfg.entrypoint() == ["-m", "trainer.dit_train"]
    assert cfg.trainer.parallel.cp == 1 and cfg.checkpoint.interval_steps == 10
    fp = cfg.compute_fingerprint()
    cfg.trainer.seed = 1
    assert cfg.compute_fingerprint() != fp
    bad = yaml.safe_load(FIXTURE.read_text())
    bad["trainer"]["model"]["num_heads"] = 3
    with pytest.raises(ConfigError) as info:
        from_dict(dit_run_config, bad)
    assert info.value.path == "trainer.model.hidden_dim"
