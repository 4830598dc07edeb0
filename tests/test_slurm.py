"""The Slurm example under a real Slurm: slurmctld and three slurmd on this host run the project's sbatch.

Three Slurm nodes, not three tasks of one node: each ``NodeName`` gets its own
slurmd (``slurmd -N nX``, Debian's Slurm is built with multiple-slurmd support),
all on this host at 127.0.0.1. The job is ``examples/slurm/dit-64node.sbatch``
itself, sized down on the sbatch command line (3 nodes, no GPUs, 1 CPU per task)
and pointed at a tiny DiT config (examples/tiny.yaml with 2:3 nodes).

Job 1 runs on all three nodes and is cancelled (``scancel``) after two
checkpoints; job 2 is the same submission with bad memory-bandwidth readings
planted for n3 (``faults/diag-n3.yaml``, read by node.sh's burn-in screen): n3
leaves with 93, n1 and n2 resume from job 1's newest checkpoint and finish.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.load import CommittedCheckpoints
from elastic.common.events import read_run_events
from elastic.control.etcd_server import free_port
from tests.conftest import REPO_ROOT
from tests.launch_helpers import wait_all_gone
from tests.slurm_cluster import cmdline, find_slurm, pids_with_env, start_cluster

pytestmark = pytest.mark.slow

SBATCH = REPO_ROOT / "examples" / "slurm" / "dit-64node.sbatch"
NODES = ["n1", "n2", "n3"]
STEPS = 40
# The 64-node script as a 3-node job on this host: every other #SBATCH line stays as it is.
SBATCH_ARGS = ["--nodes=3", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]
PROGRAMS, MISSING = find_slurm()


@pytest.fixture
def slurm(tmp_path):
    if not PROGRAMS:
        pytest.skip(MISSING)
    cluster = start_cluster(tmp_path / "slurm", PROGRAMS, NODES)
    try:
        yield cluster
    finally:
        cluster.stop()


def _run_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((REPO_ROOT / "examples" / "tiny.yaml").read_text())
    cfg["run"] = {"id": "slurm", "dir": str(tmp_path / "run")}
    cfg["launch"]["nodes"] = "2:3"  # what the sbatch derives from --nodes=3
    cfg["trainer"].update(steps=STEPS, global_batch_size=6, step_sleep=0.25)  # 6 splits over 2 and 3
    cfg["checkpoint"]["interval_steps"] = 5
    # Wait a little for late joiners (their screens) so job 1 forms with all three nodes at once.
    cfg["rendezvous"] = {"last_call_timeout_s": 5}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _job_env(tmp_path: Path, subprocess_env: dict[str, str]) -> dict[str, str]:
    return {**subprocess_env, "REPO": str(REPO_ROOT), "BIN": str(Path(sys.executable).parent),
            "CONFIG": str(_run_config(tmp_path)), "RUN_DIR": str(tmp_path / "run"),
            "ETCD_PORT": str(free_port()), "ETCD_PEER_PORT": str(free_port()), "TMPDIR": str(tmp_path)}


def _job_processes(job_id: int) -> dict[int, str]:
    """pid -> command line of every process of the job on this host (they carry SLURM_JOB_ID)."""
    return {pid: cmdline(pid) for pid in pids_with_env("SLURM_JOB_ID", str(job_id))}


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        pairs = [item.decode(errors="replace").partition("=") for item in fh.read().split(b"\0") if item]
    return {k: v for k, _, v in pairs}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _agents(run_dir: Path, procs: dict[int, str]) -> dict[str, dict[str, str]]:
    """node id -> Slurm's variables of the live agent process that runs it.

    The launcher forks its agent (launch.agentproc): the pid comes from its event, the command line
    is the launcher's and the process is named elastic-agent.
    """
    agents = {}
    for event in read_run_events(run_dir):
        pid = event.get("agent_pid")
        if event["kind"] == "launcher.agent_started" and pid in procs:
            assert Path(f"/proc/{pid}/comm").read_text().strip() == "elastic-agent"
            agents[event["node"]] = _environ(pid)
    return agents


def _etcd_pid(procs: dict[int, str]) -> int:
    (pid,) = [p for p, cmd in procs.items() if "--data-dir" in cmd and "etcd" in cmd.split()[0]]
    return pid


def _wait_event(slurm, job_id: int, tmp_path: Path, predicate, timeout: float) -> dict:
    """The first matching run event; fails at once, with the job's output, if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_run_events(tmp_path / "run"):
            if predicate(event):
                return event
        record = slurm.job(job_id)
        if record["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"):
            out = tmp_path / f"dit64-{job_id}.out"
            tail = out.read_text()[-3000:] if out.exists() else "(no output)"
            raise AssertionError(f"job {job_id} ended {record['JobState']} {record['ExitCode']} first:\n{tail}")
        time.sleep(0.2)
    raise AssertionError(f"no matching event of job {job_id} within {timeout}s")


def _events_since(run_dir: Path, ts: float) -> list[dict]:
    return [e for e in read_run_events(run_dir) if e["ts"] >= ts]


def _newest_commit(run_dir: Path) -> int:
    commits = [e["step"] for e in read_run_events(run_dir)
               if e["kind"] == "checkpoint.committed" and e["source"] == "trainer/rank0"]
    return max(commits)


