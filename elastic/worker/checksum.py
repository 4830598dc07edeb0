"""The final-weights fingerprint both trainers print: what "bitwise equal to a fault-free run" compares."""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch import nn


def canonical_name(name: str) -> str:
    """Parameter name without activation-checkpoint wrappers (they must not change the checksum)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def param_checksum(model: nn.Module) -> str:
    """sha256 over the full (unsharded) fp32 parameters in name order; collective under FSDP."""
    digest = hashlib.sha256()
    params = sorted((canonical_name(n), p) for n, p in model.named_parameters())
    for name, param in params:
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def publish_checksum(run_dir: Path, rank: int, checksum: str) -> None:
    """Rank 0 prints ``FINAL_CHECKSUM <sha256>`` and writes ``<run_dir>/final_checksum.txt``."""
    if rank == 0:
        (run_dir / "final_checksum.txt").write_text(checksum + "\n")
        print(f"FINAL_CHECKSUM {checksum}", flush=True)
