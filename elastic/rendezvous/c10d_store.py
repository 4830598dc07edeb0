"""A ``torch.distributed.Store`` on etcd for torchrun's own agent traffic, without a hot key.

torchrun's agents use the rendezvous store for rank assignment (every agent ``set``s its role
info, rank 0 ``multi_get``s them all and ``multi_set``s the answers, every agent ``get``s its
own) and for the exit barrier (every agent ``add``s 1 to one counter, the last ``set``s a key
everyone waits for).  At 1,000 nodes the counter is the trap: a read-modify-write counter is
1,000 writers on one key, each attempt a raft proposal, most of them lost.  Here every ``add``
writes its own record and reads the sum in the same transaction (one proposal, no retry):
the records of a counter live under ``<key>/1/`` (unit steps, summed by counting) and
``<key>/n/`` (other amounts).  Waits are watches, batches are transactions of at most 128
operations (etcd's cap).

Layout under the store prefix: ``<quoted key>/=`` holds a set value, ``<quoted key>/1/<id>``
and ``<quoted key>/n/<id>`` the counter records; keys are percent-quoted so that ``a`` and
``a/b`` never share a prefix.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic.control.store import EtcdStore, StoreError, StoreTimeout, StoreUnavailable
from elastic.control.txn import MAX_TXN_OPS, Compare, Count, Delete, Get, Put, Range, Txn
from elastic.control.watch import WatchCompacted


class EtcdC10dStore(dist.Store):
    """``torch.distributed.Store`` whose keys live under one etcd prefix (see the module docstring)."""

    def __init__(self, store: EtcdStore, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix.rstrip("/") + "/"
        self.set_timeout(timeout)

    # -- key layout -------------------------------------------------------------
    def _base(self, key: str) -> str:
        return f"{self._prefix}{quote(key, safe='')}/"

    def _value_key(self, key: str) -> str:
        return self._base(key) + "="

    # -- c10d API ----------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        base = self._base(key)
        self._txn(Txn(success=[Delete(base + "1/", prefix=True), Delete(base + "n/", prefix=True),
                               Put(base + "=", _as_bytes(value))]))

    def get(self, key: str) -> bytes:
        value = self._read(key)
        if value is None:
            self._wait_one(key, time.monotonic() + self.timeout.total_seconds())
            value = self._read(key)
        if value is None:  # deleted between the wake-up and the read
            raise dist.DistStoreError(f"key {key!r} vanished from the etcd store")
        return value

    def add(self, key: str, value: int) -> int:
        amount = int(value)
        base = self._base(key)
        record = base + ("1/" if amount == 1 else "n/") + uuid.uuid4().hex  # one id per call: a retry is idempotent
        result = self._txn(Txn(success=[Put(record, str(amount)), Get(base + "="), Count(base + "1/"),
                                        Range(base + "n/")]))
        return _counter_value(*result.results[1:])

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        target = self._value_key(key)
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        compare = Compare.absent(target) if not expected else Compare(target, "value", "=", expected)
        result = self._txn(Txn(compare=[compare], success=[Put(target, desired)], failure=[Get(target)]))
        if result.succeeded:
            return desired
        current = result.results[0]
        return current.value if current is not None else expected

    def check(self, keys: list[str]) -> bool:
        return all(self._present(chunk) for chunk in _chunks(list(keys), MAX_TXN_OPS))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        budget = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + budget.total_seconds()
        for key in keys:
            if not self._present([key]):
                self._wait_one(key, deadline)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """All values, waiting for absent keys; plain values are read 128 to a transaction."""
        values: list[bytes | None] = []
        for chunk in _chunks(list(keys), MAX_TXN_OPS):
            result = self._txn(Txn(success=[Get(self._value_key(k)) for k in chunk]))
            values += [kv.value if kv is not None else None for kv in result.results]
        return [v if v is not None else self.get(k) for k, v in zip(keys, values)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        pairs = list(zip(keys, values))
        for chunk in _chunks(pairs, MAX_TXN_OPS):
            self._txn(Txn(success=[Put(self._value_key(k), _as_bytes(v)) for k, v in chunk]))

    def delete_key(self, key: str) -> bool:
        return self._txn(Txn(success=[Delete(self._base(key), prefix=True)])).results[0] > 0

    def num_keys(self) -> int:
        kvs = self._guard(lambda: self._store.get_prefix(self._prefix))
        return len({kv.key[len(self._prefix):].split("/", 1)[0] for kv in kvs})

    # -- internals ----------------------------------------------------------------
    def _read(self, key: str) -> bytes | None:
        base = self._base(key)
        result = self._txn(Txn(success=[Get(base + "="), Count(base + "1/"), Range(base + "n/")]))
        plain, units, others = result.results
        if plain is None and not units and not others:
            return None
        return str(_counter_value(plain, units, others)).encode() if (units or others) else plain.value

    def _present(self, keys: list[str]) -> bool:
        result = self._txn(Txn(success=[Count(self._base(k)) for k in keys]))
        return all(n > 0 for n in result.results)

    def _wait_one(self, key: str, deadline: float) -> None:
        """Watch the key's prefix from the revision of a read that found it absent."""
        base = self._base(key)
        while True:
            count, revision = self._count_at(base)
            if count:
                return
            try:
                with self._store.watch(base, revision + 1, prefix=True) as stream:
                    while (left := deadline - time.monotonic()) > 0:
                        if any(e.value is not None for e in stream.get(left) or []):
                            return
            except WatchCompacted:
                continue
            except StoreUnavailable as exc:
                raise RendezvousConnectionError(f"etcd unreachable while waiting for {key!r}") from exc
            raise dist.DistStoreError(f"Timeout waiting for key {key!r} in the etcd store")

    def _count_at(self, base: str) -> tuple[int, int]:
        result = self._txn(Txn(success=[Count(base)]))
        return result.results[0], result.revision

    def _txn(self, txn: Txn):
        return self._guard(lambda: self._store.txn(txn))

    @staticmethod
    def _guard(fn):
        try:
            return fn()
        except StoreTimeout as exc:
            raise dist.DistStoreError(str(exc)) from exc
        except StoreError as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details."
            ) from exc


def _counter_value(plain, units: int, others) -> int:
    base = int(plain.value) if plain is not None and plain.value.strip() else 0
    return base + units + sum(int(kv.value) for kv in others)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # c10d passes std::vector<uint8_t> as a list of ints
        return bytes(value)
    return str(value).encode()

