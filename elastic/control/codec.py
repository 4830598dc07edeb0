"""Records and JSON-gateway encoding shared by the etcd store, its transactions and its watches."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str
    value: bytes | None  # None for a delete
    mod_revision: int


def b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The etcd range_end (base64) that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return b64(bytes(raw[: i + 1]))
    return b64(b"\0")  # all keys


def kv_from_json(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=unb64(raw["key"]).decode(),
        value=unb64(raw.get("value")),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def event_from_json(raw: dict[str, Any]) -> WatchEvent:
    """One event of a gateway watch stream (key and value still base64)."""
    kv = raw.get("kv", {})
    deleted = raw.get("type") == "DELETE"
    return WatchEvent(key=unb64(kv.get("key")).decode(), value=None if deleted else unb64(kv.get("value")),
                      mod_revision=int(kv.get("mod_revision", 0)))
