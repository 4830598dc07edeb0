"""The host reader, the YAML injection overlay, and the default composition of both."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from diagnostics.readers.base import (
    GPU_FIELDS,
    IB_FIELDS,
    INJECT_ENV,
    KNOB_SECTIONS,
    NVLINK_FIELDS,
    HardwareReader,
    InjectionError,
)
from diagnostics.readers.nvml import NvmlReader
from diagnostics.readers.sysfs import SysfsReader

# ---------------------------------------------------------------------------
# composition and injection


class HostReader:
    """The real host: GPUs from NVML, IB ports from sysfs."""

    def __init__(self, nvml: NvmlReader | None = None, sysfs: SysfsReader | None = None) -> None:
        self.nvml = nvml or NvmlReader()
        self.sysfs = sysfs or SysfsReader()

    def gpus(self) -> list[dict[str, Any]]:
        return self.nvml.gpus()

    def gpus_now(self) -> list[dict[str, Any]]:
        return self.nvml.gpus_now()

    def driver_version(self) -> str | None:
        return self.nvml.driver_version()

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.sysfs.ib_ports()

    def knobs(self, section: str) -> dict[str, Any]:
        return {}


_TOP_KEYS = {"gpu_devices", "gpu", "gpu_under_load", "driver_version", "ib_ports", "ib", "nvlink", *KNOB_SECTIONS}


class InjectedReader:
    """Overlay of ``injection`` (a dict in the format of the module docstring) on ``base``."""

    def __init__(self, base: HardwareReader, injection: Mapping[str, Any], source: str = "<inject>") -> None:
        self.base = base
        self.source = source
        self.injection = _validate(dict(injection or {}), source)

    @classmethod
    def from_file(cls, base: HardwareReader, path: str | os.PathLike[str]) -> InjectedReader:
        return cls(base, load_injection(path), source=str(path))

    def gpus(self) -> list[dict[str, Any]]:
        return self._overlay(self.base.gpus, under_load=False)

    def gpus_now(self) -> list[dict[str, Any]]:
        """The readings under load: ``gpu_under_load`` overrides on top of the idle overlay
        (how a test or chaos makes a GPU throttle or overheat only while it works)."""
        return self._overlay(self.base.gpus_now, under_load=True)

    def _overlay(self, base_read: Any, under_load: bool) -> list[dict[str, Any]]:
        inj = self.injection
        if "gpu_devices" in inj:
            devices = []
            for i, raw in enumerate(inj["gpu_devices"]):
                dev = dict.fromkeys(GPU_FIELDS)
                dev.update(copy.deepcopy(raw))
                if dev.get("index") is None:
                    dev["index"] = i
                devices.append(dev)
        else:
            devices = copy.deepcopy(base_read())
        by_index = {d["index"]: d for d in devices}
        sections = ("gpu", "gpu_under_load") if under_load else ("gpu",)
        for section in sections:
            for idx, fields in (inj.get(section) or {}).items():
                if idx not in by_index:
                    raise InjectionError(f"{self.source}: {section}.{idx}: no such device (have {sorted(by_index)})")
                by_index[idx].update(copy.deepcopy(fields))
        for idx, links in (inj.get("nvlink") or {}).items():
            if idx not in by_index:
                raise InjectionError(f"{self.source}: nvlink.{idx}: no such device (have {sorted(by_index)})")
            dev = by_index[idx]
            current = {link["link"]: link for link in dev.get("nvlink") or []}
            for link, fields in links.items():
                entry = current.setdefault(link, {"link": link, **dict.fromkeys(NVLINK_FIELDS[1:])})
                entry.update(fields)
            dev["nvlink"] = [current[k] for k in sorted(current)]
        return devices

    def driver_version(self) -> str | None:
        if "driver_version" in self.injection:
            return self.injection["driver_version"]
        if "gpu_devices" in self.injection:
            return None
        return self.base.driver_version()

    def ib_ports(self) -> dict[str, dict[str, dict[str, Any]]]:
        inj = self.injection
        ports = copy.deepcopy(inj["ib_ports"]) if "ib_ports" in inj else copy.deepcopy(self.base.ib_ports())
        for dev, per_port in (inj.get("ib") or {}).items():
            for port, fields in per_port.items():
                entry = ports.setdefault(dev, {}).setdefault(port, {"counters": {}})
                fields = dict(fields)
                if "counters" in fields:
                    entry.setdefault("counters", {}).update(fields.pop("counters"))
                entry.update(fields)
        return ports

    def knobs(self, section: str) -> dict[str, Any]:
        merged = dict(self.base.knobs(section))
        merged.update(self.injection.get(section) or {})
        return merged


def load_injection(path: str | os.PathLike[str], _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read an injection file.

    Top-level keys starting with ``x-`` are ignored (holders for YAML anchors).
    ``include: other.yaml`` (or a list), relative to the file, is loaded first and
    this file's sections are merged over it, so a fault file can say "the healthy
    node, except GPU 3 has a pending row remap".
    """
    path = Path(path)
    if str(path.resolve()) in _seen:
        raise InjectionError(f"{path}: include cycle")
    try:
        text = path.read_text()
    except OSError as exc:
        raise InjectionError(f"{path}: cannot read injection file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InjectionError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InjectionError(f"{path}: expected a mapping at top level")
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    includes = data.pop("include", None)
    if includes is None:
        return data
    merged: dict[str, Any] = {}
    for inc in [includes] if isinstance(includes, str) else list(includes):
        if not isinstance(inc, str):
            raise InjectionError(f"{path}: include: expected a file name or a list of them")
        _merge(merged, load_injection(path.parent / inc, _seen + (str(path.resolve()),)))
    _merge(merged, data)
    return merged


def _merge(into: dict[Any, Any], over: Mapping[Any, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _validate(inj: dict[str, Any], source: str) -> dict[str, Any]:
    inj = {k: v for k, v in inj.items() if not str(k).startswith("x-")}
    unknown = sorted(set(map(str, inj)) - _TOP_KEYS)
    if unknown:
        raise InjectionError(f"{source}: {unknown[0]}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    if "gpu_devices" in inj and not isinstance(inj["gpu_devices"], list):
        raise InjectionError(f"{source}: gpu_devices: expected a list of device readings")
    for i, dev in enumerate(inj.get("gpu_devices") or []):
        _check_fields(dev, GPU_FIELDS, f"{source}: gpu_devices[{i}]")
    for section in ("gpu", "gpu_under_load", "nvlink"):
        value = inj.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of device index -> readings")
        fixed = {}
        for key, fields in value.items():
            try:
                idx = int(key)
            except (TypeError, ValueError):
                raise InjectionError(f"{source}: {section}.{key}: device index must be an integer") from None
            if section != "nvlink":
                _check_fields(fields, GPU_FIELDS, f"{source}: {section}.{key}")
                fixed[idx] = fields
            else:
                if not isinstance(fields, dict):
                    raise InjectionError(f"{source}: nvlink.{key}: expected a mapping of link -> readings")
                links = {}
                for link, lf in fields.items():
                    _check_fields(lf, NVLINK_FIELDS, f"{source}: nvlink.{key}.{link}")
                    links[int(link)] = lf
                fixed[idx] = links
        inj[section] = fixed
    for section in ("ib_ports", "ib"):
        value = inj.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of device -> port -> readings")
        fixed_ib: dict[str, dict[str, Any]] = {}
        for dev, ports in value.items():
            if not isinstance(ports, dict):
                raise InjectionError(f"{source}: {section}.{dev}: expected a mapping of port -> readings")
            fixed_ib[str(dev)] = {}
            for port, fields in ports.items():
                _check_fields(fields, IB_FIELDS, f"{source}: {section}.{dev}.{port}")
                fixed_ib[str(dev)][str(port)] = fields
        inj[section] = fixed_ib
    for section in KNOB_SECTIONS:
        if section in inj and not isinstance(inj[section], dict):
            raise InjectionError(f"{source}: {section}: expected a mapping of knob -> value")
    return inj


def _check_fields(fields: Any, known: tuple[str, ...], where: str) -> None:
    if not isinstance(fields, dict):
        raise InjectionError(f"{where}: expected a mapping of readings")
    unknown = sorted(set(map(str, fields)) - set(known))
    if unknown:
        raise InjectionError(f"{where}.{unknown[0]}: unknown reading (known: {', '.join(known)})")


def default_reader(
    inject: str | os.PathLike[str] | Mapping[str, Any] | None = None, xid_window_s: float = 0.0
) -> HardwareReader:
    """The host reader, overlaid with ``inject`` (a path or dict) or else ``$ELASTIC_DIAG_INJECT``."""
    base: HardwareReader = HostReader(nvml=NvmlReader(xid_window_s=xid_window_s))
    if inject is None:
        inject = os.environ.get(INJECT_ENV) or None
    if inject is None:
        return base
    if isinstance(inject, Mapping):
        return InjectedReader(base, inject)
    return InjectedReader.from_file(base, inject)
