"""The same kind of loop without ``elastic.api``: torch.distributed only, its own checkpoint.

Run by the runtime as ``launch.entrypoint: [examples/byo/plain_train.py]`` (torchrun appends
``--config FILE --run-dir DIR``): it gets the restart path, not in-process recovery.  A lost
worker restarts every worker through a new torchrun, and this script resumes from the checkpoint
it writes itself after every step (rank 0, replicated weights).  Its progress goes to
``<run-dir>/plain-rank<R>.json`` (pid, the step it started from, the last step done).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml


def save(path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint whole


def load(path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    if not path.exists():
        return 0
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    return int(state["step"])


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 1009 + rank))
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    for param in model.parameters():  # data parallel by hand: average the gradients
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()
    optim.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    trainer = yaml.safe_load(Path(args.config).read_text())["trainer"]
    run_dir, steps = Path(args.run_dir), int(trainer["steps"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    start = load(run_dir / "plain-ckpt.pt", model, optim)
    progress = {"pid": os.getpid(), "start": start, "step": start}
    for step in range(start + 1, steps + 1):
        train_step(model, optim, step, rank)
        if rank == 0:
            save(run_dir / "plain-ckpt.pt", model, optim, step)
        dist.barrier()  # no rank runs ahead of the checkpoint
        progress["step"] = step
        (run_dir / f"plain-rank{rank}.json").write_text(json.dumps(progress))
        time.sleep(float(trainer.get("step_sleep", 0.0)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
