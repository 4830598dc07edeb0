"""A node loss resharded point to point, in real gloo worlds, against the old full gather.

Four ranks train the tiny DiT two steps (FSDP2, AdamW) and snapshot step 2; then old rank 2's node
is gone and the three others re-form.  Each new rank restores twice: through
:meth:`InProcess.restore` (meta-device build, each rank receives only its new shards' rows; the
lost rank's snapshot is read from the buddy node's agent by one rank only), and through the old
path (full build, every old snapshot joined into full tensors, each rank taking its chunk).  Both
states must be equal bit for bit.  The old world also checks that a meta-device build restored
from its own snapshot is bitwise the live model, and a provider that cannot read its snapshot
makes every rank raise RecoveryUnavailable instead of some ranks waiting for rows.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from elastic.checkpoint.memstate import SnapMeta
from elastic.checkpoint.snapshot import SnapshotRing, capture, from_bytes, restore, to_bytes
from elastic.checkpoint.statedict import same_tree
from elastic.common.config import from_dict
from elastic.common.events import EventLog
from elastic.control.generations import Plan, Slot
from elastic.sdc.config import SdcConfig
from elastic.worker.generation import RecoveryUnavailable
from elastic.worker.inprocess import InProcess
from trainer.data import GlobalSampler
from trainer.dit_config import DiTTrainerConfig
from trainer import dit_train
from trainer.dit_train import DiTRun

OLD_WORLD, LOST = 4, 2
SURVIVORS = [0, 1, 3]
"""Old ranks that re-form, as new ranks 0, 1, 2; new ranks 1 and 2 share the lost rank's buddy node."""
STEP = 2


def _cfg() -> DiTTrainerConfig:
    return from_dict(DiTTrainerConfig, {"global_batch_size": 12, "steps": STEP, "model": {"preset": "tiny"}}, "trainer")


def _session(world: int, inproc: object | None) -> SimpleNamespace:
    """What DiTRun reads of a WorkerSession (and its steps call)."""
    return SimpleNamespace(cfg=SimpleNamespace(trainer=_cfg(), sdc=SdcConfig()), device=torch.device("cpu"),
                           world=world, inproc=inproc, loss=lambda step, value: value, commit_point=lambda: None,
                           hooks=SimpleNamespace(sdc=lambda step: None))


def _train(run: DiTRun, steps: int) -> None:
    for step in range(1, steps + 1):
        indices = GlobalSampler.rank_slice(run.sampler.next_global_batch(), run.dp_rank, run.dp)
        run.forward_backward(step, indices)
        run.optimizer_step(run.lr(step))
        run.train_state.step = step


def _output(run: DiTRun) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    with torch.no_grad():
        return run.model(x, torch.tensor([0.3, 0.7]), torch.tensor([1, 2]))


def _same_run(a: DiTRun, b: DiTRun) -> None:
    assert same_tree(a.train_state.state_dict(), b.train_state.state_dict())
    assert torch.equal(a.model.pos_embed, b.model.pos_embed)
    assert torch.equal(_output(a), _output(b))


def _stub(rank: int, old_rank: int, plan: Plan, snaps: Path, lost_meta: SnapMeta | None, readable: bool = True
          ) -> InProcess:
    """An InProcess of the new world without agents: its ring holds its own snapshot; a rank on the
    buddy node is offered the lost rank's snapshot by its agent (``lost_meta``)."""
    inproc = InProcess.__new__(InProcess)
    inproc.rank, inproc.epoch, inproc.client = rank, 0, None
    inproc.events, inproc.slot = EventLog(None, "test"), Slot(f"n{old_rank}", 0)
    inproc.round = SimpleNamespace(plan=plan, old_rank=old_rank, lost_nodes=lambda: set(plan.lost))
    inproc.ring = SnapshotRing()
    inproc.ring.add(_read(snaps, old_rank))
    inproc.fetched = []
    inproc._agent_metas = lambda: [lost_meta] if lost_meta is not None else []

    def fetch(slot: Slot, step: int):
        inproc.fetched.append(slot.node)
        return _read(snaps, LOST) if readable else None

    inproc._fetch = fetch
    return inproc


def _read(snaps: Path, old_rank: int):
    return from_bytes(_meta(snaps, old_rank), bytearray((snaps / f"snap{old_rank}.bin").read_bytes()))


