"""Typed etcd v3 transactions: ``if all(compare) then success else failure``, atomically.

One transaction is one raft proposal however many operations it holds (etcd's default cap is
128 operations), and a read placed after a write in the same branch sees that write.  That is
what lets the rendezvous join a round, learn the round's size and claim the coordinator role
in a single round trip.  :meth:`elastic.control.store.EtcdStore.txn` runs one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from elastic.control.codec import KeyValue, b64, kv_from_json, prefix_end

MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: the most operations one transaction may carry."""

_RESULT = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_TARGET = {"version": "VERSION", "create": "CREATE", "mod": "MOD", "value": "VALUE"}
_FIELD = {"version": "version", "create": "create_revision", "mod": "mod_revision"}


@dataclass(frozen=True, slots=True)
class Compare:
    key: str
    target: Literal["version", "create", "mod", "value"]
    op: Literal["=", "!=", "<", ">"]
    value: int | bytes | str

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "version", "=", 0)

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": b64(self.key), "target": _TARGET[self.target], "result": _RESULT[self.op]}
        out["value" if self.target == "value" else _FIELD[self.target]] = (
            b64(self.value) if self.target == "value" else int(self.value))  # type: ignore[arg-type]
        return out


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes | str
    lease: int | None = None


@dataclass(frozen=True, slots=True)
class Get:
    key: str


@dataclass(frozen=True, slots=True)
class Count:
    """Number of keys under a prefix (no values move)."""

    prefix: str


@dataclass(frozen=True, slots=True)
class Range:
    """Every key-value under a prefix, in key order (the first ``limit`` of them, when given)."""

    prefix: str
    limit: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Txn:
    """A nested transaction (an operation of an outer one)."""

    compare: list[Compare] = field(default_factory=list)
    success: list[Op] = field(default_factory=list)
    failure: list[Op] = field(default_factory=list)


Op = Union[Put, Get, Count, Range, Delete, Txn]
Result = Union[int, KeyValue, None, list[KeyValue], "TxnResult"]


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    results: list[Any]
    """One per operation of the branch that ran: Put -> revision, Get -> KeyValue | None,
    Count -> int, Range -> list[KeyValue], Delete -> number deleted, Txn -> TxnResult."""


def encode_txn(txn: Txn) -> dict[str, Any]:
    return {"compare": [c.encode() for c in txn.compare], "success": [_encode_op(o) for o in txn.success],
            "failure": [_encode_op(o) for o in txn.failure]}


def _encode_op(op: Op) -> dict[str, Any]:
    if isinstance(op, Put):
        body: dict[str, Any] = {"key": b64(op.key), "value": b64(op.value)}
        if op.lease:
            body["lease"] = op.lease
        return {"request_put": body}
    if isinstance(op, Get):
        return {"request_range": {"key": b64(op.key)}}
    if isinstance(op, Count):
        return {"request_range": {"key": b64(op.prefix), "range_end": prefix_end(op.prefix), "count_only": True}}
    if isinstance(op, Range):
        body = {"key": b64(op.prefix), "range_end": prefix_end(op.prefix)}
        if op.limit:
            body["limit"] = op.limit
        return {"request_range": body}
    if isinstance(op, Delete):
        body = {"key": b64(op.key)}
        if op.prefix:
            body["range_end"] = prefix_end(op.key)
        return {"request_delete_range": body}
    return {"request_txn": encode_txn(op)}


def decode_txn(txn: Txn, resp: dict[str, Any], revision: int | None = None) -> TxnResult:
    """The gateway's answer to ``txn`` (nested answers carry no header: the outer revision applies)."""
    rev = int(resp.get("header", {}).get("revision", 0)) or int(revision or 0)
    ok = bool(resp.get("succeeded"))
    ops = txn.success if ok else txn.failure
    raw = resp.get("responses") or []
    return TxnResult(ok, rev, [_decode_op(op, raw[i] if i < len(raw) else {}, rev) for i, op in enumerate(ops)])


def _decode_op(op: Op, raw: dict[str, Any], rev: int) -> Any:
    if isinstance(op, Put):
        return int(raw.get("response_put", {}).get("header", {}).get("revision", rev))
    if isinstance(op, Get):
        kvs = raw.get("response_range", {}).get("kvs") or []
        return kv_from_json(kvs[0]) if kvs else None
    if isinstance(op, Count):
        return int(raw.get("response_range", {}).get("count", 0))
    if isinstance(op, Range):
        return [kv_from_json(kv) for kv in raw.get("response_range", {}).get("kvs") or []]
    if isinstance(op, Delete):
        return int(raw.get("response_delete_range", {}).get("deleted", 0))
    return decode_txn(op, raw.get("response_txn", {}), rev)
