"""Plain torchrun on this project's etcd3 backend: two "nodes" on loopback, one worker killed, torchrun's
own ``--max-restarts`` brings the run back, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE.  The handler
decides that each round's workers get a store of their own (a shared agent store handed restarted gloo
workers the previous attempt's addresses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic.common.events import read_run_events
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["etcd3", "etcd3-state"])
def test_both_handlers_give_workers_their_own_store(etcd_endpoint, monkeypatch, backend):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    params = RendezvousParameters(backend, etcd_endpoint, f"own-store-{backend}", 1, 1, local_addr="127.0.0.1")
    handler = get_rendezvous_handler(params)
    try:
        assert handler.use_agent_store is False
    finally:
        handler.shutdown()


def _torchrun(node: int, endpoint: str, config: Path, run_dir: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", "--rdzv-id=plain",
           "--rdzv-conf=join_timeout=60,last_call_timeout=1,heartbeat_timeout=5,keep_alive_interval=1",
           "--max-restarts=3", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
           "-m", "trainer.train", "--config", str(config), "--run-dir", str(run_dir)]
    log = open(run_dir.parent / f"torchrun-{node}.log", "w")
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_torchrun_recovers_a_killed_worker_with_its_own_restarts(tmp_path, etcd_endpoint, subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    run = tmp_path / "run"
    run.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": {"interval_steps": 4, "keep_last": 2}, "trainer": {
        "steps": 24, "batch_size": 8, "dim": 16, "depth": 2, "lr": 0.01, "step_sleep": 0.1}}))
    procs = [_torchrun(i, etcd_endpoint, config, run, env) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            victim = next((e for e in read_run_events(run) if e["kind"] == "trainer.step"
                           and e["source"] == "trainer/rank1" and e["step"] >= 6), None)
            time.sleep(0.1)
        assert victim is not None, "the run never reached step 6"
        os.kill(victim["pid"], signal.SIGKILL)
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "\n".join((tmp_path / f"torchrun-{i}.log").read_text(errors="replace")[-3000:] for i in range(2))
    assert codes == [0, 0], logs
    events = read_run_events(run)
    resumed = [e for e in events if e["kind"] == "trainer.start" and e["source"] == "trainer/rank0" and e["resumed"]]
    assert resumed and resumed[0]["step"] >= 4  # came back from a checkpoint, through torchrun's own restart
    assert max(e["step"] for e in events if e["kind"] == "trainer.step") == 24
    assert any(e["kind"] == "trainer.done" for e in events)
