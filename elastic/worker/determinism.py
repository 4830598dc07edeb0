"""``--deterministic``: bitwise reproducible GPU runs, for the kill/resume checksum checks.

Add the flag to the trainer command (``launch.entrypoint: [-m, trainer.dit_train,
--deterministic]``); the worker session applies it while reading its flags, before the process
group or any CUDA work, because cuBLAS reads its workspace config when its first handle is
created.  It is slower: deterministic kernels give up atomics, and the math attention backend
materialises the score matrix that flash attention never stores.  CPU runs are deterministic
without it (same seed, world size and thread count).
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS workspace config that makes its GEMMs deterministic (CUDA docs, "Results reproducibility")."""


def set_deterministic() -> None:
    """Deterministic torch algorithms, cuBLAS workspace and attention kernel for this process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # Flash / memory-efficient / cuDNN attention backward accumulate with atomics (run-to-run
    # differences); the math backend is plain matmul + softmax, deterministic under the flag above.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
