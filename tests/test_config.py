"""Run config: typed loading, one-line errors naming the field, CLI overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.common.config import ConfigError
from launch.cli import build_parser, resolve_config
from elastic.run.schema import load_run_file, parse_nodes


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_example_config_loads():
    cfg = load_run_file("examples/mlp-tiny.yaml")
    assert cfg.launch.max_nodes == 4 and cfg.trainer.steps == 40 and cfg.checkpoint.interval_steps == 10


@pytest.mark.parametrize("text, field", [
    ("trainer: {stepz: 3}\n", "trainer.stepz"),
    ("agent: {max_restarts: many}\n", "agent.max_restarts"),
    ("agent: {max_restarts: true}\n", "agent.max_restarts"),
    ("launch: {nodes: '4:2'}\n", "launch.nodes"),
    ("launch: {nodes: 'x'}\n", "launch.nodes"),
    ("checkpoint: {keep_last: 0}\n", "checkpoint.keep_last"),
    ("trainer: {lr: -1}\n", "trainer.lr"),
    ("run: {id: 'bad id!'}\n", "run.id"),
    ("rendezvous: [1, 2]\n", "rendezvous"),
    ("bogus_section: {}\n", "bogus_section"),
])
def test_bad_values_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as info:
        load_run_file(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert "\n" not in message


def test_invalid_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML at line 2"):
        load_run_file(write(tmp_path, "run:\n  id: a: b\n"))


def test_cli_flags_override_yaml():
    args = build_parser().parse_args(["examples/mlp-tiny.yaml", "--nodes", "2:3", "--steps", "7",
                                      "--set", "checkpoint.interval_steps=5", "--set", "agent.term_grace_s=1.5"])
    cfg = resolve_config(args)
    assert cfg.launch.nodes == "2:3" and cfg.launch.min_nodes == 2 and cfg.launch.max_nodes == 3
    assert cfg.trainer.steps == 7 and cfg.checkpoint.interval_steps == 5 and cfg.agent.term_grace_s == 1.5


def test_parse_nodes():
    assert parse_nodes("4") == (4, 4) and parse_nodes("2:8") == (2, 8)
    for bad in ("0", "3:2", "a:b", "", "1:2:3"):
        with pytest.raises(ValueError):
            parse_nodes(bad)


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0", "examples/mlp-tiny.yaml"], "--nodes"),
    (["--set", "trainer.nope=1", "examples/mlp-tiny.yaml"], "trainer.nope"),
    (["--set", "novalue", "examples/mlp-tiny.yaml"], "--set"),
    (["--etcd-endpoint", "host:notaport", "examples/mlp-tiny.yaml"], "launch.etcd_endpoint"),
    (["missing.yaml"], "cannot read config missing.yaml"),
])
def test_launcher_config_errors_are_one_line_exit_2(argv, needle, subprocess_env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch", *argv], env=subprocess_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("elastic-launch: config error:") and needle in lines[0]
    assert not (tmp_path / "runs").exists()


def test_dit_example_selects_the_dit_schema():
    from trainer.dit_config import DiTTrainerConfig

    cfg = load_run_file("examples/tiny.yaml")
    assert cfg.workload().name == "dit"
    assert isinstance(cfg.trainer, DiTTrainerConfig) and cfg.trainer.model.preset == "tiny"
    assert cfg.entrypoint() == ["-m", "trainer.dit_train"]


def test_a_custom_entrypoint_passes_its_trainer_section_through_unread(tmp_path):
    cfg = load_run_file(write(tmp_path, "launch:\n  entrypoint: [-m, my.trainer]\ntrainer:\n  anything: [1, 2]\n"))
    assert cfg.workload() is None and cfg.trainer == {"anything": [1, 2]}
    assert cfg.entrypoint() == ["-m", "my.trainer"]
    with pytest.raises(ConfigError, match=r"^launch.workload: unknown workload 'nope' \(known: dit, mlp\)"):
        load_run_file(write(tmp_path, "launch:\n  workload: nope\n"))
    with pytest.raises(ConfigError, match=r"^launch.entrypoint: give launch.workload or launch.entrypoint"):
        load_run_file(write(tmp_path, "launch:\n  workload: dit\n  entrypoint: [-m, x]\n"))


def test_dit_batch_must_split_over_every_elastic_world_size(tmp_path):
    text = open("examples/tiny.yaml").read().replace('nodes: "4"', 'nodes: "2:3"')
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size: .*at 3 nodes"):
        load_run_file(write(tmp_path, text)).check_launch()
