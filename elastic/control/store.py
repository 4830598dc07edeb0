"""The etcd v3 operations the runtime needs, behind one small interface.

Client: etcd's v3 JSON gateway over HTTP (requests sent by :class:`~elastic.control.unary.UnaryClient`
on urllib3; etcd3gw's exception types, and its client for ``http_session``), kept after measuring the gRPC client
``cslab-etcd3`` (benchmarks/etcd_clients.py): gRPC is ~2x faster per request, but the
rendezvous sends O(1) requests per participant, and on its pattern (a join transaction, then a
watch on one key) the gateway formed 1024 participants in 4.3 s against 8.2 s for gRPC.  gRPC
would also bring the forks' 300 s failed-node lockout and a second TLS/auth path
(shared/reference/etcd-probe.md).  etcd3gw's own watch dies silently with its server, so
:mod:`elastic.control.watch` streams watches itself.  Callers see only :class:`KVStore` and
the typed errors below, so the client can be swapped.

Endpoints ``host:port[,host:port...]``: requests go to one member; when it cannot be reached,
or says the cluster has no leader for the moment, the store moves to the next member and
retries, so losing a member (the raft leader included) costs a retry, not an error.  Every
call is retried with jittered backoff (tenacity) for up to ``retry_deadline`` seconds; longer
outages surface as :class:`StoreUnavailable`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import requests
import tenacity
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

from elastic.control.codec import KeyValue, WatchEvent, b64, kv_from_json, prefix_end
from elastic.control.etcd_security import EtcdSecurity, etcd_error_text, short_ssl_reason, ssl_error_in
from elastic.control.txn import Txn, TxnResult, decode_txn, encode_txn
from elastic.control.unary import UnaryClient
from elastic.control.watch import WatchCompacted, WatchStream

__all__ = ["KeyValue", "WatchEvent", "KVStore", "EtcdStore", "StoreMeter", "StoreError", "StoreUnavailable",
           "StoreTimeout", "LeaseExpired", "StoreAuthError", "StoreTLSError", "parse_endpoint", "parse_endpoints"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreError(RuntimeError):
    """Base class of store errors."""


class StoreUnavailable(StoreError):
    """etcd could not be reached within the retry deadline."""


class StoreTimeout(StoreError):
    """A blocking wait (watch, wait-for-key) ran out of time."""


class LeaseExpired(StoreError):
    """A lease was revoked or expired; keys attached to it are gone."""


class StoreAuthError(StoreError):
    """etcd refused the credentials (no user, wrong password, no permission); retrying cannot help."""


class StoreTLSError(StoreError):
    """The TLS handshake with etcd failed (no or untrusted client cert, unknown CA); not retried."""


class KVStore(Protocol):
    """The subset of etcd v3 the runtime relies on."""

    def get(self, key: str) -> KeyValue | None: ...
    def read(self, key: str) -> tuple[KeyValue | None, int]:
        """``key`` (or None) and the store revision it was read at: watch from revision + 1."""

    def txn(self, txn: Txn) -> TxnResult:
        """Run one transaction (see :mod:`elastic.control.txn`)."""

    def get_prefix(self, prefix: str, limit: int = 0) -> list[KeyValue]: ...
    def count_prefix(self, prefix: str) -> int:
        """How many keys are under ``prefix`` (etcd's count-only range: no record comes back)."""

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...
    def delete(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def compare_and_swap(
        self, key: str, value: bytes | str, expected_mod_revision: int, lease: int | None = None
    ) -> tuple[bool, KeyValue | None]: ...
    def grant_lease(self, ttl: int) -> int: ...
    def refresh_lease(self, lease_id: int, timeout: float | None = None) -> int: ...
    def revoke_lease(self, lease_id: int) -> None: ...
    def watch_once(self, key: str, start_revision: int, timeout: float, prefix: bool = False) -> WatchEvent | None: ...
    def revision(self) -> int: ...


class _Transient(Exception):
    """etcd answered, but with an error that passes (no leader during an election): retried."""


# Answers of a member that is up while its cluster elects a leader or catches up.
_TRANSIENT_TEXT = ("leader changed", "no leader", "request timed out", "too many requests", "server stopped",
                   "unhealthy cluster", "read index", "not started")

_CONNECTION_ERRORS = (
    gw_exc.ConnectionFailedError,
    gw_exc.ConnectionTimeoutError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
)


class StoreMeter:
    """What one or more stores sent to etcd and read back: requests, the raft writes among them
    (puts, deletes, lease grants and revokes, and every transaction that holds a write in either
    branch: etcd proposes those through raft whether their compare holds or not), watch streams
    opened and response bytes (HTTP bodies as received, watch streams included).

    ``benchmarks/control_plane.py`` gives every store of one simulated node the same meter, so its
    figures are per node.  Counted under a lock: eight ranks' threads share one meter, and a bare
    ``+=`` across threads loses counts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.writes = 0
        self.watches = 0
        self.bytes_read = 0

    def request(self, write: bool) -> None:
        with self._lock:
            self.requests += 1
            self.writes += int(write)

    def watch(self) -> None:
        with self._lock:
            self.requests += 1
            self.watches += 1

    def read(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "writes": self.writes, "watches": self.watches,
                    "bytes_read": self.bytes_read}


_WRITE_PATHS = frozenset({"/kv/put", "/kv/deleterange", "/kv/lease/revoke", "/lease/grant"})


def _is_write(path: str, body: dict[str, Any]) -> bool:
    """Whether etcd proposes this request through raft (see :class:`StoreMeter`)."""
    if path in _WRITE_PATHS:
        return True
    return path == "/kv/txn" and _txn_writes(body)


def _txn_writes(body: dict[str, Any]) -> bool:
    for op in [*body.get("success", []), *body.get("failure", [])]:
        if "request_put" in op or "request_delete_range" in op:
            return True
        if "request_txn" in op and _txn_writes(op["request_txn"]):
            return True
    return False


def parse_endpoint(endpoint: str, default_port: int = 2379) -> tuple[str, int]:
    """``host[:port]`` (optionally with ``http://`` or ``https://``) -> (host, port); ValueError if malformed.

    The scheme is not kept: TLS is on when the etcd security settings give a CA or client cert.
    """
    text = endpoint.strip().removeprefix("http://").removeprefix("https://")
    host, _, port = text.rstrip("/").partition(":")
    if not host:
        raise ValueError(f"bad etcd endpoint {endpoint!r}: expected HOST:PORT")
    try:
        port_num = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad etcd endpoint {endpoint!r}: port must be an integer") from None
    if not 0 < port_num < 65536:
        raise ValueError(f"bad etcd endpoint {endpoint!r}: port out of range")
    return host, port_num


def parse_endpoints(endpoints: str, default_port: int = 2379) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` (the members of one cluster) -> [(host, port)]; ValueError if malformed."""
    parts = [p for p in endpoints.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"bad etcd endpoint {endpoints!r}: expected HOST:PORT[,HOST:PORT...]")
    return [parse_endpoint(p, default_port) for p in parts]


class EtcdStore:
    """:class:`KVStore` over etcd's v3 JSON gateway.

    Thread-safe: each thread gets its own HTTP session, because
    ``requests.Session`` is not safe to share between threads.
    """

    def __init__(
        self,
        endpoint: str,
        request_timeout: float = 5.0,
        retry_deadline: float = 15.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.endpoints = parse_endpoints(endpoint)
        self._current = 0  # index into endpoints of the member in use (see failover)
        self.requests_sent = 0  # unary requests and watch streams opened (benchmarks report the rate)
        self.meter: StoreMeter | None = None  # set by benchmarks: exact counts and bytes (StoreMeter)
        self.request_timeout = request_timeout
        self.retry_deadline = retry_deadline
        # Child processes get TLS / auth settings through ELASTIC_ETCD_* (never argv).
        self.security = EtcdSecurity.from_env() if security is None else security
        self._local = threading.local()
        self._pool: dict[int, list[UnaryClient]] = {}  # idle clients for requests, per member (_borrow)
        self._pool_lock = threading.Lock()
        self._shutting_down = threading.Event()
        self._token: str | None = None  # etcd auth token, shared by this store's threads
        self._token_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------
    @property
    def host(self) -> str:
        return self.endpoints[self._current][0]

    @property
    def port(self) -> int:
        return self.endpoints[self._current][1]

    def endpoint_index(self) -> int:
        return self._current

    def failover(self, index: int) -> None:
        """Member ``index`` failed: move to the next one (unless another thread already did)."""
        if len(self.endpoints) > 1 and self._current == index:
            self._current = (index + 1) % len(self.endpoints)
            log.warning("etcd member %s:%d failed; using %s:%d", *self.endpoints[index], *self.endpoints[self._current])

    def stream_client(self, index: int) -> UnaryClient:
        """This thread's client for watch streams on member ``index`` (a stream holds its connection)."""
        clients = self._local.__dict__.setdefault("streams", {})
        client = clients.get(index)
        if client is None:
            client = clients[index] = self._new_unary(index)
        self._authorize(client)
        return client

    def _client(self, index: int | None = None, timeout: float | None = None) -> Etcd3Client:
        """This thread's own etcd3gw client (``http_session``: callers that need the HTTP response)."""
        index = self._current if index is None else index
        timeout = self.request_timeout if timeout is None else timeout
        clients = self._local.__dict__.setdefault("clients", {})
        client = clients.get((index, timeout))
        if client is None:
            client = clients[(index, timeout)] = self._new_client(index, timeout)
        self._authorize(client)
        return client

    def _new_client(self, index: int, timeout: float) -> Etcd3Client:
        host, port = self.endpoints[index]
        # api_path given explicitly so construction never makes a network call.
        client = Etcd3Client(
            host=host, port=port, protocol=self.security.scheme, timeout=timeout,
            api_path="/v3/", session=self.security.session(f"{self.security.scheme}://{host}:{port}"),
        )
        client.session.hooks["response"].append(self._metered)
        return client

    def _new_unary(self, index: int) -> UnaryClient:
        host, port = self.endpoints[index]
        return UnaryClient(f"{self.security.scheme}://{host}:{port}", self.security, self._metered_body)

    def _authorize(self, client: Etcd3Client | UnaryClient) -> None:
        if self.security.username:
            headers = client.headers if isinstance(client, UnaryClient) else client.session.headers
            headers["Authorization"] = self._auth_token(headers)

    def _metered(self, resp: requests.Response, *args: Any, stream: bool = False, **kwargs: Any) -> None:
        # A watch's body is its stream: WatchStream counts it chunk by chunk, never read here.
        if self.meter is not None and not stream:
            self.meter.read(len(resp.content))

    def _metered_body(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.read(nbytes)

    # etcd3gw has no auth support: authenticate over the gateway and send the token as the
    # Authorization header.  etcd expires a token after --auth-token-ttl (300 s) unused or
    # on restart, answering "invalid auth token"; _call then fetches a new one once.
    def _auth_token(self, headers: Any) -> str:
        with self._token_lock:
            if self._token is None:
                headers.pop("Authorization", None)  # a stale token would be refused
                body = {"name": self.security.username, "password": self.security.password}
                try:
                    resp = self._unauthenticated(body)
                except gw_exc.Etcd3Exception as exc:
                    if isinstance(exc, (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError)):
                        raise
                    raise StoreAuthError(f"etcd at {self.endpoint} refused user {self.security.username!r}: "
                                         f"{etcd_error_text(exc)}") from None
                self._token = str(resp["token"])
            return self._token

    def _unauthenticated(self, body: dict[str, Any]) -> Any:
        client = self._new_unary(self._current)
        try:
            return client.post("/auth/authenticate", body, self.request_timeout)
        finally:
            client.close()

    def _drop_token(self) -> None:
        with self._token_lock:
            self._token = None

    def _typed_error(self, what: str, exc: Exception) -> StoreError | None:
        """A non-retryable TLS / auth error, or None for everything else."""
        ssl_exc = ssl_error_in(exc)
        if ssl_exc is not None:
            hint = "check etcd.ca_file / etcd.cert_file / etcd.key_file"
            return StoreTLSError(f"TLS handshake with etcd at {self.endpoint} failed during {what}: "
                                 f"{short_ssl_reason(ssl_exc)} ({hint})")
        text = etcd_error_text(exc)
        if isinstance(exc, gw_exc.Etcd3Exception) and "sent an HTTP request to an HTTPS server" in text:
            return StoreTLSError(f"etcd at {self.endpoint} requires TLS (set etcd.ca_file)")
        if "user name is empty" in text:
            return StoreAuthError(f"etcd at {self.endpoint} requires authentication (set etcd.username and "
                                  f"etcd.password_env or etcd.password_file)")
        if "permission denied" in text:
            return StoreAuthError(f"etcd at {self.endpoint}: user {self.security.username!r} may not {what}")
        return None

    def _call(self, what: str, fn: Callable[[UnaryClient, float], T], deadline: float | None = None,
              timeout: float | None = None) -> T:
        deadline = self.retry_deadline if deadline is None else deadline
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((*_CONNECTION_ERRORS, _Transient)),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
            # A process that is shutting down must not spend the retry deadline on a dead
            # server (its parent may be gone and etcd with it): one try, then give up.
            stop=tenacity.stop_after_delay(deadline) | tenacity.stop_when_event_set(self._shutting_down),
            reraise=True,
        )

        def attempt() -> T:
            index = self._current
            try:
                return self._attempt(fn, index, timeout)
            except (*_CONNECTION_ERRORS, _Transient):
                self.failover(index)
                raise

        try:
            return retrying(lambda: self._guard_tls(what, attempt))
        except _CONNECTION_ERRORS as exc:
            raise StoreUnavailable(self._unreachable(what, exc)) from exc
        except _Transient as exc:
            raise StoreUnavailable(f"etcd at {self.endpoint} has no leader during {what}: {exc}") from exc
        except gw_exc.Etcd3Exception as exc:
            typed = self._typed_error(what, exc)
            if typed is not None:
                raise typed from None
            text = etcd_error_text(exc)
            if "lease not found" in text or "lease not found" in str(exc):
                raise LeaseExpired(f"{what}: {text}") from exc
            raise StoreError(f"etcd error during {what}: {text}") from exc

    def _attempt(self, fn: Callable[[UnaryClient, float], T], index: int, timeout: float | None = None) -> T:
        client = self._borrow(index)
        try:
            return self._attempt_with(fn, client, self.request_timeout if timeout is None else timeout)
        finally:
            self._give_back(client, index)

    def _attempt_with(self, fn: Callable[[UnaryClient, float], T], client: UnaryClient, timeout: float) -> T:
        try:
            return fn(client, timeout)
        except gw_exc.Etcd3Exception as exc:
            text = etcd_error_text(exc)
            if isinstance(exc, (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError)):
                raise
            if any(t in text for t in _TRANSIENT_TEXT):
                raise _Transient(text) from exc
            if not (self.security.username and "invalid auth token" in text):
                raise
        self._drop_token()  # expired or the server restarted: authenticate again, once
        self._authorize(client)
        return fn(client, timeout)

    # A request borrows a client from a pool shared by this store's threads (a client is used by
    # one thread at a time: its one connection carries one request at a time) and gives it back;
    # the timeout is the request's, not the client's, so a lease's short refreshes share it too.  Per-thread
    # clients cost every new thread a new session and a new connection (a TLS handshake with TLS):
    # an agent's round runs on a thread of its own, so every node paid one per round (1,024 new
    # connections to etcd at once in benchmarks/control_plane.py).  Watch streams keep a client per
    # thread (stream_client): a stream holds its connection for as long as it runs.
    _POOL_IDLE = 32

    def _borrow(self, index: int) -> UnaryClient:
        with self._pool_lock:
            idle = self._pool.get(index)
            client = idle.pop() if idle else None
        if client is None:
            client = self._new_unary(index)
        self._authorize(client)
        return client

    def _give_back(self, client: UnaryClient, index: int) -> None:
        with self._pool_lock:
            idle = self._pool.setdefault(index, [])
            if len(idle) < self._POOL_IDLE:
                idle.append(client)
                return
        client.close()

    def _unreachable(self, what: str, exc: Exception) -> str:
        text = etcd_error_text(exc) or type(exc).__name__
        hint = ""
        if not self.security.tls and "RemoteDisconnected" in text:
            hint = " (an etcd that serves TLS drops plain HTTP like this: set etcd.ca_file)"
        return f"etcd at {self.endpoint} unreachable during {what}: {text}{hint}"

    def _guard_tls(self, what: str, fn: Callable[[], T]) -> T:
        # A failed handshake is not an outage: surface it at once instead of retrying it.
        try:
            return fn()
        except _CONNECTION_ERRORS as exc:
            if ssl_error_in(exc) is not None:
                raise self._typed_error(what, exc) from None  # type: ignore[misc]
            raise

    def http_session(self) -> tuple[requests.Session, str]:
        """This thread's session (TLS, auth header) and the gateway's base URL, for callers that
        need the HTTP response itself (``diag``'s clock-skew check reads its Date header)."""
        try:
            client = self._guard_tls("connect", self._client)
        except _CONNECTION_ERRORS as exc:
            raise StoreUnavailable(self._unreachable("connect", exc)) from exc
        return client.session, client.base_url + "/v3"

    def stop_retrying(self) -> None:
        """From now on every operation is tried once: used when the caller is shutting down."""
        self._shutting_down.set()

    def _post(self, path: str, body: dict[str, Any], what: str, deadline: float | None = None,
              timeout: float | None = None) -> dict[str, Any]:
        self.requests_sent += 1  # approximate under threads (no lock): for rate reports only
        if self.meter is not None:
            self.meter.request(_is_write(path, body))
        return self._call(what, lambda client, t: client.post(path, body, t), deadline, timeout)

    # -- KV ----------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        resp = self._post("/kv/range", {"key": b64(key)}, f"get {key}")
        kvs = resp.get("kvs") or []
        return kv_from_json(kvs[0]) if kvs else None

    def read(self, key: str) -> tuple[KeyValue | None, int]:
        """``key`` (or None) and the store revision it was read at: watch from revision + 1."""
        resp = self._post("/kv/range", {"key": b64(key)}, f"get {key}")
        kvs = resp.get("kvs") or []
        return (kv_from_json(kvs[0]) if kvs else None), int(resp["header"]["revision"])

    def txn(self, txn: Txn) -> TxnResult:
        """Run one transaction (see :mod:`elastic.control.txn`)."""
        return decode_txn(txn, self._post("/kv/txn", encode_txn(txn), "txn"))

    def get_prefix(self, prefix: str, limit: int = 0) -> list[KeyValue]:
        """Every key under ``prefix`` in key order; only the first ``limit`` when given."""
        body: dict[str, Any] = {"key": b64(prefix), "range_end": prefix_end(prefix), "sort_order": "ASCEND",
                                "sort_target": "KEY"}
        if limit:
            body["limit"] = limit
        resp = self._post("/kv/range", body, f"get_prefix {prefix}")
        return [kv_from_json(raw) for raw in resp.get("kvs") or []]

    def count_prefix(self, prefix: str) -> int:
        body = {"key": b64(prefix), "range_end": prefix_end(prefix), "count_only": True}
        return int(self._post("/kv/range", body, f"count {prefix}").get("count", 0))

    def revision(self) -> int:
        resp = self._post("/kv/range", {"key": b64("\0"), "count_only": True}, "revision")
        return int(resp["header"]["revision"])

    def server_status(self) -> tuple[str, int]:
        """The answering member's etcd version and how many members its cluster has (two reads)."""
        version = str(self._post("/maintenance/status", {}, "status").get("version", ""))
        members = self._post("/cluster/member/list", {}, "member list").get("members") or []
        return version, len(members)

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        resp = self._post("/kv/put", body, f"put {key}")
        return int(resp["header"]["revision"])

    def delete(self, key: str) -> bool:
        resp = self._post("/kv/deleterange", {"key": b64(key)}, f"delete {key}")
        return int(resp.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        body = {"key": b64(prefix), "range_end": prefix_end(prefix)}
        return int(self._post("/kv/deleterange", body, f"delete_prefix {prefix}").get("deleted", 0))

    def compare_and_swap(
        self, key: str, value: bytes | str, expected_mod_revision: int, lease: int | None = None
    ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key's mod revision equals ``expected_mod_revision``.

        ``expected_mod_revision=0`` means "only if the key does not exist".
        Returns (succeeded, current key-value after the transaction): on
        success the new revision is filled in; on failure the current value
        (or None if absent) comes back in the same round trip.
        """
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = lease
        compare = {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": expected_mod_revision}
        txn = {
            "compare": [compare],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": b64(key)}}],
        }
        resp = self._post("/kv/txn", txn, f"cas {key}")
        if resp.get("succeeded"):
            rev = int(resp["header"]["revision"])
            data = value.encode() if isinstance(value, str) else value
            return True, KeyValue(key, data, mod_revision=rev, create_revision=0, version=0, lease=lease or 0)
        responses = resp.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        return False, (kv_from_json(kvs[0]) if kvs else None)

    # -- leases ------------------------------------------------------------
    def grant_lease(self, ttl: int) -> int:
        resp = self._post("/lease/grant", {"TTL": int(ttl), "ID": 0}, "lease grant")
        return int(resp["ID"])

    def refresh_lease(self, lease_id: int, timeout: float | None = None) -> int:
        """``timeout`` per attempt (default: request_timeout): a keepalive must fail over from a
        stalled member well within the lease's TTL (see :class:`~elastic.control.lease.LeaseKeeper`)."""
        resp = self._post("/lease/keepalive", {"ID": lease_id}, "lease keepalive", timeout=timeout)
        ttl = int(resp.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired")
        return ttl

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease_id}, "lease revoke", deadline=2.0)
        except LeaseExpired:
            pass

    # -- watch -------------------------------------------------------------
    def watch(self, key: str, start_revision: int, prefix: bool = False, range_end: str | None = None,
              idle_s: float = 30.0) -> WatchStream:
        """Every change to ``key`` (its prefix, or [key, range_end)) from ``start_revision`` on.

        The stream survives the loss of the member it reads from (see :mod:`elastic.control.watch`);
        close it when done.
        """
        return WatchStream(self, key, start_revision, prefix=prefix, idle_s=idle_s, range_end=range_end)

    def watch_keys(self, keys: list[str], start_revision: int, idle_s: float = 30.0,
                   on_events: Callable[[list[WatchEvent]], None] | None = None) -> WatchStream:
        """Every change to any of ``keys`` from ``start_revision`` on, over one stream (close it when
        done); ``on_events``: each batch to it on the stream's reader thread instead of ``get()``."""
        return WatchStream.of_keys(self, keys, start_revision, idle_s=idle_s, on_events=on_events)

    def watch_once(self, key: str, start_revision: int, timeout: float, prefix: bool = False) -> WatchEvent | None:
        """First change to ``key`` (or the prefix) at or after ``start_revision``; None on timeout."""
        with self.watch(key, start_revision, prefix=prefix, idle_s=max(timeout + 1.0, 5.0)) as stream:
            try:
                batch = stream.get(timeout)
            except WatchCompacted:
                return None  # the caller re-reads, as after a timeout
        return batch[0] if batch else None

    def wait_for_key(self, key: str, timeout: float, poll: float = 1.0) -> KeyValue:
        """Block until ``key`` exists (a read, then a watch: ``poll`` is unused); else StoreTimeout."""
        deadline = time.monotonic() + timeout
        while True:
            kv, rev = self.read(key)
            if kv is not None:
                return kv
            try:
                found = self._watch_for_put(key, rev + 1, deadline)
            except WatchCompacted:
                continue
            if found is not None:
                return found
            raise StoreTimeout(f"key {key} did not appear within {timeout:.1f}s")

    def _watch_for_put(self, key: str, start_revision: int, deadline: float) -> KeyValue | None:
        with self.watch(key, start_revision) as stream:
            while (remaining := deadline - time.monotonic()) > 0:
                for event in stream.get(remaining) or []:
                    if event.value is not None:
                        return KeyValue(event.key, event.value, event.mod_revision, 0, 0, 0)
        return None
