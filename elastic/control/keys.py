"""Every etcd key a run owns, built in one place.

All of a run's keys live under ``<key_prefix>/runs/<run_id>`` (the run prefix), so that a run
can be listed, inspected (``elastic status``) and cleaned up as one prefix range::

    epoch                      run-wide restart epoch (int, compare-and-swap)
    stop                       {reason, by, ts}: the run was stopped on purpose; every agent leaves
    done                       {by, ts}: a node finished training
    numerics                   {ranges: [{lo, hi, epoch, by}], rollbacks}: batches skipped after NaNs
    leader                     {node, ts} on the leader's lease
    leader_view                {epoch, members}: the nodes the last leader saw heartbeating in that
                               epoch (no lease: a new leader compares with it, see leader.check_lost)
    nodes/<node>               node record on the node's lease (state, failures, metrics address)
    heartbeat/<node>           step, step time, epoch, on the node's lease
    excluded/<node>            exclusion record {reason, until, by, ts}
    failures/<node>/<ms>       one record per counted failure (lemon-node policy)
    faults/<epoch>/<node>      one record per fault: the node that failed or was lost in that epoch
                               (create-only, so the N agents that notice one fault write it once)
    noticed/<epoch>/<gen>      {step, by, kind, ts}: the first agent to notice a fault in that epoch
                               (generation ``gen`` of an in-process re-formation, 0 on the epoch path)
                               and the step its workers stood at (create-only)
    members/<node>             {state, ts}: the roster (no lease): "joined" while the node takes part,
                               its final state once its agent left cleanly, "lost" once the leader
                               found its lease expired
    hangs/<epoch>/<node>       a stalled node's ranks: where each one is (hang attribution)
    sdc/rollback               {from_step, epoch, node, rank, by, ts}: a replay found a silent corruption
                               at from_step in epoch; checkpoints of that step or later committed in
                               that epoch or before hold it
    sdc/sums/<rank>            that rank's last few replay checks: its gradient's checksums by step,
                               the world (epoch.generation) that computed them (one key per rank)
    sdc/verified/<node>        {step, rank, tag, ts}: the newest check that node's spare verified (agreed);
                               an epoch is verified through the lowest of its verifiers' ones
    diag/<node>                newest screen verdict
    admission/{token,fingerprint}
    checkpoint/latest          newest committed checkpoint (a hint; disk is the truth)
    torchft/{lighthouse,finished}
    chaos/requests/<node>/<id>  a fault for that node's agent to execute (HMAC'd with the run token)
    chaos/results/<node>/<id>   what the agent did with it (executed, or refused and why)
    gen/<epoch>/0/members/<node>   generation 0: a node's local slots and the ranks torchrun gave them
    gen/<epoch>/<g>/join/<node>    a node joins generation g: its live local slots, in one record
    gen/<epoch>/<g>/lost/<node>    a node declared lost for generation g (create-only)
    gen/<epoch>/<g>/plan           generation g as a delta of g-1 (create-only, by the round's coordinator)
    gen/<epoch>/<g>/store          where the generation's c10d store (served by its rank 0) listens
    rdzv/closed                the rendezvous was closed (torchrun's set_closed / shutdown)
    rdzv/latest                number of the newest round that formed (etcd3 barrier handler)
    rdzv/round/<r>/ctl/        coord (on the coordinator's lease), done (the round record),
                               master (shared TCPStore address), closed
    rdzv/round/<r>/join/<node> one join record per node, on the node's lease
    rdzv/state                 the etcd3-state backend's one state blob (torch's DynamicRendezvous)
    c10d/<r>/...               the torch Store of round r (rank assignment, exit barrier)

Nothing outside this module formats a run key; callers ask :class:`RunKeys` for it.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKEND_NAME = "etcd3"
"""The ``--rdzv-backend`` name of this project's torchrun rendezvous handler (the barrier handler)."""
STATE_BACKEND_NAME = "etcd3-state"
"""The ``--rdzv-backend`` name of torch's DynamicRendezvousHandler over one etcd state key."""
DEFAULT_KEY_PREFIX = "/elastic"


def runs_root(key_prefix: str) -> str:
    """The prefix under which every run of ``key_prefix`` lives (``<key_prefix>/runs/``)."""
    return f"{key_prefix.rstrip('/')}/runs/"


