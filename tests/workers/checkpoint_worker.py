"""Rank program for the multi-process checkpoint tests (no tests of its own).

Run by ``tests/test_checkpoint_multiproc.py``; this process imports torch
once and forks one child per rank (with ``RANK``/``WORLD_SIZE``/``MASTER_*``)::

    python tests/workers/checkpoint_worker.py SCENARIO WORLD WORKDIR PORT

Each scenario asserts what it can see from inside a rank and writes events to
``WORKDIR/events-rank<R>.jsonl``; the pytest side checks exit codes, event
ordering and the files left behind.  A tiny FSDP2 MLP with uneven shards
(33 and 7 rows over 2 ranks) is trained with AdamW on gloo.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# Before torch: importing torch.distributed loads the ``torchrun.handlers`` entry point,
# which imports ``elastic`` from wherever the project is installed, not this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from elastic.checkpoint.manager import CheckpointConfig, CheckpointManager  # noqa: E402
from elastic.checkpoint.load import CheckpointMismatch  # noqa: E402
from elastic.checkpoint.publish import EtcdCheckpointPublisher, read_latest  # noqa: E402
from elastic.checkpoint.storage import FaultInjectingStorage, LocalStorage  # noqa: E402
from elastic.worker.faults import FaultHooks  # noqa: E402
from elastic.common.events import EventLog  # noqa: E402
from elastic.control.store import EtcdStore  # noqa: E402

ETCD_ENV = "TEST_CKPT_ETCD"
PREFIX = "/elastic/runs/ckpt-test"


class AppState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


class Sampler(Stateful):
    """A data-sampler position (global, identical on every rank)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


class GatedStorage(LocalStorage):
    """Writes of the gated steps block until WORKDIR/gate-<step> exists."""

    def __init__(self, workdir: Path, gated: set[int]) -> None:
        self.workdir, self.gated = workdir, gated

    def write_file(self, path, chunks, step):
        if step in self.gated:
            deadline = time.monotonic() + 60
            while not (self.workdir / f"gate-{step}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gate {step} never opened")
                time.sleep(0.02)
        return super().write_file(path, chunks, step)


class DyingStorage(LocalStorage):
    """The chosen ranks write 8 bytes of their shard of ``step``, then the process dies."""

    def __init__(self, step: int, ranks: set[int]) -> None:
        self.step, self.ranks = step, ranks

    def write_file(self, path, chunks, step):
        if step == self.step and dist.get_rank() in self.ranks and path.name.startswith("shard-"):
            with open(path, "wb") as fh:
                fh.write(bytes(next(iter(chunks)))[:8])
                fh.flush()
            os._exit(9)
        return super().write_file(path, chunks, step)


class Rig:
    def __init__(self, workdir: Path, tag: str = "") -> None:
        self.workdir = workdir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.events = EventLog(workdir / f"events{tag}-rank{self.rank}.jsonl", f"test/rank{self.rank}")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 10), nn.GELU(), nn.Linear(10, 7))
        mesh = init_device_mesh("cpu", (self.world,))
        for module in model:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.app = AppState(self.model, self.optim)
        self.sampler = Sampler()
        self.ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))

    @property
    def state(self) -> dict[str, Any]:
        return {"app": self.app, "sampler": self.sampler}

    def train(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 * step + self.rank)
        x = torch.randn(4, 16, generator=gen)
        loss = (self.model(x) - x[:, :7]).pow(2).mean()
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.app.step = step
        self.sampler.position = 4 * step

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) params and optimizer state; collective."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            out[name] = _full(param).clone()
            for key, value in self.optim.state.get(param, {}).items():
                out[f"optim/{name}/{key}"] = _full(value).clone()
        return out

    def manager(self, root: str = "ckpt", **kwargs: Any) -> CheckpointManager:
        cfg = kwargs.pop("config", CheckpointConfig(interval_steps=2, keep_last=2))
        kwargs.setdefault("fingerprint", "fp-A")
        return CheckpointManager(cfg, self.workdir / root, events=self.events, group=self.ckpt_group, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ {sorted(got.keys() ^ want.keys())}"
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), f"{what}: {key} differs"


