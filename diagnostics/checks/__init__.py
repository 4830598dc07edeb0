"""Check registry: each check is a small class registered under a name.

A check's :meth:`Check.run` returns a :class:`~diagnostics.report.CheckResult`;
:meth:`Check.__call__` times it and turns an unexpected exception into a
``fail`` result (a check that crashes on a node -- a CUDA error in the GEMM, an
I/O error on the checkpoint disk -- is itself evidence against the node; the
exception text is kept in ``details.error``).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from diagnostics.calibration import Calibration
from diagnostics.readers import HardwareReader
from diagnostics.report import CheckResult
from diagnostics.thresholds import Thresholds


@dataclass(kw_only=True)
class Context:
    """What a check may look at."""

    mode: str  # "quick" | "full"
    thresholds: Thresholds
    reader: HardwareReader
    etcd_endpoint: str | None = None
    ckpt_dir: str | None = None
    host: str = field(default_factory=socket.gethostname)
    calibration: Calibration | None = None
    """Medians measured on known-good nodes (``diag calibrate``); None: datasheet figures only."""

    @property
    def full(self) -> bool:
        return self.mode == "full"


class Check:
    name: ClassVar[str]
    description: ClassVar[str]

    def run(self, ctx: Context) -> CheckResult:
        raise NotImplementedError

    def __call__(self, ctx: Context) -> CheckResult:
        start = time.perf_counter()
        try:
            result = self.run(ctx)
        except Exception as exc:  # noqa: BLE001 - reported as the check's verdict
            result = CheckResult(
                name=self.name,
                verdict="fail",
                reason=f"check raised {type(exc).__name__}: {exc}",
                details={"error": repr(exc)},
            )
        result.duration_s = time.perf_counter() - start
        return result

    # helpers
    def skip(self, why: str, **details: Any) -> CheckResult:
        return CheckResult(name=self.name, verdict="skip", reason=f"skipped: {why}", details=details)


REGISTRY: dict[str, type[Check]] = {}
ALIASES: dict[str, str] = {"nccl": "collective"}


def register(cls: type[Check]) -> type[Check]:
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"check {cls.name!r} registered twice ({REGISTRY[cls.name].__module__}, {cls.__module__})")
    REGISTRY[cls.name] = cls
    return cls


def resolve(name: str) -> str:
    """Canonical check name; KeyError lists the known names."""
    _load()
    canonical = ALIASES.get(name, name)
    if canonical not in REGISTRY:
        known = ", ".join(all_names() + sorted(ALIASES))
        raise KeyError(f"unknown check {name!r} (known: {known})")
    return canonical


#: Run order: cheap readings first, then benchmarks, then the external services.
ORDER = ("gpu", "nvlink", "ib", "gemm", "membw", "collective", "disk", "etcd")


def all_names() -> list[str]:
    _load()
    return [n for n in ORDER if n in REGISTRY] + sorted(set(REGISTRY) - set(ORDER))


def get(name: str) -> Check:
    return REGISTRY[resolve(name)]()


def _load() -> None:
    # Import for the registration side effect; cheap modules, torch only imported inside runs.
    from diagnostics.checks import collective, disk, etcd, gemm, gpu, ib, membw, nvlink  # noqa: F401
