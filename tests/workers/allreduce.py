"""Tiny torchrun worker for rendezvous tests: all-reduce the rank and write the result."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.txt"), "w") as fh:
        fh.write(f"{dist.get_world_size()} {value.item()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
