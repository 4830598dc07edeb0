"""The etcd v3 operations the runtime needs, behind one small interface.

Client choice: ``etcd3gw`` (the v3 JSON gateway over HTTP).  Measured on this
project's hosts (shared/reference/etcd-probe.md): the original ``etcd3`` 0.12
does not import with current protobuf; the gRPC forks (cslab-etcd3) are ~2x
faster per op but lock an endpoint out for 300 s after one timeout unless
carefully configured, and drag in grpcio/protobuf, which conflict with other
users of protobuf in the same process.  etcd3gw has no protobuf at all,
reconnects instantly after a server restart, and its one trap -- a long-lived
watch dies silently when the server restarts -- is avoided here by never
holding long watches: :meth:`EtcdStore.watch_once` is a bounded single-event
watch from a known revision, and callers loop over it, re-reading with
:meth:`get` after every timeout.  Everything outside this module sees only
:class:`KVStore` and the typed errors below, so the client can be swapped.

Every unary call is retried with jittered exponential backoff (tenacity) for
up to ``retry_deadline`` seconds on connection errors, so a short etcd outage
(SIGSTOP, restart) is invisible to callers; longer ones surface as
:class:`StoreUnavailable`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import requests
import tenacity
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

from elastic.control.etcd_security import EtcdSecurity, etcd_error_text, short_ssl_reason, ssl_error_in

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


class KVStore(Protocol):
    """The subset of etcd v3 the runtime relies on."""

    def get(self, key: str) -> KeyValue | None: ...
    def get_prefix(self, prefix: str) -> list[KeyValue]: ...
    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...
    def delete(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def compare_and_swap(
        self, key: str, value: bytes | str, expected_mod_revision: int, lease: int | None = None
    ) -> tuple[bool, KeyValue | None]: ...
    def grant_lease(self, ttl: int) -> int: ...
    def refresh_lease(self, lease_id: int) -> int: ...
    def revoke_lease(self, lease_id: int) -> None: ...
    def watch_once(self, key: str, start_revision: int, timeout: float, prefix: bool = False) -> WatchEvent | None: ...
    def revision(self) -> int: ...


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: str) -> str:
    """The etcd range_end that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return _b64(bytes(raw[: i + 1]))
    return _b64(b"\0")  # all keys


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw["key"]).decode(),
        value=_unb64(raw.get("value")),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