def _meta(snaps: Path, old_rank: int) -> SnapMeta:
    return SnapMeta.from_json(json.loads((snaps / f"meta{old_rank}.json").read_text()))


def _write(snaps: Path, rank: int, snap) -> None:
    (snaps / f"snap{rank}.bin").write_bytes(b"".join(bytes(c) for c in to_bytes(snap)))
    meta = SnapMeta(node=f"n{rank}", slot=0, rank=rank, world_size=OLD_WORLD, epoch=0, gen=0, step=STEP,
                    checksum="", nbytes=0)
    (snaps / f"meta{rank}.json").write_text(json.dumps(meta.to_json()))


def _old_world(rank: int, snaps: Path) -> None:
    run = DiTRun(_session(OLD_WORLD, None))
    _train(run, STEP)
    snap = capture(run.state(), STEP, 0, rank, OLD_WORLD, run.extra())
    _write(snaps, rank, snap)
    same_world = SimpleNamespace(plan=Plan(1, OLD_WORLD))  # a replaced worker: the world keeps its ranks
    fresh = _meta_built(_session(OLD_WORLD, same_world))
    restore(fresh.state(), [snap], rank, OLD_WORLD)
    _same_run(fresh, run)


def _meta_built(session: SimpleNamespace) -> DiTRun:
    """DiTRun for a re-formed world, checked to have taken the meta-device build."""
    real, calls = dit_train.materialize, []
    dit_train.materialize = lambda model, device: (calls.append(device), real(model, device))
    try:
        run = DiTRun(session)
    finally:
        dit_train.materialize = real
    assert calls == [torch.device("cpu")]
    _poison(run)
    return run


def _poison(run: DiTRun) -> None:
    """NaN in every tensor a restore must write (the optimizer's state created first, as the restore
    would): freshly mapped memory reads as zeros, and a missed row could pass for a zero-initialised
    one (adaLN-Zero)."""
    with torch.no_grad():
        for tensor in _tensors(get_state_dict(run.model, run.optim)):
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            if local.is_floating_point():
                local.fill_(float("nan"))


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
    return [t for value in values for t in _tensors(value)]


def _new_world(rank: int, snaps: Path) -> None:
    plan = Plan(1, OLD_WORLD, dropped=(LOST,), nodes=3, lost=(f"n{LOST}",))
    lost_meta = _meta(snaps, LOST) if rank > 0 else None
    inproc = _stub(rank, SURVIVORS[rank], plan, snaps, lost_meta)
    run = _meta_built(_session(len(SURVIVORS), inproc))
    step, extra, source = inproc.restore(run.state())
    assert (step, extra, source) == (STEP, {}, "memory, resharded")
    rng = torch.get_rng_state()
    old = DiTRun(_session(len(SURVIVORS), None))
    restore(old.state(), [_read(snaps, r) for r in range(OLD_WORLD)], rank, len(SURVIVORS))
    _same_run(run, old)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG: old rank 0's, both ways
    fetches = torch.tensor([len(inproc.fetched)])
    dist.all_reduce(fetches)
    assert fetches.item() == 1  # one rank of the buddy node reads the lost snapshot, not each of them

    unreadable = _stub(rank, SURVIVORS[rank], plan, snaps, lost_meta, readable=False)
    with pytest.raises(RecoveryUnavailable, match=rf"old ranks \[{LOST}\]"):
        unreadable.restore(DiTRun(_session(len(SURVIVORS), unreadable)).state())


def _worker(rank: int, world: int, port: int, snaps: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        (_old_world if phase == "old" else _new_world)(rank, Path(snaps))
        dist.barrier()  # rank 0 hosts the store: nobody tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/test_dit_parallel.py: gloo's threads and interpreter teardown


def _free_port() -> int:
    from elastic.control.etcd_server import free_port

    return free_port()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_loss_reshards_point_to_point_bitwise_as_the_full_gather(tmp_path):
    mp.spawn(_worker, args=(OLD_WORLD, _free_port(), str(tmp_path), "old"), nprocs=OLD_WORLD, join=True)
    mp.spawn(_worker, args=(len(SURVIVORS), _free_port(), str(tmp_path), "new"), nprocs=len(SURVIVORS), join=True)
