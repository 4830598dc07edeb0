"""The DiT trainer end to end: determinism, resume (same and different dp), numerics guard, sampling.

World-1 runs call ``trainer.dit_train.train`` in this process (a gloo group of
one); multi-rank runs use ``python -m torch.distributed.run`` with gloo.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from elastic.common.config import from_dict
from elastic.run.schema import RunConfig
from elastic.worker.channel import EXIT_NUMERICS
from elastic.worker.faults import write_fault
from elastic.worker.session import NumericsRollback, WorkerSession
from trainer.dit_train import train

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


@pytest.fixture
def world1(monkeypatch):
    def fresh_port():
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))

    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ELASTIC_AGENT_ADDR", raising=False)
    fresh_port()
    return fresh_port


def trainer_section(**overrides) -> dict:
    base = {"steps": 8, "seed": 0, "global_batch_size": 4, "optim": {"lr": 3e-3, "warmup_steps": 2},
            "data": {"num_samples": 24}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def run_file(trainer: dict, interval: int = 4) -> RunConfig:
    return from_dict(RunConfig, {"launch": {"workload": "dit"}, "trainer": trainer,
                                 "checkpoint": {"interval_steps": interval, "keep_last": 5}})


def run_in_process(world1, run_dir: Path, trainer: dict, interval: int = 4) -> str:
    world1()
    with WorkerSession.open(run_file(trainer, interval), run_dir) as session:
        return train(session)


def nan_at(run_dir: Path, step: int) -> None:
    """A NaN loss at ``step``, once per run directory (the run's fault files, as chaos injects it)."""
    write_fault(run_dir, f"nan-{step}", {"kind": "nan_loss", "step": step})


def events(run_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict]:
    path = run_dir / "events" / f"trainer-rank{rank}.jsonl"
    out = [json.loads(line) for line in path.open()]
    return [e for e in out if kind is None or e["kind"] == kind]


def _events_so_far(run_dir: Path, kind: str) -> list[dict]:
    """Rank 0's events of ``kind`` written so far (a partial last line is skipped)."""
    path = run_dir / "events" / "trainer-rank0.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event["kind"] == kind:
            out.append(event)
    return out


def write_yaml(path: Path, trainer: dict, interval: int = 4) -> Path:
    path.write_text(yaml.safe_dump({"launch": {"workload": "dit"}, "trainer": trainer,
                                    "checkpoint": {"interval_steps": interval, "keep_last": 5}, "fingerprint": ""}))
    return path


def torchrun(nproc: int, config: Path, run_dir: Path, env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainer.dit_train", "--config", str(config), "--run-dir", str(run_dir)]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def test_same_seed_bitwise_equal_and_stop_resume_matches_uninterrupted(tmp_path, world1):
    sec = trainer_section()
    a = run_in_process(world1, tmp_path / "a", sec)
    b = run_in_process(world1, tmp_path / "b", sec)
    assert a == b
    assert (tmp_path / "a" / "final_checksum.txt").read_text().strip() == a
    # a different seed really changes the result (the checksum is not constant)
    assert run_in_process(world1, tmp_path / "c", trainer_section(seed=1)) != a
    # stop after step 4 (checkpoint), start again with the full step budget: same weights
    run_in_process(world1, tmp_path / "r", trainer_section(steps=4))
    resumed = run_in_process(world1, tmp_path / "r", sec)
    assert resumed == a
    start = events(tmp_path / "r", kind="trainer.start")[-1]
    assert start["resumed"] and start["step"] == 4 and start["samples_seen"] == 16 and start["rank_rng_restored"]


def test_injected_nan_is_skipped_and_never_reaches_the_weights(tmp_path, world1):
    before = run_in_process(world1, tmp_path / "two", trainer_section(steps=2))
    nan_at(tmp_path / "nan", 3)
    after = run_in_process(world1, tmp_path / "nan", trainer_section(steps=3))
    assert after == before  # step 3 was dropped: no optimizer update at all
    bad = events(tmp_path / "nan", kind="trainer.numerics")
    assert [(e["step"], e["action"]) for e in bad] == [(3, "skip")]
    assert "non-finite loss" in bad[0]["reason"]
    step3 = events(tmp_path / "nan", kind="trainer.step")[-1]
    assert step3["skipped"] and math.isnan(step3["loss"])
    # training goes on after a skip and stays finite
    nan_at(tmp_path / "more", 3)
    run_in_process(world1, tmp_path / "more", trainer_section(steps=5))
    steps = events(tmp_path / "more", kind="trainer.step")
    assert [e["skipped"] for e in steps] == [False, False, True, False, False]
    assert all(math.isfinite(e["loss"]) for e in steps if not e["skipped"])
    assert events(tmp_path / "more", kind="trainer.done")[0]["total_skips"] == 1


def test_rollback_reports_and_exits_with_exit_numerics(tmp_path, world1, monkeypatch):
    """``main`` (what ``python -m trainer.dit_train`` exits with) returns EXIT_NUMERICS after reporting."""
    from trainer import dit_train

    config = write_yaml(tmp_path / "run.yaml", trainer_section(steps=6, numerics={"action": "rollback"}), interval=2)
    nan_at(tmp_path / "run", 3)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    monkeypatch.setenv("ELASTIC_AGENT_ADDR", f"127.0.0.1:{sock.getsockname()[1]}")
    # Under an agent a worker asks for SIGKILL when its parent dies; not for the pytest process.
    monkeypatch.setattr("elastic.worker.channel.set_parent_death_signal", lambda sig: None)
    assert dit_train.main(["--config", str(config), "--run-dir", str(tmp_path / "run")]) == EXIT_NUMERICS
    reports = []
    try:
        while True:
            reports.append(json.loads(sock.recv(65536)))
            if reports[-1]["type"] == "numerics":
                break
    finally:
        sock.close()
    assert reports[-1]["step"] == 3 and "non-finite loss" in reports[-1]["reason"]
    assert [r["step"] for r in reports if r["type"] == "step"] == [1, 2]
    # The step-2 checkpoint committed before the rollback (commits reach the agents through etcd).
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "COMMIT").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000002"]


def test_rollback_restart_resumes_from_last_commit_and_gets_past_the_fault(tmp_path, world1):
    sec = trainer_section(steps=6, numerics={"action": "rollback"})
    nan_at(tmp_path / "run", 3)
    with pytest.raises(NumericsRollback):
        run_in_process(world1, tmp_path / "run", sec, interval=2)
    assert events(tmp_path / "run", kind="trainer.rollback")[0]["step"] == 3
    # the injection is once per run dir: the restart (what the agent does on EXIT_NUMERICS) resumes
    # from the step-2 checkpoint and gets past step 3
    run_in_process(world1, tmp_path / "run", sec, interval=2)
    assert events(tmp_path / "run", kind="trainer.start")[-1]["step"] == 2
    assert [e["step"] for e in events(tmp_path / "run", kind="trainer.step")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_with_fewer_ranks_continues_with_the_next_samples(tmp_path, subprocess_env, world1):
    """Save with dp=2 (torchrun, 2 ranks), resume with dp=1: step, data position and losses continue."""
    sec = trainer_section(steps=8)
    run2 = tmp_path / "dp2"
    proc = torchrun(2, write_yaml(tmp_path / "run.yaml", sec), run2, subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_losses = {e["step"]: e["loss"] for e in events(run2, 0, "trainer.step")}
    assert events(run2, 1, "trainer.done")[0]["checksum"] == events(run2, 0, "trainer.done")[0]["checksum"]
    # keep only the step-4 checkpoint and continue on one rank
    resumed = tmp_path / "dp1"
    shutil.copytree(run2 / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    run_in_process(world1, resumed, sec)
    start = events(resumed, kind="trainer.start")[0]
    assert start["resumed"] and start["step"] == 4 and start["world_size"] == 1
    assert start["samples_seen"] == 4 * 4 and not start["rank_rng_restored"]  # other world size: global RNG only
    steps = events(resumed, kind="trainer.step")
    assert [e["step"] for e in steps] == [5, 6, 7, 8]
    assert [e["samples_seen"] for e in steps] == [20, 24, 28, 32]
    # Same samples, noise and timesteps as the dp=2 run: the losses agree up to reduction order.
    for e in steps:
        assert e["loss"] == pytest.approx(ref_losses[e["step"]], rel=1e-4, abs=1e-6), e["step"]


def test_sample_writes_png_grid_from_newest_checkpoint(tmp_path, world1):
    from trainer import sample

    run_in_process(world1, tmp_path / "run", trainer_section(steps=4), interval=2)
    out = tmp_path / "grid.png"
    assert sample.main(["--run-dir", str(tmp_path / "run"), "--out", str(out), "--per-class", "2",
                        "--max-classes", "3", "--steps", "4"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2 * (64 + 2) + 2, 3 * (64 + 2) + 2)  # 2 per class x 3 classes, 8x upscale
    assert sample.main(["--run-dir", str(tmp_path / "run"), "--out", str(out), "--step", "2"]) == 0
    assert sample.main(["--run-dir", str(tmp_path / "run"), "--out", str(out), "--step", "3"]) == 1


# Long tier (pytest -m soak): the restart path from disk for the DiT is also the chaos quick suite's
# corrupt_checkpoint scenario and test_inprocess_e2e.py's fallback test, both bitwise.
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_and_resume_bitwise_equal_two_ranks(tmp_path, subprocess_env):
    """2 ranks: SIGKILL torchrun after the step-4 commit, resume, compare with an uninterrupted run."""
    sec = trainer_section(steps=8, step_sleep=0.3)  # the sleep gives the kill time to land mid-run
    config = write_yaml(tmp_path / "run.yaml", sec)
    fast = write_yaml(tmp_path / "fast.yaml", {**sec, "step_sleep": 0.0})  # sleeping changes no numerics
    straight = torchrun(2, fast, tmp_path / "straight", subprocess_env, timeout=150)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "trainer.dit_train", "--config", str(config), "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, env=subprocess_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    # Kill mid-run: after the step-4 commit, once step 5 has trained.
    while not ((run / "checkpoints" / "step-00000004" / "COMMIT").exists()
               and any(e["step"] >= 5 for e in _events_so_far(run, "trainer.step"))):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "final_checksum.txt").exists()
    resumed = torchrun(2, fast, run, subprocess_env, timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = events(run, 0, "trainer.start")[-1]
    assert start["resumed"] and start["step"] >= 4 and start["rank_rng_restored"]
    assert (run / "final_checksum.txt").read_text() == (tmp_path / "straight" / "final_checksum.txt").read_text()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cp2_and_fp8_run_end_to_end(tmp_path, subprocess_env):
    """Full trainer with cp=2 (Ulysses, 2 ranks), FP8 emulation and 2 micro-batches (FSDP gradient sync
    toggled): runs, loss finite, fp8 stats logged."""
    sec = trainer_section(steps=4, micro_batch_size=2, model={"num_heads": 2}, parallel={"cp": 2},
                          fp8={"enabled": True})
    proc = torchrun(2, write_yaml(tmp_path / "run.yaml", sec), tmp_path / "run", subprocess_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = events(tmp_path / "run", 0, "trainer.start")[0]
    assert (start["dp"], start["cp"], start["fp8_layers"]) == (1, 2, 8)
    steps = events(tmp_path / "run", 1, "trainer.step")
    assert all(math.isfinite(e["loss"]) for e in steps)
    assert steps[-1]["fp8"]["layers"] == 8 and steps[-1]["fp8"]["amax_grad_max"] > 0


def test_bf16_fp8_activation_checkpointing_run(tmp_path, world1):
    """Mixed precision (bf16 params, fp32 reduce) + FP8 emulation + activation checkpointing train and resume."""
    sec = trainer_section(steps=4, parallel={"param_dtype": "bfloat16", "activation_checkpointing": True},
                          fp8={"enabled": True, "recipe": "rowwise"})
    first = run_in_process(world1, tmp_path / "run", sec, interval=2)
    steps = events(tmp_path / "run", kind="trainer.step")
    assert len(steps) == 4 and all(math.isfinite(e["loss"]) and not e["skipped"] for e in steps)
    assert steps[-1]["fp8"]["layers"] == 8 and steps[-1]["fp8"]["amax_input_max"] > 0
    assert events(tmp_path / "run", kind="trainer.start")[0]["fp8_layers"] == 8
    # the same run from its step-2 checkpoint ends bitwise identical
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000004")
    (tmp_path / "run" / "final_checksum.txt").unlink()
    assert run_in_process(world1, tmp_path / "run", sec, interval=2) == first


def test_trains_from_safetensors_latents(tmp_path, world1):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        save_file({"latents": torch.randn(6, 4, 8, 8, generator=gen), "labels": torch.arange(6) % 3},
                  str(tmp_path / f"shard-{i:03d}.safetensors"))
    sec = trainer_section(steps=3, data={"kind": "safetensors", "path": str(tmp_path), "num_samples": 1})
    run_in_process(world1, tmp_path / "run", sec)
    steps = events(tmp_path / "run", kind="trainer.step")
    assert [e["samples_seen"] for e in steps] == [4, 8, 12] and all(math.isfinite(e["loss"]) for e in steps)


def test_micro_batches_accumulate_to_the_full_batch_gradient(tmp_path, world1):
    full = trainer_section(steps=3, global_batch_size=6)
    run_in_process(world1, tmp_path / "full", full)
    run_in_process(world1, tmp_path / "micro", {**full, "micro_batch_size": 4})  # chunks of 4 + 2
    a = events(tmp_path / "full", kind="trainer.step")
    b = events(tmp_path / "micro", kind="trainer.step")
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
