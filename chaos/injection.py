"""The injector base: one class per fault kind, registered by name (see :mod:`chaos.injectors`)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from chaos.follow import RunFollower

REGISTRY: dict[str, type["Injector"]] = {}


class TargetNotFound(RuntimeError):
    """The fault's target does not exist at this moment (try again later)."""


def register(name: str) -> Callable[[type["Injector"]], type["Injector"]]:
    """Class decorator: make an injector available under ``name`` (names are unique)."""

    def deco(cls: type[Injector]) -> type[Injector]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"fault {name!r} is already registered by {REGISTRY[name].__name__}")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


@dataclass
class InjectionContext:
    run_dir: Path
    follower: RunFollower
    endpoint: str | None = None
    nodes: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.follower.max_step()


@dataclass
class InjectionRecord:
    fault: str
    target: str
    pids: list[int] = field(default_factory=list)
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def event_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["injected_ts"] = fields.pop("ts")
        return fields


@dataclass(kw_only=True)
class NoParams:
    pass


class Injector:
    """One fault kind.  Subclasses set ``Params`` and implement :meth:`inject`."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    needs_run: ClassVar[bool] = True
    """False for faults that can be planted before the launch starts (files only)."""
    restarts_workers: ClassVar[bool] = True
    """Whether the runtime is expected to restart workers to recover (drives the metrics)."""

    def __init__(self, target: str, params: Any = None) -> None:
        self.target = target
        self.params = params if params is not None else self.Params()

    def ready(self, ctx: InjectionContext) -> bool:
        return True

    def inject(self, ctx: InjectionContext) -> InjectionRecord:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Undo anything still in effect (called once, after the run)."""

    def _record(self, ctx: InjectionContext, pids: list[int] | None = None, **detail: Any) -> InjectionRecord:
        return InjectionRecord(self.name, self.target, pids or [], ctx.step, detail)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise TargetNotFound(f"pid {pid} exited before signal {signal.Signals(sig).name}") from None


def _rank_of(source: str) -> int | None:
    return int(source.rsplit("rank", 1)[1]) if "rank" in source else None