def run_prefix(key_prefix: str, run_id: str) -> str:
    """Root of every key a run owns in etcd."""
    return runs_root(key_prefix) + run_id


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The keys of one run, from its prefix (``<key_prefix>/runs/<run_id>``)."""

    prefix: str

    @classmethod
    def of(cls, key_prefix: str, run_id: str) -> RunKeys:
        return cls(run_prefix(key_prefix, run_id))

    def _k(self, *parts: str) -> str:
        return "/".join((self.prefix.rstrip("/"), *parts))

    # -- run-wide scalars -------------------------------------------------
    @property
    def epoch(self) -> str:
        return self._k("epoch")

    @property
    def stop(self) -> str:
        return self._k("stop")

    @property
    def done(self) -> str:
        return self._k("done")

    @property
    def pushed_fault(self) -> str:
        """The newest fault an agent pushed to every other (its epoch, generation, node, reason):
        one key for the run, so that it rides on the agents' one signal watch."""
        return self._k("pushed-fault")

    @property
    def round_note(self) -> str:
        """The newest generation plan closed in place (its epoch, generation, plan), written in the
        plan's own compare-and-swap, and the newest c10d store address a new rank 0 published (in
        its put): one key for the run, on the agents' one signal watch, so a round whose only change
        is a slot the warm spare took reaches every node without a join or a watch of its own."""
        return self._k("round-note")

    @property
    def numerics(self) -> str:
        return self._k("numerics")

    @property
    def leader(self) -> str:
        return self._k("leader")

    @property
    def leader_view(self) -> str:
        return self._k("leader_view")

    @property
    def checkpoint_latest(self) -> str:
        return self._k("checkpoint", "latest")

    @property
    def admission_token(self) -> str:
        return self._k("admission", "token")

    @property
    def admission_fingerprint(self) -> str:
        return self._k("admission", "fingerprint")

    @property
    def lighthouse(self) -> str:
        return self._k("torchft", "lighthouse")

    @property
    def replicas_finished(self) -> str:
        return self._k("torchft", "finished")

    # -- per-node records: the key of one node, and the prefix of all -------
    def node(self, node_id: str) -> str:
        return self._k("nodes", node_id)

    @property
    def nodes(self) -> str:
        return self._k("nodes", "")

    def slot(self, node_id: str) -> str:
        """Which process runs as ``node_id`` since a standby or the node itself claimed it back
        (elastic.agent.slots)."""
        return self._k("slots", node_id)

    def heartbeat(self, node_id: str) -> str:
        return self._k("heartbeat", node_id)

    @property
    def heartbeats(self) -> str:
        return self._k("heartbeat", "")

    def excluded(self, node_id: str) -> str:
        return self._k("excluded", node_id)

    @property
    def exclusions(self) -> str:
        return self._k("excluded", "")

    def failure(self, node_id: str, ts_ms: int) -> str:
        return self._k("failures", node_id, str(ts_ms))

    @property
    def failures(self) -> str:
        return self._k("failures", "")

    def fault(self, epoch: int, node_id: str, gen: int | None = None) -> str:
        """One fault of ``node_id`` in ``epoch``; in-process recoveries stay in their epoch, so a
        node's second worker death in it is another fault, named by the generation that replaced it."""
        return self._k("faults", str(epoch), node_id if gen is None else f"{node_id}@g{gen}")

    @property
    def faults(self) -> str:
        return self._k("faults", "")

    def noticed(self, epoch: int, gen: int) -> str:
        return self._k("noticed", str(epoch), str(gen))

    def noticed_in(self, epoch: int) -> str:
        return self._k("noticed", str(epoch), "")

    def member(self, node_id: str) -> str:
        return self._k("members", node_id)

    @property
    def members(self) -> str:
        return self._k("members", "")

    def hang(self, epoch: int, node_id: str) -> str:
        return self._k("hangs", str(epoch), node_id)

    def hangs(self, epoch: int) -> str:
        return self._k("hangs", str(epoch), "")

    def diag(self, node_id: str) -> str:
        return self._k("diag", node_id)

    @property
    def sdc_rollback(self) -> str:
        return self._k("sdc", "rollback")

    def replay_sum(self, rank: int) -> str:
        return self._k("sdc", "sums", str(rank))

    def sdc_verified(self, node_id: str) -> str:
        return self._k("sdc", "verified", node_id)

    @property
    def sdc_verified_prefix(self) -> str:
        return self._k("sdc", "verified", "")

    def sdc_arbitrate(self, node_id: str) -> str:
        """The newest arbitration asked of this node's spare (a watched signal of its agent)."""
        return self._k("sdc", "arbitrate", node_id)

    # -- chaos: faults delivered through etcd to a node's agent ----------------
    def chaos_request(self, node_id: str, request_id: str) -> str:
        return self._k("chaos", "requests", node_id, request_id)

    def chaos_requests(self, node_id: str) -> str:
        return self._k("chaos", "requests", node_id, "")

    def chaos_result(self, node_id: str, request_id: str) -> str:
        return self._k("chaos", "results", node_id, request_id)

    def chaos_results(self, node_id: str = "") -> str:
        """Prefix of one node's results, or of every node's (``node_id`` empty)."""
        return self._k("chaos", "results", node_id, "") if node_id else self._k("chaos", "results", "")

    # -- rendezvous ---------------------------------------------------------
    def rdzv(self, *parts: str) -> str:
        """Rendezvous keys (``rdzv/...``); the handlers own what lies below."""
        return self._k("rdzv", *parts)

    @property
    def rdzv_state(self) -> str:
        """The etcd3-state backend's single state key."""
        return self._k("rdzv", "state")

    @property
    def rdzv_closed(self) -> str:
        return self._k("rdzv", "closed")

    @property
    def rdzv_latest(self) -> str:
        return self._k("rdzv", "latest")

    def rdzv_round(self, round_: int) -> str:
        """Prefix of every key of one round.  Zero-padded, so that consecutive rounds are
        neighbours in key order and one watch range covers two of them."""
        return self._k("rdzv", "round", f"{round_:08d}", "")

    def rdzv_ctl(self, round_: int, name: str = "") -> str:
        """``ctl/`` keys of a round (coord, done, master, closed); ``name=""`` is their prefix."""
        return self.rdzv_round(round_) + "ctl/" + name

    def rdzv_joins(self, round_: int) -> str:
        return self.rdzv_round(round_) + "join/"

    def rdzv_join(self, round_: int, node: str) -> str:
        return self.rdzv_joins(round_) + node

    @property
    def c10d_store(self) -> str:
        """Prefix of the torch ``Store`` torchrun's agents share (rank assignment, barriers)."""
        return self._k("c10d")

    def c10d_round(self, round_: int) -> str:
        """Prefix of the torch ``Store`` of one rendezvous round."""
        return self._k("c10d", f"{round_:08d}")

    # -- in-process generations (elastic.worker.generations) ------------------
    def generation(self, epoch: int, gen: int) -> str:
        """Prefix of generation ``gen`` of ``epoch``: every key of one in-process re-formation."""
        return self._k("gen", str(epoch), str(gen), "")

    def generations(self, epoch: int) -> str:
        """Prefix of every generation of ``epoch`` (a standby watches it for a plan that loses a node)."""
        return self._k("gen", str(epoch), "")

    def gen_member(self, epoch: int, node: str) -> str:
        """A node's generation-0 record: its slots and their ranks (the roster every round starts from)."""
        return self.gen_members(epoch) + node

    def gen_members(self, epoch: int) -> str:
        return self.generation(epoch, 0) + "members/"

    def gen_join(self, epoch: int, gen: int, node: str) -> str:
        return self.gen_joins(epoch, gen) + node

    def gen_joins(self, epoch: int, gen: int) -> str:
        return self.generation(epoch, gen) + "join/"

    def gen_lost(self, epoch: int, gen: int, node: str) -> str:
        return self.gen_losts(epoch, gen) + node

    def gen_losts(self, epoch: int, gen: int) -> str:
        return self.generation(epoch, gen) + "lost/"

    def gen_plan(self, epoch: int, gen: int) -> str:
        return self.generation(epoch, gen) + "plan"

    def gen_control(self, epoch: int, gen: int) -> tuple[str, str]:
        """[start, end) of a round's control keys: ``lost/*``, ``plan`` and ``store``, in key order,
        and no join: what every node watches (one stream), while only the coordinator reads joins."""
        return self.gen_losts(epoch, gen), self.gen_store(epoch, gen) + "\0"

    def gen_store(self, epoch: int, gen: int) -> str:
        return self.generation(epoch, gen) + "store"

    @staticmethod
    def tail(key: str, prefix: str) -> str:
        """``key`` without ``prefix`` (the node id of ``nodes/<node>`` and the like)."""
        return key[len(prefix):]
