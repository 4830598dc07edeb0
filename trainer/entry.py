"""What every trainer entry point shares: its flags, reading the resolved config, process setup.

torchrun starts each trainer as ``python -m trainer.<name> --config FILE --run-dir DIR``; the
launcher writes FILE (the resolved run config), so a bad file here is a launcher or operator
error and gets the same one-line treatment as any config error, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

import os

import torch
import torch.distributed as dist
import yaml

from elastic.common.config import ConfigError
from elastic.worker.channel import pg_timeout

EXIT_CONFIG = 2

T = TypeVar("T")


def parse_trainer_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help="resolved run config (YAML)")
    parser.add_argument("--run-dir", required=True, help="run directory (events, checkpoints, results)")
    return parser.parse_args(argv)


def read_trainer_config(load: Callable[[str], T], path: str) -> T | None:
    """``load(path)``, or None after one line on stderr when the file is missing or invalid."""
    try:
        return load(path)
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        # YAML parser errors span several lines (with a caret); one line is what logs grep for.
        print(f"trainer: config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return None


def init_worker_process() -> tuple[torch.device, int, int]:
    """This worker's device (``cuda:LOCAL_RANK`` when CUDA is present), the default process group
    (NCCL or gloo, with the agent's collective timeout) and torch's thread count.

    Returns (device, rank, world size). The thread count is set explicitly because a resumed run
    is only bitwise equal to an uninterrupted one with the same number of intra-op threads.
    """
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=pg_timeout())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return device, dist.get_rank(), dist.get_world_size()
