"""torch's own rendezvous semantics on etcd v3: the ``etcd3-state`` backend.

torch ships etcd rendezvous backends only for the etcd **v2** API, which
etcd 3.6 removed.  This module provides the v3 equivalent for torch's
``DynamicRendezvousHandler``:

* :class:`Etcd3RendezvousBackend` -- the ``RendezvousBackend`` (get_state /
  set_state with a fencing token).  The token is the state key's etcd
  ``mod_revision``; ``set_state`` is one compare-and-swap transaction.
* :func:`create_etcd3_handler` -- registered (via :mod:`elastic.rendezvous.plugin`) under the
  ``torchrun.handlers`` entry point as ``etcd3-state``.
* :class:`Etcd3RendezvousHandler` -- torch's dynamic handler, except that the workers of each
  round get a store of their own instead of sharing the torchrun agent's TCPStore.  With the
  shared store, torchrun's ``--max-restarts`` recovery fails (measured: two loopback nodes, one
  worker killed): the agent keeps one TCPStore server for every round, while the workers assume a
  new one per retry and use no per-attempt prefix, so restarted gloo workers read the previous
  attempt's addresses (``connectFullMesh failed ... Connection refused``, or a hang).  torch
  offers the fix only as ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the handler decides it for its
  own rounds, so plain torchrun needs no variable (the ``etcd3`` barrier handler decides the same).

When to use it: never for more than a few dozen nodes.  Every participant rewrites the one
state key (joins and every keep-alive), so conflicts grow with the square of the node count
(64 nodes form in ~3 s, 256 do not form at torch's default timings).  It is here for runs that
want torch's exact ``DynamicRendezvousHandler`` behaviour; the default ``etcd3`` backend
(:mod:`elastic.rendezvous.barrier`) scales and is what elastic-launch uses.

Backend semantics follow torch's own backends exactly: absent state -> None;
a stale or invalid token -> the current state and ``False``; a state that
cannot be decoded -> :class:`RendezvousStateError`; etcd unreachable ->
:class:`RendezvousConnectionError`.

``--rdzv-conf`` keys understood here (besides torch's own join/last_call/
close/heartbeat timeouts): ``key_prefix`` (default ``/elastic``),
``request_timeout`` (default 10) and ``retry_deadline`` (default 60, torch's c10d read timeout;
seconds, etcd client), and for a
secured etcd ``etcd_ca_file``, ``etcd_cert_file``, ``etcd_key_file``,
``etcd_user`` and ``etcd_password_env`` (the *name* of the variable that holds
the password, default ``ELASTIC_ETCD_PASSWORD``; a password on torchrun's
command line would be visible in ``ps``).  Keys not given fall back to the
``ELASTIC_ETCD_*`` environment (:mod:`elastic.control.etcd_security`).
"""

from __future__ import annotations

import base64
import binascii
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from elastic.control.etcd_security import EtcdSecurity
from elastic.control.keys import DEFAULT_KEY_PREFIX, STATE_BACKEND_NAME, RunKeys
from elastic.control.store import EtcdStore, StoreError
from elastic.rendezvous.c10d_store import EtcdC10dStore

# Stored value = magic + base64(pickled state).  The magic makes a foreign or
# truncated value detectable before torch tries to unpickle it.
_STATE_MAGIC = b"ERDZV1:"
_BACKOFF_BASE_S = 0.002
_BACKOFF_MAX_S = 0.1