def scenario_main(workdir: Path) -> None:
    """Async ordering, back-to-back saves, retention, disk full, round trip, corruption, publish."""
    rig = Rig(workdir)
    rank = rig.rank
    publisher = None
    endpoint = os.environ.get(ETCD_ENV)
    if endpoint and rank == 0:
        publisher = EtcdCheckpointPublisher(EtcdStore(endpoint), PREFIX)
    # Checkpoint-write faults come from the run's fault files, as in a trainer's worker session.
    storage = FaultInjectingStorage(GatedStorage(workdir, {2, 4}), FaultHooks(workdir, rank).checkpoint_write_fails)
    mgr = rig.manager(publisher=publisher, storage=storage)

    # 1. save() returns after staging while the writes are still blocked; the optimizer
    #    then mutates the weights, and the checkpoint must still hold the step-2 state.
    for step in (1, 2):
        rig.train(step)
    ref2 = rig.snapshot()
    rng2 = torch.get_rng_state()
    mgr.save(2, rig.state, extra={"rng": rng2, "rank": rank})
    rig.events.emit("test.save_returned", step=2)
    assert 2 not in mgr.committed_steps()
    rig.train(3)
    dist.barrier()
    if rank == 0:
        rig.events.emit("test.gate_open", step=2)
        (workdir / "gate-2").touch()
    mgr.wait()
    dist.barrier()
    assert mgr.last_error is None, mgr.last_error
    assert mgr.committed_steps() == [2]
    loaded = mgr.load_latest(rig.state)
    assert loaded is not None and loaded[0] == 2, loaded
    assert_same(rig.snapshot(), ref2, "step 2 holds the state of save(), not of the step trained after it")

    # 2. A second save waits for the first (gate 4 opens later from a timer thread).
    rig.train(4)
    mgr.save(4, rig.state, extra={"rank": rank})
    if rank == 0:
        inflight4 = mgr._inflight

        def open_gate() -> None:
            # Open only once save(6) has taken up the step-4 save (a correct manager now waits for
            # it; one that did not wait would already have started step 6 and fail the ordering).
            deadline = time.monotonic() + 20
            while mgr._inflight is inflight4 and time.monotonic() < deadline:
                time.sleep(0.01)
            rig.events.emit("test.gate_open", step=4)
            (workdir / "gate-4").touch()

        threading.Thread(target=open_gate, daemon=True).start()
    for step in (5, 6):
        rig.train(step)
    ref6 = rig.snapshot()
    mgr.save(6, rig.state, extra={"rank": rank})
    mgr.wait()
    dist.barrier()
    assert mgr.last_error is None, mgr.last_error
    assert mgr.committed_steps() == [4, 6], mgr.committed_steps()  # keep_last=2 dropped 2

    # 3. Disk full on rank 1 for step 8 (a ckpt_write_error fault file from the test).
    for step in (7, 8):
        rig.train(step)
    mgr.save(8, rig.state, extra={"rank": rank})
    mgr.wait()
    dist.barrier()
    assert mgr.last_error is not None
    assert mgr.committed_steps() == [4, 6]
    assert not list((workdir / "ckpt").glob(".step-00000008*")), "tmp dir of the failed save left behind"
    for step in (9, 10):  # training goes on
        rig.train(step)
    ref10 = rig.snapshot()
    rng10 = torch.get_rng_state()
    mgr.save(10, rig.state, extra={"rng": rng10, "rank": rank})
    mgr.wait()
    dist.barrier()
    assert mgr.committed_steps() == [6, 10], mgr.committed_steps()

    # 4. Round trip: mutate, load, compare bitwise (model + optimizer + sampler + extra).
    rig.train(11)
    torch.manual_seed(123)
    loaded = mgr.load_latest(rig.state)
    assert loaded is not None and loaded[0] == 10, loaded
    assert_same(rig.snapshot(), ref10, "round trip step 10")
    assert rig.app.step == 10 and rig.sampler.position == 40
    assert loaded[1]["rank"] == rank and torch.equal(loaded[1]["rng"], rng10)

    # 5. Publish: etcd holds the last committed step (the failed step 8 never published).
    if publisher is not None:
        record = read_latest(EtcdStore(endpoint), PREFIX)
        assert record["step"] == 10 and record["path"].endswith("step-00000010"), record
        assert record["world_size"] == rig.world

    # 6. A flipped byte in the newest checkpoint: detected, reported, older one loaded.
    if rank == 0:
        victim = workdir / "ckpt" / "step-00000010" / "shard-00001.safetensors"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    dist.barrier()
    loaded = mgr.load_latest(rig.state)
    assert loaded is not None and loaded[0] == 6, loaded
    assert_same(rig.snapshot(), ref6, "fallback to step 6")

    # 7. A checkpoint of another run config (fingerprint) is never loaded: it is refused on every rank.
    foreign = rig.manager(fingerprint="fp-B")
    before = rig.snapshot()
    try:
        foreign.load_latest(rig.state)
    except CheckpointMismatch as exc:
        assert "different run config" in str(exc) and "--fresh" in str(exc), exc
    else:
        raise AssertionError("a checkpoint of another run config was loaded instead of refused")
    assert_same(rig.snapshot(), before, "state untouched by the refused foreign checkpoint")
    foreign.close()
    mgr.close()
    rig.events.emit("test.done")


def scenario_hop(workdir: Path) -> None:
    """Load whatever the previous hop saved (any world size), check it, train, save."""
    rig = Rig(workdir, tag=f"-hop{dist.get_world_size()}")
    mgr = rig.manager(config=CheckpointConfig(interval_steps=1, keep_last=3))
    ref_file = workdir / "ref.pt"
    loaded = mgr.load_latest(rig.state)
    if ref_file.exists():
        ref = torch.load(ref_file)
        assert loaded is not None and loaded[0] == ref["step"], (loaded, ref["step"])
        assert_same(rig.snapshot(), ref["tensors"], f"reshard {ref['world']}->{rig.world}")
        assert rig.sampler.position == 4 * ref["step"]
        if rig.rank < ref["world"]:
            assert loaded[1] == {"rank": rig.rank, "saved_by": ref["world"]}, loaded[1]
        else:
            assert loaded[1] == {}, loaded[1]
    else:
        assert loaded is None
    step = rig.app.step + 1
    rig.train(step)
    snap = rig.snapshot()
    mgr.save(step, rig.state, extra={"rank": rig.rank, "saved_by": rig.world})
    mgr.close()
    assert mgr.last_error is None, mgr.last_error
    if rig.rank == 0:
        torch.save({"step": step, "world": rig.world, "tensors": snap}, ref_file)
    dist.barrier()


