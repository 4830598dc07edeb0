"""What every trainer entry point shares: its two flags and reading the resolved config file.

torchrun starts each trainer as ``python -m trainer.<name> --config FILE --run-dir DIR``; the
launcher writes FILE (the resolved run config), so a bad file here is a launcher or operator
error and gets the same one-line treatment as any config error, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TypeVar

import yaml

from elastic.config import ConfigError

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
