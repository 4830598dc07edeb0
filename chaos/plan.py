"""Fault plans: which faults hit which targets, and when.

A plan is YAML, in one of two forms.  An explicit list::

    faults:
      - {fault: kill_worker, target: node1, at_step: 6}
      - {fault: etcd_outage, target: etcd, at_time_s: 4, params: {duration_s: 3}}
      - {fault: nan, target: rank0, at_time_s: 0, params: {step: 9}}   # 0 = before the launch

or a random one, expanded into such a list by a seeded generator::

    random:
      mtbf_s: 20          # mean time between faults (exponential inter-arrival)
      seed: 7
      faults: {kill_worker: 3, hang_worker: 1}   # names with weights (a plain list = equal weights)
      protected: [node0]  # never targeted
      max_faults: 5
      start_s: 5          # first fault no earlier than this

In the runs of ``chaos suite`` and ``chaos soak`` (faults through etcd) ``after`` names an
earlier fault of the plan that must have run first; with ``delay_s`` the fault fires that many
seconds after it (chaos keeps the time, so the two may hit different nodes: a second kill while
the run re-forms after the first).  The same seed and node list always give the same schedule;
``cover`` (the soak's draw) makes the first draws go through every fault once.  Errors are
:class:`~elastic.common.config.ConfigError` with one line naming the field, e.g.
``faults[1].params.duration_s: expected a number, got str 'x'``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.follow import parse_target
from chaos.injectors import REGISTRY, Injector
from elastic.common.config import ConfigError, from_dict

_FAULT_KEYS = ("fault", "target", "at_step", "at_time_s", "params", "after", "delay_s")
_RANDOM_KEYS = ("mtbf_s", "seed", "faults", "protected", "max_faults", "start_s", "params")
ETCD_FAULTS = ("etcd_outage", "etcd_member_stop")
"""Faults whose target is the run's etcd itself (their default target: ``etcd``)."""


@dataclass
class FaultSpec:
    fault: str
    target: str
    at_step: int | None = None
    at_time_s: float | None = None
    params: Any = None
    after: int | None = None
    """Index of another fault of the plan that must have run first (on the same node, unless ``delay_s``)."""
    delay_s: float | None = None
    """With ``after``: fire this many seconds after that fault ran (chaos keeps the time; any target)."""

    @property
    def before_launch(self) -> bool:
        return self.at_time_s is not None and self.at_time_s <= 0

    def build(self) -> Injector:
        return REGISTRY[self.fault](self.target, self.params)

    def describe(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"t={self.at_time_s:g}s"
        if self.after is not None and self.delay_s is not None:
            when = f"#{self.after} + {self.delay_s:g}s"
        return f"{self.fault} -> {self.target} @ {when}"


@dataclass
class RandomPlan:
    mtbf_s: float
    seed: int
    weights: dict[str, float]
    protected: list[str] = field(default_factory=list)
    max_faults: int = 3
    start_s: float = 0.0
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    cover: bool = False
    """The first draws go through every fault once (in a seeded order), then by weight: a soak
    shorter than the catalogue still sees as many different kinds as it has faults."""

    def schedule(self, targets: list[str]) -> list[FaultSpec]:
        """Deterministic expansion: times by exponential inter-arrival, faults by weight, targets uniform."""
        pool = [t for t in targets if t not in self.protected]
        if not pool:
            raise ConfigError("random.protected", f"protects every target ({targets})")
        rng = random.Random(self.seed)
        names = sorted(self.weights)
        first = rng.sample(names, len(names)) if self.cover else []
        out: list[FaultSpec] = []
        t = self.start_s
        for i in range(self.max_faults):
            t += rng.expovariate(1.0 / self.mtbf_s)
            name = first[i] if i < len(first) else rng.choices(names, weights=[self.weights[n] for n in names])[0]
            target = "etcd" if name in ETCD_FAULTS else rng.choice(pool)
            params = _params(name, self.params.get(name, {}), f"random.params.{name}")
            out.append(FaultSpec(name, target, at_time_s=round(t, 3), params=params))
        return out


@dataclass
class Plan:
    faults: list[FaultSpec] = field(default_factory=list)
    random: RandomPlan | None = None

    def schedule(self, targets: list[str]) -> list[FaultSpec]:
        """The concrete fault list: explicit faults, then the random ones, ordered by trigger."""
        out = list(self.faults)
        if self.random is not None:
            out += self.random.schedule(targets)
        return out


def _params(fault: str, raw: Any, path: str) -> Any:
    cls = REGISTRY[fault].Params
    return from_dict(cls, raw or {}, path)


def _fault(raw: Any, path: str) -> FaultSpec:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {type(raw).__name__} {raw!r}")
    unknown = sorted(set(raw) - set(_FAULT_KEYS))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}", f"unknown key (known keys: {', '.join(_FAULT_KEYS)})")
    name = raw.get("fault")
    if name not in REGISTRY:
        raise ConfigError(f"{path}.fault", f"unknown fault {name!r} (known: {', '.join(sorted(REGISTRY))})")
    target = raw.get("target", "etcd" if name in ETCD_FAULTS else None)
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{path}.target", "required: a node (node1), a rank (rank0), node1/rank0 or etcd")
    at_step, at_time = raw.get("at_step"), raw.get("at_time_s")
    if (at_step is None) == (at_time is None):
        raise ConfigError(path, "needs exactly one of at_step, at_time_s")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0):
        raise ConfigError(f"{path}.at_step", f"expected an integer >= 0, got {at_step!r}")
    if at_time is not None and (isinstance(at_time, bool) or not isinstance(at_time, (int, float))):
        raise ConfigError(f"{path}.at_time_s", f"expected a number, got {at_time!r}")
    params = _params(name, raw.get("params"), f"{path}.params")
    after = raw.get("after")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
        raise ConfigError(f"{path}.after", f"expected the index of an earlier fault, got {after!r}")
    delay = raw.get("delay_s")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ConfigError(f"{path}.delay_s", f"expected a number of seconds >= 0, got {delay!r}")
        if after is None:
            raise ConfigError(f"{path}.delay_s", "counts from the fault named by after: give after too")
        delay = float(delay)
    spec = FaultSpec(name, target, at_step, float(at_time) if at_time is not None else None, params, after, delay)
    if spec.before_launch and REGISTRY[name].needs_run:
        raise ConfigError(f"{path}.at_time_s", f"{name} needs running processes; 0 (before launch) is only "
                                               "for file faults")
    return spec


