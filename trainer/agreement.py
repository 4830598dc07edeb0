"""Cross-replica agreement in the DiT replica trainer (``sdc.check_every``): find the group that computed wrong.

Every ``check_every`` steps, right after the step commits (after the optimizer step, before the step
is saved and before any gradient of the next step is shared), each rank computes a CRC32 of its
parameter shard (:func:`~elastic.sdc.agreement.shard_checksum`) and the groups compare them:

1. **Across the groups**, through torchft: one ``manager.allreduce`` (SUM) of an int64 tensor with
   one slot per group of the quorum, each group filling its own slot.  8 bytes per group travel, over
   the process group that already joins rank ``r`` of every group, and exactly the groups that trained
   this step are compared.  Not etcd: that would put etcd writes and a wait for every group's key on
   the step path, and an etcd outage would stop the checks while training goes on.
2. **Inside the group**: one all-reduce on the group's own process group, so every rank holds the
   whole matrix (group x rank) and every rank of every group reaches the same verdict
   (:func:`~elastic.sdc.agreement.judge`) with no further vote.

A suspect group emits ``sdc.suspect``, records a counted failure of its node (the leader's lemon-node
policy), does not save the step (when it is the writer), and sets its torchft step back by one: at the
next quorum it is behind its peers and heals from a live one, the same healing a restarted group gets,
without a restart.  The others go on at once; the next step trains on equal weights, so the run stays
on its fault-free trajectory.  The last step is not checked: no quorum follows it to heal in.

With no strict majority (two groups, a tie) nobody can be named: ``sdc.no_majority`` says so, with
every group's checksums, and training goes on (report only; the last step the groups agreed on is in
the event, so an operator knows which checkpoint predates the divergence).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic.api import WorkerSession
from elastic.common.env import ETCD_ENDPOINT_ENV, RUN_PREFIX_ENV
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState
from elastic.control.store import EtcdStore, StoreError
from elastic.sdc.agreement import Agreement, judge, shard_checksum
from elastic.sdc.config import SdcConfig

FAILURE_KIND = "sdc"
"""The kind of the counted failure a suspect group records for its node (lemon-node policy input)."""


@dataclass
class CheckOutcome:
    """One check's verdict as this group acts on it."""

    step: int
    agreement: Agreement
    own: int
    """This group's quorum rank."""

    @property
    def suspect(self) -> bool:
        return self.own in self.agreement.suspects


class AgreementCheck:
    """The check of one replica group (built once per worker; the manager is the group's torchft Manager)."""

    def __init__(self, cfg: SdcConfig, session: WorkerSession, replica_id: str) -> None:
        self.cfg = cfg
        self.session = session
        self.replica_id = replica_id
        self.last_agreed = 0

    def due(self, step: int, last_step: int, participants: int) -> bool:
        """Whether the weights just committed at ``step`` are compared (never the last step's: no quorum
        follows to heal in; nor a lone group's: nothing to compare with)."""
        return (self.cfg.agreement and step % self.cfg.check_every == 0 and 0 < step < last_step
                and participants > 1)

    def run(self, manager: Any, model: torch.nn.Module, committed: int) -> CheckOutcome | None:
        """The verdict on the weights after step ``committed``; None when a peer was lost during the check."""
        own, groups = manager.participating_rank(), manager.num_participants()
        if own is None:
            return None  # not a participant of this quorum (torchft's spare mode): nothing of ours to compare
        crc = shard_checksum(model.parameters())
        row = torch.zeros(groups, dtype=torch.int64)
        row[own] = crc
        manager.allreduce(row, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored():
            self.session.events.emit("sdc.check_lost", step=committed, replica_group=self.replica_id,
                                     error=str(manager.errored().original_exception))
            return None  # a peer was lost: these weights stay unverified until the next check
        matrix = self._group_matrix(row)
        outcome = CheckOutcome(committed, judge(matrix.tolist()), own)
        self._report(outcome)
        return outcome

    def _group_matrix(self, row: torch.Tensor) -> torch.Tensor:
        """(groups, group ranks): every rank's row, summed over the group's own process group."""
        world, rank = self.session.world, self.session.rank
        matrix = torch.zeros(row.numel(), world, dtype=torch.int64)
        matrix[:, rank] = row
        if world > 1:
            dist.all_reduce(matrix)  # gloo, int64: exact
        return matrix

    def _report(self, outcome: CheckOutcome) -> None:
        verdict, events = outcome.agreement, self.session.events
        if verdict.agree:
            self.last_agreed = outcome.step
        if self.session.rank != 0:
            return
        events.emit("sdc.checked", step=outcome.step, groups=len(verdict.checksums), agree=verdict.agree,
                    quorum_rank=outcome.own, suspects=sorted(verdict.suspects), no_majority=verdict.no_majority,
                    replica_group=self.replica_id)
        if outcome.suspect:
            self._suspect(outcome)
        if verdict.no_majority:
            events.emit("sdc.no_majority", step=outcome.step, node=self.replica_id, ranks=verdict.no_majority,
                        checksums=verdict.checksums, groups=len(verdict.checksums), last_agreed_step=self.last_agreed,
                        action="report only: no strict majority of groups to heal from")

    def _suspect(self, outcome: CheckOutcome) -> None:
        verdict = outcome.agreement
        ranks = verdict.suspects[outcome.own]
        own = verdict.checksum_of(outcome.own)
        self.session.events.emit(
            "sdc.suspect", node=self.replica_id, rank=ranks[0], ranks=ranks, step=outcome.step,
            checksum=own[ranks[0]], majority=verdict.majority[ranks[0]],
            checksums={str(r): own[r] for r in ranks}, majority_checksums={str(r): verdict.majority[r] for r in ranks},
            quorum_rank=outcome.own, groups=len(verdict.checksums), action="heal from a peer")
        record_failure(self.replica_id, self.session.epoch, self.session.events)

    @staticmethod
    def heal(manager: Any, outcome: CheckOutcome | None) -> None:
        """A suspect group steps its torchft step back by one, so the next quorum heals it from a peer."""
        if outcome is None or not outcome.suspect:
            return
        manager.load_state_dict({"step": manager.current_step() - 1,
                                 "batches_committed": manager.batches_committed()})


def record_failure(node: str, epoch: int, events: EventLog) -> None:
    """A counted failure of ``node`` in etcd: repeated suspects make it a lemon (``agent.leader``)."""
    endpoint, prefix = os.environ.get(ETCD_ENDPOINT_ENV), os.environ.get(RUN_PREFIX_ENV)
    if not endpoint or not prefix:
        return
    try:
        RunState(EtcdStore(endpoint, request_timeout=2.0, retry_deadline=2.0), RunKeys(prefix)).record_failure(
            node, FAILURE_KIND, epoch)
    except StoreError as exc:
        events.emit("sdc.record_failed", node=node, error=str(exc))