def scenario_kill(workdir: Path) -> None:
    """Commit step 2, then the ranks in TEST_KILL_RANKS die half-way through writing step 4."""
    rig = Rig(workdir, tag="-kill")
    dying = {int(r) for r in os.environ["TEST_KILL_RANKS"].split(",")}
    mgr = rig.manager(storage=DyingStorage(step=4, ranks=dying))
    for step in (1, 2):
        rig.train(step)
    ref2 = rig.snapshot()
    mgr.save(2, rig.state)
    mgr.wait()
    dist.barrier()
    if rig.rank == 0:
        torch.save({"step": 2, "world": rig.world, "tensors": ref2}, workdir / "ref-kill.pt")
    for step in (3, 4):
        rig.train(step)
    mgr.save(4, rig.state)  # rank 1 dies in the background
    mgr.wait()
    rig.events.emit("test.after_kill", committed=mgr.committed_steps(), failed=mgr.last_error is not None)
    assert mgr.committed_steps() == [2], mgr.committed_steps()
    os._exit(0)  # the peer is gone: skip process-group teardown


def scenario_kill_resume(workdir: Path) -> None:
    rig = Rig(workdir, tag="-resume")
    mgr = rig.manager()
    assert mgr.committed_steps() == [2]
    assert not list((workdir / "ckpt").glob(".step-*")), "stale tmp dir survived start-up"
    ref = torch.load(workdir / "ref-kill.pt")
    loaded = mgr.load_latest(rig.state)
    assert loaded is not None and loaded[0] == 2, loaded
    assert_same(rig.snapshot(), ref["tensors"], "resume after kill")
    mgr.close()


def _sync_point(rig: Rig, mgr: CheckpointManager, step: int) -> None:
    """What the worker session's sync point does for a step that saves: rank 0's part of the save's
    agreement, summed over the world (the session's all-reduce, here on the world group)."""
    values = torch.tensor([0.0, *mgr.sync_contribution(mgr.should_save(step))], dtype=torch.float64)
    dist.all_reduce(values)
    _, busy, token = values.tolist()
    mgr.agreed(step, busy, token)


def scenario_agreed(workdir: Path) -> None:
    """A save whose step's sync point agreed on its token broadcasts nothing; while rank 0 has a
    failed save to tell, the save broadcasts as before, and every rank takes the streak."""
    import elastic.checkpoint.manager as manager_module

    rig = Rig(workdir, tag="-agreed")
    calls: list[int] = []
    real = manager_module.collectives.broadcast_object

    def counting(obj, group):
        calls.append(1)
        return real(obj, group)

    manager_module.collectives.broadcast_object = counting
    fails = {4} if rig.rank == 0 else set()  # rank 0 commits: its failed write starts the streak
    mgr = rig.manager(storage=FaultInjectingStorage(LocalStorage(), lambda step: step in fails))
    tokens = []
    for step in range(1, 9):
        rig.train(step)
        _sync_point(rig, mgr, step)
        if mgr.should_save(step):
            before = len(calls)
            mgr.save(step, rig.state)
            mgr.wait()
            dist.barrier()  # rank 0's finalize of this save is known before the next sync point
            tokens.append(mgr.last_save_token)
            rig.events.emit("test.saved", step=step, broadcasts=len(calls) - before,
                            streak=[s for s, _ in mgr.failed_in_a_row], token=mgr.last_save_token)
    mgr.close()
    same = [None] * rig.world
    dist.all_gather_object(same, tokens)
    assert all(t == tokens for t in same), same
    assert len(set(tokens)) == len(tokens), tokens


SCENARIOS = {
    "agreed": scenario_agreed,
    "main": scenario_main,
    "hop": scenario_hop,
    "kill": scenario_kill,
    "kill_resume": scenario_kill_resume,
}


def run_forked(scenario: str, world: int, workdir: Path, port: int) -> None:
    """Fork one child per rank from this already-imported interpreter (saves a torch import
    per rank); write the ranks' exit codes to WORKDIR/<scenario>-w<world>.codes."""
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(workdir / f"{scenario}-w{world}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                torch.set_num_threads(1)
                dist.init_process_group("gloo", timeout=timedelta(seconds=30))
                SCENARIOS[scenario](workdir)
                dist.barrier()
                dist.destroy_process_group()
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    codes = [None] * world
    for _ in range(world):
        pid, status = os.wait()
        codes[children[pid]] = os.waitstatus_to_exitcode(status)
    (workdir / f"{scenario}-w{world}.codes").write_text(" ".join(str(c) for c in codes))


if __name__ == "__main__":
    run_forked(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