class Etcd3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in one etcd key, updated by compare-and-swap on mod revision."""

    def __init__(self, store: EtcdStore, run_id: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._key = RunKeys.of(key_prefix, run_id).rdzv_state
        self._conflicts = 0  # consecutive lost compare-and-swaps (see _back_off)

    @property
    def name(self) -> str:
        return STATE_BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._store.get(self._key)
        except StoreError as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details."
            ) from exc
        if kv is None:
            return None
        return _decode_state(kv.value), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                # An invalid token can never match; report the current state.
                return self._current_with_false()
        else:
            expected = 0  # create only
        if expected < 0:
            return self._current_with_false()
        try:
            ok, kv = self._store.compare_and_swap(self._key, _STATE_MAGIC + base64.b64encode(state), expected)
        except StoreError as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details."
            ) from exc
        if ok:
            assert kv is not None
            self._conflicts = 0
            return state, kv.mod_revision, True
        self._back_off()
        if kv is None:
            return None
        return _decode_state(kv.value), kv.mod_revision, False

    def _back_off(self) -> None:
        """Randomised exponential wait (capped at 0.1 s) after a lost compare-and-swap.

        torch's handler retries a lost write at once, and every participant writes the one
        state key. Measured with the embedded etcd: 16 writers retrying at once win ~40 CAS/s
        (six losers per winner) where one writer alone wins ~140/s. Spreading the retries
        took 64 lightweight participants from 4.4 s to 3.4 s median (benchmarks/rendezvous.py,
        2 cores); a 1 s cap made it far worse (33 s), and no cap tried makes 256 form here.
        A small run pays nothing: its first conflict waits at most a few milliseconds.
        """
        self._conflicts += 1
        ceiling = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * (2 ** min(self._conflicts, 16)))
        time.sleep(random.uniform(0, ceiling))

    def _current_with_false(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], False


def _decode_state(raw: bytes) -> bytes:
    if not raw.startswith(_STATE_MAGIC):
        raise RendezvousStateError("The state object is corrupt (bad header); it was not written by this backend.")
    try:
        return base64.b64decode(raw[len(_STATE_MAGIC) :], validate=True)
    except binascii.Error as exc:
        raise RendezvousStateError("The state object is corrupt. See inner exception for details.") from exc


def store_from_params(params: RendezvousParameters) -> EtcdStore:
    """The etcd store of ``--rdzv-endpoint`` (``host:port[,host:port...]``) and ``--rdzv-conf``."""
    endpoint = params.endpoint or "127.0.0.1:2379"
    # A busy etcd (1,000 agents joining at once) may take seconds to answer: a participant that
    # gave up after a few retries would hold up the whole round.  An etcd that stays down still
    # surfaces as RendezvousConnectionError, after a minute as on torch's c10d store.
    request_timeout = float(params.get("request_timeout", 10) or 10)
    retry_deadline = float(params.get("retry_deadline", 60) or 60)
    # TLS paths and the user come as --rdzv-conf keys, the password only from the environment.
    security = EtcdSecurity.from_rdzv_conf(params.get)
    try:
        return EtcdStore(endpoint, request_timeout=request_timeout, retry_deadline=retry_deadline,
                         security=security)
    except ValueError as exc:
        raise ValueError(f"--rdzv-endpoint: {exc}") from None


_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextmanager
def _own_worker_store() -> Iterator[None]:
    """torch reads its choice between the shared and an own worker store from this variable only."""
    before = os.environ.get(_SHARE_STORE_ENV)
    os.environ[_SHARE_STORE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_SHARE_STORE_ENV, None)
        else:
            os.environ[_SHARE_STORE_ENV] = before


class Etcd3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic handler whose workers get a store of their own each round (module docstring)."""

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        # Rank 0's address and a free port for this round's worker store, read fresh by every
        # node (never an earlier round's cached address); worker rank 0 hosts the store.
        with _own_worker_store():
            return super().next_rendezvous()


def _timeouts(params: RendezvousParameters) -> RendezvousTimeout:
    def seconds(name: str) -> timedelta | None:
        value = params.get_as_int(f"{name}_timeout")
        return timedelta(seconds=value) if value is not None else None

    return RendezvousTimeout(seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat"))


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creator registered with torchrun as ``etcd3-state``: DynamicRendezvousHandler over one state key."""
    key_prefix = params.get("key_prefix", DEFAULT_KEY_PREFIX) or DEFAULT_KEY_PREFIX
    store = store_from_params(params)
    backend = Etcd3RendezvousBackend(store, params.run_id, key_prefix)
    c10d_store = EtcdC10dStore(store, RunKeys.of(key_prefix, params.run_id).c10d_store)
    return Etcd3RendezvousHandler.from_backend(
        params.run_id, c10d_store, backend, params.min_nodes, params.max_nodes, params.local_addr, _timeouts(params),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3)
