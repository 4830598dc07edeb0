"""An etcd cluster of 1 or 3 members on loopback (local mode's ``launch.etcd_members``).

Three members tolerate the loss of one -- the raft leader included: the other two elect a
new leader within about a second and keep serving, and clients that list every member
(``--etcd-endpoint a,b,c``) move to a live one (:class:`~elastic.control.store.EtcdStore`).
That is what a c10d rendezvous, whose store lives in one agent's process, cannot offer.

Members of a 3-member cluster run etcd's default raft timings scaled down for loopback
(50 ms heartbeat, 500 ms election timeout): the single-member 10/100 ms would have a
CPU-starved follower on a busy 2-core host call elections all the time.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from elastic.control.etcd_server import EmbeddedEtcd, EtcdServerError, free_port

CLUSTER_RAFT_MS = (50, 500)


class EtcdCluster:
    """``members`` EmbeddedEtcd processes forming one cluster under ``data_dir``."""

    def __init__(self, data_dir: str | Path | None = None, members: int = 1, log_dir: str | Path | None = None,
                 name: str = "elastic-local") -> None:
        if members not in (1, 3):
            raise ValueError(f"etcd_members: must be 1 or 3, got {members}")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="etcd-cluster-"))
        log_dir = Path(log_dir) if log_dir else self.data_dir
        if members == 1:
            self.members = [EmbeddedEtcd(data_dir=self.data_dir / "member-0", log_path=log_dir / "etcd.log",
                                         name=name)]
            return
        peers = [free_port() for _ in range(members)]
        initial = ",".join(f"{name}-{i}=http://127.0.0.1:{port}" for i, port in enumerate(peers))
        self.members = [
            EmbeddedEtcd(data_dir=self.data_dir / f"member-{i}", log_path=log_dir / f"etcd-{i}.log",
                         name=f"{name}-{i}", peer_port=peers[i], initial_cluster=initial, raft_ms=CLUSTER_RAFT_MS)
            for i in range(members)
        ]

    @property
    def endpoints(self) -> str:
        """Every member's client address, comma-separated (``--etcd-endpoint``)."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def pids(self) -> list[int | None]:
        return [m.pid for m in self.members]

    def start(self, timeout: float = 30.0, parent_death_signal: int | None = None) -> str:
        for member in self.members:
            member.spawn(parent_death_signal)
        deadline = time.monotonic() + timeout
        for member in self.members:
            member.wait_healthy(max(deadline - time.monotonic(), 0.1))
        return self.endpoints

    def leader_index(self, timeout: float = 10.0) -> int:
        """Index of the member that is the raft leader now (as the live members report it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = {i: s for i, s in enumerate(map(self._status, self.members)) if s}
            leaders = {s.get("leader") for s in statuses.values()}
            for i, status in statuses.items():
                if status["header"]["member_id"] in leaders:
                    return i
            time.sleep(0.1)
        raise EtcdServerError("no etcd member reports a leader")

    @staticmethod
    def _status(member: EmbeddedEtcd) -> dict | None:
        if member.proc is None or member.proc.poll() is not None:
            return None
        request = urllib.request.Request(f"{member.client_url}/v3/maintenance/status", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def kill(self, index: int) -> None:
        """SIGKILL one member, as a crash of its host would."""
        self.members[index].kill()

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a killed member again on its data dir: it rejoins the cluster and catches up."""
        self.members[index].start(timeout)

    def close(self) -> None:
        for member in self.members:
            member.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