_CONNECTION_ERRORS = (
    gw_exc.ConnectionFailedError,
    gw_exc.ConnectionTimeoutError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
)


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
        self.host, self.port = parse_endpoint(endpoint)
        self.request_timeout = request_timeout
        self.retry_deadline = retry_deadline
        # Child processes get TLS / auth settings through ELASTIC_ETCD_* (never argv).
        self.security = EtcdSecurity.from_env() if security is None else security
        self._local = threading.local()
        self._shutting_down = threading.Event()
        self._token: str | None = None  # etcd auth token, shared by this store's threads
        self._token_lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------
    def _client(self) -> Etcd3Client:
        client = getattr(self._local, "client", None)
        if client is None:
            # api_path given explicitly so construction never makes a network call.
            client = Etcd3Client(
                host=self.host, port=self.port, protocol=self.security.scheme, timeout=self.request_timeout,
                api_path="/v3/", session=self.security.session(),
            )
            self._local.client = client
        if self.security.username:
            client.session.headers["Authorization"] = self._auth_token(client)
        return client

    # etcd3gw has no auth support: authenticate over the gateway and send the token as the
    # Authorization header.  etcd expires a token after --auth-token-ttl (300 s) unused or
    # on restart, answering "invalid auth token"; _call then fetches a new one once.
    def _auth_token(self, client: Etcd3Client) -> str:
        with self._token_lock:
            if self._token is None:
                client.session.headers.pop("Authorization", None)  # a stale token would be refused
                body = {"name": self.security.username, "password": self.security.password}
                try:
                    resp = client.post(client.get_url("/auth/authenticate"), json=body)
                except gw_exc.Etcd3Exception as exc:
                    if isinstance(exc, (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError)):
                        raise
                    raise StoreAuthError(f"etcd at {self.endpoint} refused user {self.security.username!r}: "
                                         f"{etcd_error_text(exc)}") from None
                self._token = str(resp["token"])
            return self._token

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

    def _call(self, what: str, fn: Callable[[Etcd3Client], T], deadline: float | None = None) -> T:
        deadline = self.retry_deadline if deadline is None else deadline
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_CONNECTION_ERRORS),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=1.0),
            # A process that is shutting down must not spend the retry deadline on a dead
            # server (its parent may be gone and etcd with it): one try, then give up.
            stop=tenacity.stop_after_delay(deadline) | tenacity.stop_when_event_set(self._shutting_down),
            reraise=True,
        )

        def attempt() -> T:
            client = self._client()
            try:
                return fn(client)
            except gw_exc.Etcd3Exception as exc:
                if not (self.security.username and "invalid auth token" in etcd_error_text(exc)):
                    raise
            self._drop_token()  # expired or the server restarted: authenticate again, once
            return fn(self._client())

        try:
            return retrying(lambda: self._guard_tls(what, attempt))
        except _CONNECTION_ERRORS as exc:
            raise StoreUnavailable(self._unreachable(what, exc)) from exc
        except gw_exc.Etcd3Exception as exc:
            typed = self._typed_error(what, exc)
            if typed is not None:
                raise typed from None
            text = etcd_error_text(exc)
            if "lease not found" in text or "lease not found" in str(exc):
                raise LeaseExpired(f"{what}: {text}") from exc
            raise StoreError(f"etcd error during {what}: {text}") from exc

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

    def _post(self, path: str, body: dict[str, Any], what: str, deadline: float | None = None) -> dict[str, Any]:
        return self._call(what, lambda c: c.post(c.get_url(path), json=body), deadline)

    # -- KV ----------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        resp = self._post("/kv/range", {"key": _b64(key)}, f"get {key}")
        kvs = resp.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "sort_order": "ASCEND", "sort_target": "KEY"}
        resp = self._post("/kv/range", body, f"get_prefix {prefix}")
        return [_kv(raw) for raw in resp.get("kvs") or []]

    def count_prefix(self, prefix: str) -> int:
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True}
        return int(self._post("/kv/range", body, f"count {prefix}").get("count", 0))

    def revision(self) -> int:
        resp = self._post("/kv/range", {"key": _b64("\0"), "count_only": True}, "revision")
        return int(resp["header"]["revision"])

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        resp = self._post("/kv/put", body, f"put {key}")
        return int(resp["header"]["revision"])

    def delete(self, key: str) -> bool:
        resp = self._post("/kv/deleterange", {"key": _b64(key)}, f"delete {key}")
        return int(resp.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
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
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        compare = {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": expected_mod_revision}
        txn = {
            "compare": [compare],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        resp = self._post("/kv/txn", txn, f"cas {key}")
        if resp.get("succeeded"):
            rev = int(resp["header"]["revision"])
            data = value.encode() if isinstance(value, str) else value
            return True, KeyValue(key, data, mod_revision=rev, create_revision=0, version=0, lease=lease or 0)
        responses = resp.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        return False, (_kv(kvs[0]) if kvs else None)

    def add(self, key: str, amount: int) -> int:
        """Atomically add to an integer counter stored as decimal text."""
        while True:
            current = self.get(key)
            base = int(current.value) if current else 0
            ok, _ = self.compare_and_swap(key, str(base + amount), current.mod_revision if current else 0)
            if ok:
                return base + amount

    # -- leases ------------------------------------------------------------
    def grant_lease(self, ttl: int) -> int:
        resp = self._post("/lease/grant", {"TTL": int(ttl), "ID": 0}, "lease grant")
        return int(resp["ID"])

    def refresh_lease(self, lease_id: int) -> int:
        resp = self._post("/lease/keepalive", {"ID": lease_id}, "lease keepalive")
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
    def watch_once(self, key: str, start_revision: int, timeout: float, prefix: bool = False) -> WatchEvent | None:
        """First change to ``key`` (or the prefix) at or after ``start_revision``; None on timeout.

        Bounded and from an explicit revision, so no event is missed between
        a read and the watch, and a server restart costs one timeout rather
        than a silently dead watch.
        """
        kwargs: dict[str, Any] = {"start_revision": start_revision}
        if prefix:
            kwargs["range_end"] = base64.b64decode(_prefix_end(key)).decode(errors="surrogateescape")
        try:
            event = self._client().watch_once(key, timeout=timeout, **kwargs)
        except gw_exc.WatchTimedOut:
            return None
        except _CONNECTION_ERRORS as exc:
            typed = self._typed_error(f"watch {key}", exc)
            if typed is not None:
                raise typed from None
            raise StoreUnavailable(self._unreachable(f"watch {key}", exc)) from exc
        # etcd3gw has already base64-decoded key and value of watch events.
        kv = event.get("kv", {})
        deleted = event.get("type") == "DELETE"
        raw_key = kv.get("key", key.encode())
        return WatchEvent(
            key=raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key),
            value=None if deleted else bytes(kv.get("value", b"")),
            mod_revision=int(kv.get("mod_revision", 0)),
        )

    def wait_for_key(self, key: str, timeout: float, poll: float = 1.0) -> KeyValue:
        """Block until ``key`` exists; StoreTimeout after ``timeout`` seconds."""

        deadline = time.monotonic() + timeout
        while True:
            kv = self.get(key)
            if kv is not None:
                return kv
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(f"key {key} did not appear within {timeout:.1f}s")
            try:
                rev = self.revision()
                self.watch_once(key, rev + 1, min(poll, remaining))
            except StoreUnavailable:
                time.sleep(min(0.2, max(remaining, 0)))


class LeaseKeeper:
    """Keeps a lease alive from a daemon thread; records loss instead of raising.

    The keeper refreshes at a third of the TTL so that one missed refresh
    (etcd briefly unreachable) does not lose the lease.  If the lease does
    expire, ``lost`` is set and ``on_lost`` is called once; the owner decides
    what that means (the agent re-registers).
    """

    def __init__(self, store: EtcdStore, ttl: int, on_lost: Callable[[], None] | None = None) -> None:
        self.store = store
        self.ttl = ttl
        self.lease_id = store.grant_lease(ttl)
        self.lost = threading.Event()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.lease_id:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while not self._stop.wait(interval):
            try:
                self.store.refresh_lease(self.lease_id)
            except LeaseExpired:
                self.lost.set()
                if self._on_lost:
                    self._on_lost()
                return
            except StoreError as exc:
                log.warning("lease %x refresh failed (will retry): %s", self.lease_id, exc)

    def renewed(self) -> LeaseKeeper:
        """A keeper of a new lease with the same TTL and callback (this one was lost)."""
        return LeaseKeeper(self.store, self.ttl, self._on_lost)

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if revoke and not self.lost.is_set():
            try:
                self.store.revoke_lease(self.lease_id)
            except StoreError:
                pass