def _assert_all_gone(job_id: int, timeout: float) -> None:
    """Nothing of the job is left on the host: no process with its SLURM_JOB_ID, no slurmstepd of it."""
    left = wait_all_gone(set(_job_processes(job_id)), timeout)
    assert not left, {p: cmdline(p) for p in left}
    stepds = [int(p) for p in os.listdir("/proc")
              if p.isdigit() and cmdline(int(p)).startswith(f"slurmstepd: [{job_id}.")]
    assert not wait_all_gone(set(stepds), timeout)


def test_sbatch_screens_cancels_and_resumes_under_real_slurm(slurm, tmp_path, subprocess_env):
    env = _job_env(tmp_path, subprocess_env)
    run_dir = tmp_path / "run"

    # Job 1: three healthy nodes, cancelled mid-run after its second checkpoint.
    job1 = slurm.sbatch(SBATCH, *SBATCH_ARGS, f"--chdir={tmp_path}", env=env)
    _wait_event(slurm, job1, tmp_path, lambda e: e["kind"] == "trainer.step" and e["step"] >= 3, timeout=120)
    assert slurm.job(job1)["NodeList"] == "n[1-3]"  # three Slurm nodes, one slurmd each
    procs = _job_processes(job1)
    agents = _agents(run_dir, procs)
    # Every task is one agent whose node id is Slurm's node name, on its own task rank.
    assert sorted(agents) == NODES, procs
    assert all(agents[n]["SLURMD_NODENAME"] == n for n in NODES)
    assert sorted(agents[n]["SLURM_PROCID"] for n in NODES) == ["0", "1", "2"]
    # etcd is the batch script's child (slurmd's copy of it is `slurm_script`) and serves this job.
    etcd1 = _etcd_pid(procs)
    assert cmdline(_parent(etcd1)).endswith("slurm_script") and env["ETCD_PORT"] in procs[etcd1]
    start = next(e for e in read_run_events(run_dir) if e["kind"] == "trainer.start" and e["source"] == "trainer/rank0")
    assert start["world_size"] == 3 and not start["resumed"]

    _wait_event(slurm, job1, tmp_path, lambda e: e["kind"] == "checkpoint.committed" and e["step"] >= 10, timeout=120)
    slurm.client("scancel", str(job1))
    record = slurm.wait_job(job1, timeout=60)
    assert record["JobState"] == "CANCELLED", record
    _assert_all_gone(job1, timeout=15)
    assert not (tmp_path / f"etcd-{job1}").exists()  # the batch script's cleanup ran on SIGTERM
    events = read_run_events(run_dir)
    # SIGTERM reached every agent (it stopped its workers), and the run was cut short.
    stopped = {e["source"] for e in events if e["kind"] == "agent.state" and e.get("state") == "STOPPED"}
    assert stopped == {f"agent/{n}" for n in NODES}
    assert max(e["step"] for e in events if e["kind"] == "trainer.step") < STEPS
    newest = _newest_commit(run_dir)
    committed = CommittedCheckpoints(CheckpointConfig(), run_dir / "checkpoints")  # reads, removes nothing
    assert committed.committed_steps()[-1] == newest
    committed.verify(newest)  # every file of it, by size and sha256

    # Job 2: the same submission; n3's screen sees bad hardware and leaves with 93.
    (run_dir / "faults").mkdir()
    (run_dir / "faults" / "diag-n3.yaml").write_text("membw: {gbps_scale: 0.001}\n")
    submitted = time.time()
    job2 = slurm.sbatch(SBATCH, *SBATCH_ARGS, f"--chdir={tmp_path}", env=env)
    _wait_event(slurm, job2, tmp_path, lambda e: e["kind"] == "trainer.start" and e["ts"] >= submitted, timeout=120)
    procs = _job_processes(job2)
    assert sorted(_agents(run_dir, procs)) == ["n1", "n2"]
    assert cmdline(_parent(_etcd_pid(procs))).endswith("slurm_script")
    record = slurm.wait_job(job2, timeout=120)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), record
    _assert_all_gone(job2, timeout=15)

    out = (tmp_path / f"dit64-{job2}.out").read_text()
    assert "n3: task 2: Exited with exit code 93" in out, out  # srun's own report of the task
    prolog = yaml.safe_load((run_dir / "diag" / "prolog-n3.json").read_text())
    assert [c["name"] for c in prolog["checks"] if c["verdict"] == "fail"] == ["membw"]
    events = _events_since(run_dir, submitted)
    starts = [e for e in events if e["kind"] == "trainer.start"]
    # n1 and n2 went on without n3 (2 of 2:3), from job 1's newest checkpoint, to the last step.
    assert {(e["world_size"], e["resumed"], e["step"]) for e in starts} == {(2, True, newest)}
    assert {e["source"] for e in events if e["kind"] == "agent.start"} == {"agent/n1", "agent/n2"}
    assert max(e["step"] for e in events if e["kind"] == "trainer.step") == STEPS
    # etcd of job 2 was stopped by the script at the end: shut down cleanly, data dir removed.
    assert "closed etcd server" in (tmp_path / f"etcd-{job2}.log").read_text()
    assert not (tmp_path / f"etcd-{job2}").exists()