def _random(raw: Any) -> RandomPlan:
    if not isinstance(raw, dict):
        raise ConfigError("random", "expected a mapping")
    unknown = sorted(set(raw) - set(_RANDOM_KEYS))
    if unknown:
        raise ConfigError(f"random.{unknown[0]}", f"unknown key (known keys: {', '.join(_RANDOM_KEYS)})")
    mtbf = raw.get("mtbf_s")
    if isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or mtbf <= 0:
        raise ConfigError("random.mtbf_s", f"required: a number > 0, got {mtbf!r}")
    seed = raw.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("random.seed", f"required: an integer, got {seed!r}")
    names = raw.get("faults")
    if isinstance(names, list):
        weights = {n: 1.0 for n in names}
    elif isinstance(names, dict):
        weights = names
    else:
        raise ConfigError("random.faults", "required: a list of fault names or a mapping name -> weight")
    if not weights:
        raise ConfigError("random.faults", "must name at least one fault")
    for name, weight in weights.items():
        if name not in REGISTRY:
            raise ConfigError(f"random.faults.{name}", f"unknown fault (known: {', '.join(sorted(REGISTRY))})")
        if REGISTRY[name].ready is not Injector.ready:
            raise ConfigError(f"random.faults.{name}", "waits for a run event; schedule it explicitly")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(f"random.faults.{name}", f"weight must be a number > 0, got {weight!r}")
    protected = raw.get("protected", [])
    if not isinstance(protected, list) or not all(isinstance(p, str) for p in protected):
        raise ConfigError("random.protected", "expected a list of targets")
    max_faults = raw.get("max_faults", 3)
    if isinstance(max_faults, bool) or not isinstance(max_faults, int) or max_faults < 1:
        raise ConfigError("random.max_faults", f"expected an integer >= 1, got {max_faults!r}")
    start = raw.get("start_s", 0.0)
    if isinstance(start, bool) or not isinstance(start, (int, float)) or start < 0:
        raise ConfigError("random.start_s", f"expected a number >= 0, got {start!r}")
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError("random.params", "expected a mapping fault -> params")
    for name, values in params.items():
        if name not in weights:
            raise ConfigError(f"random.params.{name}", "params for a fault the plan does not draw")
        _params(name, values, f"random.params.{name}")  # validate now, not mid-run
    return RandomPlan(float(mtbf), seed, {k: float(v) for k, v in weights.items()}, protected, max_faults,
                      float(start), params)


def parse_plan(data: Any) -> Plan:
    """A plan from parsed YAML; ConfigError (one line, names the field) if anything is off."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"a plan is a mapping with faults: and/or random:, got {type(data).__name__}")
    unknown = sorted(set(data) - {"faults", "random"})
    if unknown:
        raise ConfigError(unknown[0], "unknown key (known keys: faults, random)")
    raw_faults = data.get("faults", [])
    if not isinstance(raw_faults, list):
        raise ConfigError("faults", "expected a list")
    faults = [_fault(raw, f"faults[{i}]") for i, raw in enumerate(raw_faults)]
    plan = Plan(faults, _random(data["random"]) if "random" in data else None)
    if not plan.faults and plan.random is None:
        raise ConfigError("", "the plan has no faults (give faults: or random:)")
    return plan


def check_targets(faults: list[FaultSpec], nodes: list[str], world_size: int) -> None:
    """Every explicit fault's target exists in the launch: ConfigError naming the fault, before anything runs."""
    for i, spec in enumerate(faults):
        if spec.target in ("", "any") or (spec.target == "etcd" and spec.fault.startswith("etcd")):
            continue
        node, rank = parse_target(spec.target)
        if node is not None and node not in nodes:
            raise ConfigError(f"faults[{i}].target", f"{node!r} is not a node of this launch "
                                                     f"(nodes: {', '.join(nodes)})")
        if rank is not None and rank >= world_size:
            raise ConfigError(f"faults[{i}].target", f"rank{rank} does not exist: this launch has at most "
                                                     f"{world_size} ranks (rank0..rank{world_size - 1})")


def load_plan(path: str | Path) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read plan {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError("", f"{path}: invalid YAML" + (f" at line {mark.line + 1}" if mark else "")) from None
    return parse_plan(data)
