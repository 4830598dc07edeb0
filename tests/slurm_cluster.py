"""A throwaway Slurm cluster on this host, for tests that submit the project's sbatch for real.

slurmctld and one slurmd per node run in the foreground (``-D``) as the current
user, with their state, spool and logs under a test directory and on free
loopback ports.  Several nodes share the host: each slurmd is started as
``slurmd -N <node>`` for its own ``NodeName`` entry with its own port, which
Slurm allows when it was built with ``--enable-multiple-slurmd`` (Debian's
build is; :func:`start_cluster` fails loudly if a node never registers).

Nothing is installed here: :func:`find_slurm` says what is missing so the test
can skip with that reason (CI installs the Debian packages in ``.ci/run``).
Authentication is ``auth/none`` (no munge daemon), processes are tracked by
``proctrack/linuxproc`` (no cgroups), and there is no accounting.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic.common.procs import alive
from elastic.control.etcd_server import free_port

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "sinfo")
# Daemons live in sbin, which is not on every user's PATH.
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# Every process of the test cluster (daemons and jobs) carries this variable: teardown finds them by it.
MARKER_ENV = "ELASTIC_TEST_SLURM"


def find_slurm() -> tuple[dict[str, str], str]:
    """({program: path}, "") when every Slurm program is present, else ({}, why not)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    found = {name: shutil.which(name, path=path) for name in DAEMONS + CLIENTS}
    missing = sorted(name for name, where in found.items() if where is None)
    if missing:
        return {}, (f"Slurm not installed ({', '.join(missing)} not found; "
                    "Debian: apt-get install slurmctld slurmd slurm-client)")
    return {name: str(where) for name, where in found.items()}, ""


def _short_host() -> str:
    return socket.gethostname().split(".")[0]


def slurm_conf(root: Path, nodes: list[str], ctld_port: int, node_ports: list[int], cpus: int) -> str:
    """slurm.conf for a cluster of ``nodes`` on this host, everything under ``root``."""
    host, user = _short_host(), getpass.getuser()
    lines = [
        "ClusterName=elastictest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                     f"CPUs={cpus} RealMemory=1000 State=UNKNOWN")
    lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    programs: dict[str, str]
    env: dict[str, str]
    """Environment for client commands and jobs: SLURM_CONF and the marker."""
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self, name: str, *args: str, timeout: float = 30) -> str:
        out = subprocess.run([self.programs[name], *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{name} {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def sbatch(self, script: Path, *args: str, env: dict[str, str]) -> int:
        job_env = {**env, **self.env}
        out = subprocess.run([self.programs["sbatch"], "--parsable", *args, str(script)], env=job_env,
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch exited {out.returncode}: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        text = self.client("scontrol", "-o", "show", "job", str(job_id))
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job has ended; its final record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return record
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout}s")

    def wait_running(self, job_id: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.job(job_id)["JobState"] != "RUNNING":
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not running after {timeout}s: {self.job(job_id)}")
            time.sleep(0.2)

    def _node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc.args[0]} exited {proc.returncode}; logs in {self.root / 'log'}")
            try:
                states = self._node_states()
            except (RuntimeError, subprocess.TimeoutExpired):
                states = {}
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        raise AssertionError(f"Slurm nodes not idle after {timeout}s: {states} (logs in {self.root / 'log'})")

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then kill whatever of the cluster is left."""
        try:
            self.client("scancel", "--user", getpass.getuser(), timeout=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in marked_pids(self.env[MARKER_ENV]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_cluster(root: Path, programs: dict[str, str], nodes: list[str]) -> SlurmCluster:
    """slurmctld and one slurmd per node, in the foreground, on free loopback ports."""
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, nodes, free_port(), [free_port() for _ in nodes], os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf), MARKER_ENV: str(root)}
    cluster = SlurmCluster(root, nodes, programs, env)
    try:
        cluster.daemons.append(_daemon([programs["slurmctld"], "-D", "-f", str(conf)], root / "log" / "slurmctld.out",
                                       env))
        for name in nodes:
            cluster.daemons.append(_daemon([programs["slurmd"], "-D", "-N", name, "-f", str(conf)],
                                           root / "log" / f"slurmd-{name}.out", env))
        cluster.wait_idle(timeout=30)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _daemon(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def pids_with_env(name: str, value: str) -> set[int]:
    """Live processes of this host whose environment has ``name=value``."""
    wanted = f"{name}={value}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and wanted in _environ(int(entry)) and alive(int(entry)):
            found.add(int(entry))
    return found


def marked_pids(root: str) -> set[int]:
    return pids_with_env(MARKER_ENV, root)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
